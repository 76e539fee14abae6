"""Per-request phases, computed in ClickHouse: ``INSERT INTO request_split SELECT ... FROM request_figures``.

For each inference request: network in (with accept wait and TLS for a
connection's first request), queue, prefill, decode, network out; server and
client TTFT, end to end, TPOT, inter-token gaps (p50, p90, p99, max) and
stalls (gaps over ``stall_factor`` × the stream's median gap), and for long
streams the decode-rate ratio of their last quarter to their first.

Queue and prefill split the server TTFT: prefill is what the request's
calibration (``calibration``) predicts for its prompt size, at most the TTFT;
where the engine exports its own TTFT, the server's mean TTFT beyond it is
time spent outside the engine (``overhead_ms``, at most what prefill leaves);
queue is the rest. Where the engine stated the request's own figures, they are
used as stated: its queue and prefill (vLLM ``--enable-per-request-metrics``,
``split_method`` ``engine``: what the TTFT holds beyond them is overhead), or
its prefill alone (llama.cpp ``timings``, Ollama durations, ``engine_prefill``:
the calibration's overhead and the queue split the rest). ``split_method`` says
which of these a row had. Requests of a server and model with neither keep
their TTFT with queue and prefill NULL. The whole computation stays in the
store: nothing per request travels to Python.

Every figure but the split was computed when the request was stored
(``request_figures``, ``contract/figures.py``): a pass joins those rows with
the calibrations and stores only the split, narrow (``request_split``).
Where that table lacks rows of the pass, or holds them computed with other
thresholds, the pass first stores them there, computed from ``requests``
under their own definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from ..contract import measures
from ..contract.analysis import (
    PREFILL_CALIBRATION_TABLE,
    REQUEST_SPLIT_COLUMNS,
    REQUEST_SPLIT_TABLE,
    SPLIT_COLUMNS,
)
from ..contract.figures import (
    REQUEST_FIGURES_TABLE,
    figures_definition,
    figures_select,
    phases_select,
)
from ..contract.requests import REQUESTS_TABLE
from ..store.client import Store
from .calibration import Calibration, ServerModel
from .config import Thresholds
from .scope import Scope
from .timerange import TimeRange, range_condition

# The split_method of a request whose calibration has no line good enough to split its TTFT with.
POOR_FIT = "poor fit"

# Per request: the phase columns that the calibration decides, as expressions over a request_figures row
# joined with its calibration (``c_*`` are the calibration's coefficients, NULL when it has none; a line too
# poor to split with, ``UnitFit.quality_problem``, is not among them); every other column is the figures
# row's own.
_USES_TOKENS = "prompt_tokens IS NOT NULL AND c_has_tokens"
_PREDICTED_PREFILL_MS = (
    f"greatest(0, if({_USES_TOKENS},"
    " c_tokens_intercept + c_tokens_slope * prompt_tokens,"
    " c_bytes_intercept + c_bytes_slope * bytes_in)) * c_scale"
)
_USES_USAGE = "prompt_tokens IS NOT NULL AND (c_calibration_id IS NULL OR c_has_tokens)"
# the request's calibration has a usable line for its prompt size
_FIT_USABLE = f"({_USES_TOKENS} OR c_has_bytes)"


# The engine's own figures for the request (Float32 in the row), where it stated them.
_ENGINE_QUEUE_MS = "toFloat64(engine_queue_ms)"
_ENGINE_PREFILL_MS = "toFloat64(engine_prompt_ms)"
_ENGINE_STATES_SPLIT = "(engine_queue_ms IS NOT NULL AND engine_prompt_ms IS NOT NULL)"


def _split_expressions() -> dict[str, str]:
    # The TTFT in float64 from its timestamps, not the figures row's Float32: the split stays what it was.
    ttft = measures.TTFT_SERVER_MS
    engine_prefill_known = "engine_prompt_ms IS NOT NULL"
    splittable = f"({engine_prefill_known} OR (c_calibration_id IS NOT NULL AND {_FIT_USABLE})) AND {ttft} >= 0"
    modelled_prefill = f"least(if({engine_prefill_known}, {_ENGINE_PREFILL_MS}, {_PREDICTED_PREFILL_MS}), {ttft})"
    prefill = f"if({_ENGINE_STATES_SPLIT}, {_ENGINE_PREFILL_MS}, {modelled_prefill})"
    # Stated queue and prefill: the rest of the TTFT is the server's time outside its engine (none where
    # the engine states more than the wire shows: its clock and the probes' differ by a few ms).
    overhead = (f"if({_ENGINE_STATES_SPLIT}, greatest(0, {ttft} - {_ENGINE_QUEUE_MS} - {_ENGINE_PREFILL_MS}),"
                f" if(c_overhead IS NULL, 0, least(c_overhead, {ttft} - {prefill})))")
    has_overhead = f"({_ENGINE_STATES_SPLIT} OR c_overhead IS NOT NULL)"
    return {
        "prefill_ms": f"if({splittable}, {prefill}, NULL)",
        "overhead_ms": f"if({splittable} AND {has_overhead}, {overhead}, NULL)",
        "queue_ms": f"if({splittable}, if({_ENGINE_STATES_SPLIT}, {_ENGINE_QUEUE_MS}, {ttft} - {prefill} - {overhead}), NULL)",
        "prompt_size": f"if({_USES_USAGE}, toUInt64(prompt_tokens), bytes_in)",
        "prompt_size_source": f"if({_USES_USAGE}, 'usage', 'bytes')",
        "calibration_id": f"if(c_calibration_id IS NOT NULL AND {_FIT_USABLE}, c_calibration_id, '')",
        "split_method": f"multiIf(NOT ifNull({splittable}, 0),"
                        f" if(c_calibration_id IS NOT NULL AND NOT {_FIT_USABLE}, '{POOR_FIT}', ''),"
                        f" {_ENGINE_STATES_SPLIT}, 'engine', {engine_prefill_known}, 'engine_prefill',"
                        " c_overhead IS NOT NULL, 'calibration+engine+overhead',"
                        " c_engine_used, 'calibration+engine', 'calibration')",
        "finished_at": measures.FINISHED_AT,
        "computed_at": "fromUnixTimestamp64Nano({computed_at:Int64}, 'UTC')",
    }


# A request's key as one number: summed over a pass's rows, it tells two tables' sets of requests apart.
_KEY = "cityHash64(node, server_port, req_start, conn_id, req_seq)"
# Per server and model: how many requests, and their keys' sum.
_COUNTED = f"node, server_port, model, count(), sum({_KEY})"


@dataclass(frozen=True)
class PhaseRequests:
    """The inference requests whose phases a run computes: a condition on the columns ``requests`` and
    ``request_figures`` share, its parameters, per server and model their count and keys' sum, the
    thresholds their figures are computed with, and whether ``request_figures`` holds every one of them
    computed so (per server and model the same count and sum of key hashes: no row missing, none extra)."""

    condition: str
    parameters: dict
    counted: dict[ServerModel, tuple[int, int]]
    thresholds: Thresholds
    figures_stored: bool

    @property
    def keys(self) -> list[ServerModel]:
        return sorted(self.counted)


def phase_requests(store: Store, requests: TimeRange, scope: Scope, thresholds: Thresholds,
                   only: tuple[str, dict] | None = None) -> PhaseRequests:
    """Every inference request that started in ``requests`` (and, with ``only``, meets that condition over
    the requests' columns that ``request_figures`` copies, given with its parameters), whose figures are
    computed with ``thresholds``."""
    in_range, range_parameters = range_condition("req_start", "requests", requests)
    in_scope, scope_parameters = scope.condition()
    if only is not None:
        in_scope, scope_parameters = f"{in_scope} AND {only[0]}", {**scope_parameters, **only[1]}
    condition, parameters = f"{in_range} AND {in_scope}", {**range_parameters, **scope_parameters}
    # Both tables counted in one call: apart, each planned and read its parts afresh (22 and 19 ms in a live
    # pass at 1k requests/s, 24 ms together).
    counted = store.query_rows(
        f"SELECT 0 AS stored, {_COUNTED} FROM {store.table(REQUESTS_TABLE)}"
        f" WHERE {measures.IS_INFERENCE} AND {condition} GROUP BY node, server_port, model"
        f" UNION ALL SELECT 1 AS stored, {_COUNTED} FROM ({_stored_figures(store, condition, thresholds)})"
        " GROUP BY node, server_port, model", parameters)
    in_requests = _by_server_model([row[1:] for row in counted if not row[0]])
    in_figures = _by_server_model([row[1:] for row in counted if row[0]])
    return PhaseRequests(condition, parameters, in_requests, thresholds, in_figures == in_requests)


def _by_server_model(counted: list[tuple]) -> dict[ServerModel, tuple[int, int]]:
    return {(node, int(port), model): (int(count), int(keys)) for node, port, model, count, keys in counted}


def _stored_figures(store: Store, condition: str, thresholds: Thresholds) -> str:
    """The rows of ``request_figures`` that meet ``condition``, computed by this definition with
    ``thresholds``."""
    return (f"SELECT * FROM {store.table(REQUEST_FIGURES_TABLE)} WHERE {condition}"
            f" AND definition = '{_definition(thresholds)}'")


def _definition(thresholds: Thresholds) -> str:
    return figures_definition(thresholds.stall_factor, thresholds.long_stream_events)


def _store_figures(store: Store, requests: PhaseRequests) -> None:
    """Store in ``request_figures`` the figures of ``requests``, computed from ``requests`` with the pass's
    thresholds, in place of those stored by their definition (some missing, or some twice: a replay the
    view did not deduplicate); rows by another definition stay as they are."""
    thresholds = requests.thresholds
    store.command(f"DELETE FROM {store.table(REQUEST_FIGURES_TABLE)} WHERE {requests.condition}"
                  f" AND definition = '{_definition(thresholds)}'", requests.parameters)
    store.command(f"INSERT INTO {store.table(REQUEST_FIGURES_TABLE)}\n"
                  + figures_select(store.table(REQUESTS_TABLE), thresholds.stall_factor,
                                   thresholds.long_stream_events, requests.condition), requests.parameters)


def compute_phases(store: Store, requests: PhaseRequests, calibrations: Mapping[ServerModel, Calibration],
                   now_ns: int) -> None:
    """(Re)compute the split of ``requests`` (``phase_requests``), stored narrow in ``request_split``."""
    if not requests.figures_stored:
        _store_figures(store, requests)
    source = _stored_figures(store, requests.condition, requests.thresholds)
    split = _split_expressions()
    names = [column.name for column in REQUEST_SPLIT_COLUMNS]
    select_list = ",\n    ".join(f"{split[name]} AS {name}" if name in split else name for name in names)
    # optimize_on_insert = 0: the insert holds each request once, so the ReplacingMergeTree has nothing to
    # collapse in it (a quarter of the insert's cost); a request's older rows go at merges, and every reader
    # reads with FINAL.
    store.command(
        f"""INSERT INTO {store.table(REQUEST_SPLIT_TABLE)} ({", ".join(names)})
WITH calibrations AS (
    SELECT node, server_port, model,
        any(calibration_id) AS c_calibration_id,
        countIf(size_unit = 'tokens' AND usable) > 0 AS c_has_tokens,
        countIf(size_unit = 'bytes' AND usable) > 0 AS c_has_bytes,
        anyIf(intercept_ms, size_unit = 'tokens') AS c_tokens_intercept,
        anyIf(slope_ms, size_unit = 'tokens') AS c_tokens_slope,
        anyIf(intercept_ms, size_unit = 'bytes') AS c_bytes_intercept,
        anyIf(slope_ms, size_unit = 'bytes') AS c_bytes_slope,
        any(engine_scale) AS c_scale,
        any(engine_samples) > 0 AS c_engine_used,
        any(server_overhead_ms) AS c_overhead
    FROM (SELECT *, (calibration_id, size_unit) IN {{usable:Array(Tuple(String, String))}} AS usable
          FROM {store.table(PREFILL_CALIBRATION_TABLE)})
    WHERE calibration_id IN {{calibration_ids:Array(String)}}
    GROUP BY node, server_port, model
)
SELECT
    {select_list}
FROM ({source}) AS r
LEFT JOIN calibrations AS c USING (node, server_port, model)
SETTINGS join_use_nulls = 1, optimize_on_insert = 0""",
        {
            **requests.parameters, "computed_at": now_ns,
            "calibration_ids": sorted(c.calibration_id for c in calibrations.values()),
            "usable": sorted((c.calibration_id, unit) for c in calibrations.values() for unit in c.usable_units),
        },
    )


def phases_source(store: Store, condition: str, thresholds: Thresholds, split_condition: str | None = None) -> str:
    """SELECT of the phases of the requests that meet ``condition`` (``contract.figures.phases_select``), their
    figures computed with ``thresholds``."""
    return phases_select(store.table(REQUEST_FIGURES_TABLE), store.table(REQUEST_SPLIT_TABLE), condition,
                         _definition(thresholds), split_condition)


PHASE_SUMMARY_MEASURES = (
    "network_in_ms", "queue_ms", "prefill_ms", "decode_ms", "network_out_ms",
    "ttft_server_ms", "ttft_client_ms", "e2e_ms", "tpot_ms", "itl_p99_ms",
)  # fmt: skip


def phase_summary(store: Store, analysed: TimeRange, scope: Scope, thresholds: Thresholds) -> pd.DataFrame:
    """Per server and model: request count, p50 and p95 of every phase, stalls, prompt-size sources."""
    in_range, range_parameters = range_condition("req_start", "analysed", analysed)
    in_scope, scope_parameters = scope.condition()

    # One sample per measure for both levels (a quantile() each would keep two); NULL without values, as
    # quantile() gives.
    def quantiles(names: list[str]) -> str:
        return ", ".join(f"if(count({name}) = 0, NULL, quantiles(0.5, 0.95)({name})[{index}]) AS {name}_{level}"
                         for name in names for index, level in ((1, "p50"), (2, "p95")))

    in_split = [name for name in PHASE_SUMMARY_MEASURES if name in SPLIT_COLUMNS]
    in_figures = [name for name in PHASE_SUMMARY_MEASURES if name not in in_split]
    frame = store.query_df(
        grouped_phases(
            store, f"{in_range} AND {in_scope}", thresholds, {"node": "node", "server_port": "server_port",
                                                              "model": "model"},
            figures="count() AS requests, countIf(outcome != 'complete' OR status >= 500) AS failed, "
                    f"{quantiles(in_figures)}, sum(stalls) AS total_stalls, sum(itl_gaps) AS total_itl_gaps",
            split=f"{quantiles(in_split)}, countIf(prompt_size_source = 'usage') AS prompt_size_from_usage, "
                  "countIf(prompt_size_source = 'bytes') AS prompt_size_from_bytes, "
                  "countIf(prefill_ms IS NULL) AS unsplit, any(split_method) AS split_method")
        + " ORDER BY node, server_port, model",
        {**range_parameters, **scope_parameters},
    )
    return frame[["node", "server_port", "model", "requests", "failed",
                  *(f"{name}_{level}" for name in PHASE_SUMMARY_MEASURES for level in ("p50", "p95")),
                  "total_stalls", "total_itl_gaps", "prompt_size_from_usage", "prompt_size_from_bytes", "unsplit",
                  "split_method"]] if not frame.empty else frame


def grouped_phases(store: Store, condition: str, thresholds: Thresholds, keys: Mapping[str, str], *,
                   figures: str, split: str) -> str:
    """SELECT of aggregates per ``keys`` (name: expression over both tables' shared columns) of the phases
    of the requests that meet ``condition``: ``figures`` over their ``request_figures`` rows (computed with
    ``thresholds``), ``split`` over their splits (``FINAL``), each side aggregated apart and only the
    aggregates joined: a join of every request costs a reader seconds over 10M of them. A group with no
    split has its counts 0 and the rest NULL."""
    grouping = ", ".join(f"{expression} AS {name}" for name, expression in keys.items())
    names = ", ".join(keys)
    return f"""SELECT * FROM (
    SELECT {grouping}, {figures} FROM ({_stored_figures(store, condition, thresholds)}) GROUP BY {names}
) AS figures LEFT JOIN (
    SELECT {grouping}, {split} FROM {store.table(REQUEST_SPLIT_TABLE)} FINAL WHERE {condition} GROUP BY {names}
) AS split USING ({names})"""
