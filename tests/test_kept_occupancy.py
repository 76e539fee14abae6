"""The occupancy the live analysis keeps between passes (analytics/indicators.py ``KeptOccupancy``), on a
real embedded store: pass after pass, the sub-bucket sums from the kept intervals and the rows a pass
wrote are those the look-back's query (``FINAL``) gives, a long request that moves the base back, rows a
re-analysis wrote and a restart included.
"""

from __future__ import annotations

import time

import pandas as pd
import pytest
from tokenprobe.analytics import indicators
from tokenprobe.analytics.indicators import KeptOccupancy
from tokenprobe.analytics.live import LiveAnalysis
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.scope import Scope, Server
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.store.embedded import open_store

from tests.support.phases import forget_analyses
from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

NODE = "occupancy-node"
EVERY_S = 10
WINDOW_NS = EVERY_S * NS_PER_S
START_NS = (time.time_ns() // WINDOW_NS - 60) * WINDOW_NS
COLUMNS = ["node", "server_port", "bucket", "in_flight_s", "queued_s", "running_s"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('occupancy') / 'store'}", serve=False)
    store.ensure_schema()
    rows = [request.row for port, seed in ((8000, 1), (8001, 2))
            for request in simulate(SlotServer(), [LoadPhase(450, 3.0), LoadPhase(500, 25.0)], start_ns=START_NS,
                                    node=NODE, port=port, seed=seed)]
    store.insert_rows("requests", rows)
    yield store, rows
    store.close()


def sums(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame[COLUMNS].astype({"server_port": "int64", "bucket": "int64", "node": "object"})
    return frame.sort_values(COLUMNS[:3]).reset_index(drop=True)


@pytest.mark.parametrize("holding", [False, True], ids=["rows-read-back", "rows-held"])
def test_kept_occupancy_equals_the_look_back_query_pass_after_pass(store, monkeypatch, holding):
    """Passes whose rows are read back, and passes that give them from the requests the agent holds."""
    store, rows = store
    forget_analyses(store)  # what the other variant's passes wrote
    compared, whole_reads = [], []
    kept_occupancy = KeptOccupancy.occupancy
    query_df = store.query_df

    def checked(kept, store, windows, scope, thresholds, written_ns):
        frame = kept_occupancy(kept, store, windows, scope, thresholds, written_ns)
        # the same query the whole analysis runs, over the same sub-buckets and servers
        pd.testing.assert_frame_equal(sums(frame), sums(indicators._occupancy(store, windows, scope)),
                                      check_exact=False, rtol=1e-9, atol=1e-9)
        compared.append(windows.base_ns)
        return frame

    def counted(sql, parameters=None):
        if " FINAL WHERE " in sql and "start_ns" in sql and "occupancy_written" not in sql:
            whole_reads.append(len(compared))
        return query_df(sql, parameters)

    monkeypatch.setattr(KeptOccupancy, "occupancy", checked)
    monkeypatch.setattr(store, "query_df", counted)
    clock = [START_NS + 5 * WINDOW_NS]

    def started_agent(watermark_ns: int) -> LiveAnalysis:
        agent = LiveAnalysis(store, NODE, every_s=EVERY_S, settle_s=0, clock_ns=lambda: clock[0],
                             hold_requests=holding)
        agent.watermark_ns = watermark_ns
        for row in rows if holding else ():  # as its sink would hand them over
            agent.held.add(row)
        return agent

    live = started_agent(START_NS)
    last_end = max(row["resp_end"] for row in rows)
    for step in range(40):
        clock[0] += WINDOW_NS
        if step == 6:  # a request that ran long ends: its start puts the base before the kept ones
            long = next(row for row in rows if row["req_start"] > START_NS + 20 * NS_PER_S)
            ran_long = dict(long, conn_id=long["conn_id"] + 10**9, resp_end=clock[0] - NS_PER_S,
                            last_token=clock[0] - 2 * NS_PER_S)
            store.insert_rows("requests", [ran_long])
            if holding:
                live.held.add(ran_long)
        if step == 10:  # a re-analysis of the range by hand rewrites the rows the passes kept
            analyze(store, TimeRange(START_NS, clock[0] - WINDOW_NS), window_s=EVERY_S,
                    scope=Scope((Server(8000, NODE), Server(8001, NODE))), schema_ready=True, summarize=False)
        if step == 14:  # the agent restarts
            live = started_agent(clock[0] - WINDOW_NS)
        live.run_once()
        if clock[0] > last_end + 2 * WINDOW_NS:
            break
    # read whole: the first pass, the long request's, after the re-analysis, after the restart; else kept
    assert whole_reads == [0, 6, 10, 14], whole_reads
    assert len(compared) - len(whole_reads) >= 10
    assert live.passes_held >= (10 if holding else 0) and (holding or not live.passes_held)
