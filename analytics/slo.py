"""SLOs: compliance, multi-window multi-burn-rate alerts, and goodput, per server and model.

An objective says what share of requests (``target``) must have a measure
(client TTFT, TPOT or end to end; see ``measures``) at or under a threshold.
A request that failed (5xx, no response, reset, cut off) fails every
objective; one without a first token fails TTFT; 4xx requests are the
client's doing and are not counted.

The burn rate over a window is its bad share over the error budget
(1 − target): 1 spends the budget exactly over the SLO period. Alerts follow
the Google SRE workbook's multi-window, multi-burn-rate recipe, so a short
spike does not page and a slow leak still tickets:

- page: the last 1 h and the last 5 min both burn faster than 14.4×
  (2% of a 30-day budget in an hour);
- ticket: the last 6 h and the last 30 min both burn faster than 6×.

Goodput is the share of requests that met every objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..contract import measures
from ..contract.analysis import SLO_STATUS_TABLE
from ..contract.requests import REQUESTS_TABLE
from ..contract.rollup import ALL_REQUESTS, ROLLUP_STEP_S, ROLLUP_TABLE
from ..store.client import Store
from .calibration import ServerModel
from .config import Objective
from .scope import Scope
from .timerange import NS_PER_S, TimeRange, range_condition

WINDOWS_S = {"5m": 300, "30m": 1800, "1h": 3600, "6h": 21600}
LONGEST = "6h"
PAGE_BURN, PAGE_WINDOWS = 14.4, ("1h", "5m")
TICKET_BURN, TICKET_WINDOWS = 6.0, ("6h", "30m")
GOODPUT = "goodput"

_MEASURE_MS = {"ttft": measures.TTFT_CLIENT_MS, "tpot": measures.TPOT_MS, "e2e": measures.E2E_MS}


def good_condition(objective: Objective) -> str:
    """SQL: the request meets the objective."""
    value = _MEASURE_MS[objective.objective]
    if objective.objective == "ttft":
        met = f"first_token IS NOT NULL AND {value} <= {objective.threshold_ms!r}"
    elif objective.objective == "tpot":
        met = f"ifNull({value} <= {objective.threshold_ms!r}, 1)"  # a single token has no TPOT to miss
    else:
        met = f"resp_end IS NOT NULL AND {value} <= {objective.threshold_ms!r}"
    return f"(NOT {measures.FAILED} AND {met})"


@dataclass(frozen=True)
class SloStatus:
    node: str
    server_port: int
    model: str
    objective: str  # an objective's measure, or "goodput"
    threshold_ms: float | None
    target: float | None
    requests: dict[str, int]  # window -> requests counted
    good: dict[str, int]
    alert: str  # page | ticket | ok | no data
    explanation: str

    def share_good(self, window: str) -> float | None:
        return self.good[window] / self.requests[window] if self.requests[window] else None

    def burn(self, window: str) -> float | None:
        share = self.share_good(window)
        if share is None or self.target is None:
            return None
        return (1.0 - share) / (1.0 - self.target)


MINUTE_NS = ROLLUP_STEP_S * NS_PER_S
SECONDS_PER_MINUTE = MINUTE_NS // NS_PER_S
Counts = tuple[int, ...]  # served (role server, any method), SLO-eligible requests, good: goodput, each objective


class SloMinutes:
    """Per whole minute and server and model, the counts an evaluation took, for the next one to reuse.

    The live analysis keeps one, so a pass reads the raw requests of the minutes
    new since the last pass instead of 6 h of them. Each minute is kept second
    by second too: a window's first, partial, minute is then its kept seconds
    and at most one partial second of raw requests. A minute is counted again
    when the rollup's count of its served requests (``request_latency_bands``,
    kept by a view on every insert) differs from the one taken with it: a request
    stored late (a spool replay) is counted too. The rollup counts the servers'
    side only (``role = 'server'``): a client-side row stored late into a kept
    minute is not seen until the counts are forgotten.
    """

    def __init__(self) -> None:
        self._for: tuple | None = None
        self.minutes: dict[int, dict[ServerModel, Counts]] = {}  # minute start (Unix ns) -> counts
        self.seconds: dict[int, dict[ServerModel, np.ndarray]] = {}  # minute start -> counts, a row per second

    def current_for(self, objectives: Sequence[Objective], scope: Scope, kept: TimeRange) -> SloMinutes:
        """Itself, holding only the minutes of ``kept``; forgotten whole when the objectives or the scope differ
        from the last evaluation's."""
        if self._for != (tuple(objectives), scope):
            self._for, self.minutes, self.seconds = (tuple(objectives), scope), {}, {}
        for minute in [minute for minute in self.minutes if not kept.start_ns <= minute < kept.end_ns]:
            del self.minutes[minute], self.seconds[minute]
        return self

    def keep(self, minute_ns: int, seconds: dict[ServerModel, np.ndarray]) -> None:
        self.seconds[minute_ns] = seconds
        self.minutes[minute_ns] = {group: tuple(int(count) for count in per_second.sum(axis=0))
                                   for group, per_second in seconds.items()}

    def tail(self, minute_ns: int, from_ns: int) -> dict[ServerModel, Counts]:
        """The SLO counts (served left out) of the kept minute's seconds from ``from_ns`` (a whole second) on."""
        first = (from_ns - minute_ns) // NS_PER_S
        return {group: tuple(int(count) for count in per_second[first:, 1:].sum(axis=0))
                for group, per_second in self.seconds.get(minute_ns, {}).items()}


def evaluate_slos(store: Store, at_ns: int, objectives: Sequence[Objective], scope: Scope,
                  kept: SloMinutes | None = None) -> list[SloStatus]:
    """Every objective (and goodput) of every server and model with requests in the 6 h before ``at_ns``; stored.

    Each window ``[at_ns - length, at_ns)`` is its whole minutes (from ``kept`` where
    still current, see ``SloMinutes``), the whole seconds of its first minute (kept
    too), and raw requests: the partial second it starts in and the minute ``at_ns`` is in.
    """
    longest_ns = at_ns - WINDOWS_S[LONGEST] * NS_PER_S
    whole = TimeRange(longest_ns // MINUTE_NS * MINUTE_NS, at_ns // MINUTE_NS * MINUTE_NS)  # 6 h: never empty
    minutes = (kept or SloMinutes()).current_for(objectives, scope, whole)
    _count_stale_minutes(store, whole, objectives, scope, minutes)
    raw = {None: TimeRange(whole.end_ns, at_ns)} if at_ns > whole.end_ns else {}
    tails: dict[str, dict[ServerModel, Counts]] = {}
    for window, seconds in WINDOWS_S.items():
        starts_ns = at_ns - seconds * NS_PER_S
        if starts_ns % MINUTE_NS:
            whole_second_ns = -(-starts_ns // NS_PER_S) * NS_PER_S
            if whole_second_ns > starts_ns:
                raw[window] = TimeRange(starts_ns, whole_second_ns)
            tails[window] = minutes.tail(starts_ns // MINUTE_NS * MINUTE_NS, whole_second_ns)
    edges = _raw_counts(store, raw, objectives, scope)
    totals: dict[ServerModel, dict[str, list[int]]] = {}
    for window, seconds in WINDOWS_S.items():
        starts_ns = at_ns - seconds * NS_PER_S
        for minute, groups in minutes.minutes.items():
            if minute >= starts_ns:
                for group, counts in groups.items():
                    _add(totals, group, window, counts[1:])
        # the window's first minute, kept and raw, and the minute it shares with every window
        for part in (tails.get(window, {}), edges.get(window, {}), edges.get(None, {})):
            for group, counts in part.items():
                _add(totals, group, window, counts)
    statuses = []
    for (node, port, model), counts in sorted(totals.items()):
        if LONGEST not in counts or not counts[LONGEST][0]:
            continue  # served requests only, none SLO-eligible
        requests = {window: counts[window][0] if window in counts else 0 for window in WINDOWS_S}
        for objective in (*objectives, None):
            index = 2 + objectives.index(objective) if objective else 1  # _count_columns' order
            good = {window: counts[window][index] if window in counts else 0 for window in WINDOWS_S}
            statuses.append(_status(node, port, model, objective, requests, good))
    if statuses:
        store.insert_rows(SLO_STATUS_TABLE, [_row(status, at_ns) for status in statuses])
    return statuses


def _add(totals: dict[ServerModel, dict[str, list[int]]], group: ServerModel, window: str, counts: Counts) -> None:
    window_counts = totals.setdefault(group, {}).setdefault(window, [0] * len(counts))
    for index, count in enumerate(counts):
        window_counts[index] += count


def _count_columns(objectives: Sequence[Objective]) -> str:
    """SQL: the SLO-eligible requests, those that met every objective, and those that met each."""
    every = " AND ".join(good_condition(objective) for objective in objectives)
    met = [every, *(good_condition(objective) for objective in objectives)]
    return ", ".join([f"countIf({measures.IS_SLO_ELIGIBLE})",
                      *(f"countIf({measures.IS_SLO_ELIGIBLE} AND {condition})" for condition in met)])


def _count_stale_minutes(store: Store, whole: TimeRange, objectives: Sequence[Objective], scope: Scope,
                         minutes: SloMinutes) -> None:
    """Count again, from the requests, second by second, every minute of ``whole`` not kept or whose served
    count has changed."""
    in_scope, scope_parameters = scope.condition()
    served: dict[int, dict[ServerModel, int]] = {}
    for node, port, model, minute, count in store.query_rows(
            f"""SELECT node, server_port, model, toUnixTimestamp(minute), sum(requests)
                FROM {store.table(ROLLUP_TABLE)}
                WHERE metric = '{ALL_REQUESTS}' AND minute >= toDateTime({{slo_whole_from:Int64}}, 'UTC')
                  AND minute < toDateTime({{slo_whole_to:Int64}}, 'UTC') AND {in_scope}
                GROUP BY node, server_port, model, minute""",
            {"slo_whole_from": whole.start_ns // NS_PER_S, "slo_whole_to": whole.end_ns // NS_PER_S,
             **scope_parameters}):
        served.setdefault(int(minute) * NS_PER_S, {})[(node, int(port), model)] = int(count)
    kept = minutes.minutes
    stale = [minute for minute in range(whole.start_ns, whole.end_ns, MINUTE_NS)
             if minute not in kept
             or {group: counts[0] for group, counts in kept[minute].items() if counts[0]} != served.get(minute, {})]
    if not stale:
        return
    in_range, range_parameters = range_condition("req_start", "slo", TimeRange(stale[0], stale[-1] + MINUTE_NS))
    counted: dict[int, dict[ServerModel, np.ndarray]] = {minute: {} for minute in stale}
    columns = 3 + len(objectives)  # served, eligible, goodput, each objective
    for node, port, model, second, *counts in store.query_rows(
            f"""SELECT node, server_port, model, intDiv(toUnixTimestamp64Nano(req_start), {NS_PER_S}) AS second,
                       countIf(role = 'server'), {_count_columns(objectives)}
                FROM {store.table(REQUESTS_TABLE)}
                WHERE {in_range} AND intDiv(second, {SECONDS_PER_MINUTE}) IN {{slo_stale:Array(Int64)}}
                  AND {in_scope}
                GROUP BY ALL""",
            {**range_parameters, **scope_parameters, "slo_stale": [minute // MINUTE_NS for minute in stale]}):
        minute, offset = divmod(int(second), SECONDS_PER_MINUTE)
        group = (node, int(port), model)
        per_second = counted[minute * MINUTE_NS].get(group)
        if per_second is None:
            per_second = counted[minute * MINUTE_NS][group] = np.zeros((SECONDS_PER_MINUTE, columns), np.int64)
        per_second[offset] = counts
    for minute, seconds in counted.items():
        minutes.keep(minute, seconds)


def _raw_counts(store: Store, parts: dict[str | None, TimeRange], objectives: Sequence[Objective],
                scope: Scope) -> dict[str | None, dict[ServerModel, Counts]]:
    """The counts of each part, from the raw requests that started in it, in one read."""
    if not parts:
        return {}
    in_scope, scope_parameters = scope.condition()
    conditions, parameters = [], dict(scope_parameters)
    for index, part in enumerate(parts.values()):
        condition, part_parameters = range_condition("req_start", f"slo_edge_{index}", part)
        conditions.append(f"({condition})")
        parameters.update(part_parameters)
    which = f"multiIf({', '.join(f'{condition}, {index}' for index, condition in enumerate(conditions))}, -1)"
    names = list(parts)
    counts: dict[str | None, dict[ServerModel, Counts]] = {}
    for node, port, model, edge, *edge_counts in store.query_rows(
            f"""SELECT node, server_port, model, {which} AS edge, {_count_columns(objectives)}
                FROM {store.table(REQUESTS_TABLE)}
                WHERE ({" OR ".join(conditions)}) AND {in_scope}
                GROUP BY ALL""", parameters):
        counts.setdefault(names[int(edge)], {})[(node, int(port), model)] = tuple(int(count) for count in edge_counts)
    return counts


def _status(node: str, port: int, model: str, objective: Objective | None, requests: dict[str, int],
            good: dict[str, int]) -> SloStatus:
    status = SloStatus(node, port, model, objective.objective if objective else GOODPUT,
                       objective.threshold_ms if objective else None, objective.target if objective else None,
                       requests, good, "", "")
    alert, explanation = _judge(status, objective) if objective else _judge_goodput(status)
    return replace(status, alert=alert, explanation=explanation)


def _judge_goodput(status: SloStatus) -> tuple[str, str]:
    share = status.share_good("1h")
    if share is None:
        return "no data", "no requests in the last hour"
    return "ok", f"{share:.1%} of requests met every objective in the last hour"


def _judge(status: SloStatus, objective: Objective) -> tuple[str, str]:
    burns = {window: status.burn(window) for window in WINDOWS_S}
    if burns["1h"] is None:
        return "no data", "no requests in the last hour"
    goal = f"{objective.target:.2%} of {objective.objective} <= {objective.threshold_ms:g} ms"
    if all((burns[window] or 0.0) > PAGE_BURN for window in PAGE_WINDOWS):
        return "page", (f"burning the error budget {burns['1h']:.1f}x over 1 h and {burns['5m']:.1f}x over 5 min "
                        f"(page > {PAGE_BURN:g}x): {goal} is being missed now")
    if all((burns[window] or 0.0) > TICKET_BURN for window in TICKET_WINDOWS):
        return "ticket", (f"burning the error budget {burns['6h']:.1f}x over 6 h and {burns['30m']:.1f}x over "
                          f"30 min (ticket > {TICKET_BURN:g}x): {goal} will be missed if this goes on")
    return "ok", (f"{status.share_good('1h'):.2%} met {objective.objective} <= {objective.threshold_ms:g} ms "
                  f"in the last hour (burn {burns['1h']:.1f}x)")


def _row(status: SloStatus, at_ns: int) -> dict:
    row = {
        "evaluated_at": at_ns, "node": status.node, "server_port": status.server_port, "model": status.model,
        "objective": status.objective, "threshold_ms": status.threshold_ms, "target": status.target,
        "alert": status.alert, "explanation": status.explanation,
    }
    for window in WINDOWS_S:
        row[f"requests_{window}"] = status.requests[window]
        row[f"good_{window}"] = status.good[window]
        row[f"burn_{window}"] = status.burn(window)
    return row
