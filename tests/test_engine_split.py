"""Queue vs prefill vs server overhead with the engine's own figures, on a real embedded store.

A simulated server spends a constant 40 ms of every request's TTFT outside
its engine (an API server tokenising, say). From the socket that is
indistinguishable from queueing; the engine's /metrics (vLLM's mean prefill
and mean TTFT, as the agent scrapes them into engine_samples) tell the two
apart. Without them the overhead lands in queue; with them it is booked as
``overhead_ms`` and each row says so in ``split_method``.

Where the engine states each request's own queue and prefill (vLLM with
``--enable-per-request-metrics``), the split is those figures, exactly; where it
states the prefill alone (llama.cpp ``timings``, Ollama), the prefill is.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tokenprobe.agent.sampling.engine_metrics import EngineReading
from tokenprobe.agent.sampling.samplers import engine_samples_arrow
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.store.embedded import open_store

from tests.support.phases import phases_of
from tests.support.slot_simulation import MS, LoadPhase, SlotServer, simulate

OVERHEAD_MS = 40.0
MINUTE = 60 * NS_PER_S
START_NS = (time.time_ns() // (10 * MINUTE) - 2) * 10 * MINUTE
SERVER = SlotServer()  # 4 slots, about 17 requests/s
WITH_ENGINE, WITHOUT_ENGINE = 8300, 8301
STATED, PREFILL_STATED = 8302, 8303  # the engine states each request's queue and prefill; its prefill alone


def stated(rows: list[dict], requests, queue: bool) -> list[dict]:
    """The rows as the agent reads them from an engine that states each request's prefill (and queue)."""
    return [{**row, "engine_prompt_ms": request.prefill_ms, "engine_queue_ms": request.queue_ms if queue else None}
            for row, request in zip(rows, requests)]


def outside_the_engine(requests) -> list[dict]:
    """The rows as if every request's first token (and all after) came OVERHEAD_MS later."""
    shift = int(OVERHEAD_MS * MS)
    return [{**request.row, **{key: request.row[key] + shift for key in ("first_token", "last_token", "resp_end")}}
            for request in requests]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('engine-split') / 'store'}", serve=False)
    store.ensure_schema()
    load = [LoadPhase(120, 2.0), LoadPhase(120, 14.0)]  # idle arrivals to calibrate, then queueing
    truth = {}
    for port in (WITH_ENGINE, WITHOUT_ENGINE, STATED, PREFILL_STATED):
        requests = simulate(SERVER, load, start_ns=START_NS, port=port, seed=port)
        rows = outside_the_engine(requests)
        if port in (STATED, PREFILL_STATED):
            rows = stated(rows, requests, queue=port == STATED)
        store.insert_rows("requests", rows)
        truth[port] = {request.row["response_id"]: request for request in requests}
    engine = truth[WITH_ENGINE].values()
    prefill_s = np.mean([request.prefill_ms for request in engine]) / 1000
    ttft_s = np.mean([request.queue_ms + request.prefill_ms for request in engine]) / 1000
    store.insert_arrow("engine_samples", engine_samples_arrow(
        [EngineReading(START_NS + second * NS_PER_S, "http://127.0.0.1:8300/metrics", WITH_ENGINE, "vllm",
                       "sim-model", prefill_mean_s=prefill_s, ttft_mean_s=ttft_s) for second in range(0, 240, 5)],
        "sim-node"))
    analyze(store, TimeRange(START_NS, START_NS + 5 * MINUTE), window_s=60, now_ns=START_NS + 5 * MINUTE)
    frame = store.query_df("SELECT server_port, response_id, queue_ms, prefill_ms, overhead_ms, ttft_server_ms, "
                           f"split_method FROM {phases_of(store)}")
    yield frame, truth
    store.close()


def test_the_engine_s_ttft_books_time_outside_it_as_overhead_not_queue(split):
    frame, truth = split
    rows = frame[frame["server_port"] == WITH_ENGINE]
    assert set(rows["split_method"]) == {"calibration+engine+overhead"}
    assert rows["overhead_ms"].median() == pytest.approx(OVERHEAD_MS, abs=1.0)
    # The three add up to the server's TTFT, row by row.
    assert np.allclose(rows["queue_ms"] + rows["prefill_ms"] + rows["overhead_ms"], rows["ttft_server_ms"], atol=0.01)
    queued = [(row.queue_ms, truth[WITH_ENGINE][row.response_id].queue_ms) for row in rows.itertuples()]
    mean_truth = np.mean([true for _, true in queued])
    # It queued, and little enough that overhead booked as queue would miss by more than 10%.
    assert 20 < mean_truth < 10 * OVERHEAD_MS, mean_truth
    assert np.mean([estimate for estimate, _ in queued]) == pytest.approx(mean_truth, rel=0.1)


def test_without_the_engine_the_overhead_reads_as_queue_and_the_row_says_how_it_was_split(split):
    frame, truth = split
    rows = frame[frame["server_port"] == WITHOUT_ENGINE]
    assert set(rows["split_method"]) == {"calibration"} and rows["overhead_ms"].isna().all()
    # Idle arrivals put the overhead in the prefill fit's intercept: prefill reads 40 ms long instead.
    true_prefill = np.mean([truth[WITHOUT_ENGINE][i].prefill_ms for i in rows["response_id"]])
    assert rows["prefill_ms"].mean() == pytest.approx(true_prefill + OVERHEAD_MS, rel=0.1)


def test_an_engine_that_states_each_request_s_split_is_taken_at_its_word(split):
    frame, truth = split
    rows = frame[frame["server_port"] == STATED]
    assert set(rows["split_method"]) == {"engine"} and len(rows) == len(truth[STATED])
    for row in rows.itertuples():
        request = truth[STATED][row.response_id]
        # Exactly the stated figures (stored as Float32), and what the TTFT holds beyond them is overhead.
        assert row.queue_ms == pytest.approx(request.queue_ms, rel=1e-6, abs=1e-4)
        assert row.prefill_ms == pytest.approx(request.prefill_ms, rel=1e-6, abs=1e-4)
        assert row.overhead_ms == pytest.approx(OVERHEAD_MS, abs=0.01)


def test_a_stated_prefill_alone_is_exact_and_the_queue_is_the_rest(split):
    frame, truth = split
    rows = frame[frame["server_port"] == PREFILL_STATED]
    assert set(rows["split_method"]) == {"engine_prefill"}
    for row in rows.itertuples():
        assert row.prefill_ms == pytest.approx(truth[PREFILL_STATED][row.response_id].prefill_ms, rel=1e-6, abs=1e-4)
    assert np.allclose(rows["queue_ms"] + rows["prefill_ms"] + rows["overhead_ms"].fillna(0), rows["ttft_server_ms"],
                       atol=0.01)
