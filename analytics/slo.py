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

from ..contract import measures
from ..contract.analysis import SLO_STATUS_TABLE
from ..contract.requests import REQUESTS_TABLE
from ..store.client import Store
from .config import Objective
from .scope import Scope
from .timerange import NS_PER_S, TimeRange, range_condition

WINDOWS_S = {"5m": 300, "30m": 1800, "1h": 3600, "6h": 21600}
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


def evaluate_slos(store: Store, at_ns: int, objectives: Sequence[Objective], scope: Scope) -> list[SloStatus]:
    """Every objective (and goodput) of every server and model with requests in the 6 h before ``at_ns``; stored."""
    longest = TimeRange(at_ns - max(WINDOWS_S.values()) * NS_PER_S, at_ns)
    in_range, range_parameters = range_condition("req_start", "slo", longest)
    in_scope, scope_parameters = scope.condition()
    every = " AND ".join(good_condition(objective) for objective in objectives)
    aggregates = []
    for window, seconds in WINDOWS_S.items():
        recent = f"req_start >= fromUnixTimestamp64Nano({{slo_to:Int64}} - {seconds * NS_PER_S}, 'UTC')"
        aggregates.append(f"countIf({recent}) AS requests_{window}")
        aggregates.append(f"countIf({recent} AND {every}) AS good_{window}_{GOODPUT}")
        for objective in objectives:
            aggregates.append(f"countIf({recent} AND {good_condition(objective)}) "
                              f"AS good_{window}_{objective.objective}")
    frame = store.query_df(
        f"""SELECT node, server_port, model, {", ".join(aggregates)}
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_SLO_ELIGIBLE} AND {in_range} AND {in_scope}
            GROUP BY node, server_port, model ORDER BY node, server_port, model""",
        {**range_parameters, **scope_parameters},
    )
    statuses = []
    for _, row in frame.iterrows():
        requests = {window: int(row[f"requests_{window}"]) for window in WINDOWS_S}
        for objective in (*objectives, None):
            name = objective.objective if objective else GOODPUT
            good = {window: int(row[f"good_{window}_{name}"]) for window in WINDOWS_S}
            statuses.append(_status(row["node"], int(row["server_port"]), row["model"], objective, requests, good))
    if statuses:
        store.insert_rows(SLO_STATUS_TABLE, [_row(status, at_ns) for status in statuses])
    return statuses


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
