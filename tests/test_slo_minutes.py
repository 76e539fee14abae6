"""SLO windows from kept whole-minute counts (analytics/slo.py ``SloMinutes``) on a real embedded store.

The live analysis reuses the minutes an earlier pass counted; each window's
counts must still be those of its raw requests, to the nanosecond at both
ends, and a request stored late into a kept minute (a spool replay) must be
counted. A request that failed inside its 200 stream is a failure for the SLOs
and for the retry-storm indicator.
"""

from __future__ import annotations

import time

import pytest
from tokenprobe.analytics import indicators
from tokenprobe.analytics.config import DEFAULT_OBJECTIVES
from tokenprobe.analytics.scope import Scope, Server
from tokenprobe.analytics.slo import WINDOWS_S, SloMinutes, evaluate_slos
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.contract import measures
from tokenprobe.store.embedded import open_store

from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

NODE = "slo-node"
SCOPE = Scope((Server(8000, NODE),))
# Minute boundaries and window starts fall inside the traffic, off the second.
START_NS = time.time_ns() // NS_PER_S * NS_PER_S - 3600 * NS_PER_S + 17_250_000_000


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('slo') / 'store'}", serve=False)
    store.ensure_schema()
    quiet_then_overloaded = [LoadPhase(200, 2.0), LoadPhase(200, 30.0)]
    rows = [request.row for request in simulate(SlotServer(), quiet_then_overloaded, start_ns=START_NS,
                                                node=NODE, port=8000, seed=3)]
    store.insert_rows("requests", rows)
    yield store, rows
    store.close()


def window_requests(store, at_ns: int) -> dict[str, int]:
    """The SLO-eligible requests of each window ending at ``at_ns``, counted from the raw rows."""
    columns = ", ".join(f"countIf(toUnixTimestamp64Nano(req_start) >= {at_ns - seconds * NS_PER_S})"
                        for seconds in WINDOWS_S.values())
    counts = store.query_rows(
        f"SELECT {columns} FROM {store.table('requests')} WHERE {measures.IS_SLO_ELIGIBLE}"
        f" AND node = '{NODE}' AND toUnixTimestamp64Nano(req_start) < {at_ns}")[0]
    return dict(zip(WINDOWS_S, (int(count) for count in counts), strict=True))


def test_kept_minutes_give_each_window_its_raw_counts_and_count_late_rows(store):
    store, rows = store
    kept = SloMinutes()
    # Passes 7.3 s apart: the 5 min window's start crosses minute boundaries inside the traffic.
    for at_ns in (START_NS + step * 7_300_000_000 + 300 * NS_PER_S for step in range(6)):
        statuses = evaluate_slos(store, at_ns, DEFAULT_OBJECTIVES, SCOPE, kept)
        assert statuses[0].requests == window_requests(store, at_ns)
        assert len(statuses) == len(DEFAULT_OBJECTIVES) + 1
    assert kept.minutes, "whole minutes are kept for the next pass"
    # A request of the first minute stored again late, as a spool replay would.
    store.insert_rows("requests", [dict(rows[0], conn_id=rows[0]["conn_id"] + 10**9)])
    again = evaluate_slos(store, at_ns, DEFAULT_OBJECTIVES, SCOPE, kept)
    fresh = evaluate_slos(store, at_ns, DEFAULT_OBJECTIVES, SCOPE)
    assert again[0].requests["6h"] == statuses[0].requests["6h"] + 1
    assert [(status.objective, status.requests, status.good, status.alert) for status in again] == \
        [(status.objective, status.requests, status.good, status.alert) for status in fresh]


def judged(statuses) -> list[tuple]:
    return [(status.node, status.server_port, status.model, status.objective, status.requests, status.good,
             status.alert) for status in statuses]


def test_kept_seconds_equal_a_recount_pass_after_pass_a_late_row_and_a_restart_included(store):
    store, rows = store
    kept = SloMinutes()
    # Passes 9.7 s apart, off the second: the 5 min window's first minute, in the traffic, is mostly kept seconds.
    for step in range(14):
        at_ns = START_NS + 300 * NS_PER_S + step * 9_700_000_123
        if step == 6:  # a request of a kept second stored late: its minute is counted again
            late = next(row for row in rows if at_ns - 295 * NS_PER_S < row["req_start"] < at_ns - 250 * NS_PER_S)
            store.insert_rows("requests", [dict(late, conn_id=late["conn_id"] + 2 * 10**9)])
        if step == 10:  # the agent restarted: nothing kept
            kept = SloMinutes()
        statuses = evaluate_slos(store, at_ns, DEFAULT_OBJECTIVES, SCOPE, kept)
        assert judged(statuses) == judged(evaluate_slos(store, at_ns, DEFAULT_OBJECTIVES, SCOPE)), f"pass {step}"
        assert statuses[0].requests == window_requests(store, at_ns), f"pass {step}"
        assert set(kept.seconds) == set(kept.minutes), "every kept minute has its seconds"


def test_an_error_inside_a_200_stream_fails_every_objective(store):
    """The same quick request twice, once ending in an error event of its 200 stream (outcome 'error'):
    only the other meets the objectives."""
    store, rows = store
    node = "slo-errors-node"
    quick = dict(rows[0], node=node)
    store.insert_rows("requests", [quick, dict(quick, conn_id=quick["conn_id"] + 1, outcome="error",
                                               error_type="overloaded_error")])
    at_ns = quick["resp_end"] + NS_PER_S
    statuses = evaluate_slos(store, at_ns, DEFAULT_OBJECTIVES, Scope((Server(8000, node),)))
    assert [(status.objective, status.requests["5m"], status.good["5m"]) for status in statuses] == \
        [(objective.objective, 2, 1) for objective in DEFAULT_OBJECTIVES] + [("goodput", 2, 1)]


def test_a_retry_of_a_request_that_failed_inside_its_200_stream_counts_as_after_a_failure(store):
    """Two clients each send a request twice, 2 s apart: one's first attempt failed inside its 200 stream."""
    store, rows = store
    node, port = "retry-errors-node", 8090
    first = dict(rows[0], node=node, server_port=port, body_fp=11)
    at = first["req_start"]
    sent = [dict(first, client_addr="10.0.0.1", outcome="error", error_type="overloaded_error"),
            dict(first, client_addr="10.0.0.1", req_start=at + 2 * NS_PER_S, conn_id=first["conn_id"] + 1),
            dict(first, client_addr="10.0.0.2", conn_id=first["conn_id"] + 2),
            dict(first, client_addr="10.0.0.2", req_start=at + 2 * NS_PER_S, conn_id=first["conn_id"] + 3)]
    store.insert_rows("requests", sent)
    windows = indicators.Windows(TimeRange(at - at % (60 * NS_PER_S), at + 60 * NS_PER_S), 60, 0)
    counted = indicators._retries(store, windows, Scope((Server(port, node),)), retry_window_s=60)
    assert counted[["fingerprinted", "retries", "after_failure"]].values.tolist() == [[4, 2, 1]]
