"""The tables the analytics write.

- ``request_split``: one narrow row per inference request (POST): how its
  server TTFT splits into queue, prefill and server overhead, and by which
  calibration and method. Recomputed for a time range on every analysis run;
  the newest computation of a request replaces older ones (ReplacingMergeTree
  on ``computed_at``), so readers query it with ``FINAL``; with the times of its
  occupancy interval (``OCCUPANCY_COLUMNS``). A request's other
  phases are its ``request_figures`` row's (``contract/figures.py``), computed
  once at insert: ``phases_select`` there joins the two for readers, so no pass
  rewrites every column of every request (the wide ``request_phases`` copy
  an older tokenprobe wrote is dropped, ``RETIRED_TABLES``).
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

from .tables import (
    INTEGER_CODEC,
    NULLABLE_TIMESTAMP_TYPE,
    OPAQUE_CODEC,
    TIMESTAMP_CODEC,
    TIMESTAMP_TYPE,
    Column,
    Table,
)

REQUEST_SPLIT_TABLE = "request_split"
# Tables an older tokenprobe made that this one has no more (derived data, recomputed by an analysis).
RETIRED_TABLES = ("request_phases",)
PREFILL_CALIBRATION_TABLE = "prefill_calibration"
KNEE_TABLE = "knee"
INDICATOR_MATRIX_TABLE = "indicator_matrix"
SLO_STATUS_TABLE = "slo_status"

_LABEL = "LowCardinality(String)"
_MS = "Nullable(Float32)"

# A request's phases, as ``phases_select`` (contract/figures.py) gives them: its ``request_figures`` row's
# columns, and the split's (``SPLIT_COLUMNS``) from ``request_split``.
REQUEST_PHASES_COLUMNS: tuple[Column, ...] = (
    Column("node", _LABEL, OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("model", _LABEL, OPAQUE_CODEC),
    Column("conn_id", "UInt64", INTEGER_CODEC),
    Column("req_seq", "UInt32", INTEGER_CODEC),
    Column("req_start", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("req_end", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("first_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("last_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("resp_end", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("response_id", "String", OPAQUE_CODEC),
    Column("client_addr", "String", OPAQUE_CODEC),
    Column("path", _LABEL, OPAQUE_CODEC),
    Column("status", "UInt16", INTEGER_CODEC),
    Column("outcome", _LABEL, OPAQUE_CODEC),
    Column("inflight_at_arrival", "UInt32", INTEGER_CODEC),
    # network in = request bytes, plus accept wait and TLS for a connection's first request
    Column("network_in_ms", _MS, OPAQUE_CODEC),
    Column("accept_wait_ms", _MS, OPAQUE_CODEC),
    Column("tls_ms", _MS, OPAQUE_CODEC),
    Column("queue_ms", _MS, OPAQUE_CODEC),
    Column("prefill_ms", _MS, OPAQUE_CODEC),
    # server TTFT spent outside the engine (API server, tokenising), where the engine's TTFT tells it
    Column("overhead_ms", _MS, OPAQUE_CODEC),
    Column("decode_ms", _MS, OPAQUE_CODEC),
    Column("network_out_ms", _MS, OPAQUE_CODEC),
    Column("ttft_server_ms", _MS, OPAQUE_CODEC),
    Column("ttft_client_ms", _MS, OPAQUE_CODEC),
    Column("e2e_ms", _MS, OPAQUE_CODEC),
    Column("tpot_ms", _MS, OPAQUE_CODEC),
    Column("itl_p50_ms", _MS, OPAQUE_CODEC),
    Column("itl_p90_ms", _MS, OPAQUE_CODEC),
    Column("itl_p99_ms", _MS, OPAQUE_CODEC),
    Column("itl_max_ms", _MS, OPAQUE_CODEC),
    Column("itl_gaps", "UInt32", INTEGER_CODEC),
    Column("stalls", "UInt32", INTEGER_CODEC),
    # long streams only: decode rate in the last quarter of events / in the first quarter
    Column("decode_rate_ratio", _MS, OPAQUE_CODEC),
    Column("token_events", "UInt32", INTEGER_CODEC),
    Column("output_tokens", "UInt32", INTEGER_CODEC),
    Column("output_tokens_source", _LABEL, OPAQUE_CODEC),  # usage | events
    Column("prompt_size", "Nullable(UInt64)", INTEGER_CODEC),
    Column("prompt_size_source", _LABEL, OPAQUE_CODEC),  # usage (tokens) | bytes (request bytes)
    Column("calibration_id", _LABEL, OPAQUE_CODEC),  # '' when queue and prefill could not be split
    # engine | engine_prefill | calibration | calibration+engine | calibration+engine+overhead | poor fit | ''
    Column("split_method", _LABEL, OPAQUE_CODEC),
    Column("computed_at", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
)
# What a pass stores per request: its key, what the calibration decides, and the times its occupancy
# interval needs (read with the split, they spare the matrix a join of every request with its figures).
OCCUPANCY_COLUMNS = ("req_end", "last_token", "finished_at")
KEY_COLUMNS = ("node", "server_port", "req_start", "conn_id", "req_seq")
SPLIT_COLUMNS = ("queue_ms", "prefill_ms", "overhead_ms", "prompt_size", "prompt_size_source", "calibration_id",
                 "split_method")
_PHASE_COLUMN = {column.name: column for column in (
    *REQUEST_PHASES_COLUMNS, Column("finished_at", TIMESTAMP_TYPE, TIMESTAMP_CODEC))}  # measures.FINISHED_AT
REQUEST_SPLIT_COLUMNS: tuple[Column, ...] = tuple(
    _PHASE_COLUMN[name] for name in (*KEY_COLUMNS, "model", *SPLIT_COLUMNS, *OCCUPANCY_COLUMNS, "computed_at"))

PREFILL_CALIBRATION_COLUMNS: tuple[Column, ...] = (
    Column("calibration_id", _LABEL, OPAQUE_CODEC),
    Column("fitted_at", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("node", _LABEL, OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("model", _LABEL, OPAQUE_CODEC),
    Column("size_unit", _LABEL, OPAQUE_CODEC),  # tokens | bytes
    Column("method", _LABEL, OPAQUE_CODEC),
    Column("intercept_ms", "Float64", OPAQUE_CODEC),
    Column("slope_ms", "Float64", OPAQUE_CODEC),  # per token or per byte
    Column("r2", "Nullable(Float64)", OPAQUE_CODEC),  # over the inliers
    Column("mad_ms", "Float64", OPAQUE_CODEC),  # median |residual|
    Column("n", "UInt32", INTEGER_CODEC),
    Column("n_outliers", "UInt32", INTEGER_CODEC),
    Column("size_min", "UInt64", INTEGER_CODEC),
    Column("size_max", "UInt64", INTEGER_CODEC),
    Column("data_from", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("data_to", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    # engine check: the engine's mean prefill over our predicted mean; applied as a factor
    Column("engine_scale", "Float64", OPAQUE_CODEC),
    Column("engine_samples", "UInt32", INTEGER_CODEC),
    Column("engine_prefill_ms", "Nullable(Float64)", OPAQUE_CODEC),
    Column("predicted_prefill_ms", "Nullable(Float64)", OPAQUE_CODEC),
    # our mean server TTFT − the engine's mean TTFT over the same span: time outside the engine
    Column("server_overhead_ms", "Nullable(Float64)", OPAQUE_CODEC),
)

KNEE_COLUMNS: tuple[Column, ...] = (
    Column("fitted_at", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("node", _LABEL, OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("model", _LABEL, OPAQUE_CODEC),
    Column("knee_concurrency", "Nullable(Float64)", OPAQUE_CODEC),  # from the TTFT p50 curve
    Column("knee_concurrency_p99", "Nullable(Float64)", OPAQUE_CODEC),  # from the TTFT p99 curve
    Column("confidence", "Float64", OPAQUE_CODEC),
    Column("method", _LABEL, OPAQUE_CODEC),
    Column("flat_ttft_ms", "Nullable(Float64)", OPAQUE_CODEC),
    Column("slope_after_ms", "Nullable(Float64)", OPAQUE_CODEC),  # TTFT added per extra request past the knee
    Column("max_concurrency_seen", "UInt32", INTEGER_CODEC),
    Column("levels", "UInt32", INTEGER_CODEC),
    Column("n_requests", "UInt64", INTEGER_CODEC),
    Column("engine_slots", "Nullable(Float64)", OPAQUE_CODEC),
    Column("data_from", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("data_to", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("explanation", "String", OPAQUE_CODEC),
)

INDICATOR_MATRIX_COLUMNS: tuple[Column, ...] = (
    Column("window_start", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("window_end", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("node", _LABEL, OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("device_id", _LABEL, OPAQUE_CODEC),  # '' for a server-wide cell
    Column("indicator", _LABEL, OPAQUE_CODEC),
    Column("value", "Nullable(Float64)", OPAQUE_CODEC),
    Column("unit", _LABEL, OPAQUE_CODEC),
    Column("state", _LABEL, OPAQUE_CODEC),  # ok | warn | crit | n/a (no data)
    Column("warn", "Nullable(Float64)", OPAQUE_CODEC),
    Column("crit", "Nullable(Float64)", OPAQUE_CODEC),
    Column("comparison", _LABEL, OPAQUE_CODEC),  # above | below: which side of the thresholds is bad
    Column("explanation", "String", OPAQUE_CODEC),
    Column("computed_at", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
)

SLO_STATUS_COLUMNS: tuple[Column, ...] = (
    Column("evaluated_at", TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("node", _LABEL, OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("model", _LABEL, OPAQUE_CODEC),
    Column("objective", _LABEL, OPAQUE_CODEC),  # ttft | tpot | e2e | goodput
    Column("threshold_ms", "Nullable(Float64)", OPAQUE_CODEC),
    Column("target", "Nullable(Float64)", OPAQUE_CODEC),
    *(
        column
        for window in ("5m", "30m", "1h", "6h")
        for column in (
            Column(f"requests_{window}", "UInt64", INTEGER_CODEC),
            Column(f"good_{window}", "UInt64", INTEGER_CODEC),
            Column(f"burn_{window}", "Nullable(Float64)", OPAQUE_CODEC),
        )
    ),
    Column("alert", _LABEL, OPAQUE_CODEC),  # page | ticket | ok | no data
    Column("explanation", "String", OPAQUE_CODEC),
)


REQUEST_SPLIT = Table(
    REQUEST_SPLIT_TABLE, REQUEST_SPLIT_COLUMNS, engine="ReplacingMergeTree(computed_at)",
    partition_by="req_start", order_by="node, server_port, req_start, conn_id, req_seq", ttl_column="req_start",
)
PREFILL_CALIBRATION = Table(
    PREFILL_CALIBRATION_TABLE, PREFILL_CALIBRATION_COLUMNS,
    partition_by="fitted_at", order_by="node, server_port, model, size_unit, fitted_at", ttl_column="fitted_at",
)
KNEE = Table(
    KNEE_TABLE, KNEE_COLUMNS,
    partition_by="fitted_at", order_by="node, server_port, model, fitted_at", ttl_column="fitted_at",
)
INDICATOR_MATRIX = Table(
    INDICATOR_MATRIX_TABLE, INDICATOR_MATRIX_COLUMNS, engine="ReplacingMergeTree(computed_at)",
    partition_by="window_start", order_by="node, server_port, device_id, indicator, window_start",
    ttl_column="window_start",
)
SLO_STATUS = Table(
    SLO_STATUS_TABLE, SLO_STATUS_COLUMNS,
    partition_by="evaluated_at", order_by="node, server_port, model, objective, evaluated_at",
    ttl_column="evaluated_at",
)
