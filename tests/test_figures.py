"""One definition per figure: the same rows through every surface give the same numbers.

contract/measures.py defines server TTFT, TPOT, ITL, end to end and "inference
request" once, as SQL and as Python. Here a handful of rows that differ where
the definitions have branches (a connection's first request and a keep-alive
one, usage and counted events, one token, no tokens, a health check) go
through each surface that shows a figure, and each must give the Python
value: the SQL over a real embedded store, the analytics' phases
(stored as Float32), the dashboard's heatmap metrics, the agent's Prometheus
endpoint, the OTLP exporter's GenAI metrics (a real gRPC receiver) and the
controller's window figures.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client import generate_latest
from tokenprobe.agent.export.metrics_endpoint import AgentMetrics
from tokenprobe.agent.export.otel_export import OtelExporter
from tokenprobe.agent.sampling.prom_text import parse_exposition
from tokenprobe.analytics.figures import window_figures
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.contract import measures
from tokenprobe.contract.latency import METRICS
from tokenprobe.store.embedded import open_store

from tests.support.phases import phases_of
from tests.support.slot_simulation import LoadPhase, SlotServer, simulate
from tests.test_otel_export import OtlpReceiver, attributes_of

MS = 1_000_000
START_NS = (time.time_ns() // (60 * NS_PER_S) - 5) * 60 * NS_PER_S
FIGURES = ("ttft", "tpot", "e2e")


def python_figures(row: dict) -> dict[str, float | None]:
    return {"ttft": measures.ttft_server_ms(row), "tpot": measures.tpot_ms(row), "e2e": measures.e2e_ms(row)}


def rows() -> list[dict]:
    """One row per case, each on its own server port (so every surface's per-server figure is that row's)."""
    base = [request.row for request in simulate(SlotServer(), [LoadPhase(60, 1.0)], start_ns=START_NS, seed=3)][:6]
    cases = [
        {},  # first request on its connection, usage counts
        {"req_seq": 1, "completion_tokens": None},  # keep-alive: no connection setup; counted events
        {"completion_tokens": 40},  # usage says more tokens than events (several per event)
        {"token_events": 1, "completion_tokens": None, "token_offsets_us": [0]},  # one token: no TPOT
        {"first_token": None, "last_token": None, "token_events": 0, "token_offsets_us": [],
         "completion_tokens": None, "streamed": False},  # unstreamed: no TTFT, no TPOT
        {"method": "GET", "path": "/health", "model": ""},  # not an inference request
    ]
    out = []
    for index, (row, case) in enumerate(zip(base, cases, strict=True)):
        row = {**row, **case, "server_port": 9100 + index, "model": case.get("model", f"m{index}")}
        if case.get("token_events") == 1:
            row["last_token"] = row["first_token"]
        out.append(row)
    return out


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('figures') / 'store'}", serve=False)
    store.ensure_schema()
    data = rows()
    store.insert_rows("requests", data)
    analyze(store, TimeRange(START_NS - 60 * NS_PER_S, START_NS + 120 * NS_PER_S), window_s=60)
    yield store, data
    store.close()


def by_port(store, sql: str) -> dict[int, tuple]:
    return {row[0]: row[1:] for row in store.query_rows(sql)}


def test_sql_and_python_agree_to_the_bit(stored):
    store, data = stored
    sql = by_port(store, f"SELECT server_port, {measures.TTFT_SERVER_MS}, {measures.TPOT_MS}, {measures.E2E_MS}, "
                         f"{measures.ITL_GAPS_US}, {measures.IS_INFERENCE} FROM tokenprobe.requests")
    for row in data:
        ttft, tpot, e2e, gaps_us, inference = sql[row["server_port"]]
        assert dict(zip(FIGURES, (ttft, tpot, e2e), strict=True)) == python_figures(row), row["server_port"]
        assert [gap / 1000 for gap in gaps_us] == measures.itl_gaps_ms(row)
        assert bool(inference) == measures.is_inference(row)


def test_the_analytics_store_the_same_figures(stored):
    store, data = stored
    phases = by_port(store, "SELECT server_port, ttft_server_ms, tpot_ms, e2e_ms, itl_max_ms "
                            f"FROM {phases_of(store)}")
    for row in data:
        if not measures.is_inference(row):
            assert row["server_port"] not in phases
            continue
        expected = [None if value is None else np.float32(value) for value in python_figures(row).values()]
        gaps = measures.itl_gaps_ms(row)
        expected.append(np.float32(max(gaps)) if gaps else None)
        assert list(phases[row["server_port"]]) == expected, row["server_port"]


def test_the_dashboard_heatmaps_use_the_same_figures(stored):
    store, data = stored
    columns = ", ".join(f"if({METRICS[key].condition}, {METRICS[key].sql}, NULL)" for key in FIGURES)
    heat = by_port(store, f"SELECT server_port, {columns} FROM tokenprobe.requests")
    for row in data:
        assert dict(zip(FIGURES, heat[row["server_port"]], strict=True)) == python_figures(row)


def histogram_sums(samples, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in samples if s.name == name}


def test_the_prometheus_endpoint_observes_the_same_figures():
    data = rows()
    metrics = AgentMetrics()
    for row in data:
        metrics.observe_request(row)
    samples = parse_exposition(generate_latest(metrics.registry).decode()).samples
    for key, name in (("ttft", "ttft"), ("tpot", "tpot"), ("e2e", "duration")):
        sums = histogram_sums(samples, f"tokenprobe_request_{name}_seconds_sum", "server_port")
        expected = {str(row["server_port"]): python_figures(row)[key] / 1000 for row in data
                    if measures.is_inference(row) and python_figures(row)[key] is not None}
        assert sums == expected, key


def test_the_otlp_exporter_records_the_same_figures():
    data = rows()
    receiver = OtlpReceiver()
    receiver.server.start()
    exporter = OtelExporter(f"http://127.0.0.1:{receiver.port}", node="n", export_interval_s=60)
    try:
        exported = [exporter.export_request(row) for row in data]
        assert exporter.flush(timeout_s=30)
    finally:
        exporter.close()
        receiver.server.stop(grace=None)
    assert exported == [measures.is_inference(row) for row in data]
    received = receiver.metrics()
    for key, name in (("ttft", "gen_ai.server.time_to_first_token"), ("tpot", "gen_ai.server.time_per_output_token"),
                      ("e2e", "gen_ai.server.request.duration")):
        sums = {attributes_of(point)["server.port"]: point.sum for point in received.get(name, [])}
        expected = {row["server_port"]: python_figures(row)[key] / 1000 for row in data
                    if measures.is_inference(row) and python_figures(row)[key] is not None}
        assert sums == expected, key


def test_the_controller_reads_the_same_ttft(stored):
    store, data = stored
    figures = window_figures(store, START_NS / NS_PER_S - 60, START_NS / NS_PER_S + 120)
    p99 = {figure.upstream: figure.p99_ttft_s for figure in figures}
    expected = {f"{row['node']}:{row['server_port']}": measures.ttft_server_ms(row) / 1000 for row in data
                if measures.is_inference(row) and measures.ttft_server_ms(row) is not None}
    assert {upstream: p99[upstream] for upstream in expected} == expected
    assert set(p99) == {f"{row['node']}:{row['server_port']}" for row in data if measures.is_inference(row)}
