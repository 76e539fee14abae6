"""What the actuator's controller needs for one window, per upstream: ``window_figures``.

For each server with inference requests in the window it returns a
``actuator.controller.WindowFigures``.

A window holds the requests that *ended* in it. The agent writes a request's
row when the request ends, so a window read a little after its end (the
control loop's ``settle_s``) is complete, and every request is counted in
exactly one window. Choosing by arrival instead would hide the queued
requests of an overloaded server until they are served, long after the
windows that should have seen them were decided. A request's TTFT is thus
known one decode later than its first token; that delay is the price of
never deciding on a partial window.

- ``request_rate``: requests that ended per second of the window. A
  saturated server cannot finish requests faster than its capacity, so past
  the knee this sits at capacity, above the breaker's capacity × 0.8;
- ``p99_ttft_s``: their server-side TTFT p99;
- ``knee_capacity_rps``: the requests per second the server sustains before
  queueing, by Little's law: its slot count (the engine's, else the stored
  knee; ``analyze`` fits knees) over the mean time a request holds a slot
  (the TTFT median of requests that found a free slot, which is all prefill,
  plus the window's mean decode time);
- ``baseline_p99_s``: the server's TTFT p99 at healthy load over the last
  ``baseline_lookback_s``: the p99 of the requests in 10-second arrival
  buckets whose rate stayed under 0.7 × capacity and where most arrivals
  found a free slot. Normal queueing is in it; only when no
  such bucket is known does it fall back to the p99 of requests that found
  a free slot, a stricter bar;
- ``arrived_p99_ttft_s``: the TTFT p99 of the requests that arrived in the
  window and have ended: what the breaker judges recovery probes by;
- ``tenant_tokens``: prompt + output tokens per tenant: the tenant header the
  agent recorded (``tokenprobe agent --tenant-header``), else the client
  address. Prompt tokens come from usage, else from the request bytes at the
  server's bytes per prompt token (learnt from requests with usage; 4 where
  none had it). Charged as soon as they are seen: a request with a tenant
  header that the agent sampled in flight (``inflight_samples``) is charged,
  in each window, what it added since the sample before the window: its
  prompt, estimated from the request bytes received (at once, while it still
  waits for a slot), and the token events it streamed; when it ends, the
  rest of its count, which corrects the estimate (an overcharge is taken
  back). So a long stream, or a long prompt queued, weighs on its tenant's
  budget from the window it arrives in, not minutes later when it ends.
  (Without a header the sample cannot be matched to the client address:
  charged on ending.);
- ``tokens_per_request``: the mean prompt + output tokens of the requests
  that ended, which turns a capacity in requests into tokens;
- ``indicators``: per indicator, the newest cell with data of the server's
  indicator matrix (live analysis writes it) ending within
  ``indicator_max_age_s`` of the window's end, when lit (warn or crit); for
  a per-GPU indicator, its worst GPU;
- ``queue``: requests in flight waiting for their first token at the
  newest in-flight sample in the window and at the one before it.

A server with requests in flight sampled in the window has figures even if
no request ended or arrived in it: a jammed server ends nothing, and only
its in-flight figures and its ``inflight_stall`` cell show it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..contract import measures
from ..contract.analysis import INDICATOR_MATRIX_TABLE
from ..contract.decisions import IndicatorReading, QueueSample, WindowFigures
from ..contract.indicators import CRIT, WARN
from ..contract.inflight import INFLIGHT_SAMPLES_TABLE, WAITING
from ..contract.requests import REQUESTS_TABLE
from ..store.client import Store
from .config import DEFAULT_CONFIG, DEFAULT_LIVE_EVERY_S, AnalysisSpans
from .knee import engine_slots, latest_found_knees
from .pipeline import server_capacities
from .scope import EVERYTHING, Scope
from .timerange import NS_PER_S, TimeRange, range_condition

DEFAULT_BYTES_PER_TOKEN = 4.0  # a typical BPE token is about four characters of English
MIN_BASELINE_REQUESTS = 20
# Requests longer than this are left out of windows; the bound lets the
# store skip old parts through the (server_port, req_start) sort key.
MAX_REQUEST_S = 3600.0
TENANT = "if(tenant != '', tenant, client_addr)"
# The baseline p99 is the server's p99 at healthy load: arrival buckets of this
# many seconds whose rate stayed under this share of the capacity.
HEALTH_BUCKET_S = 10
HEALTHY_LOAD_SHARE = 0.7
# An indicator cell older than this says nothing of now (live analysis writes one every pass).
INDICATOR_MAX_AGE_S = 2.0 * DEFAULT_LIVE_EVERY_S
_SEVERITY = {WARN: 1, CRIT: 2}


def default_upstream(node: str, server_port: int) -> str:
    return f"{node}:{server_port}"


def window_figures(store: Store, since: float, until: float, *, scope: Scope = EVERYTHING,
                   spans: AnalysisSpans = DEFAULT_CONFIG.spans,
                   upstream_of: Callable[[str, int], str] = default_upstream,
                   indicator_max_age_s: float = INDICATOR_MAX_AGE_S) -> list[WindowFigures]:
    """One ``WindowFigures`` per server with inference requests (ended, arrived or sampled in flight)
    in [since, until) (Unix seconds).

    ``upstream_of(node, port)`` names the upstream as the gateway knows it
    (default ``node:port``).
    """
    window = TimeRange(int(since * NS_PER_S), int(until * NS_PER_S))
    lookback = window.ending_span(max(spans.baseline_lookback_s, window.seconds))
    knees = latest_found_knees(store, scope)
    capacities = server_capacities(knees, {})
    slots_by_engine = engine_slots(store, lookback, scope)
    ended, ended_parameters = range_condition(measures.ENDED_AT, "window", window)
    arrived, arrived_parameters = range_condition("req_start", "arrived", window)
    recent, recent_parameters = _recent_enough(window)
    in_scope, scope_parameters = scope.condition()
    traffic = store.query_rows(
        f"""SELECT node, server_port, countIf(ended), quantileIf(0.99)({measures.TTFT_SERVER_MS}, ended),
                   avgIf({measures.DECODE_MS}, ended), quantileIf(0.99)({measures.TTFT_SERVER_MS}, arrived)
            FROM (SELECT *, {ended} AS ended, {arrived} AS arrived FROM {store.table(REQUESTS_TABLE)}
                  WHERE {measures.IS_INFERENCE} AND {recent} AND {in_scope})
            WHERE ended OR arrived
            GROUP BY node, server_port ORDER BY node, server_port""",
        {**ended_parameters, **arrived_parameters, **recent_parameters, **scope_parameters},
    )
    queues = _queues(store, window, scope)
    lit = _lit_indicators(store, window, scope, indicator_max_age_s)
    # Servers sampled in flight with nothing ended or arrived: no latency, only in-flight figures.
    with_traffic = {(node, int(port)) for node, port, *_ in traffic}
    jammed = [(node, port, 0, None, None, None) for node, port in sorted(set(queues) - with_traffic)]
    figures = []
    for node, port, requests, p99_ms, decode_ms, arrived_p99_ms in [*traffic, *jammed]:
        server = (node, int(port))
        slots = slots_by_engine.get(server) or (capacities[server].knee_concurrency if server in capacities
                                                else None)
        unqueued = _unqueued_ttft(store, server, lookback, slots)
        capacity_rps = baseline_p99_ms = None
        if slots and unqueued is not None and not _missing(decode_ms):
            service_s = (unqueued[0] + decode_ms) / 1000
            capacity_rps = slots / service_s if service_s > 0 else None
        if capacity_rps is not None:
            baseline_p99_ms = _healthy_p99(store, server, lookback, HEALTHY_LOAD_SHARE * capacity_rps, slots)
        if baseline_p99_ms is None and unqueued is not None:
            baseline_p99_ms = unqueued[1]
        tenant_tokens, tokens_per_request = _tenant_tokens(store, server, window, lookback, scope)
        figures.append(WindowFigures(
            upstream=upstream_of(*server), window_end=until, request_rate=requests / window.seconds,
            p99_ttft_s=_seconds(p99_ms), knee_capacity_rps=capacity_rps, baseline_p99_s=_seconds(baseline_p99_ms),
            tenant_tokens=tenant_tokens, arrived_p99_ttft_s=_seconds(arrived_p99_ms),
            tokens_per_request=tokens_per_request, indicators=lit.get(server, {}), queue=queues.get(server),
        ))
    return figures


def _recent_enough(window: TimeRange) -> tuple[str, dict[str, int]]:
    return range_condition("req_start", "started", TimeRange(
        window.start_ns - int(MAX_REQUEST_S * NS_PER_S), window.end_ns))


def _seconds(ms: float | None) -> float | None:
    return None if _missing(ms) else ms / 1000


def _ended_in(window: TimeRange) -> tuple[str, dict[str, int]]:
    ended, parameters = range_condition(measures.ENDED_AT, "window", window)
    recent, recent_parameters = _recent_enough(window)
    return f"{ended} AND {recent}", {**parameters, **recent_parameters}


def _missing(value) -> bool:
    return value is None or value != value  # NaN is not equal to itself


def _server_condition(server: tuple[str, int]) -> tuple[str, dict]:
    return "node = {node:String} AND server_port = {port:UInt16}", {"node": server[0], "port": server[1]}


def _unqueued_ttft(store: Store, server: tuple[str, int], lookback: TimeRange,
                   slots: float | None) -> tuple[float, float] | None:
    """TTFT (p50, p99) in ms of requests that found a free slot (an idle server if the slots are unknown):
    prefill alone, no queueing."""
    in_range, range_parameters = range_condition("req_start", "baseline", lookback)
    on_server, server_parameters = _server_condition(server)
    below = "inflight_at_arrival + 1 <= {slots:Float64}" if slots else "inflight_at_arrival = 0"
    count, p50, p99 = store.query_rows(
        f"""SELECT count(), quantile(0.5)({measures.TTFT_SERVER_MS}), quantile(0.99)({measures.TTFT_SERVER_MS})
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND first_token IS NOT NULL AND req_end IS NOT NULL AND {below}
              AND {in_range} AND {on_server}""",
        {**range_parameters, **server_parameters, "slots": float(slots or 0)},
    )[0]
    return None if count < MIN_BASELINE_REQUESTS else (float(p50), float(p99))


def _healthy_p99(store: Store, server: tuple[str, int], lookback: TimeRange, healthy_rps: float,
                 slots: float) -> float | None:
    """The TTFT p99 in ms at healthy load: over the requests of the lookback's arrival buckets whose
    request rate was at most `healthy_rps` and where most arrivals found a free slot. The slot
    condition leaves out buckets where a backlog was still draining (arrivals were few, but queued);
    pooling the requests lets busy healthy buckets, with their normal queueing, outweigh near-idle ones."""
    in_range, range_parameters = range_condition("req_start", "baseline", lookback)
    on_server, server_parameters = _server_condition(server)
    bucket = f"toStartOfInterval(req_start, INTERVAL {HEALTH_BUCKET_S} SECOND)"
    measured = (f"{measures.IS_INFERENCE} AND first_token IS NOT NULL AND req_end IS NOT NULL "
                f"AND {in_range} AND {on_server}")
    requests, p99 = store.query_rows(
        f"""SELECT count(), quantile(0.99)({measures.TTFT_SERVER_MS}) FROM {store.table(REQUESTS_TABLE)}
            WHERE {measured} AND {bucket} IN (
                SELECT {bucket} AS healthy_bucket FROM {store.table(REQUESTS_TABLE)} WHERE {measured}
                GROUP BY healthy_bucket
                HAVING count() / {HEALTH_BUCKET_S} <= {{healthy_rps:Float64}}
                   AND quantile(0.5)(inflight_at_arrival) + 1 <= {{slots:Float64}})""",
        {**range_parameters, **server_parameters, "healthy_rps": healthy_rps, "slots": float(slots)},
    )[0]
    return None if requests < MIN_BASELINE_REQUESTS else float(p99)


def _tenant_tokens(store: Store, server: tuple[str, int], window: TimeRange, lookback: TimeRange,
                   scope: Scope) -> tuple[dict[str, int], float | None]:
    """(tokens charged to each tenant in the window, as they leave; mean tokens of the requests that ended)."""
    in_lookback, lookback_parameters = range_condition("req_start", "ratio", lookback)
    on_server, server_parameters = _server_condition(server)
    ratio = store.query_rows(
        f"""SELECT sum(bytes_in) / sum(prompt_tokens) FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND prompt_tokens > 0 AND {in_lookback} AND {on_server}""",
        {**lookback_parameters, **server_parameters},
    )[0][0]
    bytes_per_token = DEFAULT_BYTES_PER_TOKEN if _missing(ratio) or not ratio else float(ratio)
    in_window, window_parameters = _ended_in(window)
    in_scope, scope_parameters = scope.condition()
    sampled, sampled_parameters = range_condition("sampled_at", "sampled", TimeRange(window.start_ns, window.end_ns))
    before, before_parameters = range_condition("sampled_at", "before", TimeRange(
        window.start_ns - int(MAX_REQUEST_S * NS_PER_S), window.start_ns))
    ended_by, ended_by_parameters = range_condition(measures.ENDED_AT, "ended_by", TimeRange(
        window.start_ns - int(MAX_REQUEST_S * NS_PER_S), window.end_ns))
    samples = store.table(INFLIGHT_SAMPLES_TABLE)
    # A sample's charge so far: the prompt its request bytes make, and the events streamed.
    sample_charge = "(toFloat64(bytes_in) / {bytes_per_token:Float64} + token_events)"
    # What a request sampled in flight was charged by the window's start: its newest sample's then.
    charged_before = f"""(SELECT conn_id, req_seq, argMax({sample_charge}, sampled_at) AS charged
                         FROM {samples} WHERE {on_server} AND role = 'server' AND tenant != '' AND {before}
                         GROUP BY conn_id, req_seq)"""
    rows = store.query_rows(
        f"""SELECT tenant, sum(charge), sum(full_tokens), sum(ended) FROM (
                SELECT tenant, full_tokens - charged AS charge, full_tokens, 1 AS ended
                FROM (SELECT {TENANT} AS tenant, conn_id, req_seq,
                             toFloat64(ifNull(prompt_tokens, bytes_in / {{bytes_per_token:Float64}})
                                       + {measures.OUTPUT_TOKENS}) AS full_tokens
                      FROM {store.table(REQUESTS_TABLE)}
                      WHERE {measures.IS_INFERENCE} AND {in_window} AND {on_server} AND {in_scope}) AS ended_rows
                LEFT JOIN {charged_before} AS prior USING (conn_id, req_seq)
                UNION ALL
                -- still in flight at the newest sample in the window: what it added since the one before
                SELECT tenant, greatest(0., {sample_charge} - charged) AS charge, 0. AS full_tokens, 0 AS ended
                FROM (SELECT conn_id, req_seq, tenant, token_events, bytes_in FROM {samples}
                      WHERE {on_server} AND role = 'server' AND tenant != '' AND {in_scope} AND sampled_at = (
                          SELECT max(sampled_at) FROM {samples} WHERE {on_server} AND {sampled})
                        AND (conn_id, req_seq) NOT IN (
                          SELECT conn_id, req_seq FROM {store.table(REQUESTS_TABLE)}
                          WHERE {measures.IS_INFERENCE} AND {on_server} AND {ended_by})) AS streaming
                LEFT JOIN {charged_before} AS prior USING (conn_id, req_seq)
            )
            GROUP BY tenant
            SETTINGS join_use_nulls = 0""",
        {**window_parameters, **server_parameters, **scope_parameters, **sampled_parameters, **before_parameters,
         **ended_by_parameters, "bytes_per_token": bytes_per_token},
    )
    ended = sum(int(row[3]) for row in rows)
    tokens_per_request = sum(float(row[2]) for row in rows) / ended if ended else None
    return {tenant: round(charge) for tenant, charge, _, _ in rows if charge > 0}, tokens_per_request


def _queues(store: Store, window: TimeRange, scope: Scope) -> dict[tuple[str, int], QueueSample | None]:
    """Per server sampled in the window: requests waiting for a first token at its newest sample in the
    window and at the sample before (None when there is none within MAX_REQUEST_S)."""
    in_range, range_parameters = range_condition("sampled_at", "queue", TimeRange(
        window.start_ns - int(MAX_REQUEST_S * NS_PER_S), window.end_ns))
    in_scope, scope_parameters = scope.condition()
    rows = store.query_rows(
        f"""SELECT node, server_port, toUnixTimestamp64Nano(sampled_at) AS at, countIf(stage = {{waiting:String}})
            FROM {store.table(INFLIGHT_SAMPLES_TABLE)}
            WHERE role = 'server' AND {in_range} AND {in_scope}
            GROUP BY node, server_port, at ORDER BY node, server_port, at DESC LIMIT 2 BY node, server_port""",
        {**range_parameters, **scope_parameters, "waiting": WAITING},
    )
    newest: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for node, port, at, waiting in rows:
        newest.setdefault((node, int(port)), []).append((int(at), int(waiting)))
    return {server: QueueSample(before=samples[-1][1], after=samples[0][1],
                                span_s=(samples[0][0] - samples[-1][0]) / NS_PER_S) if len(samples) == 2 else None
            for server, samples in newest.items() if samples[0][0] >= window.start_ns}


def _lit_indicators(store: Store, window: TimeRange, scope: Scope,
                    max_age_s: float) -> dict[tuple[str, int], dict[str, IndicatorReading]]:
    """Per server, its lit indicators (see the module docstring)."""
    in_scope, scope_parameters = scope.condition(with_model=False)
    rows = store.query_rows(
        f"""SELECT node, server_port, indicator, argMax((state, value, warn, crit), window_start)
            FROM {store.table(INDICATOR_MATRIX_TABLE)} FINAL
            WHERE state != 'n/a' AND {in_scope}
              AND window_start <= fromUnixTimestamp64Nano({{until_ns:Int64}}, 'UTC')
              AND window_end > fromUnixTimestamp64Nano({{oldest_ns:Int64}}, 'UTC')
            GROUP BY node, server_port, device_id, indicator""",
        {**scope_parameters, "until_ns": window.end_ns, "oldest_ns": window.end_ns - int(max_age_s * NS_PER_S)},
    )
    lit: dict[tuple[str, int], dict[str, IndicatorReading]] = {}
    for node, port, indicator, (state, value, warn, crit) in rows:
        if state not in _SEVERITY:
            continue
        readings = lit.setdefault((node, int(port)), {})
        held = readings.get(indicator)
        if held is None or _SEVERITY[state] > _SEVERITY[held.state]:  # a per-GPU indicator: its worst GPU
            threshold = crit if state == CRIT else warn
            readings[indicator] = IndicatorReading(indicator, state, float(value), float(threshold))
    return lit
