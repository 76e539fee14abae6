"""The dashboard's charts, built from the frames ``queries`` returns (Vega-Lite through Altair).

Every time-based chart shares ``time_axis``: the window's own bounds, in UTC,
labelled to the precision the window's length needs. Figures print with two
decimals.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from ..contract.latency import METRICS
from .legend import (
    STATE_COLOURS,
    STATE_WORDS,
    indicator_meaning,
    indicator_order,
    indicator_title,
)
from .queries import Filters

TOOLTIP_TIME = "%Y-%m-%d %H:%M:%S"
TWO_DECIMALS = ".2f"
SLO_COLOUR = "#e53935"
BREAKER_COLOURS = {"OPEN": "#d32f2f", "HALF_OPEN": "#ffb300", "CLOSED": "#66bb6a"}
SPAN_ROW_PX = 26
STRIP_ROW_PX = 22  # a row's label needs this much not to be dropped as overlapping its neighbour


# --------------------------------------------------------------------------- time


def time_format(span_s: float) -> str:
    """Axis labels as precise as the window needs: seconds within a quarter of an hour (a minute's
    window would otherwise print one "HH:MM" a dozen times), dates past two days."""
    if span_s <= 900:
        return "%H:%M:%S"
    if span_s <= 2 * 86400:
        return "%H:%M"
    return "%b %d %H:%M"


def vega_time(epoch_ns: int) -> alt.DateTime:
    # Vega-Lite takes a temporal domain as date-time objects (plain epoch numbers break line charts).
    moment = pd.Timestamp(epoch_ns, unit="ns", tz="UTC")
    return alt.DateTime(year=moment.year, month=moment.month, date=moment.day, hours=moment.hour,
                        minutes=moment.minute, seconds=moment.second,
                        milliseconds=moment.microsecond // 1000, utc=True)


def time_axis(filters: Filters, field: str = "time_bin", title: str = "time (UTC)") -> alt.X:
    """The x axis every time-based panel shares: the window, in UTC."""
    domain = [vega_time(filters.start_ns), vega_time(filters.end_ns)]
    span_s = (filters.end_ns - filters.start_ns) / 1e9
    return alt.X(f"{field}:T", title=title, scale=alt.Scale(type="utc", domain=domain),
                 axis=alt.Axis(format=time_format(span_s), labelOverlap=True))


# --------------------------------------------------------------------------- latency heatmaps


def slo_label(objective: pd.Series) -> str:
    source = "" if objective["source"] == "store" else ", the default"
    measured = " (client TTFT)" if objective["objective"] == "ttft" else ""
    return (f"SLO{measured}: {objective['target'] * 100:g}% within {objective['threshold_ms']:,.2f} ms"
            f"{source}")


def heatmap_chart(cells: pd.DataFrame, metric_key: str, filters: Filters, objectives: pd.DataFrame) -> alt.Chart:
    """Requests per time bin and latency band, and a dashed line at each latency objective of the metric."""
    metric = METRICS[metric_key]
    cell = alt.selection_point(name="cell", fields=["bin_start_s", "band"])
    heatmap = (
        alt.Chart(cells)
        .mark_rect()
        .encode(
            x=time_axis(filters),
            x2="time_bin_end:T",
            y=alt.Y("low_ms:Q", title=f"{metric.title} (ms, log scale)", scale=alt.Scale(type="log")),
            y2="high_ms:Q",
            color=alt.Color("requests:Q", title=metric.counted, scale=alt.Scale(type="log", scheme="viridis")),
            opacity=alt.condition(cell, alt.value(1.0), alt.value(0.4)),
            tooltip=[
                alt.Tooltip("time_bin:T", title="from (UTC)", format=TOOLTIP_TIME),
                alt.Tooltip("low_ms:Q", title="latency from (ms)", format=TWO_DECIMALS),
                alt.Tooltip("high_ms:Q", title="latency to (ms)", format=TWO_DECIMALS),
                alt.Tooltip("requests:Q", title=metric.counted),
            ],
        )
        .add_params(cell)
        .properties(height=280)
    )
    lines = objectives[objectives["objective"] == metric_key]
    if lines.empty:
        return heatmap
    lines = lines.assign(label=[slo_label(objective) for _, objective in lines.iterrows()])
    rule = alt.Chart(lines).mark_rule(color=SLO_COLOUR, strokeDash=[6, 3], strokeWidth=2).encode(
        y="threshold_ms:Q", tooltip=["label:N"])
    text = alt.Chart(lines).mark_text(align="left", baseline="bottom", dx=4, dy=-3, color=SLO_COLOUR,
                                      fontWeight="bold").encode(y="threshold_ms:Q", x=alt.value(0), text="label:N")
    return alt.layer(heatmap, rule, text)


# --------------------------------------------------------------------------- request timeline

# (span, from event, to event) in the events ``DashboardQueries.request_timeline`` names; a span is
# drawn when both ends are known. "first token"/"last token" are the first and last token events.
SPANS = (
    ("connection setup", "accept", "request first byte in"),
    ("network in", "request first byte in", "request last byte in"),
    ("queue", "request last byte in", "queue end (prefill starts)"),
    ("prefill", "queue end (prefill starts)", "prefill end"),
    ("server TTFT (queue + prefill, not split)", "request last byte in", "first token"),
    ("decode", "first token", "last token"),
    ("response tail", "last token", "response last byte out"),
)
SPLIT_BY_ANALYSIS = "queue end (prefill starts)"
TOKENS_ROW = "token events"


def request_spans(events: pd.DataFrame) -> pd.DataFrame:
    """One request's phases as spans (span, start_ms, end_ms, ms, label) from its events."""
    moments = {event.split(" (")[0] if event.startswith("response last byte") else event: at_ms
               for event, at_ms in zip(events["event"], events["at_ms"], strict=True)}
    tokens = events.loc[events["kind"] == "token", "at_ms"]
    if not tokens.empty:
        moments["first token"], moments["last token"] = tokens.min(), tokens.max()
    split = SPLIT_BY_ANALYSIS in moments
    rows = [(span, moments[start], moments[end]) for span, start, end in SPANS
            if start in moments and end in moments and not (split and span.startswith("server TTFT"))]
    spans = pd.DataFrame(rows, columns=["span", "start_ms", "end_ms"])
    spans["ms"] = spans["end_ms"] - spans["start_ms"]
    spans["label"] = [f"{ms:,.2f} ms" for ms in spans["ms"]]
    return spans


def timeline_chart(events: pd.DataFrame) -> alt.Chart:
    """A request as labelled spans, one row each (network, queue, prefill, decode, ...), and its token events."""
    spans = request_spans(events)
    rows = [*spans["span"], TOKENS_ROW]
    # Not rounded out to a whole tick: a connection's setup, a fraction of a ms before 0, would stretch it to -100.
    x = alt.X("start_ms:Q", title="ms after the request's first byte", scale=alt.Scale(nice=False, zero=False,
                                                                                     padding=70))
    y = alt.Y("span:N", title=None, sort=rows, axis=alt.Axis(labelLimit=300))
    bars = alt.Chart(spans).mark_bar(height=SPAN_ROW_PX - 8).encode(
        x=x, x2="end_ms:Q", y=y, color=alt.Color("span:N", legend=None, sort=rows),
        tooltip=["span:N", alt.Tooltip("start_ms:Q", title="from (ms)", format=TWO_DECIMALS),
                 alt.Tooltip("end_ms:Q", title="to (ms)", format=TWO_DECIMALS),
                 alt.Tooltip("ms:Q", title="lasted (ms)", format=TWO_DECIMALS)])
    labels = alt.Chart(spans).mark_text(align="left", dx=4).encode(x="end_ms:Q", y=y, text="label:N")
    tokens = events[events["kind"] == "token"].assign(span=TOKENS_ROW, start_ms=lambda frame: frame["at_ms"])
    ticks = alt.Chart(tokens).mark_tick(thickness=1, size=SPAN_ROW_PX - 8, color="#455a64").encode(
        x=x, y=y, tooltip=["event:N", alt.Tooltip("at_ms:Q", title="ms", format=TWO_DECIMALS)])
    return alt.layer(bars, labels, ticks).properties(height=alt.Step(SPAN_ROW_PX))


# --------------------------------------------------------------------------- indicators over time


def subject(server: str, device_id: str) -> str:
    return server if not device_id else f"{server} · {device_id}"


def cell_key(node: str, server_port: int, device_id: str, indicator: str, start_ns: int, end_ns: int) -> str:
    """One analysed cell as a string: a chart's selection returns it whole (ns do not survive a JS number)."""
    return f"{node}|{server_port}|{device_id}|{indicator}|{start_ns}|{end_ns}"


def parse_cell_key(key: str) -> tuple[str, int, str, str, int, int]:
    node, port, device_id, indicator, start_ns, end_ns = key.rsplit("|", 5)
    return node, int(port), device_id, indicator, int(start_ns), int(end_ns)


def strip_rows(history: pd.DataFrame) -> pd.DataFrame:
    """The history with what the strip draws: a row name, the state in words, a cell key and the value."""
    return history.assign(
        row=[f"{subject(server, device)} · {indicator_title(indicator)}"
             for server, device, indicator in zip(history["server"], history["device_id"], history["indicator"],
                                                  strict=True)],
        state_words=history["state"].map(lambda state: STATE_WORDS.get(state, state)),
        meaning=history["indicator"].map(indicator_meaning),
        cell_key=[cell_key(*identity) for identity in history[
            ["node", "server_port", "device_id", "indicator", "window_start_ns", "window_end_ns"]].itertuples(
            index=False)],
        value_text=[format_value(value, unit) for value, unit in zip(history["value"], history["unit"], strict=True)],
    )


def format_value(value: float | None, unit: str) -> str:
    if value is None or pd.isna(value):
        return ""
    if unit == "ratio":
        return f"{value * 100:.2f}%"
    return f"{value:,.2f} {unit}".strip()


def row_order(rows: pd.DataFrame) -> list[str]:
    """Servers in order, each with its indicators in the analysis' order."""
    rank = {name: position for position, name in enumerate(indicator_order())}
    ordered = rows.sort_values(["server", "device_id"]).assign(
        rank=lambda frame: frame["indicator"].map(lambda name: rank.get(name, len(rank))))
    return list(dict.fromkeys(ordered.sort_values(["server", "device_id", "rank"], kind="stable")["row"]))


def indicator_strip(history: pd.DataFrame, filters: Filters) -> alt.Chart:
    """A strip per server (and GPU) and indicator over the window, each analysed window coloured by its
    state (a bin of several by the worst of them), the explanation on hover; click a cell to drill down."""
    rows = strip_rows(history)
    picked = alt.selection_point(name="strip_cell", fields=["cell_key"])
    states = list(STATE_WORDS)
    return (
        alt.Chart(rows)
        .mark_rect(stroke="white", strokeWidth=0.5)
        .encode(
            x=time_axis(filters, "from"),
            x2="to:T",
            y=alt.Y("row:N", title=None, sort=row_order(rows), axis=alt.Axis(labelLimit=360)),
            color=alt.Color("state_words:N", title="state", legend=alt.Legend(orient="top"),
                            scale=alt.Scale(domain=[STATE_WORDS[state] for state in states],
                                            range=[STATE_COLOURS[state] for state in states])),
            opacity=alt.condition(picked, alt.value(1.0), alt.value(0.55)),
            tooltip=[alt.Tooltip("row:N", title="indicator"), alt.Tooltip("state_words:N", title="state"),
                     alt.Tooltip("value_text:N", title="value"), alt.Tooltip("explanation:N", title="why"),
                     alt.Tooltip("from:T", title="from (UTC)", format=TOOLTIP_TIME),
                     alt.Tooltip("to:T", title="to (UTC)", format=TOOLTIP_TIME),
                     alt.Tooltip("windows:Q", title="analysed windows"),
                     alt.Tooltip("crit_windows:Q", title="of them critical"),
                     alt.Tooltip("meaning:N", title="measures")],
        )
        .add_params(picked)
        .properties(height=alt.Step(STRIP_ROW_PX))
    )


# --------------------------------------------------------------------------- actuator decisions


def in_force_until(decisions: pd.DataFrame) -> pd.Series:
    """When each decision stopped being in force: its expiry, or the next decision of the same kind for
    the same target (which replaces it), whichever came first."""
    ordered = decisions.sort_values("issued_at", kind="stable")
    replaced = ordered.groupby(["kind", "target"])["issued_at"].shift(-1)
    return pd.concat([ordered["expires_at"], replaced], axis=1).min(axis=1).reindex(decisions.index)


def breaker_band(decisions: pd.DataFrame, filters: Filters) -> alt.Chart:
    """Each breaker's state over time, a band per target: open, half-open (probing), closed."""
    breakers = decisions[decisions["kind"] == "breaker"].assign(until=lambda frame: in_force_until(frame))
    states = list(BREAKER_COLOURS)
    return (
        alt.Chart(breakers.rename(columns={"issued_at": "time_bin"}))
        .mark_rect()
        .encode(
            x=time_axis(filters), x2="until:T",
            y=alt.Y("target:N", title="breaker", axis=alt.Axis(labelLimit=400)),
            color=alt.Color("breaker_state:N", title="breaker", legend=alt.Legend(orient="top"),
                            scale=alt.Scale(domain=states, range=[BREAKER_COLOURS[state] for state in states])),
            tooltip=["target:N", "action:N", "reason:N", "outcome:N",
                     alt.Tooltip("time_bin:T", title="from (UTC)", format=TOOLTIP_TIME),
                     alt.Tooltip("until:T", title="until (UTC)", format=TOOLTIP_TIME)],
        )
        .properties(height=alt.Step(28))
    )


def budget_steps(decisions: pd.DataFrame) -> pd.DataFrame:
    """Token budgets as a step line's points (target, at, tokens_per_second, run): each budget from its
    issue until it lapsed or the next replaced it; a run is a stretch with no gap between budgets."""
    budgets = decisions[decisions["kind"] != "breaker"].sort_values("issued_at", kind="stable")
    budgets = budgets.assign(until=in_force_until(budgets))
    points = []
    for target, steps in budgets.groupby("target", sort=True):
        run, previous_until = 0, None
        for step in steps.itertuples(index=False):
            if previous_until is not None and step.issued_at > previous_until:
                run += 1  # the budget lapsed before the next one: no line across the gap
            points += [(target, step.issued_at, step.tokens_per_second, f"{target} #{run}", step.reason),
                       (target, step.until, step.tokens_per_second, f"{target} #{run}", step.reason)]
            previous_until = step.until
    return pd.DataFrame(points, columns=["target", "at", "tokens_per_second", "run", "reason"])


def budget_chart(decisions: pd.DataFrame, filters: Filters) -> alt.Chart:
    """The token budgets in force, in tokens/s, as a step line per target."""
    return (
        alt.Chart(budget_steps(decisions))
        .mark_line(interpolate="step-after", point=True)
        .encode(
            x=time_axis(filters, "at"),
            y=alt.Y("tokens_per_second:Q", title="token budget (tokens/s)"),
            color=alt.Color("target:N", title="budget for", legend=alt.Legend(labelLimit=400)),
            detail="run:N",
            tooltip=["target:N", alt.Tooltip("tokens_per_second:Q", title="tokens/s", format=TWO_DECIMALS),
                     alt.Tooltip("at:T", title="at (UTC)", format=TOOLTIP_TIME), "reason:N"],
        )
        .properties(height=260)
    )
