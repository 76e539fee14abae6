"""The windows in which no agent traced the node: the heartbeat file, what the next run makes of it, and
the request sink's durable mark that says where a crash's lost rows begin."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tokenprobe.agent.heartbeat import BlindWindow, Heartbeat
from tokenprobe.contract.gaps import AGENT_GAPS, CRASHED, STOPPED
from tokenprobe.store.embedded import open_store
from tokenprobe.store.sink import RequestSink

from tests.support import WAIT_S, free_port, wait_until
from tests.test_store import make_row


def test_a_first_start_has_no_window_and_a_crash_leaves_one_from_the_last_beat(tmp_path: Path):
    path = tmp_path / "heartbeat.json"
    first = Heartbeat(path)
    assert first.start(durable_until_s=100.0, now_s=100.0) is None
    first.beat(durable_until_s=104.0, now_s=105.0)
    first.beat(durable_until_s=104.0, now_s=105.5)  # within a second of the last: not written
    # SIGKILL: no stop(). The next run attaches its probes 20 s later.
    window = Heartbeat(path).start(durable_until_s=125.0, now_s=125.0)
    assert window == BlindWindow(104.0, 125.0, CRASHED, first._state.pid)  # the sink's mark, not the beat
    assert window.seconds == 21.0


def test_a_clean_stop_starts_the_window_at_the_stop(tmp_path: Path):
    path = tmp_path / "heartbeat.json"
    run = Heartbeat(path)
    run.start(durable_until_s=10.0, now_s=10.0)
    run.stop(durable_until_s=50.0, now_s=49.0)
    later = Heartbeat(path)
    assert later.start(durable_until_s=60.0, now_s=60.0) == BlindWindow(49.0, 60.0, STOPPED, run._state.pid)
    # The totals carry over restarts: the metrics are counters across them.
    later.stop(durable_until_s=61.0, now_s=61.0)
    third = Heartbeat(path)
    third.start(durable_until_s=70.0, now_s=70.0)
    assert (third.windows_total, third.blind_seconds_total) == (2, 11.0 + 9.0)


def test_a_stop_whose_rows_were_not_all_made_durable_starts_the_window_earlier(tmp_path: Path):
    path = tmp_path / "heartbeat.json"
    run = Heartbeat(path)
    run.start(durable_until_s=10.0, now_s=10.0)
    run.stop(durable_until_s=30.0, now_s=40.0)  # the store hung at close: rows since 30 s lost
    assert Heartbeat(path).start(durable_until_s=50.0, now_s=50.0).start_s == 30.0


def test_a_run_that_never_traced_leaves_the_window_open(tmp_path: Path):
    """A restart whose probes never attached (a compile failure) traced nothing: the next run's window
    still starts where the last tracing run left off."""
    path = tmp_path / "heartbeat.json"
    Heartbeat(path).start(durable_until_s=10.0, now_s=10.0)  # then killed
    Heartbeat(path).stop(durable_until_s=20.0, now_s=20.0)  # never started
    assert Heartbeat(path).start(durable_until_s=30.0, now_s=30.0).start_s == 10.0


def test_an_unreadable_heartbeat_is_set_aside_and_the_agent_starts(tmp_path: Path):
    path = tmp_path / "heartbeat.json"
    for damage in (b"\x00garbage", json.dumps({"format": 1, "beat_s": "soon"}).encode(), b"[]"):
        path.write_bytes(damage)
        assert Heartbeat(path).start(durable_until_s=1.0, now_s=1.0) is None
        assert path.with_name("heartbeat.json.unreadable").read_bytes() == damage
        assert json.loads(path.read_bytes())["beat_s"] == 1.0  # written anew


def test_an_unwritable_heartbeat_never_stops_tracing(tmp_path: Path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    Heartbeat(blocker / "heartbeat.json").start(durable_until_s=1.0, now_s=1.0)  # logs, raises nothing


def test_a_window_is_an_agent_gaps_row(tmp_path: Path):
    store = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    try:
        store.ensure_schema()
        start = float(int(time.time()) - 60)  # recent: the table's TTL drops old rows
        row = BlindWindow(start + 0.5, start + 15.25, CRASHED, 4242).row("node-a")
        store.insert_arrow(AGENT_GAPS.name, AGENT_GAPS.arrow([row]))
        stored = store.query_df("SELECT node, reason, seconds, last_pid, toUnixTimestamp64Nano(gap_start) AS s, "
                                "toUnixTimestamp64Nano(gap_end) AS e FROM tokenprobe.agent_gaps")
    finally:
        store.close()
    (got,) = stored.to_dict("records")
    assert {k: got[k] for k in ("node", "reason", "seconds", "last_pid")} == {
        "node": "node-a", "reason": CRASHED, "seconds": 14.75, "last_pid": 4242}
    # Wall seconds as floats hold about a quarter of a microsecond at today's dates.
    assert abs(got["s"] - (start + 0.5) * 1e9) < 1000 and abs(got["e"] - (start + 15.25) * 1e9) < 1000


def test_the_sinks_durable_mark_follows_what_is_written_or_spooled(tmp_path: Path):
    """durable_until: every row put before it is written or spooled. A store that is down spools (the mark
    moves on); rows only queued in memory hold it back (a crash now would lose them)."""
    sink = RequestSink(f"http://127.0.0.1:{free_port()}/", spool_dir=tmp_path / "spool", flush_interval=0.2,
                       retry_min_s=60)
    try:
        before = time.time()
        sink.put(make_row(conn_id=1))
        wait_until(lambda: sink.rows_spooled == 1 and sink.durable_until >= before)  # the row is on disk
        held = time.time()
        sink.put(make_row(conn_id=2))
        assert sink.durable_until < held  # queued, not yet durable
        wait_until(lambda: sink.rows_spooled == 2 and sink.durable_until > held)
        idle = time.time()
        assert sink.durable_until >= idle  # nothing waits: durable up to now
    finally:
        sink.close(timeout=WAIT_S)
