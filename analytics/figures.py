"""What the actuator's controller needs for one window, per upstream: ``window_figures``.

For each server with inference requests in the window it returns a
``actuator.controller.WindowFigures``:

- ``request_rate``: requests that arrived per second of the window;
- ``p99_ttft_s``: their server-side TTFT p99;
- ``knee_capacity_rps``: the requests per second the server sustains before
  queueing, by Little's law: its slot count (the engine's, else the stored
  knee; ``analyze`` fits knees) over the mean time a request holds a slot
  (the low-load TTFT median, which is all prefill, plus the window's mean
  decode time);
- ``baseline_p99_s``: the TTFT p99 of requests that arrived below the knee in
  the last ``baseline_lookback_s`` (at an idle server when no knee is known);
- ``tenant_tokens``: prompt + output tokens per client address (the agent
  does not know tenants; the peer address stands in for one). Prompt tokens
  come from usage, else from the request bytes at the server's bytes per
  prompt token (learnt from requests with usage; 4 where none had it).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenprobe.actuator.controller import WindowFigures
from tokenprobe.agent.schema import REQUESTS_TABLE
from tokenprobe.agent.store import Store
from tokenprobe.analytics import measures
from tokenprobe.analytics.config import DEFAULT_CONFIG, AnalysisSpans
from tokenprobe.analytics.knee import engine_slots, latest_found_knees
from tokenprobe.analytics.pipeline import server_capacities
from tokenprobe.analytics.scope import EVERYTHING, Scope
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange, range_condition

DEFAULT_BYTES_PER_TOKEN = 4.0  # a typical BPE token is about four characters of English
MIN_BASELINE_REQUESTS = 20


def default_upstream(node: str, server_port: int) -> str:
    return f"{node}:{server_port}"


def window_figures(store: Store, since: float, until: float, *, scope: Scope = EVERYTHING,
                   spans: AnalysisSpans = DEFAULT_CONFIG.spans,
                   upstream_of: Callable[[str, int], str] = default_upstream) -> list[WindowFigures]:
    """One ``WindowFigures`` per server with inference requests in [since, until) (Unix seconds).

    ``upstream_of(node, port)`` names the upstream as the gateway knows it
    (default ``node:port``).
    """
    window = TimeRange(int(since * NS_PER_S), int(until * NS_PER_S))
    lookback = window.ending_span(max(spans.baseline_lookback_s, window.seconds))
    knees = latest_found_knees(store, scope)
    capacities = server_capacities(knees, {})
    slots_by_engine = engine_slots(store, lookback, scope)
    in_window, window_parameters = range_condition("req_start", "window", window)
    in_scope, scope_parameters = scope.condition()
    traffic = store.query_rows(
        f"""SELECT node, server_port, count(), quantile(0.99)({measures.TTFT_SERVER_MS}),
                   avg({measures.DECODE_MS})
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND {in_window} AND {in_scope}
            GROUP BY node, server_port ORDER BY node, server_port""",
        {**window_parameters, **scope_parameters},
    )
    figures = []
    for node, port, requests, p99_ms, decode_ms in traffic:
        server = (node, int(port))
        slots = slots_by_engine.get(server) or (capacities[server].knee_concurrency if server in capacities
                                                else None)
        baseline = _baseline(store, server, lookback, slots)
        capacity_rps = None
        if slots and baseline is not None and not _missing(decode_ms):
            service_s = (baseline[0] + decode_ms) / 1000
            capacity_rps = slots / service_s if service_s > 0 else None
        figures.append(WindowFigures(
            upstream=upstream_of(*server), window_end=until, request_rate=requests / window.seconds,
            p99_ttft_s=None if _missing(p99_ms) else p99_ms / 1000, knee_capacity_rps=capacity_rps,
            baseline_p99_s=None if baseline is None else baseline[1] / 1000,
            tenant_tokens=_tenant_tokens(store, server, window, lookback, scope),
        ))
    return figures


def _missing(value) -> bool:
    return value is None or value != value  # NaN is not equal to itself


def _server_condition(server: tuple[str, int]) -> tuple[str, dict]:
    return "node = {node:String} AND server_port = {port:UInt16}", {"node": server[0], "port": server[1]}


def _baseline(store: Store, server: tuple[str, int], lookback: TimeRange,
              slots: float | None) -> tuple[float, float] | None:
    """TTFT (p50, p99) in ms of requests that arrived below the knee (to an idle server if none is known)."""
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


def _tenant_tokens(store: Store, server: tuple[str, int], window: TimeRange, lookback: TimeRange,
                   scope: Scope) -> dict[str, int]:
    in_lookback, lookback_parameters = range_condition("req_start", "ratio", lookback)
    on_server, server_parameters = _server_condition(server)
    ratio = store.query_rows(
        f"""SELECT sum(bytes_in) / sum(prompt_tokens) FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND prompt_tokens > 0 AND {in_lookback} AND {on_server}""",
        {**lookback_parameters, **server_parameters},
    )[0][0]
    bytes_per_token = DEFAULT_BYTES_PER_TOKEN if _missing(ratio) or not ratio else float(ratio)
    in_window, window_parameters = range_condition("req_start", "window", window)
    in_scope, scope_parameters = scope.condition()
    rows = store.query_rows(
        f"""SELECT client_addr,
                   sum(ifNull(prompt_tokens, bytes_in / {{bytes_per_token:Float64}}) + {measures.OUTPUT_TOKENS})
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND {in_window} AND {on_server} AND {in_scope}
            GROUP BY client_addr""",
        {**window_parameters, **server_parameters, **scope_parameters, "bytes_per_token": bytes_per_token},
    )
    return {client: round(tokens) for client, tokens in rows}
