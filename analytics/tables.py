"""The tables the analytics write, registered with ``agent.schema`` so ``Store.ensure_schema()`` creates them.

- ``request_phases``: one row per inference request (POST), where its time
  went. Recomputed for a time range on every analysis run; the newest
  computation of a request replaces older ones (ReplacingMergeTree on
  ``computed_at``), so readers query it with ``FINAL``.
- ``prefill_calibration``: every prefill-time fit, one row per fitted size
  unit (``tokens`` from usage, ``bytes`` from the request size); a
  calibration is all rows with one ``calibration_id``.
- ``knee``: every capacity-knee fit per server and model.
- ``indicator_matrix``: one row per cell: server (and GPU device), window,
  indicator. Recomputing a window replaces its cells (read with ``FINAL``).
- ``slo_status``: per server, model and objective, the SLO's compliance and
  burn rates at one evaluation time.

Timestamps are ``DateTime64(9, 'UTC')`` like the agent's; durations are
milliseconds (Float32: sub-microsecond precision is not needed downstream).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenprobe.agent import schema
from tokenprobe.agent.schema import NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_TYPE, Column

REQUEST_PHASES_TABLE = "request_phases"
PREFILL_CALIBRATION_TABLE = "prefill_calibration"
KNEE_TABLE = "knee"
INDICATOR_MATRIX_TABLE = "indicator_matrix"
SLO_STATUS_TABLE = "slo_status"

_TIMESTAMP = "CODEC(Delta, ZSTD(1))"
_INTEGER = "CODEC(T64, ZSTD(1))"
_FLOAT = "CODEC(ZSTD(1))"
_PLAIN = "CODEC(ZSTD(1))"
_LABEL = "LowCardinality(String)"
_MS = "Nullable(Float32)"

REQUEST_PHASES_COLUMNS: tuple[Column, ...] = (
    Column("node", _LABEL, _PLAIN),
    Column("server_port", "UInt16", _INTEGER),
    Column("model", _LABEL, _PLAIN),
    Column("conn_id", "UInt64", _INTEGER),
    Column("req_seq", "UInt32", _INTEGER),
    Column("req_start", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("req_end", NULLABLE_TIMESTAMP_TYPE, _TIMESTAMP),
    Column("first_token", NULLABLE_TIMESTAMP_TYPE, _TIMESTAMP),
    Column("last_token", NULLABLE_TIMESTAMP_TYPE, _TIMESTAMP),
    Column("resp_end", NULLABLE_TIMESTAMP_TYPE, _TIMESTAMP),
    Column("response_id", "String", _PLAIN),
    Column("client_addr", "String", _PLAIN),
    Column("path", _LABEL, _PLAIN),
    Column("status", "UInt16", _INTEGER),
    Column("outcome", _LABEL, _PLAIN),
    Column("inflight_at_arrival", "UInt32", _INTEGER),
    # network in = request bytes, plus accept wait and TLS for a connection's first request
    Column("network_in_ms", _MS, _FLOAT),
    Column("accept_wait_ms", _MS, _FLOAT),
    Column("tls_ms", _MS, _FLOAT),
    Column("queue_ms", _MS, _FLOAT),
    Column("prefill_ms", _MS, _FLOAT),
    Column("decode_ms", _MS, _FLOAT),
    Column("network_out_ms", _MS, _FLOAT),
    Column("ttft_server_ms", _MS, _FLOAT),
    Column("ttft_client_ms", _MS, _FLOAT),
    Column("e2e_ms", _MS, _FLOAT),
    Column("tpot_ms", _MS, _FLOAT),
    Column("itl_p50_ms", _MS, _FLOAT),
    Column("itl_p90_ms", _MS, _FLOAT),
    Column("itl_p99_ms", _MS, _FLOAT),
    Column("itl_max_ms", _MS, _FLOAT),
    Column("itl_gaps", "UInt32", _INTEGER),
    Column("stalls", "UInt32", _INTEGER),
    # long streams only: decode rate in the last quarter of events / in the first quarter
    Column("decode_rate_ratio", _MS, _FLOAT),
    Column("token_events", "UInt32", _INTEGER),
    Column("output_tokens", "UInt32", _INTEGER),
    Column("output_tokens_source", _LABEL, _PLAIN),  # usage | events
    Column("prompt_size", "Nullable(UInt64)", _INTEGER),
    Column("prompt_size_source", _LABEL, _PLAIN),  # usage (tokens) | bytes (request bytes)
    Column("calibration_id", _LABEL, _PLAIN),  # '' when queue and prefill could not be split
    Column("split_method", _LABEL, _PLAIN),  # calibration | calibration+engine | ''
    Column("computed_at", TIMESTAMP_TYPE, _TIMESTAMP),
)

PREFILL_CALIBRATION_COLUMNS: tuple[Column, ...] = (
    Column("calibration_id", _LABEL, _PLAIN),
    Column("fitted_at", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("node", _LABEL, _PLAIN),
    Column("server_port", "UInt16", _INTEGER),
    Column("model", _LABEL, _PLAIN),
    Column("size_unit", _LABEL, _PLAIN),  # tokens | bytes
    Column("method", _LABEL, _PLAIN),
    Column("intercept_ms", "Float64", _FLOAT),
    Column("slope_ms", "Float64", _FLOAT),  # per token or per byte
    Column("r2", "Nullable(Float64)", _FLOAT),  # over the inliers
    Column("mad_ms", "Float64", _FLOAT),  # median |residual|
    Column("n", "UInt32", _INTEGER),
    Column("n_outliers", "UInt32", _INTEGER),
    Column("size_min", "UInt64", _INTEGER),
    Column("size_max", "UInt64", _INTEGER),
    Column("data_from", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("data_to", TIMESTAMP_TYPE, _TIMESTAMP),
    # engine check: the engine's mean prefill over our predicted mean; applied as a factor
    Column("engine_scale", "Float64", _FLOAT),
    Column("engine_samples", "UInt32", _INTEGER),
    Column("engine_prefill_ms", "Nullable(Float64)", _FLOAT),
    Column("predicted_prefill_ms", "Nullable(Float64)", _FLOAT),
)

KNEE_COLUMNS: tuple[Column, ...] = (
    Column("fitted_at", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("node", _LABEL, _PLAIN),
    Column("server_port", "UInt16", _INTEGER),
    Column("model", _LABEL, _PLAIN),
    Column("knee_concurrency", "Nullable(Float64)", _FLOAT),  # from the TTFT p50 curve
    Column("knee_concurrency_p99", "Nullable(Float64)", _FLOAT),  # from the TTFT p99 curve
    Column("confidence", "Float64", _FLOAT),
    Column("method", _LABEL, _PLAIN),
    Column("flat_ttft_ms", "Nullable(Float64)", _FLOAT),
    Column("slope_after_ms", "Nullable(Float64)", _FLOAT),  # TTFT added per extra request past the knee
    Column("max_concurrency_seen", "UInt32", _INTEGER),
    Column("levels", "UInt32", _INTEGER),
    Column("n_requests", "UInt64", _INTEGER),
    Column("engine_slots", "Nullable(Float64)", _FLOAT),
    Column("data_from", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("data_to", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("explanation", "String", _PLAIN),
)

INDICATOR_MATRIX_COLUMNS: tuple[Column, ...] = (
    Column("window_start", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("window_end", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("node", _LABEL, _PLAIN),
    Column("server_port", "UInt16", _INTEGER),
    Column("device_id", _LABEL, _PLAIN),  # '' for a server-wide cell
    Column("indicator", _LABEL, _PLAIN),
    Column("value", "Nullable(Float64)", _FLOAT),
    Column("unit", _LABEL, _PLAIN),
    Column("state", _LABEL, _PLAIN),  # ok | warn | crit | n/a (no data)
    Column("warn", "Nullable(Float64)", _FLOAT),
    Column("crit", "Nullable(Float64)", _FLOAT),
    Column("comparison", _LABEL, _PLAIN),  # above | below: which side of the thresholds is bad
    Column("explanation", "String", _PLAIN),
    Column("computed_at", TIMESTAMP_TYPE, _TIMESTAMP),
)

SLO_STATUS_COLUMNS: tuple[Column, ...] = (
    Column("evaluated_at", TIMESTAMP_TYPE, _TIMESTAMP),
    Column("node", _LABEL, _PLAIN),
    Column("server_port", "UInt16", _INTEGER),
    Column("model", _LABEL, _PLAIN),
    Column("objective", _LABEL, _PLAIN),  # ttft | tpot | e2e | goodput
    Column("threshold_ms", "Nullable(Float64)", _FLOAT),
    Column("target", "Nullable(Float64)", _FLOAT),
    *(
        column
        for window in ("5m", "30m", "1h", "6h")
        for column in (
            Column(f"requests_{window}", "UInt64", _INTEGER),
            Column(f"good_{window}", "UInt64", _INTEGER),
            Column(f"burn_{window}", "Nullable(Float64)", _FLOAT),
        )
    ),
    Column("alert", _LABEL, _PLAIN),  # page | ticket | ok | no data
    Column("explanation", "String", _PLAIN),
)


def _ddl(table: str, columns: Sequence[Column], *, engine: str, partition: str, order_by: str, ttl: str) -> str:
    column_lines = ",\n    ".join(column.ddl() for column in columns)
    return f"""CREATE TABLE IF NOT EXISTS {{db}}.{table}
(
    {column_lines}
)
ENGINE = {engine}
PARTITION BY toDate({partition})
ORDER BY ({order_by})
TTL toDateTime({ttl}) + INTERVAL {{ttl_days}} DAY"""


REQUEST_PHASES_DDL = _ddl(
    REQUEST_PHASES_TABLE, REQUEST_PHASES_COLUMNS, engine="ReplacingMergeTree(computed_at)",
    partition="req_start", order_by="node, server_port, req_start, conn_id, req_seq", ttl="req_start",
)
PREFILL_CALIBRATION_DDL = _ddl(
    PREFILL_CALIBRATION_TABLE, PREFILL_CALIBRATION_COLUMNS, engine="MergeTree",
    partition="fitted_at", order_by="node, server_port, model, size_unit, fitted_at", ttl="fitted_at",
)
KNEE_DDL = _ddl(
    KNEE_TABLE, KNEE_COLUMNS, engine="MergeTree",
    partition="fitted_at", order_by="node, server_port, model, fitted_at", ttl="fitted_at",
)
INDICATOR_MATRIX_DDL = _ddl(
    INDICATOR_MATRIX_TABLE, INDICATOR_MATRIX_COLUMNS, engine="ReplacingMergeTree(computed_at)",
    partition="window_start", order_by="node, server_port, device_id, indicator, window_start",
    ttl="window_start",
)
SLO_STATUS_DDL = _ddl(
    SLO_STATUS_TABLE, SLO_STATUS_COLUMNS, engine="MergeTree",
    partition="evaluated_at", order_by="node, server_port, model, objective, evaluated_at", ttl="evaluated_at",
)

schema.register_table(REQUEST_PHASES_TABLE, REQUEST_PHASES_DDL)
schema.register_table(PREFILL_CALIBRATION_TABLE, PREFILL_CALIBRATION_DDL)
schema.register_table(KNEE_TABLE, KNEE_DDL)
schema.register_table(INDICATOR_MATRIX_TABLE, INDICATOR_MATRIX_DDL)
schema.register_table(SLO_STATUS_TABLE, SLO_STATUS_DDL)
