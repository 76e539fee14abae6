"""dcgm-exporter scraping: exporter-format pages served by a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.sampling.dcgm import MIB, DcgmRead, DcgmScraper, parse_dcgm_text
from tokenprobe.agent.sampling.gpu import GpuReading
from tokenprobe.agent.sampling.prom_text import ScrapeError
from tokenprobe.agent.sampling.samplers import SamplerSet
from tokenprobe.store.embedded import open_store

DATA = Path(__file__).resolve().parent / "data"
H100_0 = "GPU-5d3e5f8a-9c1b-7a42-e0f3-2b6c8d1e4a90"
H100_1 = "GPU-a17c2e94-3b5d-6f08-1e9a-c4d7b2f5e381"
A100_MIG = "GPU-0c8b7d2e-61f4-4a9d-b3e5-7f21a6c9d048"
A100_WHOLE = "GPU-e49f1a73-2d8c-4b06-95e7-3c1f8a6b2d57"


class _ExporterHandler(BaseHTTPRequestHandler):
    """Serves a file at /metrics the way dcgm-exporter does (text 0.0.4)."""

    body = b""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def exporter():
    """Start a real HTTP server; returns a function that sets the page and gives the /metrics URL."""
    handler = type("Handler", (_ExporterHandler,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def serve(path: Path) -> str:
        handler.body = path.read_bytes()
        return f"http://127.0.0.1:{server.server_port}/metrics"

    yield serve
    server.shutdown()
    server.server_close()


def by_device(readings):
    return {reading.device_id: reading for reading in readings}


def test_h100_node_with_pod_mapping(exporter):
    result = DcgmScraper(exporter(DATA / "dcgm_h100x2_k8s.txt")).read(ts_ns=123)
    assert result.problems == []
    devices = by_device(result.readings)
    assert set(devices) == {H100_0, H100_1}

    busy = devices[H100_0]
    assert (busy.ts_ns, busy.source, busy.gpu_uuid, busy.gpu_index) == (123, "dcgm", H100_0, 0)
    assert busy.gpu_name == "NVIDIA H100 80GB HBM3" and busy.mig_gi_id is None and busy.mig_profile == ""
    assert busy.mem_used_bytes == 73996 * MIB and busy.mem_free_bytes == 7011 * MIB
    assert busy.mem_reserved_bytes == 552 * MIB
    # No FB_TOTAL in this counter set: the frame buffer is used + free + reserved (81559 MiB on an H100 80GB).
    assert busy.mem_total_bytes == 81559 * MIB
    assert (busy.gpu_util_pct, busy.mem_util_pct, busy.sm_clock_mhz, busy.temp_c) == (87, 41, 1980, 58)
    assert busy.power_w == pytest.approx(412.647)
    assert (busy.sm_active, busy.sm_occupancy, busy.tensor_active, busy.dram_active) == pytest.approx(
        (0.812045, 0.187322, 0.356218, 0.523871)
    )
    assert (busy.pod, busy.namespace, busy.container) == ("vllm-llama3-8b-6d9f7c5b8-x2kq4", "llm-serving", "vllm")
    # Fields without a column of their own keep their DCGM name; counters included.
    assert busy.extra["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 81523664213
    assert busy.extra["DCGM_FI_PROF_PCIE_RX_BYTES"] == 102433781
    assert busy.extra["DCGM_FI_DEV_MEM_CLOCK"] == 2619
    assert "DCGM_FI_DEV_FB_USED" not in busy.extra
    assert not busy.simulated and busy.processes == ()

    idle = devices[H100_1]
    assert idle.tensor_active is None  # NaN in the page: unknown, not zero
    assert idle.sm_active == 0.0 and idle.mem_used_bytes == 1 * MIB
    assert (idle.pod, idle.namespace, idle.container) == ("", "", "")


def test_mig_instances_are_devices_of_their_own(exporter):
    result = DcgmScraper(exporter(DATA / "dcgm_a100_mig.txt")).read(ts_ns=5)
    assert result.problems == []
    devices = by_device(result.readings)
    assert set(devices) == {f"{A100_MIG}/gi1", f"{A100_MIG}/gi2", A100_WHOLE}

    serving = devices[f"{A100_MIG}/gi1"]
    assert (serving.gpu_uuid, serving.gpu_index, serving.mig_gi_id, serving.mig_profile) == (A100_MIG, 0, 1, "3g.40gb")
    assert serving.mem_used_bytes == 37938 * MIB
    assert serving.mem_total_bytes == (37938 + 2311) * MIB  # no FB_RESERVED in this counter set
    assert serving.gpu_util_pct is None  # DCGM has no per-instance GPU_UTIL
    assert serving.tensor_active == pytest.approx(0.290775)
    assert serving.power_w == pytest.approx(187.204)  # whole-GPU fields repeat on each instance
    assert (serving.pod, serving.namespace, serving.container) == ("sglang-qwen-7b-0", "llm", "sglang")
    assert devices[f"{A100_MIG}/gi2"].pod == ""

    whole = devices[A100_WHOLE]
    assert whole.mig_gi_id is None and whole.gpu_util_pct == 3 and whole.gpu_index == 1


def test_what_real_pages_also_carry_escapes_shared_devices_unattributed_series_and_bad_lines():
    labels = 'gpu="0",UUID="GPU-1",device="nvidia0",modelName="Tesla T4",Hostname="n"'
    text = "\n".join(
        [
            "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).",
            "# TYPE DCGM_FI_DEV_FB_USED gauge",
            # Time-slicing: one GPU shared by two pods, one series each.
            f'DCGM_FI_DEV_FB_USED{{{labels},container="a",namespace="ns",pod="pod-\\"quoted\\""}} 100',
            f'DCGM_FI_DEV_FB_USED{{{labels},container="b",namespace="ns",pod="pod-b"}} 100',
            "# TYPE DCGM_FI_DEV_XID_ERRORS gauge",
            f'DCGM_FI_DEV_XID_ERRORS{{{labels},err_code="79",err_msg="GPU has fallen off the bus"}} 79',
            # No labels at all: nothing to attribute it to.
            "DCGM_FI_DEV_FAN_SPEED 0",
            f"DCGM_FI_DEV_FB_TOTAL{{{labels}}} 15360",
            f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} warm",
            "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
            f"DCGM_FI_DEV_POWER_USAGE{{{labels}}} 27.5",
        ]
    )
    result = parse_dcgm_text(text, 9)
    (reading,) = result.readings
    assert reading.mem_used_bytes == 100 * MIB and reading.power_w == 27.5 and reading.temp_c is None
    assert reading.mem_total_bytes == 15360 * MIB  # FB_TOTAL, where the exporter sends it
    assert reading.pod == 'pod-"quoted",pod-b' and reading.container == "a,b" and reading.namespace == "ns,ns"
    assert reading.extra == {"DCGM_FI_DEV_XID_ERRORS{err_code=79,err_msg=GPU has fallen off the bus}": 79.0}
    kinds = sorted(problem.kind for problem in result.problems)
    assert kinds == ["dcgm series without UUID", "dcgm unreadable line"]
    assert any("line 9" in problem.message and "not a number" in problem.message for problem in result.problems)


def test_simulated_label_marks_the_reading():
    text = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-sim",modelName="Simulated GPU",simulated="true"} 40\n'
    (reading,) = parse_dcgm_text(text, 0).readings
    assert reading.simulated and reading.gpu_util_pct == 40


def test_non_dcgm_series_are_ignored():
    text = 'go_goroutines 12\nDCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-1"} 40\n'
    result = parse_dcgm_text(text, 0)
    assert len(result.readings) == 1 and result.problems == []


def test_unreachable_or_failing_exporter_is_a_scrape_error(exporter):
    url = exporter(DATA / "dcgm_h100x2_k8s.txt")
    with pytest.raises(ScrapeError, match="HTTP 404"):
        DcgmScraper(url.replace("/metrics", "/nope")).read(0)
    with ThreadingHTTPServer(("127.0.0.1", 0), _ExporterHandler) as closed:
        port = closed.server_port
    with pytest.raises(ScrapeError, match="could not be read"):
        DcgmScraper(f"http://127.0.0.1:{port}/metrics", timeout_s=5).read(0)
    with pytest.raises(ValueError, match="must be http"):
        DcgmScraper("127.0.0.1:9400/metrics")


# --------------------------------------------------------------------------- through SamplerSet into a real store


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.05)


def test_rows_wait_for_a_store_that_cannot_take_them_and_the_oldest_are_dropped(exporter, tmp_path):
    url = exporter(DATA / "dcgm_h100x2_k8s.txt")  # two devices per scrape
    with open_store(f"chdb://{tmp_path / 'store'}", serve=False) as store:
        # No schema yet: every insert fails until ensure_schema() below.
        samplers = SamplerSet(
            store, "node-a", MonotonicWallClock(), dcgm=[DcgmScraper(url)],
            scrape_interval_s=0.02, flush_interval_s=0.1, max_buffered_rows=20,
        )  # fmt: skip
        samplers.start()
        try:
            wait_for(lambda: samplers.stats()["rows_dropped"].get("gpu_samples", 0) > 0, "dropping the oldest rows")
            failures = [kind for kind in samplers.stats()["errors"] if kind.startswith("store insert into gpu_samples")]
            assert failures, samplers.stats()
            store.ensure_schema()
            wait_for(lambda: samplers.stats()["rows_written"].get("gpu_samples", 0) >= 30, "writing after recovery")
        finally:
            samplers.stop()
        stats = samplers.stats()
        (stored,) = store.query_rows(f"SELECT count() FROM {store.table('gpu_samples')}")[0]
        assert stored == stats["rows_written"]["gpu_samples"]
        assert stats["errors"]["gpu_samples: buffer full"] >= 1


def test_a_value_its_column_cannot_hold_is_left_empty_and_the_row_stored(exporter, tmp_path):
    broken = tmp_path / "negative.txt"
    broken.write_text('DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-1",modelName="Tesla T4"} -5\n'
                      'DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-1"} +Inf\n'
                      'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-1"} 41\n')
    url = exporter(broken)
    with open_store(f"chdb://{tmp_path / 'store'}", serve=False) as store:
        store.ensure_schema()
        samplers = SamplerSet(
            store, "node-a", MonotonicWallClock(), dcgm=[DcgmScraper(url)], scrape_interval_s=0.02, flush_interval_s=0.1
        )
        samplers.start()
        try:
            wait_for(lambda: samplers.stats()["rows_written"].get("gpu_samples", 0) >= 3, "storing the rows")
        finally:
            samplers.stop()
        rows = store.query_rows(f"SELECT mem_used_bytes, sm_clock_mhz, temp_c FROM {store.table('gpu_samples')}")
    assert set(rows) == {(None, None, 41.0)}
    assert samplers.stats()["errors"][f"{url}: dcgm value out of range"] >= 3
    assert not any(samplers.stats()["rows_dropped"].values())


def test_rows_that_do_not_fit_the_table_are_dropped_and_sampling_goes_on(tmp_path):
    class BrokenScraper(DcgmScraper):
        """A reader with a bug: a reading no gpu_samples row can hold."""

        def read(self, ts_ns):
            return DcgmRead([GpuReading(ts_ns, "dcgm", "GPU-1", "GPU-1", mem_used_bytes=-5)], [])

    with open_store(f"chdb://{tmp_path / 'store'}", serve=False) as store:
        store.ensure_schema()
        samplers = SamplerSet(store, "node-a", MonotonicWallClock(), dcgm=[BrokenScraper("http://127.0.0.1:1/")],
                              scrape_interval_s=0.02, flush_interval_s=0.1)
        samplers.start()
        try:
            wait_for(lambda: samplers.stats()["rows_dropped"].get("gpu_samples", 0) >= 3, "dropping bad rows")
        finally:
            samplers.stop()
    assert samplers.stats()["errors"]["gpu_samples: rows that do not fit"] >= 3
    assert samplers.stats()["rows_written"].get("gpu_samples", 0) == 0