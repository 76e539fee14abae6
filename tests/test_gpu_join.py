"""The request -> GPU/engine state ASOF join, on known data in a real embedded store."""

from __future__ import annotations

import bisect
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.sampling.dcgm import DcgmScraper
from tokenprobe.agent.sampling.engine_metrics import EngineReading, EngineScraper
from tokenprobe.agent.sampling.gpu import GpuReading, ServerGpu, ServerGpuMap
from tokenprobe.agent.sampling.samplers import (
    SamplerSet,
    engine_samples_arrow,
    gpu_samples_arrow,
    server_gpus_arrow,
)
from tokenprobe.contract.requests import REQUEST_SCHEMA
from tokenprobe.contract.views import VIEW_NAME, request_gpu_state_sql
from tokenprobe.refserver.sim_metrics import (
    PROMETHEUS_CONTENT_TYPE,
    SimulatedGpu,
    SimulatedKvCache,
    render_dcgm_text,
    render_vllm_text,
)
from tokenprobe.store.embedded import open_store
from tokenprobe.store.schema import create_request_gpu_state_view

MS = 1_000_000
# Recent, so the tables' TTL keeps every row; whole seconds, so offsets read easily.
T0 = (time.time_ns() // 1_000_000_000 - 600) * 1_000_000_000
WAIT_S = 60.0


def request_row(conn_id: int, pid: int, server_port: int, req_start: int, first_token: int | None, node="n1") -> dict:
    """A full requests row; the join reads only node, pid, server_port, req_start and first_token."""
    row = {column.name: None for column in REQUEST_SCHEMA}
    row.update(
        node=node, conn_id=conn_id, req_seq=0, role="server", pid=pid, comm="engine", server_port=server_port,
        client_addr="127.0.0.1", client_port=40000 + conn_id, tenant="", tls=False, req_start=req_start,
        first_token=first_token, method="POST", path="/v1/chat/completions", status=200, model="m",
        response_id="", streamed=True, token_events=0, sse_events=0, token_offsets_us=[],
        inflight_at_arrival=0, bytes_in=0, bytes_out=0, body_fp=0, outcome="complete", error="",
        api="openai.chat", choices=1, choice_events=0, capture="exact", bytes_unseen=0, protocol="http/1.1", stream_id=0, unreadable_reason="",
        request_messages=0, request_message_bytes=0, response_message_bytes=0, largest_response_message_bytes=0,
        namespace="", pod="", container="", pod_uid="", container_id="", error_type="", engine_queue_ms=None,
    )  # fmt: skip
    return row


@pytest.fixture
def store(tmp_path):
    with open_store(f"chdb://{tmp_path / 'store'}", serve=False) as opened:
        opened.ensure_schema()
        yield opened


def gpu_samples(node: str, device: str, base_value: int, count: int, step_ns: int = 100 * MS) -> list[GpuReading]:
    """Samples every ``step_ns`` from T0 whose mem_used_bytes is ``base_value + i`` - it names the sample."""
    return [
        GpuReading(T0 + i * step_ns, "nvml", device, device, 0, mem_used_bytes=base_value + i, gpu_util_pct=float(i))
        for i in range(count)
    ]


def load_known_data(store) -> None:
    a_samples = gpu_samples("n1", "GPU-A", 1000, 11)
    random.Random(7).shuffle(a_samples)  # arrival order must not matter
    store.insert_arrow("gpu_samples", gpu_samples_arrow(a_samples[:6], "n1"))
    store.insert_arrow("gpu_samples", gpu_samples_arrow(a_samples[6:], "n1"))
    store.insert_arrow("gpu_samples", gpu_samples_arrow(gpu_samples("n1", "GPU-B", 2000, 11), "n1"))
    # Same device name on another node, with values no n1 request may ever see.
    store.insert_arrow("gpu_samples", gpu_samples_arrow(gpu_samples("n2", "GPU-A", 9000, 11, step_ns=10 * MS), "n2"))
    engine = [EngineReading(T0 + i * 250 * MS, "u", 8000, "vllm", requests_running=i) for i in range(5)]
    store.insert_arrow("engine_samples", engine_samples_arrow(engine, "n1"))
    mapping = [
        ServerGpu(100, 0, "GPU-A", "GPU-A", "nvml"),
        ServerGpu(200, 0, "GPU-A", "GPU-A", "nvml"),  # tensor parallel over two GPUs
        ServerGpu(200, 0, "GPU-B", "GPU-B", "nvml"),
        ServerGpu(0, 9000, "GPU-B", "GPU-B", "config"),
    ]
    store.insert_arrow("server_gpus", server_gpus_arrow(mapping, T0, "n1"))
    store.insert_arrow("server_gpus", server_gpus_arrow(mapping[:1], T0 + 500 * MS, "n1"))  # re-written: no duplicates
    requests = [
        request_row(1, 100, 8000, T0 + 300 * MS, T0 + 349 * MS),  # exactly on a sample: that sample
        request_row(2, 100, 8000, T0 + 400 * MS - 1, T0 + 2_000 * MS),  # 1 ns before one: the one before
        request_row(3, 200, 8000, T0 + 550 * MS, None),  # two GPUs, no first token
        request_row(4, 999, 9000, T0 + 120 * MS, T0 + 130 * MS),  # no NVML mapping: the configured port
        request_row(5, 300, 7000, T0 + 500 * MS, None),  # no GPU known at all
        request_row(6, 100, 9000, T0 - 1, None),  # before any sample; NVML mapping beats the port's
    ]
    store.insert_rows("requests", requests)


def joined(store, sql: str) -> dict[tuple[int, str], dict]:
    frame = store.query_df(sql)
    return {(int(row["conn_id"]), row["device_id"]): row for row in frame.to_dict("records")}


def is_null(value) -> bool:
    return value is None or value != value  # NaN, NaT and pandas' NA are not equal to themselves


def test_each_request_gets_the_latest_sample_at_or_before_its_time(store):
    load_known_data(store)
    rows = joined(store, request_gpu_state_sql(store.database))
    assert set(rows) == {(1, "GPU-A"), (2, "GPU-A"), (3, "GPU-A"), (3, "GPU-B"), (4, "GPU-B"), (5, ""), (6, "GPU-A")}

    exact = rows[(1, "GPU-A")]
    assert (exact["arrival_mem_used_bytes"], exact["first_token_mem_used_bytes"]) == (1003, 1003)
    assert exact["arrival_sample_age_ms"] == 0 and exact["first_token_sample_age_ms"] == 49
    assert exact["gpu_mapping"] == "nvml" and exact["arrival_gpu_source"] == "nvml"
    assert exact["engine_requests_running"] == 1.0  # engine sample at 250 ms, not the one at 500 ms
    assert exact["engine_engine"] == "vllm" and exact["engine_sample_age_ms"] == 50

    just_before = rows[(2, "GPU-A")]
    assert just_before["arrival_mem_used_bytes"] == 1003  # the sample at 400 ms is 1 ns too late
    assert just_before["first_token_mem_used_bytes"] == 1010  # the last sample, old: the sampler stopped
    assert just_before["first_token_sample_age_ms"] == 1000

    assert rows[(3, "GPU-A")]["arrival_mem_used_bytes"] == 1005
    assert rows[(3, "GPU-B")]["arrival_mem_used_bytes"] == 2005
    assert is_null(rows[(3, "GPU-B")]["first_token_mem_used_bytes"])

    configured = rows[(4, "GPU-B")]
    assert configured["gpu_mapping"] == "config" and configured["arrival_mem_used_bytes"] == 2001
    assert is_null(configured["engine_requests_running"])  # no engine scraped on port 9000

    unknown = rows[(5, "")]
    assert unknown["gpu_mapping"] == "" and is_null(unknown["arrival_mem_used_bytes"])
    assert unknown["engine_requests_running"] is not None and is_null(unknown["engine_requests_running"])

    early = rows[(6, "GPU-A")]
    assert early["gpu_mapping"] == "nvml"
    assert is_null(early["arrival_mem_used_bytes"]) and is_null(early["arrival_sample_ts"])
    assert not any(row["simulated"] for row in rows.values())
    # Node n2's samples (values from 9000) never reach an n1 request.
    assert all(is_null(row["arrival_mem_used_bytes"]) or row["arrival_mem_used_bytes"] < 9000 for row in rows.values())


def test_join_matches_a_reference_on_random_data(store):
    """Random sample and request times; the view must agree with a bisect over the samples, per GPU."""
    rng = random.Random(20261130)
    devices = ["GPU-X", "GPU-Y"]
    sample_times = {device: sorted(rng.sample(range(0, 5_000 * MS, MS // 7), 150)) for device in devices}
    readings = [
        GpuReading(T0 + offset, "dcgm", device, device, 0, mem_used_bytes=index)
        for device in devices
        for index, offset in enumerate(sample_times[device])
    ]
    rng.shuffle(readings)
    store.insert_arrow("gpu_samples", gpu_samples_arrow(readings, "n1"))
    mapping = [ServerGpu(10 + n, 0, device, device, "nvml") for n, device in enumerate(devices)]
    store.insert_arrow("server_gpus", server_gpus_arrow(mapping, T0, "n1"))
    requests = []
    for conn_id in range(200):
        start = rng.randrange(-100 * MS, 5_100 * MS)
        first = start + rng.randrange(0, 300 * MS) if rng.random() < 0.8 else None
        requests.append(request_row(conn_id, 10 + conn_id % 2, 8000, T0 + start, None if first is None else T0 + first))
    store.insert_rows("requests", requests)

    def expected(device: str, at: int | None) -> int | None:
        if at is None:
            return None
        position = bisect.bisect_right(sample_times[device], at - T0)
        return position - 1 if position else None

    rows = joined(store, request_gpu_state_sql(store.database))
    assert len(rows) == len(requests)
    for request in requests:
        device = devices[request["pid"] - 10]
        row = rows[(request["conn_id"], device)]
        for prefix, at in (("arrival", request["req_start"]), ("first_token", request["first_token"])):
            got = row[f"{prefix}_mem_used_bytes"]
            assert (None if is_null(got) else int(got)) == expected(device, at), (request["conn_id"], prefix)


def test_view_is_created_in_the_store_and_reads_like_the_query(store):
    load_known_data(store)
    name = create_request_gpu_state_view(store)
    assert name == f"{store.database}.{VIEW_NAME}"
    via_view = joined(store, f"SELECT * FROM {name}")
    assert via_view.keys() == joined(store, request_gpu_state_sql(store.database)).keys()
    assert via_view[(1, "GPU-A")]["arrival_mem_used_bytes"] == 1003
    create_request_gpu_state_view(store)  # replacing it is fine


def test_database_name_is_checked():
    with pytest.raises(ValueError, match="not a plain identifier"):
        request_gpu_state_sql("x; DROP TABLE y")


# --------------------------------------------------------------------------- the simulated demo path


class _SimulatedFeed(BaseHTTPRequestHandler):
    """Serves the reference server's simulated pages: /sim/dcgm and /metrics."""

    snapshot = None
    gpu: SimulatedGpu
    kv_cache = SimulatedKvCache()

    def do_GET(self):  # noqa: N802
        if self.path == "/sim/dcgm":
            body = render_dcgm_text(self.snapshot, self.gpu, self.kv_cache)
        else:
            body = render_vllm_text(self.snapshot, self.kv_cache, "tiny")
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", PROMETHEUS_CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _Snapshot:
    running, waiting, slots, completed = 3, 1, 4, 12
    prompt_tokens_total, generation_tokens_total = 6_000, 1_500
    kv_blocks_total, kv_blocks_used, preemptions_total = None, 0, 0  # an unbounded engine cache: the coarse model


def test_simulated_feed_joins_and_is_marked_simulated(store):
    handler = type("Handler", (_SimulatedFeed,), {"snapshot": _Snapshot()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_port
    handler.gpu = SimulatedGpu(hostname="demo-host", port=port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clock = MonotonicWallClock()
    samplers = SamplerSet(
        store,
        "demo-host",
        clock,
        dcgm=[DcgmScraper(f"http://127.0.0.1:{port}/sim/dcgm")],
        engines=[EngineScraper(f"http://127.0.0.1:{port}/metrics")],
        gpu_map=ServerGpuMap({port: ["0"], port + 1: ["GPU-typo"]}),
        scrape_interval_s=0.1,
        flush_interval_s=0.2,
    )
    try:
        samplers.start()
        deadline = time.monotonic() + WAIT_S
        tables = ("gpu_samples", "engine_samples", "server_gpus")
        while min(samplers.stats()["rows_written"].get(table, 0) for table in tables) < 1:
            assert time.monotonic() < deadline, "the simulated feed was not sampled in time"
            time.sleep(0.1)
        arrival = clock.now_wall_ns()
    finally:
        samplers.stop()
        server.shutdown()
        server.server_close()

    assert samplers.stats()["errors"][f"gpu configuration: port {port + 1} -> GPU-typo not found"] >= 1
    store.insert_rows("requests", [request_row(1, 4242, port, arrival, arrival + 5 * MS, node="demo-host")])
    (row,) = store.query_df(f"SELECT * FROM {create_request_gpu_state_view(store)}").to_dict("records")
    assert row["device_id"] == handler.gpu.uuid and row["gpu_mapping"] == "config"
    assert row["simulated"] and row["arrival_gpu_simulated"] and row["engine_simulated"]
    assert row["arrival_gpu_util_pct"] == 84.0  # 35 + 65 * 3/4, rounded, as the model says
    assert row["engine_requests_running"] == 3.0 and row["engine_model"] == "tiny"
    flags = store.query_rows(
        f"SELECT (SELECT groupUniqArray(simulated) FROM {store.table('gpu_samples')}),"
        f" (SELECT groupUniqArray(simulated) FROM {store.table('engine_samples')}),"
        f" (SELECT groupUniqArray(simulated) FROM {store.table('server_gpus')})"
    )
    assert flags == [([True], [True], [True])]
