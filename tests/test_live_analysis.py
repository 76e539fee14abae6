"""The agent's live analysis (analytics/live.py) on a real embedded store, pass by pass.

A simulated 4-slot server goes from idle to overloaded; its rows are in the
store from the start, and a controlled clock moves the passes through the
traffic window by window, as the agent's thread would every ``every_s``.
Another node's rows sit beside them: the agent analyses its own node only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.export.metrics_endpoint import AgentMetrics
from tokenprobe.agent.sampling.engine_metrics import EngineScraper
from tokenprobe.agent.sampling.prom_text import parse_exposition
from tokenprobe.agent.sampling.samplers import SamplerSet
from tokenprobe.analytics.config import DEFAULT_CONFIG
from tokenprobe.analytics.live import LiveAnalysis
from tokenprobe.analytics.outlets import MetricsOutlet
from tokenprobe.analytics.timerange import NS_PER_S
from tokenprobe.cli.agent import before_each_pass
from tokenprobe.contract.indicators import CRIT, OK
from tokenprobe.refserver.harness import served_pages
from tokenprobe.store.client import Store
from tokenprobe.store.embedded import open_store
from tokenprobe.store.sink import RequestSink

from tests.support.phases import forget_analyses, phases_of
from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

NODE = "live-node"
EVERY_S = 30
SETTLE_S = 3.0
WINDOW_NS = EVERY_S * NS_PER_S
START_NS = (time.time_ns() // WINDOW_NS - 12) * WINDOW_NS
SERVER = SlotServer()  # 4 slots, about 17 requests/s


class Clock:
    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('live') / 'store'}", serve=False)
    store.ensure_schema()
    quiet_then_overloaded = [LoadPhase(60, 2.0), LoadPhase(60, 30.0)]
    ours = simulate(SERVER, quiet_then_overloaded, start_ns=START_NS, node=NODE, port=8000, seed=1)
    theirs = simulate(SERVER, [LoadPhase(120, 2.0)], start_ns=START_NS, node="other-node", port=8000, seed=2)
    store.insert_rows("requests", [request.row for request in ours + theirs])
    yield store, [request.row for request in ours]
    store.close()


def live_at(store, clock: Clock, **kwargs) -> LiveAnalysis:
    return LiveAnalysis(store, NODE, every_s=EVERY_S, settle_s=SETTLE_S, clock_ns=clock, **kwargs)


def metrics_page(metrics: AgentMetrics) -> list:
    return parse_exposition(generate_latest(metrics.registry).decode()).samples


def test_passes_cover_every_request_once_window_by_window(store):
    store, rows = store
    clock = Clock(START_NS + WINDOW_NS)
    metrics = AgentMetrics()
    live = live_at(store, clock, outlets=[MetricsOutlet(metrics)])
    live.watermark_ns = START_NS  # as if the agent had started with the traffic
    last_end = max(row["resp_end"] for row in rows)
    seen, analysed_starts = 0, []
    while clock.now_ns - SETTLE_S * NS_PER_S <= last_end:
        clock.now_ns += WINDOW_NS
        result = live.run_once()
        if result is None:
            continue
        seen += len(result.phases)
        analysed_starts.append(result.analysed.start_ns)
        assert all(start % WINDOW_NS == 0 for start in analysed_starts), "windows align to the epoch"
        assert {phase["node"] for phase in result.phases} == {NODE}
    assert seen == len(rows), "each request is handed to the outlets in exactly one pass"
    phases = store.query_rows("SELECT node, count(), countIf(calibration_id != '') "
                              "FROM tokenprobe.request_split FINAL GROUP BY node")
    assert phases == [(NODE, len(rows), len(rows))], "own node only, every request split"

    matrix = dict(store.query_rows(
        f"SELECT window_start, state FROM tokenprobe.indicator_matrix FINAL "
        f"WHERE node = '{NODE}' AND indicator = 'queue_wait_p95' ORDER BY window_start"))
    states = list(matrix.values())
    assert states[0] == OK and CRIT in states, states  # quiet first, then the queue builds

    page = metrics_page(metrics)
    lit = {s.labels["indicator"]: s.value for s in page if s.name == "tokenprobe_indicator_state"}
    assert set(lit) >= {"queue_wait_p95", "knee_proximity", "batch_fill"}
    queued = [s.value for s in page if s.name == "tokenprobe_request_queue_seconds_count"]
    prefilled = [s.value for s in page if s.name == "tokenprobe_request_prefill_seconds_count"]
    assert queued == prefilled == [len(rows)]


def pass_outcome(result) -> tuple:
    """What a pass found, as comparable values: its cells, the phases it handed on, its SLO verdicts."""
    cells = sorted((cell.window_start_ns, cell.server_port, cell.device_id, cell.indicator, cell.state,
                    None if cell.value is None else round(cell.value, 6)) for cell in result.cells)
    phases = sorted(tuple(round(value, 6) if isinstance(value, float) else value for value in phase.values())
                    for phase in result.phases)
    slos = sorted((slo.server_port, slo.objective, slo.alert, tuple(sorted(slo.requests.items())))
                  for slo in result.report.slos)
    return result.analysed, cells, phases, slos


def test_passes_from_the_requests_held_equal_passes_from_the_store(store):
    """The same passes over the same traffic, one agent finding its requests in the store, the other taking
    them from what it holds (its sink's rows, another node's among them): the same cells, phases and SLOs."""
    store, rows = store
    theirs = simulate(SERVER, [LoadPhase(120, 2.0)], start_ns=START_NS, node="other-node", port=8000, seed=2)
    last_end = max(row["resp_end"] for row in rows)
    outcomes = {}
    for holding in (False, True):
        forget_analyses(store)  # each from the same start
        clock = Clock(START_NS)
        live = live_at(store, clock, hold_requests=holding)
        live.watermark_ns = START_NS
        if holding:
            for row in rows + [request.row for request in theirs]:
                live.held.add(row)
        passes = []
        while clock.now_ns - SETTLE_S * NS_PER_S <= last_end:
            clock.now_ns += WINDOW_NS
            result = live.run_once()
            if result is not None:
                passes.append(pass_outcome(result))
        outcomes[holding] = passes
        assert live.passes_held == (len(passes) if holding else 0)
    assert len(outcomes[False]) >= 4 and sum(len(phases) for _, _, phases, _ in outcomes[False]) == len(rows)
    assert outcomes[True] == outcomes[False]


def test_rerunning_a_window_replaces_its_results(store):
    store, rows = store
    counts = ("SELECT (SELECT count() FROM tokenprobe.request_split FINAL), "
              "(SELECT count() FROM tokenprobe.indicator_matrix FINAL)")
    before = store.query_rows(counts)[0]
    clock = Clock(START_NS + 4 * WINDOW_NS)
    live = live_at(store, clock)
    live.watermark_ns = START_NS + WINDOW_NS  # the second window again
    assert live.run_once() is not None
    assert store.query_rows(counts)[0] == before


def test_nothing_new_is_a_cheap_pass_and_the_watermark_moves(store):
    store, _ = store
    clock = Clock(time.time_ns())
    live = live_at(store, clock)
    assert live.run_once() is None
    assert live.watermark_ns == clock.now_ns - int(SETTLE_S * NS_PER_S)


def test_failures_are_counted_logged_once_and_retried(store, caplog):
    store, _ = store
    # The same real engine, but a database with no tables yet: every query fails until it is created.
    empty = Store(replace(store.target, database="not_yet"), store.client, store.mode)
    live = LiveAnalysis(empty, NODE, every_s=EVERY_S)
    watermark = live.watermark_ns
    with caplog.at_level(logging.INFO, logger="tokenprobe.analytics.live"):
        live.tick()
        live.tick()
        assert live.failures == 2 and live.passes == 0
        assert watermark == live.watermark_ns, "a failed pass is retried: its rows are not skipped"
        empty.ensure_schema()
        live.tick()
    assert live.passes == 1 and live.watermark_ns > watermark
    messages = [record.message for record in caplog.records]
    assert sum("live analysis failed" in message for message in messages) == 1
    assert any("recovered after 2 failed passes" in message for message in messages)


def test_a_failing_outlet_does_not_stop_the_others(store):
    store, _ = store

    class Broken:
        name = "broken"

        def publish(self, result):
            raise RuntimeError("collector down")

    metrics = AgentMetrics()
    clock = Clock(START_NS + 3 * WINDOW_NS)
    live = live_at(store, clock, outlets=[Broken(), MetricsOutlet(metrics)])
    live.watermark_ns = START_NS
    live.tick()
    assert live.passes == 1 and live.outlet_failures == {"broken": 1}
    assert any(s.name == "tokenprobe_indicator_state" for s in metrics_page(metrics))


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="whole number of seconds"):
        LiveAnalysis(None, NODE, every_s=0)
    with pytest.raises(ValueError, match="whole number of seconds"):
        LiveAnalysis(None, NODE, every_s=2.5)


def long_stream(row: dict, conn_id: int, started_before_s: int) -> dict:
    """``row`` as a stream that started ``started_before_s`` earlier and stalled after its first token,
    ending when ``row`` ends: a request whose start lies far before the other requests of its window."""
    shift_ns = started_before_s * NS_PER_S
    offsets = [offset + shift_ns // 1000 if index else offset for index, offset in enumerate(row["token_offsets_us"])]
    moved = {name: row[name] - shift_ns for name in ("accept_ts", "req_start", "req_end", "resp_start", "first_token")}
    return {**row, **moved, "conn_id": conn_id, "token_offsets_us": offsets}


def test_a_pass_finds_requests_by_their_end_through_the_index_as_a_search_does(store):
    store, _ = store
    node = "long-node"  # beside the module's nodes, which the other tests count
    rows = [request.row for request in simulate(SERVER, [LoadPhase(90, 4.0)], start_ns=START_NS, node=node,
                                                 port=8000, seed=3)]
    ending = next(row for row in rows if START_NS + 2 * WINDOW_NS < row["resp_end"] < START_NS + 3 * WINDOW_NS)
    stream = long_stream(ending, 10**6, started_before_s=1200)
    store.insert_rows("requests", [*rows, stream])

    def window_keys(live: LiveAnalysis, window: int) -> list[tuple]:
        clock.now_ns = START_NS + (window + 1) * WINDOW_NS + int(SETTLE_S * NS_PER_S)
        return sorted((phase["conn_id"], phase["req_seq"]) for phase in live.run_once().phases)

    clock = Clock(START_NS)
    indexed = LiveAnalysis(store, node, every_s=EVERY_S, settle_s=SETTLE_S, clock_ns=clock)
    indexed.watermark_ns = START_NS
    window_keys(indexed, 1)  # the first pass reads requests; the next ones request_ends
    from_index = window_keys(indexed, 2)
    searching = LiveAnalysis(store, node, every_s=EVERY_S, settle_s=SETTLE_S, clock_ns=clock)
    searching.watermark_ns = indexed.watermark_ns - WINDOW_NS
    assert window_keys(searching, 2) == from_index
    ended = [(row["conn_id"], row["req_seq"]) for row in rows + [stream]
             if START_NS + 2 * WINDOW_NS <= row["resp_end"] < START_NS + 3 * WINDOW_NS]
    assert from_index == sorted(ended) and (stream["conn_id"], 0) in from_index
    stored = store.query_rows(f"SELECT ttft_server_ms FROM {phases_of(store)}"
                              " WHERE node = {node:String} AND conn_id = {conn:UInt64}",
                              {"node": node, "conn": stream["conn_id"]})
    assert stored and stored[0][0] is not None, "the long stream, 20 min before the rest, has its phases"


def fits_stored(store) -> tuple[int, int]:
    """Calibrations and knee fits stored for the module's node."""
    return store.query_rows(
        f"SELECT (SELECT count() FROM tokenprobe.prefill_calibration WHERE node = '{NODE}'),"
        f" (SELECT count() FROM tokenprobe.knee WHERE node = '{NODE}')")[0]


def test_calibration_and_knee_are_refitted_when_due_and_kept_between(store):
    store, rows = store
    refit_every_s = 3 * EVERY_S
    config = replace(DEFAULT_CONFIG, spans=replace(DEFAULT_CONFIG.spans, live_refit_every_s=refit_every_s))
    clock = Clock(START_NS + WINDOW_NS)
    live = live_at(store, clock, config=config)
    live.watermark_ns = START_NS
    last_end = max(row["resp_end"] for row in rows)
    passes = []  # (refitting, calibrations stored, knees stored, a knee kept, the calibration ids written)
    while clock.now_ns - SETTLE_S * NS_PER_S <= last_end:
        clock.now_ns += WINDOW_NS
        before = fits_stored(store)
        knee_kept = (NODE, 8000, "sim-model") in live.fits.kept_knees
        pass_started_ns = time.time_ns()  # the pass's rows are computed at a later real time
        result = live.run_once()
        if result is None:
            continue
        after = fits_stored(store)
        written = {row[0] for row in store.query_rows(
            f"SELECT DISTINCT calibration_id FROM tokenprobe.request_split FINAL"
            f" WHERE node = '{NODE}' AND toUnixTimestamp64Nano(computed_at) >= {pass_started_ns}")}
        passes.append((live.fits.refitting, after[0] - before[0], after[1] - before[1], knee_kept, written))
    assert len(passes) >= 4 and [p[0] for p in passes][:4] == [True, False, False, True], passes
    for refitting, calibrations, knees, knee_kept, written in passes:
        assert (calibrations > 0) == refitting, passes  # calibrated from the first pass on: fitted when due
        assert (knees > 0) == (refitting or not knee_kept), passes  # and the knee until one is found
        assert len(written) == 1 and "" not in written, passes  # every request split, by one calibration
    for before, now in zip(passes, passes[1:], strict=False):
        assert now[0] or now[4] == before[4], "between refits the kept calibration splits the requests"
        assert not now[0] or now[4] != before[4], "a refit splits them by the new one"
    assert any(p[3] for p in passes) and any(not p[3] for p in passes), "a knee was found in the overload"


def test_the_agent_stores_what_its_writers_hold_before_each_pass(store, tmp_path):
    """The samplers insert every 5 s and the sink feeds the store's views every 15 s: a pass must not read
    the store before they have stored what they hold (here they would not until an hour had passed)."""
    store, rows = store
    node = "held-node"
    stored = ("SELECT (SELECT count() FROM tokenprobe.engine_samples WHERE node = {node:String}),"
              " (SELECT count() FROM tokenprobe.request_ends WHERE node = {node:String})")
    engine_page = (Path(__file__).parent / "data" / "fixtures" / "vllm_metrics_busy.txt").read_bytes()
    with served_pages({"/metrics": engine_page}) as url:
        samplers = SamplerSet(store, node, MonotonicWallClock(), engines=[EngineScraper(f"{url}/metrics")],
                              scrape_interval_s=0.05, flush_interval_s=3600)
        sink = RequestSink(store, spool_dir=tmp_path / "spool", flush_interval=0.05, views_every=3600)
        try:
            samplers.start()
            sink.put(dict(rows[0], node=node, api="openai.chat", choices=1, choice_events=rows[0]["token_events"],
                          request_messages=0, request_message_bytes=0, response_message_bytes=0,
                          largest_response_message_bytes=0, namespace="", pod="", container="",
                          pod_uid="", container_id="", error_type="", engine_queue_ms=None))
            deadline = time.monotonic() + 30
            while sink.rows_written < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # a few scrapes
            assert sink.rows_written == 1
            assert store.query_rows(stored, parameters={"node": node}) == [(0, 0)]  # all still held
            live = LiveAnalysis(store, node, every_s=EVERY_S, settle_s=SETTLE_S,
                                before_pass=before_each_pass(sink, samplers))
            live.run_once()
            samples, ends = store.query_rows(stored, parameters={"node": node})[0]
            assert samples >= 2 and ends == 1
            assert samplers.stats()["write_cpu_s"] > 0
        finally:
            samplers.stop()
            sink.close()


def test_the_agent_holds_the_inference_requests_of_its_node_that_its_sink_takes(store, tmp_path):
    store, rows = store
    live = LiveAnalysis(store, "sink-node", every_s=EVERY_S, settle_s=SETTLE_S, hold_requests=True)
    sink = RequestSink(store, spool_dir=tmp_path / "spool", flush_interval=0.05, views_every=3600)
    try:
        sink.watch(live.held.add)
        extra = {"api": "openai.chat", "choices": 1, "request_messages": 0, "request_message_bytes": 0,
                 "response_message_bytes": 0, "largest_response_message_bytes": 0, "error_type": "",
                 "engine_queue_ms": None, "namespace": "", "pod": "", "container": "", "pod_uid": "",
                 "container_id": ""}
        ours = [dict(row, node="sink-node", choice_events=row["token_events"], **extra) for row in rows[:3]]
        for row in [*ours, dict(ours[0], conn_id=1, method="GET"), dict(ours[1], conn_id=2, node="another")]:
            sink.put(row)
    finally:
        sink.close()
    first_end = min(row["resp_end"] for row in ours)
    assert live.held.take(first_end).empty  # ended after: still held
    taken = live.held.take(max(row["resp_end"] for row in ours) + 1)
    assert sorted(taken["conn_id"]) == sorted(row["conn_id"] for row in ours)
    assert live.held.take(2**62).empty and not live.held.complete_from(first_end)  # taken once, and no more
