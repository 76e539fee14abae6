"""The knee's curves from per-minute TTFT digests (contract/rollup.py KNEE_ROLLUP) on a real embedded store.

The curves must count what a scan of the requests counts: minutes from the
digests (rows stored late reach them through the view), the span's partial
minutes and any minute the digests lack (rows from before the view) from the
requests.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tokenprobe.analytics.knee import ttft_curves
from tokenprobe.analytics.scope import EVERYTHING
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.contract.rollup import KNEE_ROLLUP_TABLE
from tokenprobe.store.embedded import open_store

from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

MINUTE_NS = 60 * NS_PER_S
# Mid-minute, so the span has partial minutes at both ends.
START_NS = (time.time_ns() // MINUTE_NS - 10) * MINUTE_NS + 17 * NS_PER_S
LATE_MINUTE_NS = START_NS - 17 * NS_PER_S + 2 * MINUTE_NS  # a whole minute of the busy phase
SPAN = TimeRange(START_NS, START_NS + 4 * MINUTE_NS)


def scanned_curves(store) -> dict[int, tuple[int, float, float]]:
    """concurrency -> (requests, TTFT low median, high median) straight from the requests: the reference."""
    rows = store.query_rows(
        """SELECT inflight_at_arrival + 1 AS concurrency, count(),
                  quantileExactLow(0.5)(dateDiff('microsecond', req_end, first_token) / 1000),
                  quantileExactHigh(0.5)(dateDiff('microsecond', req_end, first_token) / 1000)
           FROM tokenprobe.requests
           WHERE req_start >= fromUnixTimestamp64Nano({start:Int64}, 'UTC')
             AND req_start < fromUnixTimestamp64Nano({end:Int64}, 'UTC')
           GROUP BY concurrency HAVING count() >= 3""",
        {"start": SPAN.start_ns, "end": SPAN.end_ns})
    return {int(level): (int(count), float(low), float(high)) for level, count, low, high in rows}


def assert_matches_scan(store) -> None:
    curves = ttft_curves(store, SPAN, EVERYTHING, min_requests=3)
    expected = scanned_curves(store)
    assert dict(zip(curves["concurrency"].astype(int), curves["requests"].astype(int), strict=True)) == {
        level: counts[0] for level, counts in expected.items()}
    # A merged t-digest is not exact (and of an even count takes either middle value): its median must lie
    # within the two middle values, give or take its float32 centroids and a few percent of approximation.
    low, high = (np.array([expected[int(level)][side] for level in curves["concurrency"]]) for side in (1, 2))
    p50 = curves["ttft_p50_ms"].to_numpy()
    assert np.all((p50 >= low * 0.97) & (p50 <= high * 1.03)), (p50, low, high)


@pytest.fixture()
def store(tmp_path):
    store = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    store.ensure_schema()
    yield store
    store.close()


def rows_of_busy_server() -> list[dict]:
    requests = simulate(SlotServer(), [LoadPhase(90, 3.0), LoadPhase(150, 30.0)], start_ns=START_NS, seed=3)
    return [request.row for request in requests]


def test_curves_read_whole_minutes_from_the_digests(store):
    rows = rows_of_busy_server()
    store.insert_rows("requests", rows)
    assert_matches_scan(store)
    # With one minute's requests gone from the table but not from the digests, the curves still count
    # them: that minute was read from the digests.
    before = ttft_curves(store, SPAN, EVERYTHING, min_requests=3)["requests"].sum()
    store.command(f"DELETE FROM tokenprobe.requests WHERE toStartOfMinute(req_start) = "
                  f"toDateTime({LATE_MINUTE_NS // NS_PER_S}, 'UTC')")
    assert ttft_curves(store, SPAN, EVERYTHING, min_requests=3)["requests"].sum() == before


def test_late_rows_and_minutes_the_view_missed_count(store):
    rows = rows_of_busy_server()
    late = [row for row in rows if LATE_MINUTE_NS <= row["req_start"] < LATE_MINUTE_NS + MINUTE_NS]
    assert late
    store.insert_rows("requests", [row for row in rows if row not in late])
    assert_matches_scan(store)
    store.insert_rows("requests", late)  # a spool replay, after the minute was digested
    assert_matches_scan(store)
    store.command(f"TRUNCATE TABLE tokenprobe.{KNEE_ROLLUP_TABLE}")  # as a store made before the view
    assert_matches_scan(store)
