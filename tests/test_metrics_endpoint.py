"""The agent's /metrics endpoint, served over real HTTP on loopback and read with the project's own parser."""

from __future__ import annotations

import math
import socket
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram
from tokenprobe.agent.export.metrics_endpoint import (
    OVERFLOW_MODEL,
    QUEUE_BUCKETS_S,
    TTFT_BUCKETS_S,
    AgentMetrics,
    RequestTimings,
)
from tokenprobe.agent.sampling.prom_text import Exposition, scrape
from tokenprobe.store.sink import SinkStats

T0 = 1_760_000_000_000_000_000
MS = 1_000_000


def row(**overrides) -> dict:
    """A streamed chat request: TTFT 300 ms, 11 tokens over 500 ms (TPOT 50 ms), 805 ms end to end."""
    base = {
        "server_port": 8000, "role": "server", "model": "llama-3-8b", "method": "POST", "path": "/v1/chat/completions",
        "status": 200, "outcome": "complete", "streamed": True, "token_events": 11, "completion_tokens": None,
        "req_start": T0, "req_end": T0 + 2 * MS, "resp_start": T0 + 20 * MS, "first_token": T0 + 302 * MS,
        "last_token": T0 + 802 * MS, "resp_end": T0 + 805 * MS,
    }  # fmt: skip
    base.update(overrides)
    return base


@pytest.fixture
def metrics():
    metrics = AgentMetrics(max_models_per_server=3, indicator_ttl_s=300)
    metrics.serve("127.0.0.1", 0)
    yield metrics
    metrics.close()


def read(metrics: AgentMetrics) -> Exposition:
    host, port = metrics.address
    return scrape(f"http://{host}:{port}/metrics", timeout_s=10)


def value(page: Exposition, name: str, **labels) -> float:
    matches = [s.value for s in page.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} series"
    return matches[0]


def series(page: Exposition, name: str) -> list:
    return [s for s in page.samples if s.name == name]


def test_request_latencies_land_in_the_right_buckets_by_port_model_and_role(metrics):
    for _ in range(3):
        metrics.observe_request(row())
    metrics.observe_request(row(server_port=8001, model="qwen", role="client"))
    page = read(metrics)
    llama = {"server_port": "8000", "model": "llama-3-8b", "role": "server"}
    assert value(page, "tokenprobe_request_ttft_seconds_count", **llama) == 3
    assert value(page, "tokenprobe_request_ttft_seconds_sum", **llama) == pytest.approx(0.9)
    assert value(page, "tokenprobe_request_ttft_seconds_bucket", le="0.25", **llama) == 0
    assert value(page, "tokenprobe_request_ttft_seconds_bucket", le="0.5", **llama) == 3
    assert value(page, "tokenprobe_request_tpot_seconds_sum", **llama) == pytest.approx(3 * 0.05)
    assert value(page, "tokenprobe_request_tpot_seconds_bucket", le="0.05", **llama) == 3
    assert value(page, "tokenprobe_request_duration_seconds_bucket", le="1.0", **llama) == 3
    assert value(page, "tokenprobe_requests_total", status_class="2xx", outcome="complete", **llama) == 3
    assert value(page, "tokenprobe_request_ttft_seconds_count", server_port="8001", model="qwen",
                 role="client") == 1


def test_usage_tokens_win_over_counted_events_for_tpot():
    # 3 events carried 21 tokens: decode 500 ms over 20 gaps is 25 ms a token, not 250 ms.
    timings = RequestTimings.from_row(row(token_events=3, completion_tokens=21))
    assert timings.tpot_s == pytest.approx(0.025)
    assert RequestTimings.from_row(row(token_events=1, completion_tokens=None)).tpot_s is None
    # A broken-off stream: no end-to-end figure, TTFT still known.
    broken = RequestTimings.from_row(row(resp_end=None, outcome="client_closed"))
    assert broken.duration_s is None and broken.ttft_s == pytest.approx(0.3)
    # A clock step that put an end before its start yields nothing rather than a negative latency.
    assert RequestTimings.from_row(row(first_token=T0 - MS)).ttft_s is None


def test_health_checks_are_counted_but_not_timed(metrics):
    metrics.observe_request(row(method="GET", path="/health", model="", token_events=0, streamed=False,
                                first_token=None, last_token=None, status=200))
    metrics.observe_request(row(status=503, outcome="complete", first_token=None, last_token=None,
                                token_events=0, streamed=False))
    page = read(metrics)
    assert value(page, "tokenprobe_requests_total", model="", status_class="2xx") == 1
    assert value(page, "tokenprobe_requests_total", model="llama-3-8b", status_class="5xx") == 1
    assert series(page, "tokenprobe_request_ttft_seconds_count") == []
    assert value(page, "tokenprobe_request_duration_seconds_count", model="llama-3-8b") == 1


def test_connections_that_could_not_be_read_are_counted_by_port_and_reason(metrics):
    for reason, port in (("tls_unprobed", 8443), ("tls_unprobed", 8443), ("h2_midstream", 8000)):
        metrics.count_unreadable(port, reason)
    # Their rows, at close, are requests like any other: counted once already.
    metrics.observe_request(row(method="", path="", model="", status=0, outcome="unsupported", streamed=False,
                                token_events=0, first_token=None, last_token=None, resp_start=None, resp_end=None,
                                server_port=8443, unreadable_reason="tls_unprobed"))
    metrics.observe_request(row())
    page = read(metrics)
    name = "tokenprobe_agent_unreadable_connections_total"
    assert value(page, name, server_port="8443", reason="tls_unprobed") == 2
    assert value(page, name, server_port="8000", reason="h2_midstream") == 1
    assert len(series(page, name)) == 2
    assert series(page, "tokenprobe_request_duration_seconds_count")[0].value == 1  # blind spots are not timed


def test_errors_inside_200_streams_are_counted_by_server_model_tenant_and_type(metrics):
    for tenant, error_type in (("acme", "overloaded_error"), ("acme", "overloaded_error"), ("", "api_error")):
        metrics.observe_request(row(outcome="error", tenant=tenant, error_type=error_type))
    metrics.observe_request(row(tenant="acme"))  # a success: no error series
    for error_type in ("e1", "e2", "e3", "e4"):  # error types beyond the cap (3 here) share one series
        metrics.observe_request(row(outcome="error", tenant="beta", error_type=error_type))
    page = read(metrics)
    llama = {"server_port": "8000", "model": "llama-3-8b", "role": "server"}
    assert value(page, "tokenprobe_requests_total", status_class="2xx", outcome="error", **llama) == 7
    assert value(page, "tokenprobe_request_errors_total", tenant="acme", error_type="overloaded_error", **llama) == 2
    assert value(page, "tokenprobe_request_errors_total", tenant="", error_type="api_error", **llama) == 1
    assert value(page, "tokenprobe_request_errors_total", tenant="beta", error_type=OVERFLOW_MODEL, **llama) == 3
    assert sum(s.value for s in series(page, "tokenprobe_request_errors_total")) == 7


def test_model_names_from_clients_are_capped_per_port(metrics):
    for model in ("a", "b", "c", "d", "e"):
        metrics.observe_request(row(model=model))
    metrics.observe_request(row(model="z", server_port=9000))
    page = read(metrics)
    models = {s.labels["model"] for s in series(page, "tokenprobe_request_ttft_seconds_count")
              if s.labels["server_port"] == "8000"}
    assert models == {"a", "b", "c", OVERFLOW_MODEL}
    assert value(page, "tokenprobe_request_ttft_seconds_count", model=OVERFLOW_MODEL) == 2
    assert value(page, "tokenprobe_request_ttft_seconds_count", server_port="9000") == 1


def test_queue_and_prefill_split_from_the_analytics(metrics):
    # the second: the prefill model over-predicted, no queue
    metrics.observe_splits(8000, "llama-3-8b", queue_s=[0.3, -0.02], prefill_s=[0.04, 0.2])
    page = read(metrics)
    assert value(page, "tokenprobe_request_queue_seconds_count", server_port="8000") == 2
    assert value(page, "tokenprobe_request_queue_seconds_bucket", le="0.01", server_port="8000") == 1
    assert value(page, "tokenprobe_request_queue_seconds_sum", server_port="8000") == pytest.approx(0.3)
    assert value(page, "tokenprobe_request_prefill_seconds_sum", server_port="8000") == pytest.approx(0.24)
    assert value(page, "tokenprobe_request_prefill_seconds_bucket", le="0.05", server_port="8000") == 1
    with pytest.raises(ValueError, match="NaN"):
        metrics.observe_splits(8000, "m", queue_s=[0.2, math.nan], prefill_s=[0.1, 0.1])
    with pytest.raises(ValueError, match="one value per request"):
        metrics.observe_splits(8000, "m", queue_s=[0.2], prefill_s=[0.1, 0.1])
    assert value(read(metrics), "tokenprobe_request_queue_seconds_count", server_port="8000") == 2, "none taken"


def test_split_histograms_fed_in_bulk_read_as_histograms_fed_one_by_one():
    """A pass's requests binned at once give the series a ``prometheus_client.Histogram`` observing each
    would: the same buckets (a value on a bound counts in it), counts and sums, for every server and model."""
    rng = np.random.default_rng(7)
    bulk, reference = AgentMetrics(), CollectorRegistry()
    buckets = {"queue": QUEUE_BUCKETS_S, "prefill": TTFT_BUCKETS_S}
    one_by_one = {name: Histogram(f"tokenprobe_request_{name}_seconds", "reference", ("server_port", "model"),
                                  buckets=bounds, registry=reference) for name, bounds in buckets.items()}
    for port, model in ((8000, "a"), (8000, "b"), (8001, "a"), (8000, "a")):
        queue = np.concatenate([rng.exponential(2.0, 500), QUEUE_BUCKETS_S, -rng.random(5)])
        prefill = np.concatenate([rng.exponential(0.5, 500), TTFT_BUCKETS_S[:len(QUEUE_BUCKETS_S)], rng.random(5)])
        bulk.observe_splits(port, model, queue_s=queue, prefill_s=prefill)
        for name, values in (("queue", queue), ("prefill", prefill)):
            for seconds in values:
                one_by_one[name].labels(str(port), model).observe(max(float(seconds), 0.0))

    def samples(registry, prefix):
        return sorted((s.name, tuple(sorted(s.labels.items())), round(s.value, 9))
                      for family in registry.collect() for s in family.samples
                      if s.name.startswith(prefix) and not s.name.endswith("_created"))

    for name in ("queue", "prefill"):
        prefix = f"tokenprobe_request_{name}_seconds"
        assert samples(bulk.registry, prefix) == samples(reference, prefix)
        assert len(samples(reference, prefix)) == 3 * (len(buckets[name]) + 3)  # +Inf, count, sum


def test_indicator_cells_and_their_states(metrics):
    metrics.set_indicator(8000, "llama-3-8b", "kv_cache_pressure", 0.97, "crit")
    metrics.set_indicator(8000, "llama-3-8b", "queue_depth", math.nan, "ok")
    metrics.set_indicator(8000, "llama-3-8b", "kv_cache_pressure", 0.91, "warn")  # a refresh replaces
    page = read(metrics)
    kv = {"server_port": "8000", "model": "llama-3-8b", "indicator": "kv_cache_pressure"}
    assert value(page, "tokenprobe_indicator_state", **kv) == 1
    assert value(page, "tokenprobe_indicator_value", **kv) == pytest.approx(0.91)
    assert math.isnan(value(page, "tokenprobe_indicator_value", indicator="queue_depth"))
    # A per-GPU cell judged by a central analytics process; a cell with no data.
    metrics.set_indicator(8000, "", "gpu_memory_pressure", 0.99, "crit", node="gpu-node-1", device="GPU-0a1b")
    metrics.set_indicator(8000, "", "batch_fill", None, "n/a")
    page = read(metrics)
    assert value(page, "tokenprobe_indicator_state", indicator="gpu_memory_pressure", node="gpu-node-1",
                 device="GPU-0a1b") == 2
    assert value(page, "tokenprobe_indicator_state", indicator="batch_fill") == -1
    assert math.isnan(value(page, "tokenprobe_indicator_value", indicator="batch_fill"))
    with pytest.raises(ValueError, match="one of"):
        metrics.set_indicator(8000, "m", "x", 1.0, "critical")
    with pytest.raises(TypeError, match="number"):
        metrics.set_indicator(8000, "m", "x", "high", "ok")


def test_indicators_not_refreshed_expire():
    metrics = AgentMetrics(indicator_ttl_s=0.2)
    metrics.serve("127.0.0.1", 0)
    try:
        metrics.set_indicator(8000, "m", "token_rate_decay", 1.0, "crit")
        time.sleep(0.5)
        metrics.set_indicator(8000, "m", "queue_depth", 2.0, "ok")
        page = read(metrics)
    finally:
        metrics.close()
    assert [s.labels["indicator"] for s in series(page, "tokenprobe_indicator_state")] == ["queue_depth"]


def test_agent_health_figures(metrics):
    sink = SinkStats(rows_written=900, rows_pending=10, rows_spooled=50, rows_rejected=0, rows_lost=0,
                     inserts=9, last_error=None, spool_dropped_rows=12, spool_bytes=4096, cpu_s=0.75)
    metrics.set_agent_stats(events_total=1000, drops_total=7, lag_s=0.02, events_per_s=350.0, sink=sink)
    page = read(metrics)
    assert value(page, "tokenprobe_agent_events_total") == 1000
    assert value(page, "tokenprobe_agent_drops_total") == 7
    assert page.families["tokenprobe_agent_drops_total"].type == "counter"
    assert value(page, "tokenprobe_agent_lag_seconds") == pytest.approx(0.02)
    assert value(page, "tokenprobe_agent_rows_written_total") == 900
    assert value(page, "tokenprobe_agent_spooled_rows") == 50
    assert value(page, "tokenprobe_agent_spool_bytes") == 4096
    assert value(page, "tokenprobe_agent_spool_dropped_rows_total") == 12
    assert value(page, "tokenprobe_agent_store_write_cpu_seconds_total") == 0.75
    assert series(page, "tokenprobe_agent_sample_rows_dropped_total") == []  # no samplers yet
    metrics.set_sampler_stats({"rows_written": {"gpu_samples": 80, "engine_samples": 4}, "errors": {},
                               "rows_dropped": {"gpu_samples": 3}, "write_cpu_s": 0.25, "nvml": "sampling"})
    page = read(metrics)
    assert value(page, "tokenprobe_agent_sample_rows_written_total") == 84
    assert value(page, "tokenprobe_agent_sample_rows_dropped_total") == 3
    assert value(page, "tokenprobe_agent_sampler_write_cpu_seconds_total") == 0.25
    assert series(page, "tokenprobe_agent_open_connections") == []  # not given: not exposed
    assert value(page, "process_resident_memory_bytes") > 0
    with pytest.raises(TypeError, match="drops_total"):
        metrics.set_agent_stats(events_total=1, drops_total="7", lag_s=0, events_per_s=0)


def test_bounded_state_figures(metrics):
    metrics.set_agent_stats(events_total=1, drops_total=0, lag_s=0, events_per_s=0, idle_evicted_total=5,
                            map_sizes={"conns": 65536, "listeners": 16384},
                            map_overflows={"conns": 36, "listeners": 0})
    metrics.set_agent_stats(events_total=2, drops_total=0, lag_s=0, events_per_s=0, map_overflows={"conns": 40},
                            unknown_ends_total=3)
    page = read(metrics)
    assert value(page, "tokenprobe_agent_unknown_ends_total") == 3
    assert value(page, "tokenprobe_agent_idle_evicted_connections_total") == 5
    assert value(page, "tokenprobe_agent_map_size", map="conns") == 65536
    assert value(page, "tokenprobe_agent_map_overflows_total", map="conns") == 40
    assert value(page, "tokenprobe_agent_map_overflows_total", map="listeners") == 0
    assert page.families["tokenprobe_agent_map_overflows_total"].type == "counter"


def test_files_the_scans_skipped_are_counted_by_reason(metrics):
    metrics.set_skipped_files({"malformed_elf": 1})
    metrics.set_skipped_files({"malformed_elf": 2, "unreadable": 7})
    page = read(metrics)
    assert value(page, "tokenprobe_agent_skipped_files_total", reason="malformed_elf") == 2
    assert value(page, "tokenprobe_agent_skipped_files_total", reason="unreadable") == 7
    assert page.families["tokenprobe_agent_skipped_files_total"].type == "counter"


def test_scrapes_while_rows_arrive_from_other_threads(metrics):
    def feed():
        for _ in range(500):
            metrics.observe_request(row())

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        assert not read(metrics).problems
    for thread in threads:
        thread.join()
    assert value(read(metrics), "tokenprobe_request_ttft_seconds_count", model="llama-3-8b") == 2000


def test_a_taken_port_is_reported_clearly(metrics):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = AgentMetrics()
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            other.serve("127.0.0.1", port)
    with pytest.raises(RuntimeError, match="already serving"):
        metrics.serve("127.0.0.1", 0)
