"""The capacity knee: the concurrency where a server's TTFT turns from flat to steep.

Passively, from traffic alone: every request knows how many requests were in
flight on its server when it arrived (``inflight_at_arrival``). Its
concurrency is that plus itself. Per server and model, ClickHouse gives TTFT
p50 and p99 at each concurrency level (merged from per-minute t-digests,
``contract/rollup.py``'s ``KNEE_ROLLUP``, so a live pass reads minutes, not 6 h of requests); ``robust.fit_knee`` fits a
two-segment line through each curve (levels weighted by √requests) and the
last level before the turn is the knee. On a server with N slots, requests
at concurrency ≤ N get a slot at once (TTFT flat: prefill only) and each one
beyond waits for a slot to free (TTFT jumps, then climbs), so the knee is N.

The knee comes from the p50 curve (the p99 curve's is reported beside it: it
turns at the same place but is noisier); its confidence is ``fit_knee``'s. A
server never loaded past its knee shows a flat curve: no knee, said plainly,
and the latest knee found before stays in use.

Engines that export running and waiting counts give their slot count too:
the most requests running while others waited (``engine_slots``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract.analysis import KNEE_TABLE
from ..contract.requests import REQUESTS_TABLE
from ..contract.rollup import (
    ALL_REQUESTS,
    KNEE_ROLLUP_TABLE,
    KNEE_TTFT_MS,
    KNEE_TTFT_REQUESTS,
    ROLLUP_TABLE,
    TTFT_QUANTILE_LEVELS,
)
from ..contract.samples import ENGINE_SAMPLES_TABLE
from ..store.client import Store
from .calibration import ServerModel
from .config import AnalysisSpans
from .robust import fit_knee
from .scope import Scope
from .slo import MINUTE_NS
from .timerange import NS_PER_S, TimeRange, range_condition

METHOD = "flat line, then jump and steeper line: least squares on TTFT p50 vs concurrency at arrival"


@dataclass(frozen=True)
class Knee:
    node: str
    server_port: int
    model: str
    fitted_at_ns: int
    knee_concurrency: float | None
    knee_concurrency_p99: float | None
    confidence: float
    flat_ttft_ms: float | None
    slope_after_ms: float | None
    max_concurrency_seen: int
    levels: int
    n_requests: int
    engine_slots: float | None
    explanation: str


def fit_knees(store: Store, analysed: TimeRange, scope: Scope, spans: AnalysisSpans,
              now_ns: int) -> dict[ServerModel, Knee]:
    """Fit the knee of every server and model with traffic in the look-back before ``analysed`` ends; store them."""
    lookback = analysed.ending_span(max(spans.knee_lookback_s, analysed.seconds))
    curves = ttft_curves(store, lookback, scope, spans.knee_min_requests_per_level)
    slots = engine_slots(store, lookback, scope)
    knees: dict[ServerModel, Knee] = {}
    if curves.empty:  # an empty result has no columns at all
        return knees
    for (node, port, model), curve in curves.groupby(["node", "server_port", "model"], sort=True, observed=True):
        key = (node, int(port), model)
        knees[key] = _fit_curve(key, curve, slots.get((node, int(port))), now_ns)
    if knees:
        store.insert_rows(KNEE_TABLE, [
            {
                "fitted_at": knee.fitted_at_ns, "node": knee.node, "server_port": knee.server_port,
                "model": knee.model, "knee_concurrency": knee.knee_concurrency,
                "knee_concurrency_p99": knee.knee_concurrency_p99, "confidence": knee.confidence, "method": METHOD,
                "flat_ttft_ms": knee.flat_ttft_ms, "slope_after_ms": knee.slope_after_ms,
                "max_concurrency_seen": knee.max_concurrency_seen, "levels": knee.levels,
                "n_requests": knee.n_requests, "engine_slots": knee.engine_slots,
                "data_from": lookback.start_ns, "data_to": lookback.end_ns, "explanation": knee.explanation,
            }
            for knee in knees.values()
        ])
    return knees


def ttft_curves(store: Store, span: TimeRange, scope: Scope, min_requests: int):
    """Per server, model and concurrency at arrival (in flight + 1): requests, TTFT p50 and p99 (ms).

    The whole minutes of ``span`` come from the per-minute digests (``KNEE_ROLLUP_TABLE``), which its view
    adds to on every insert, a late row (a spool replay) too; where a minute's digests count fewer or other
    served requests than the latency rollup (rows inserted before the view existed, or while it was being
    replaced), that minute is digested from the requests instead, as are the partial minutes at the span's
    ends, and all digests are merged.
    """
    whole = span.whole_steps(MINUTE_NS)
    stale = _stale_minutes(store, whole, scope) if whole else []
    raw = _raw_ranges(span, whole, stale)
    in_scope, scope_parameters = scope.condition()
    parameters = {**scope_parameters, "min_requests": min_requests}
    parts = []
    if whole:
        parameters.update(knee_whole_from=whole.start_ns // NS_PER_S, knee_whole_to=whole.end_ns // NS_PER_S,
                          knee_stale=[minute // NS_PER_S for minute in stale])
        parts.append(f"""SELECT node, server_port, model, concurrency, toUInt64(requests) AS requests, ttft_ms
            FROM {store.table(KNEE_ROLLUP_TABLE)}
            WHERE minute >= toDateTime({{knee_whole_from:Int64}}, 'UTC')
              AND minute < toDateTime({{knee_whole_to:Int64}}, 'UTC')
              AND toUnixTimestamp(minute) NOT IN {{knee_stale:Array(Int64)}} AND {in_scope}""")
    if raw:
        conditions = []
        for index, raw_range in enumerate(raw):
            condition, range_parameters = range_condition("req_start", f"knee_raw_{index}", raw_range)
            conditions.append(f"({condition})")
            parameters.update(range_parameters)
        parts.append(f"""SELECT node, server_port, model, inflight_at_arrival + 1 AS concurrency,
                   count() AS requests, quantilesTDigestState({TTFT_QUANTILE_LEVELS})({KNEE_TTFT_MS}) AS ttft_ms
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {KNEE_TTFT_REQUESTS} AND ({" OR ".join(conditions)}) AND {in_scope}
            GROUP BY node, server_port, model, concurrency""")
    return store.query_df(
        f"""SELECT node, server_port, model, concurrency, requests, ttft[1] AS ttft_p50_ms, ttft[2] AS ttft_p99_ms
            FROM (SELECT node, server_port, model, concurrency, sum(requests) AS requests,
                         quantilesTDigestMerge({TTFT_QUANTILE_LEVELS})(ttft_ms) AS ttft
                  FROM ({" UNION ALL ".join(parts)})
                  GROUP BY node, server_port, model, concurrency
                  HAVING requests >= {{min_requests:UInt32}})
            ORDER BY node, server_port, model, concurrency""",
        parameters,
    )


def _stale_minutes(store: Store, whole: TimeRange, scope: Scope) -> list[int]:
    """The minutes of ``whole`` (Unix ns) where, for some server and model, the digests' served count differs
    from the latency rollup's: rows one of the two views never saw."""
    in_scope, scope_parameters = scope.condition()
    counted = f"""minute >= toDateTime({{knee_whole_from:Int64}}, 'UTC')
                  AND minute < toDateTime({{knee_whole_to:Int64}}, 'UTC') AND {in_scope}"""
    rows = store.query_rows(
        f"""SELECT DISTINCT toUnixTimestamp(minute)
            FROM (SELECT minute, node, server_port, model, sum(requests) AS rolled
                  FROM {store.table(ROLLUP_TABLE)} WHERE metric = '{ALL_REQUESTS}' AND {counted}
                  GROUP BY minute, node, server_port, model) AS rollup
            FULL OUTER JOIN (SELECT minute, node, server_port, model, sum(served) AS digested
                             FROM {store.table(KNEE_ROLLUP_TABLE)} WHERE {counted}
                             GROUP BY minute, node, server_port, model) AS digests
            USING (minute, node, server_port, model)
            WHERE rolled != digested""",
        {**scope_parameters, "knee_whole_from": whole.start_ns // NS_PER_S, "knee_whole_to": whole.end_ns // NS_PER_S},
    )
    return sorted(int(minute) * NS_PER_S for (minute,) in rows)


def _raw_ranges(span: TimeRange, whole: TimeRange | None, stale: list[int]) -> list[TimeRange]:
    """The parts of ``span`` read from the requests: outside its whole minutes, and each run of stale minutes."""
    if whole is None:
        return [span]
    edges = [(span.start_ns, whole.start_ns), *((minute, minute + MINUTE_NS) for minute in stale),
             (whole.end_ns, span.end_ns)]
    merged: list[list[int]] = []
    for start_ns, end_ns in edges:
        if start_ns >= end_ns:
            continue
        if merged and merged[-1][1] >= start_ns:
            merged[-1][1] = max(merged[-1][1], end_ns)
        else:
            merged.append([start_ns, end_ns])
    return [TimeRange(start_ns, end_ns) for start_ns, end_ns in merged]


def engine_slots(store: Store, span: TimeRange, scope: Scope) -> dict[tuple[str, int], float]:
    """Per server whose engine exports running and waiting counts: the most requests running while some waited."""
    in_range, range_parameters = range_condition("ts", "span", span)
    in_scope, scope_parameters = scope.condition(with_model=False)
    rows = store.query_rows(
        f"""SELECT node, server_port, max(requests_running) FROM {store.table(ENGINE_SAMPLES_TABLE)}
            WHERE requests_waiting > 0 AND requests_running > 0 AND {in_range} AND {in_scope}
            GROUP BY node, server_port""",
        {**range_parameters, **scope_parameters},
    )
    return {(node, int(port)): float(running) for node, port, running in rows}


def _fit_curve(key: ServerModel, curve, slots: float | None, now_ns: int) -> Knee:
    concurrency = curve["concurrency"].to_numpy(dtype=np.float64)
    weights = np.sqrt(curve["requests"].to_numpy(dtype=np.float64))
    p50 = fit_knee(concurrency, curve["ttft_p50_ms"].to_numpy(dtype=np.float64), weights)
    p99 = fit_knee(concurrency, curve["ttft_p99_ms"].to_numpy(dtype=np.float64), weights)
    highest = int(concurrency.max())
    if p50.knee is not None:
        explanation = (f"TTFT flat near {p50.flat_level:.0f} ms up to {p50.knee:.1f} concurrent requests, then "
                       f"+{p50.slope_after:.0f} ms per extra request (confidence {p50.confidence:.2f})")
    else:
        explanation = f"no knee up to {highest} concurrent requests: {p50.reason}"
    return Knee(
        node=key[0], server_port=key[1], model=key[2], fitted_at_ns=now_ns, knee_concurrency=p50.knee,
        knee_concurrency_p99=p99.knee, confidence=p50.confidence, flat_ttft_ms=p50.flat_level,
        slope_after_ms=p50.slope_after if p50.knee is not None else None, max_concurrency_seen=highest,
        levels=len(curve), n_requests=int(curve["requests"].sum()), engine_slots=slots, explanation=explanation,
    )


def latest_found_knees(store: Store, scope: Scope) -> dict[ServerModel, Knee]:
    """The most recent stored fit of each server and model that found a knee.

    When each was fitted is found from narrow columns first, and only those fits' rows are read whole: the
    table gains a row per server and model every live pass, and an ``argMax`` over all of their rows (the
    explanations too) took 0.25 s at 30 days of them where this takes 0.05 s.
    """
    in_scope, parameters = scope.condition()
    table, found = store.table(KNEE_TABLE), f"knee_concurrency IS NOT NULL AND {in_scope}"
    rows = store.query_df(
        f"""SELECT node, server_port, model,
                   tuple(toUnixTimestamp64Nano(fitted_at), knee_concurrency, knee_concurrency_p99, confidence,
                         flat_ttft_ms, slope_after_ms, max_concurrency_seen, levels, n_requests,
                         engine_slots, explanation) AS latest
            FROM {table}
            WHERE {found} AND (node, server_port, model, fitted_at) IN (
                SELECT node, server_port, model, max(fitted_at) FROM {table} WHERE {found}
                GROUP BY node, server_port, model)
            LIMIT 1 BY node, server_port, model""",
        parameters,
    )
    knees: dict[ServerModel, Knee] = {}
    for node, port, model, latest in rows.itertuples(index=False):
        key = (node, int(port), model)
        knees[key] = Knee(key[0], key[1], key[2], int(latest[0]), *_optional_floats(latest[1:6]),
                          int(latest[6]), int(latest[7]), int(latest[8]), _optional_float(latest[9]), latest[10])
    return knees


def _optional_float(value) -> float | None:
    return None if value is None or (isinstance(value, float) and np.isnan(value)) else float(value)


def _optional_floats(values) -> list[float | None]:
    return [_optional_float(value) for value in values]
