"""Requests in flight count before they end: the tracker's snapshot, its table, the stall indicator.

The snapshot is taken from a real ConnectionTracker fed kernel events (as in
tests/test_tracker.py); the live analysis stores it in a real embedded store
and judges ``inflight_stall`` from it, which reaches /metrics like every cell.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from tokenprobe.agent.capture.inflight import inflight_snapshot
from tokenprobe.agent.capture.kernel.records import DIR_WRITE, EV_ACCEPT, EV_DATA
from tokenprobe.agent.export.metrics_endpoint import AgentMetrics
from tokenprobe.agent.sampling.prom_text import parse_exposition
from tokenprobe.analytics.live import LiveAnalysis
from tokenprobe.analytics.outlets import MetricsOutlet
from tokenprobe.analytics.timerange import NS_PER_S
from tokenprobe.contract.indicators import CRIT, OK
from tokenprobe.contract.inflight import INFLIGHT_SAMPLES, RECEIVING, STREAMING, WAITING
from tokenprobe.store.embedded import open_store

from tests.test_tracker import HEAD, REQUEST, ev, make_tracker, sse_chunk

S = NS_PER_S


def token(i: int) -> bytes:
    return sse_chunk(b'{"id":"cmpl-1","model":"m","choices":[{"text":"w%d"}]}' % i)


def tracker_with_three_requests():
    """fd 7: streaming, last token at 2 s; fd 8: answered nothing yet; fd 9: request still arriving."""
    tracker, rows = make_tracker()
    for fd in (7, 8, 9):
        tracker.handle(ev(EV_ACCEPT, 500, fd=fd))
    tracker.handle(ev(EV_DATA, 1 * S, fd=7, data=REQUEST))
    tracker.handle(ev(EV_DATA, 1 * S + 10_000, fd=7, direction=DIR_WRITE, data=HEAD))
    for i in range(3):
        tracker.handle(ev(EV_DATA, 1 * S + (i + 1) * S // 3, fd=7, direction=DIR_WRITE, data=token(i)))
    tracker.handle(ev(EV_DATA, 1 * S, fd=8, data=REQUEST))
    tracker.handle(ev(EV_DATA, 3 * S, fd=9, data=REQUEST[:40]))
    return tracker, rows


def test_the_snapshot_reports_every_open_request_and_how_far_it_got():
    tracker, rows = tracker_with_three_requests()
    samples = {sample["conn_id"]: sample for sample in inflight_snapshot(tracker, 12 * S)}
    assert rows.rows == [], "nothing has ended"
    by_fd = {fd: samples[tracker.connections[(42, fd)].conn_id] for fd in (7, 8, 9)}
    offset = tracker.clock.offset_ns
    assert [by_fd[fd]["stage"] for fd in (7, 8, 9)] == [STREAMING, WAITING, RECEIVING]
    assert by_fd[7]["token_events"] == 3 and by_fd[7]["first_token"] == 1 * S + S // 3 + offset
    assert by_fd[7]["since_progress_ms"] == pytest.approx(10_000)  # last token at 2 s
    assert by_fd[8]["since_progress_ms"] == pytest.approx(11_000)  # request ended at 1 s, no answer since
    assert by_fd[9]["age_ms"] == by_fd[9]["since_progress_ms"] == pytest.approx(9_000)
    assert {s["sampled_at"] for s in samples.values()} == {12 * S + offset}
    assert all(set(sample) == set(INFLIGHT_SAMPLES.column_names) for sample in samples.values())
    assert tracker.connections[(42, 7)].assembler.feed_response_bytes(13 * S, token(3), len(token(3))) == [], \
        "the snapshot left the exchange as it was: it goes on streaming"


def test_a_silent_stall_is_seen_stored_and_exposed_before_anything_ends(tmp_path):
    store = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    store.ensure_schema()
    now = [time.time_ns()]
    metrics = AgentMetrics()
    live = LiveAnalysis(store, "n", every_s=30, settle_s=0, outlets=[MetricsOutlet(metrics)], samples_inflight=True,
                        clock_ns=lambda: now[0])
    tracker, _ = tracker_with_three_requests()
    try:
        live.offer_inflight(inflight_snapshot(tracker, 45 * S), now[0])
        stalled = live.run_once()
        assert stalled is not None and stalled.report is None, "no request ended: judged from what is in flight"
        (cell,) = stalled.latest_cells
        assert (cell.server_port, cell.indicator, cell.state, cell.value) == (8000, "inflight_stall", CRIT, 44.0)
        assert cell.explanation.startswith("3 of 3 requests in flight silent for over 10 s, the longest 44 s")
        assert store.query_rows("SELECT count(), max(since_progress_ms) FROM tokenprobe.inflight_samples") == [
            (3, 44_000.0)]
        assert store.query_rows("SELECT state FROM tokenprobe.indicator_matrix FINAL "
                                "WHERE indicator = 'inflight_stall'") == [(CRIT,)]
        page = parse_exposition(generate_latest(metrics.registry).decode())
        assert [s.value for s in page.samples if s.name == "tokenprobe_indicator_state"
                and s.labels["indicator"] == "inflight_stall"] == [2]

        # The stalled requests went away: the server that was lit is judged again, and clears.
        now[0] += 30 * S
        live.offer_inflight([], now[0])
        (cleared,) = live.run_once().latest_cells
        assert (cleared.server_port, cleared.state, cleared.value) == (8000, OK, 0.0)
        now[0] += 30 * S
        live.offer_inflight([], now[0])
        assert live.run_once() is None, "nothing in flight, nothing lit, nothing ended: nothing to say"
    finally:
        store.close()


def test_without_an_answer_from_the_capture_thread_the_pass_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr("tokenprobe.analytics.live.INFLIGHT_WAIT_S", 0.05)
    store = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    store.ensure_schema()
    try:
        live = LiveAnalysis(store, "n", every_s=30, samples_inflight=True)
        live.offer_inflight([{"stale": True}], time.time_ns() - 3600 * S)  # for a pass long gone
        assert live.run_once() is None
        assert live.inflight_wanted() is False
        assert store.query_rows("SELECT count() FROM tokenprobe.inflight_samples") == [(0,)]
    finally:
        store.close()
