"""The tokenprobe dashboard, a Streamlit app; ``tokenprobe dashboard`` runs it.

Panels, top to bottom, all on one UTC time axis over the chosen window:
latency heatmaps (TTFT, TPOT, end-to-end, ITL: time × log-spaced latency
band, colour = request count, or gap count for ITL; a dashed line at each
latency objective), the drill-down (a heatmap cell → its requests → one
request's own timeline as labelled spans, every token included), the
indicator matrix over time (a strip per server and indicator, each analysed
window coloured by its state, and from one of its cells to the requests of
that server's window), the actuator decisions (breakers as bands, token
budgets as a step line), the phase breakdown over time, GPU memory and
utilization.
The window fits the recent traffic unless another is chosen; the sidebar
filters by server, model and route, and shows inference requests only unless
health checks and scrapes are asked for; the panels refresh on their own
every few seconds.

Every figure is aggregated in ClickHouse by ``queries.DashboardQueries``; this
script only lays the results out. Clicking a heatmap cell fills the drill-down
selectors, which can also be set by hand.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import altair as alt
import pandas as pd
import streamlit as st
from clickhouse_connect.driver.exceptions import DatabaseError

from ..contract.analysis import INDICATOR_MATRIX_TABLE
from ..contract.decisions import DECISIONS_TABLE
from ..contract.indicators import CRIT, NO_DATA, WARN
from ..contract.latency import METRICS, band_bounds_ms
from ..contract.samples import GPU_SAMPLES_TABLE
from ..store.client import Store, StoreUnavailable
from ..store.embedded import open_store
from ..store.url import parse_store_url
from .charts import (
    breaker_band,
    budget_chart,
    heatmap_chart,
    indicator_strip,
    parse_cell_key,
    strip_rows,
    subject,
    time_axis,
    timeline_chart,
)
from .legend import INDICATOR_WORDS, STATE_WORDS, indicator_title
from .queries import DashboardQueries, Filters, choose_bin_seconds, fitting_span_s
from .settings import DashboardSettings, from_environment

FITTED_WINDOW = "fit the recent traffic"
# None: as long as the traffic of the last hour that has any (``DashboardQueries.recent_traffic``).
WINDOWS_S = {FITTED_WINDOW: None, "15 minutes": 900, "1 hour": 3600, "6 hours": 21600, "24 hours": 86400,
             "7 days": 604800}
DEFAULT_WINDOW = FITTED_WINDOW
SPAN_WITHOUT_TRAFFIC_S = 3600  # a fitted window once the store holds no request any more
ANCHORS = ("the latest request", "now")
PHASE_ORDER = ["network in", "queue", "prefill", "server TTFT", "decode", "response tail"]
ALL_REQUESTS_TOGGLE = "Include health checks and scrapes"
NO_INDICATORS = ("No indicator data in this window yet: the agent analyses its servers every `--analyze-every`"
                 " seconds; `tokenprobe analyze` analyses a past range.")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


@st.cache_resource(show_spinner="Opening the store…", on_release=Store.close)
def connect(url: str, own_store: bool) -> Store:
    # The dashboard only reads: an embedded store is reached through the agent that owns it, with its
    # reader token. Only with --own-store does it open one nobody owns, and then it serves it to other
    # processes as an agent would (a `tokenprobe query` beside it reads through it).
    return open_store(url, serve=own_store, may_own=own_store, read_only=True)


# --------------------------------------------------------------------------- formatting


def format_ms(milliseconds: float) -> str:
    """Two decimals, in ms below a second and in s above."""
    if milliseconds < 1000:
        return f"{milliseconds:.2f} ms"
    return f"{milliseconds / 1000:.2f} s"


def format_epoch_s(seconds: float) -> str:
    return time.strftime(TIME_FORMAT, time.gmtime(seconds)) + " UTC"


def band_label(band: int, count: int, counted: str) -> str:
    low, high = band_bounds_ms(band)
    return f"{format_ms(low)} – {format_ms(high)} ({count} {counted})"


def two_decimals(frame: pd.DataFrame) -> dict:
    """A dataframe's column_config that prints its fractional columns with two decimals."""
    return {column: st.column_config.NumberColumn(format="%.2f") for column in frame.columns
            if pd.api.types.is_float_dtype(frame[column])}


def show_table(frame: pd.DataFrame, container=st) -> None:
    container.dataframe(frame, hide_index=True, width="stretch", column_config=two_decimals(frame))


@contextlib.contextmanager
def panel_errors(panel: str) -> Iterator[None]:
    """Show a failed query on its panel instead of failing the page (an unreachable store still stops it)."""
    try:
        yield
    except DatabaseError as error:
        st.error(f"The {panel} query failed: {error}")


# --------------------------------------------------------------------------- window and filters


def window_filters(queries: DashboardQueries, span_s: int, anchor: str, servers: tuple[str, ...] = (),
                   models: tuple[str, ...] = (), routes: tuple[str, ...] = (), inference_only: bool = True) -> Filters:
    """The window of ``span_s`` ending at the latest request (or now), its end rounded up to a whole bin."""
    latest_ns = queries.latest_request_ns() if anchor == ANCHORS[0] else None
    end_ns = latest_ns + 1 if latest_ns is not None else time.time_ns()
    bin_ns = choose_bin_seconds(span_s) * 1_000_000_000
    end_ns = -(-end_ns // bin_ns) * bin_ns  # rounded up in integers: a float would lose the nanosecond
    return Filters(end_ns - span_s * 1_000_000_000, end_ns, servers, models, routes, inference_only)


def window_span_s(queries: DashboardQueries, window: str) -> int:
    """The length of a window offered in the sidebar; the fitted one is measured on the store each time."""
    if WINDOWS_S[window] is not None:
        return WINDOWS_S[window]
    traffic = queries.recent_traffic()
    return fitting_span_s(*traffic) if traffic else SPAN_WITHOUT_TRAFFIC_S


@dataclass(frozen=True)
class Selection:
    """What the sidebar asks for: a window (its name and what it ends at) and the filters."""

    window: str
    anchor: str
    servers: tuple[str, ...]
    models: tuple[str, ...]
    routes: tuple[str, ...]
    inference_only: bool = True

    def filters(self, queries: DashboardQueries) -> tuple[Filters, int]:
        """The window's filters as of now (a fitted window grows with the traffic) and its bin width."""
        span_s = window_span_s(queries, self.window)
        filters = window_filters(queries, span_s, self.anchor, self.servers, self.models, self.routes,
                                 self.inference_only)
        return filters, choose_bin_seconds(span_s)


def sidebar(queries: DashboardQueries, settings: DashboardSettings) -> Selection:
    st.sidebar.caption(f"Store: `{queries.store.url}` ({queries.store.mode})")
    window = st.sidebar.selectbox("Window", list(WINDOWS_S), index=list(WINDOWS_S).index(DEFAULT_WINDOW),
                                  key="window")
    anchor = st.sidebar.radio("Window ends at", ANCHORS, key="anchor")
    everything = st.sidebar.toggle(ALL_REQUESTS_TOGGLE, key="all_requests",
                                   help="By default only inference requests (calls that run a model) are counted;"
                                        " this adds health checks, metrics scrapes (the agent's own too) and the like.")
    options = queries.filter_options(window_filters(queries, window_span_s(queries, window), anchor,
                                                    inference_only=not everything))
    servers = st.sidebar.multiselect("Servers", options["servers"], key="servers", placeholder="all servers")
    models = st.sidebar.multiselect("Models", options["models"], key="models", placeholder="all models")
    routes = st.sidebar.multiselect("Routes", options["routes"], key="routes", placeholder="all routes")
    refresh = f"every {settings.refresh_s:g} s" if settings.refresh_s else "off"
    st.sidebar.caption(f"Auto-refresh: {refresh}. Times are UTC.")
    return Selection(window, anchor, tuple(servers), tuple(models), tuple(routes), not everything)


# --------------------------------------------------------------------------- heatmaps and drill-down


def on_cell_clicked(metric_key: str) -> None:
    """Point the drill-down at the heatmap cell just clicked."""
    points = st.session_state[f"heatmap_{metric_key}"]["selection"].get("cell") or []
    if points:
        st.session_state["drill_metric"] = metric_key
        st.session_state["drill_bin"] = int(points[0]["bin_start_s"])
        st.session_state["drill_band"] = int(points[0]["band"])


def heatmaps(queries: DashboardQueries, filters: Filters, bin_s: int) -> dict[str, pd.DataFrame]:
    st.subheader("Latency heatmaps")
    counted = "inference requests" if filters.inference_only else "requests of every kind"
    st.caption(f"{counted.capitalize()} (for ITL, inter-token gaps) per {bin_s} s bin and log-spaced latency"
               " band; the dashed line is the latency objective. Click a cell to list its requests.")
    objectives = pd.DataFrame(columns=["objective", "threshold_ms", "target", "source"])  # none, if it fails
    with panel_errors("latency objectives"):
        objectives = queries.slo_thresholds(filters)
    sources = {"rollup": "the per-minute rollup", "requests": "the requests"}
    cells_by_metric = {}
    tabs = st.tabs([metric.title for metric in METRICS.values()])
    for tab, (metric_key, metric) in zip(tabs, METRICS.items(), strict=True):
        with tab, panel_errors(f"{metric.title} heatmap"):
            source = queries.heatmap_source(filters, bin_s, metric_key=metric_key)
            cells = queries.latency_heatmap(metric_key, filters, bin_s, source=source)
            cells_by_metric[metric_key] = cells
            st.caption(f"{metric.description}; {int(cells['requests'].sum())} {metric.counted},"
                       f" counted from {sources[source]}.")
            if cells.empty:
                st.info(f"No requests with a {metric.title} in this window.")
                continue
            st.altair_chart(heatmap_chart(cells, metric_key, filters, objectives), key=f"heatmap_{metric_key}",
                            on_select=functools.partial(on_cell_clicked, metric_key),
                            selection_mode="cell", width="stretch")
    return cells_by_metric


def keep_if_offered(key: str, options: Sequence) -> None:
    """Forget a selector's remembered value once it is no longer among its options (the window moved)."""
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]


def pick(label: str, options: Sequence, key: str, format_func, placeholder: str, container=st):
    """A selectbox that starts empty and keeps its choice across refreshes while it is still offered."""
    keep_if_offered(key, options)
    return container.selectbox(label, options, index=None, format_func=format_func, key=key,
                               placeholder=placeholder)


def drill_down(queries: DashboardQueries, filters: Filters, bin_s: int,
               cells_by_metric: dict[str, pd.DataFrame]) -> None:
    st.subheader("Drill-down")
    available = [key for key, cells in cells_by_metric.items() if not cells.empty]
    if not available:
        st.info("Nothing to drill into: no requests in this window.")
        return
    keep_if_offered("drill_metric", available)
    columns = st.columns(3)
    metric_key = columns[0].selectbox("Latency", available, format_func=lambda key: METRICS[key].title,
                                      key="drill_metric")
    cells = cells_by_metric[metric_key]
    bins = [int(value) for value in cells["bin_start_s"].unique()]
    bin_start_s = pick("Time bin", bins, "drill_bin", format_epoch_s, "click a heatmap cell, or pick a bin",
                       columns[1])
    if bin_start_s is None:
        return
    in_bin = cells[cells["bin_start_s"] == bin_start_s]
    counts = dict(zip(in_bin["band"].astype(int), in_bin["requests"].astype(int), strict=True))
    counted = METRICS[metric_key].counted
    band = pick("Latency band", list(counts), "drill_band", lambda value: band_label(value, counts[value], counted),
                "pick a latency band", columns[2])
    if band is None:
        return
    with panel_errors("drill-down"):
        requests = queries.cell_requests(metric_key, filters, bin_start_s, bin_s, band)
        # Each request holds `in_cell` of the cell's samples: fewer in all means the list was cut.
        shown = f"the {len(requests)} slowest" if requests["in_cell"].sum() < counts[band] else f"all {len(requests)}"
        holding = " holding them" if METRICS[metric_key].per_gap else ""
        st.caption(f"{counts[band]} {counted} in this cell; {shown} requests{holding} below.")
        show_table(cell_table(requests, metric_key))
        request_drill_down(queries, requests, metric_key)


def cell_table(requests: pd.DataFrame, metric_key: str) -> pd.DataFrame:
    metric = METRICS[metric_key]
    in_cell = ["in_cell"] if metric.per_gap else []
    table = requests[["server", "model", "route", "status", "outcome", "token_events", "latency_ms", *in_cell,
                      "response_id"]].copy()
    table.insert(0, "started (UTC)", pd.to_datetime(requests["req_start_ms"], unit="ms", utc=True))
    latency = f"slowest {metric.title} in the cell (ms)" if metric.per_gap else f"{metric.title} (ms)"
    return table.rename(columns={"latency_ms": latency, "in_cell": f"{metric.counted} in the cell"})


def request_drill_down(queries: DashboardQueries, requests: pd.DataFrame, metric_key: str) -> None:
    # A request is chosen by its identity, not its row: a refresh may reorder the rows.
    keys = requests[["node", "server_port", "conn_id", "req_seq", "req_start_ns"]].itertuples(index=False)
    identities = [(str(node), int(port), int(conn_id), int(seq), int(start))
                  for node, port, conn_id, seq, start in keys]
    rows = dict(zip(identities, range(len(requests)), strict=True))

    def label(identity: tuple) -> str:
        request = requests.iloc[rows[identity]]
        started = pd.to_datetime(request["req_start_ms"], unit="ms", utc=True).strftime("%H:%M:%S.%f")[:-3]
        return (f"{started} · {request['server']} · {METRICS[metric_key].title} "
                f"{format_ms(request['latency_ms'])} · {request['response_id'] or 'no id'}")

    chosen = pick("Request", identities, "drill_request", label, "pick a request to see its timeline")
    if chosen is None:
        return
    events = queries.request_timeline(*chosen)
    if events.empty:
        st.warning("That request is no longer in the store (its data has expired).")
        return
    tokens = int((events["kind"] == "token").sum())
    st.caption(f"Request timeline: {tokens} token events; times in ms after the request's first byte arrived."
               " Queue and prefill show apart once the analysis has split them.")
    st.altair_chart(timeline_chart(events), width="stretch")
    show_table(events.rename(columns={"at_ms": "ms after first byte"}))


# --------------------------------------------------------------------------- panels over time


def phase_panel(queries: DashboardQueries, filters: Filters, bin_s: int) -> None:
    st.subheader("Where the time goes")
    with panel_errors("phase breakdown"):
        phases, analysed = queries.phase_breakdown(filters, bin_s)
        if analysed:
            st.caption("Mean time per request in each phase, from the analysis (inference requests it"
                       " analysed; server TTFT where it could not split queue from prefill).")
        else:
            st.caption("Mean time per request in each phase. Queue and prefill show together as server TTFT"
                       " until the analysis (the agent's, or `tokenprobe analyze`) splits them.")
        if phases.empty:
            st.info("No requests in this window.")
            return
        chart = (
            alt.Chart(phases)
            .mark_area()
            .encode(
                x=time_axis(filters),
                y=alt.Y("mean_ms:Q", title="mean per request (ms)", stack=True),
                color=alt.Color("phase:N", sort=PHASE_ORDER, scale=alt.Scale(domain=PHASE_ORDER)),
                order=alt.Order("phase_rank:Q"),
                tooltip=["phase:N", alt.Tooltip("mean_ms:Q", format=".2f"),
                         alt.Tooltip("time_bin:T", format="%H:%M:%S")],
            )
            .transform_calculate(phase_rank=f"indexof({PHASE_ORDER!r}, datum.phase)")
            .properties(height=220)
        )
        st.altair_chart(chart, width="stretch")


def gpu_panel(queries: DashboardQueries, filters: Filters, bin_s: int) -> None:
    st.subheader("GPUs")
    with panel_errors("GPU"):
        if not queries.has_table(GPU_SAMPLES_TABLE):
            st.info("No GPU samples table in this store: the agent creates it when it samples GPUs.")
            return
        samples = queries.gpu_usage(filters, bin_s)
        if samples.empty:
            st.info("No GPU samples in this window.")
            return
        if samples["simulated"].any():
            st.caption("Some samples are simulated (the reference server's feed): they describe no real GPU.")
        memory, utilization = st.columns(2)
        for column, field, title in ((memory, "mem_used_gib", "memory used (GiB)"),
                                     (utilization, "gpu_util_pct", "utilization (%)")):
            chart = (
                alt.Chart(samples)
                .mark_line()
                .encode(x=time_axis(filters), y=alt.Y(f"{field}:Q", title=title), color=alt.Color("gpu:N"),
                        tooltip=["gpu:N", alt.Tooltip(f"{field}:Q", format=".2f"),
                                 alt.Tooltip("time_bin:T", format="%H:%M:%S")])
                .properties(height=200)
            )
            column.altair_chart(chart, width="stretch")


def indicator_panel(queries: DashboardQueries, filters: Filters, bin_s: int) -> None:
    st.subheader("Indicators over time")
    with panel_errors("indicator matrix"):
        history = queries.indicator_history(filters, bin_s) if queries.has_table(INDICATOR_MATRIX_TABLE) else None
        if history is None or history.empty:
            st.info(NO_INDICATORS)
            return
        # A strip that is n/a throughout says only that its data does not exist: named, not drawn.
        strips = ["server", "device_id", "indicator"]
        judged = history.groupby(strips)["state"].transform(lambda states: (states != NO_DATA).any())
        shown, unjudged = history[judged], history[~judged]
        crit, warn = int(history["crit_windows"].sum()), int(history["warn_windows"].sum())
        st.caption(f"Every analysed window of every server (and GPU), coloured by its state; where one {bin_s} s"
                   f" bin holds several, the worst. This window holds {crit} critical and {warn} warning cells."
                   " Hover for the explanation; click a cell to list the requests of its window.")
        if shown.empty:
            st.info("Every indicator is without data in this window.")
        else:
            st.altair_chart(indicator_strip(shown, filters), key="indicator_strip", on_select=on_strip_clicked,
                            selection_mode="strip_cell", width="stretch")
            indicator_legend(shown["indicator"])
        if not unjudged.empty:
            missing = unjudged.drop_duplicates(strips)
            st.caption("No data for: " + "; ".join(
                f"{subject(server, device)} {indicator_title(indicator)}"
                for server, device, indicator in missing[strips].itertuples(index=False)))
        if not shown.empty:
            indicator_drill_down(queries, strip_rows(shown), filters.inference_only)


def indicator_legend(indicators: pd.Series) -> None:
    """What each indicator on the strip measures, in two columns."""
    names = [name for name in INDICATOR_WORDS if name in set(indicators)]
    columns = st.columns(2)
    for position, name in enumerate(names):
        words = INDICATOR_WORDS[name]
        columns[position % 2].caption(f"**{words.title}**: {words.meaning}")


def on_strip_clicked() -> None:
    """Point the indicator drill-down at the strip cell just clicked."""
    points = st.session_state["indicator_strip"]["selection"].get("strip_cell") or []
    if points:
        st.session_state["indicator_cell"] = points[0]["cell_key"]


def indicator_drill_down(queries: DashboardQueries, rows: pd.DataFrame, inference_only: bool) -> None:
    """From one cell of the strip to the requests its server served in that cell's (worst) window.
    Offered: the warning and critical cells, and whichever cell was clicked."""
    clicked = st.session_state.get("indicator_cell")
    offered = rows[rows["state"].isin([WARN, CRIT]) | (rows["cell_key"] == clicked)]
    offered = offered.sort_values(["crit_windows", "window_end_ns"], ascending=False)  # critical first, newest first
    labels = {row.cell_key: (f"{row.row} · {STATE_WORDS.get(row.state, row.state)} · "
                             f"{format_epoch_s(row.window_start_ns / 1e9)} → {format_epoch_s(row.window_end_ns / 1e9)}")
              for row in offered.itertuples(index=False)}
    chosen = pick("Indicator cell", list(labels), "indicator_cell", labels.get,
                  "click a strip cell, or pick a warning or critical one, to list the requests of its window")
    if chosen is None:
        return
    node, port, _, _, start_ns, end_ns = parse_cell_key(chosen)
    requests = queries.window_requests(node, port, start_ns, end_ns, inference_only=inference_only)
    total = int(requests["in_window"].iloc[0]) if not requests.empty else 0
    shown = f"the {len(requests)} slowest end to end" if len(requests) < total else f"all {total}"
    st.caption(f"{total} requests of {node}:{port} started in this window; {shown} below.")
    show_table(requests.drop(columns="in_window"))


def decisions_panel(queries: DashboardQueries, filters: Filters) -> None:
    st.subheader("Actuator decisions")
    with panel_errors("decisions"):
        if not queries.has_table(DECISIONS_TABLE):
            st.info("No decisions table in this store: the controller creates it when it first acts.")
            return
        decisions = queries.decisions(filters)
        if decisions.empty:
            st.info("No actuator decisions were in force in this window.")
            return
        st.caption("Breakers as bands (open, half-open while probing recovery, closed) and token budgets as a"
                   " step line in tokens/s, each until it expired or the next decision for its target replaced it.")
        breakers = decisions["kind"] == "breaker"
        if breakers.any():
            st.altair_chart(breaker_band(decisions, filters), width="stretch")
        if not breakers.all():
            st.altair_chart(budget_chart(decisions, filters), width="stretch")
        show_table(decisions[["issued_at", "expires_at", "target", "action", "outcome", "reason"]])


# --------------------------------------------------------------------------- the page


def panels(settings: DashboardSettings, selection: Selection | None) -> None:
    """Everything below the sidebar; re-run on its own by the auto-refresh. ``selection`` is None when
    the page was built without the sidebar (no store, or no requests yet): once there are requests to
    show, the whole page is built again."""
    try:
        queries = DashboardQueries(connect(settings.store_url, settings.own_store))
        if selection is None:
            if queries.latest_request_ns() is not None:
                st.rerun(scope="app")
            st.info(f"No requests in {queries.store.url} yet: start `tokenprobe agent --store …` on a node.")
            return
        # Anchored at the latest request, the window follows new traffic on every refresh.
        filters, bin_s = selection.filters(queries)
        st.caption(f"{format_epoch_s(filters.start_ns / 1e9)} → {format_epoch_s(filters.end_ns / 1e9)}")
        cells_by_metric = heatmaps(queries, filters, bin_s)
        drill_down(queries, filters, bin_s, cells_by_metric)
        # What went wrong and what the controller did about it, before the detail of phases and GPUs.
        indicator_panel(queries, filters, bin_s)
        decisions_panel(queries, filters)
        phase_panel(queries, filters, bin_s)
        gpu_panel(queries, filters, bin_s)
    except StoreUnavailable as error:
        store_lost(error)


def store_lost(error: StoreUnavailable) -> None:
    # The next run (the next refresh) opens the store afresh: an embedded owner may have restarted on a
    # new port, or a server come back.
    connect.clear()
    st.error(f"The store cannot be reached: {error}")


def main() -> None:
    st.set_page_config(page_title="tokenprobe", page_icon="⏱", layout="wide")
    st.title("tokenprobe")
    try:
        settings = from_environment()
        parse_store_url(settings.store_url)
    except ValueError as error:
        st.error(f"Bad dashboard settings: {error}")
        return
    selection = None
    try:
        queries = DashboardQueries(connect(settings.store_url, settings.own_store))
        if queries.latest_request_ns() is not None:
            selection = sidebar(queries, settings)
    except StoreUnavailable:
        connect.clear()  # the panels below try again, and say why it fails
    refreshing = st.fragment(panels, run_every=settings.refresh_s or None)
    refreshing(settings, selection)
