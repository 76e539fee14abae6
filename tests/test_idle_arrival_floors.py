"""The idle-arrival floors the live analysis keeps between passes (analytics/calibration.py
``IdleArrivalFloors``), on a real embedded store: a calibration that reads from the floor fits what one
that searches its whole look-back fits, pass after pass, a row stored late included.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from tokenprobe.analytics.calibration import IdleArrivalFloors, calibrate
from tokenprobe.analytics.config import DEFAULT_CONFIG
from tokenprobe.analytics.scope import Scope, Server
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.store.embedded import open_store

from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

NODE = "floors-node"
SCOPE = Scope((Server(8000, NODE), Server(8001, NODE)))
KEYS = [(NODE, 8000, "sim-model"), (NODE, 8001, "sim-model")]
START_NS = time.time_ns() // NS_PER_S * NS_PER_S - 3600 * NS_PER_S
# Few points, so the floor lies well inside the traffic and moves from pass to pass.
SPANS = replace(DEFAULT_CONFIG.spans, calibration_max_points=40)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('floors') / 'store'}", serve=False)
    store.ensure_schema()
    rows = [request.row for port, seed in ((8000, 1), (8001, 2))
            for request in simulate(SlotServer(), [LoadPhase(400, 3.0)], start_ns=START_NS, node=NODE,
                                    port=port, seed=seed)]
    store.insert_rows("requests", rows)
    yield store, rows
    store.close()


def fitted(calibrations) -> dict:
    """What a calibration found, without its id and time of fitting."""
    return {key: (c.fits, c.data_from_ns, c.data_to_ns) for key, c in calibrations.items()}


def test_calibrating_from_the_kept_floor_fits_what_the_whole_search_fits(store, monkeypatch):
    store, rows = store
    floors = IdleArrivalFloors()
    used, searches = [], []
    query_df = store.query_df

    def counted(sql, parameters=None):
        if "inflight_at_arrival = 0" in sql:
            searches.append(parameters["lookback_from"])
        return query_df(sql, parameters)

    for step in range(8):  # passes 9.5 s apart, through the traffic
        end_ns = START_NS + 120 * NS_PER_S + step * 9_500_000_000
        if step == 5:  # an idle arrival stored late, newer than the floor: it must be among the points
            late = next(row for row in rows if row["server_port"] == 8001 and row["inflight_at_arrival"] == 0
                        and end_ns - 5 * NS_PER_S < row["req_start"] < end_ns)
            store.insert_rows("requests", [{**late, "conn_id": 999_999, "req_start": late["req_start"] + 1}])
        analysed = TimeRange(end_ns - 30 * NS_PER_S, end_ns)
        lookback = analysed.ending_span(SPANS.calibration_lookback_s)
        used.append(floors.search_from(KEYS, lookback, SPANS.calibration_max_points))
        searches.clear()
        with monkeypatch.context() as patched:
            patched.setattr(store, "query_df", counted)
            kept = calibrate(store, analysed, SCOPE, SPANS, time.time_ns(), floors=floors)
        if used[-1] is not None:
            assert searches == [used[-1]], "one read, from the floor: the points are all after it"
        searched = calibrate(store, analysed, SCOPE, SPANS, time.time_ns())
        assert sorted(kept) == KEYS
        assert fitted(kept) == fitted(searched), f"pass {step}"
        assert all(kept[key].data_from_ns == floors.floors[key] for key in kept), "the floor moves with the points"
    assert used[0] is None and all(floor is not None for floor in used[1:]), "later passes read from the floor"

