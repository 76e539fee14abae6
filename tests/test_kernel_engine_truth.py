"""The engine's own word, through real probes: a reference server that states each request's split as
vLLM does (``--enable-per-request-metrics``) and fails every third stream inside its 200, traced by the
real agent, then analysed.

Every row must carry the engine's figures exactly as the server logged them (to the row's Float32), be
split by them (``split_method`` ``engine``), and every stream that failed must be an ``error`` row with
the API's label, a failure for the SLOs, and counted on the agent's /metrics.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tokenprobe.agent.sampling.prom_text import scrape
from tokenprobe.analytics.config import DEFAULT_OBJECTIVES
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.scope import EVERYTHING
from tokenprobe.analytics.slo import evaluate_slos
from tokenprobe.analytics.timerange import TimeRange
from tokenprobe.refserver.loadgen import LoadConfig, burst
from tokenprobe.store.embedded import open_store

from tests.kernel_harness import agent, read_truth, reference_server, require_kernel
from tests.support import free_port

pytestmark = pytest.mark.kernel

REQUESTS, FAIL_EVERY = 15, 3


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


def ms(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e6


def test_stated_split_and_errors_inside_200_streams_end_to_end(tmp_path: Path):
    metrics_port = free_port()
    started_ns = time.time_ns()
    with reference_server(tmp_path, per_request_metrics=True, fail_streams_every=FAIL_EVERY, slots=1) as (port, log), \
            agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port]) as handle:
        config = LoadConfig(port=port, requests=REQUESTS, duration_s=None, prompt_tokens=(8, 200), max_tokens=(2, 8),
                            stream_fraction=1.0, include_usage_fraction=1.0, seed=5)
        sent = burst(config, n=REQUESTS, concurrency=3)
        # The client read each failure as one: the error event in its 200 stream.
        assert sorted(record.error for record in sent.errors) == \
            ["error event in the stream: InternalServerError"] * (REQUESTS // FAIL_EVERY)
        time.sleep(2)  # the agent's rows of the last responses
        page = scrape(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=10)
        assert handle.stop() == 0
    counted = [s for s in page.samples if s.name == "tokenprobe_request_errors_total"]
    assert [(s.labels["server_port"], s.labels["error_type"], s.value) for s in counted] == \
        [(str(port), "InternalServerError", REQUESTS // FAIL_EVERY)]

    truth = {t["id"]: t for t in read_truth(log) if t["path"].startswith("/v1/")}
    store = open_store(handle.store_url, serve=False)
    try:
        rows = {row["response_id"]: row for row in store.query_df(
            "SELECT response_id, status, outcome, error_type, engine_queue_ms, engine_prompt_ms, engine_decode_ms"
            " FROM tokenprobe.requests WHERE startsWith(path, '/v1/')").to_dict("records")}
        assert rows.keys() == truth.keys() and len(rows) == REQUESTS
        for response_id, t in truth.items():
            row = rows[response_id]
            if t["outcome"] == "stream_error":
                assert (row["status"], row["outcome"], row["error_type"]) == (200, "error", "InternalServerError")
                continue
            assert (row["status"], row["outcome"], row["error_type"]) == (200, "complete", ""), row
            stated = (ms(t["arrival_ns"], t["slot_ns"]), ms(t["slot_ns"], t["token_ns"][0]),
                      ms(t["token_ns"][0], t["token_ns"][-1]))
            assert (row["engine_queue_ms"], row["engine_prompt_ms"], row["engine_decode_ms"]) == \
                pytest.approx(stated, rel=1e-6, abs=1e-3), response_id

        analysed = TimeRange(started_ns, time.time_ns())
        analyze(store, analysed, window_s=60)
        phases = store.query_df(
            "SELECT r.response_id AS response_id, split_method, queue_ms, prefill_ms, overhead_ms,"
            " r.engine_queue_ms AS engine_queue_ms, r.engine_prompt_ms AS engine_prompt_ms"
            " FROM tokenprobe.request_split AS p FINAL"
            " JOIN tokenprobe.requests AS r USING (node, server_port, req_start, conn_id, req_seq)").to_dict("records")
        split = [row for row in phases if row["engine_queue_ms"] == row["engine_queue_ms"]]  # not NaN
        assert len(split) == REQUESTS - REQUESTS // FAIL_EVERY
        for row in split:
            assert row["split_method"] == "engine"
            assert (row["queue_ms"], row["prefill_ms"]) == \
                pytest.approx((row["engine_queue_ms"], row["engine_prompt_ms"]), abs=1e-9)
            assert row["overhead_ms"] >= 0
        [slo] = [status for status in evaluate_slos(store, time.time_ns(), DEFAULT_OBJECTIVES, EVERYTHING)
                 if status.server_port == port and status.objective == "goodput"]
        assert slo.requests["5m"] == REQUESTS and slo.good["5m"] <= REQUESTS - REQUESTS // FAIL_EVERY
    finally:
        store.close()


def test_the_agent_s_own_scrapes_of_a_traced_port_are_never_rows(tmp_path: Path):
    """The agent scrapes the traced server's /metrics and dcgm page 4 times a second: none of it is a row, all
    of it is counted apart; another process' GETs of the same pages are rows."""
    metrics_port = free_port()
    with reference_server(tmp_path, simulated_metrics=True) as (port, _log), \
            agent(tmp_path, "--metrics-port", str(metrics_port), "--scrape-interval", "0.25",
                  "--engine", f"http://127.0.0.1:{port}/metrics", "--dcgm", f"http://127.0.0.1:{port}/sim/dcgm",
                  ports=[port]) as handle:
        for _ in range(3):  # a client that is not the agent, on connections of its own
            assert scrape(f"http://127.0.0.1:{port}/metrics", timeout_s=10).samples
        burst(LoadConfig(port=port, requests=3, duration_s=None, max_tokens=(2, 4), seed=7), n=3, concurrency=1)
        time.sleep(3)  # a dozen scrapes by the agent
        page = scrape(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=10)
        assert handle.stop() == 0
    [own] = [s.value for s in page.samples if s.name == "tokenprobe_agent_own_connections_total"]
    store = open_store(handle.store_url, serve=False)
    try:
        rows = store.query_rows("SELECT path, count() FROM tokenprobe.requests GROUP BY path ORDER BY path")
        scrapes = store.query_rows("SELECT count() FROM tokenprobe.engine_samples")[0][0]
    finally:
        store.close()
    counts = dict(rows)
    assert counts.pop("/metrics") == 3 and "/sim/dcgm" not in counts, rows
    assert sum(counts.values()) == 3 and all(path.startswith("/v1/") for path in counts), rows
    assert scrapes >= 8 and own >= 2, (scrapes, own)  # the engine's and dcgm's scrapers' connections at least
