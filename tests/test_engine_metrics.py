"""Engine /metrics scraping: real vLLM and llama.cpp captures, composed SGLang and TGI pages, a real HTTP server."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tokenprobe.agent.sampling.engine_metrics import (
    EngineScraper,
    HistogramTotals,
    detect_engine,
    reading_from_exposition,
    window_mean,
)
from tokenprobe.agent.sampling.prom_text import ScrapeError, parse_exposition

# Real captures from real inference servers (tests/data/fixtures/README.md says how each was taken).
FIXTURES = Path(__file__).resolve().parent / "data" / "fixtures"
DATA = Path(__file__).resolve().parent / "data"


def page(path: Path):
    return parse_exposition(path.read_text())


def scrape_sequence(scraper: EngineScraper, paths: list[Path]):
    return [scraper.read_exposition(page(path), ts_ns=index) for index, path in enumerate(paths)]


# --------------------------------------------------------------------------- vLLM (real captures)


def test_vllm_captures_normalize_to_the_figures_the_fixture_notes_give():
    scraper = EngineScraper("http://127.0.0.1:8300/metrics")
    idle, busy, after = scrape_sequence(
        scraper, [FIXTURES / f"vllm_metrics_{name}.txt" for name in ("idle", "busy", "after")]
    )
    assert (busy.engine, busy.model, busy.server_port) == ("vllm", "small", 8300)
    assert (busy.requests_running, busy.requests_waiting) == (2.0, 2.0)
    assert busy.kv_cache_usage == pytest.approx(0.0088, abs=1e-4)
    assert (busy.prompt_tokens_total, busy.generation_tokens_total) == (3137.0, 273.0)
    assert (after.prompt_tokens_total, after.generation_tokens_total) == (7010.0, 410.0)
    assert after.requests_running == 0.0 and after.preemptions_total == 0.0
    # No window before the first scrape; idle -> busy is the window of the first 6 first tokens.
    assert idle.ttft_mean_s is None
    busy_series = page(FIXTURES / "vllm_metrics_busy.txt").series_by_name()
    (ttft_sum,) = busy_series["vllm:time_to_first_token_seconds_sum"]
    assert busy.ttft_mean_s == pytest.approx(ttft_sum.value / 6)
    for mean in ("queue_mean_s", "prefill_mean_s", "decode_mean_s", "e2e_mean_s", "itl_mean_s"):
        assert getattr(after, mean) > 0, mean
    assert not busy.simulated and busy.problems == ()


def test_vllm_raw_keeps_engine_series_but_not_buckets_created_or_info():
    reading, _ = reading_from_exposition(page(FIXTURES / "vllm_metrics_busy.txt"), 0, "u", 8300)
    assert reading.raw["vllm:num_requests_waiting_by_reason{engine=0,model_name=small,reason=capacity}"] == 2.0
    assert reading.raw["vllm:request_success_total{engine=0,finished_reason=length,model_name=small}"] == 4.0
    assert reading.raw["vllm:time_to_first_token_seconds_count{engine=0,model_name=small}"] == 6.0
    assert not any(key.split("{")[0].endswith(("_bucket", "_created", "_info")) for key in reading.raw)
    assert not any(key.startswith(("python_", "process_", "http_")) for key in reading.raw)


# --------------------------------------------------------------------------- llama.cpp (real captures)


def test_llamacpp_captures_normalize_and_missing_fields_stay_empty():
    scraper = EngineScraper("http://127.0.0.1:8080/metrics")
    idle, busy, late = scrape_sequence(
        scraper, [FIXTURES / f"llamacpp_metrics_{name}.txt" for name in ("idle", "busy", "busy_late")]
    )
    assert idle.engine == busy.engine == "llamacpp"
    assert (busy.requests_running, busy.requests_waiting, busy.prompt_tokens_total) == (2.0, 2.0, 251.0)
    assert (late.requests_waiting, late.generation_tokens_total, late.prompt_tokens_total) == (1.0, 200.0, 2001.0)
    # llama-server exports no KV usage (in this build), no preemptions, no histograms, no model label.
    assert late.kv_cache_usage is None and late.preemptions_total is None
    assert late.ttft_mean_s is None and late.model == ""
    assert late.raw["llamacpp:n_busy_slots_per_decode"] == 1.995


# --------------------------------------------------------------------------- SGLang and TGI (composed pages)


def test_sglang_page_normalizes_with_window_means():
    scraper = EngineScraper("http://127.0.0.1:30000/metrics")
    first, second = scrape_sequence(scraper, [DATA / "engine_sglang_busy.txt", DATA / "engine_sglang_later.txt"])
    assert (first.engine, first.model) == ("sglang", "Qwen/Qwen2.5-7B-Instruct")
    assert (second.requests_running, second.requests_waiting, second.kv_cache_usage) == (15.0, 4.0, 0.64)
    # 4 requests finished between the scrapes: TTFT sum grew by 3.8 s.
    assert second.ttft_mean_s == pytest.approx(3.8 / 4)
    assert second.e2e_mean_s == pytest.approx(28.4 / 4)
    assert second.prefill_mean_s is None and second.preemptions_total is None


def test_tgi_page_normalizes_with_token_totals_from_histogram_sums():
    scraper = EngineScraper("http://127.0.0.1:9000/metrics", server_port=3000)
    first, second = scrape_sequence(scraper, [DATA / "engine_tgi_busy.txt", DATA / "engine_tgi_later.txt"])
    assert (first.engine, first.server_port) == ("tgi", 3000)
    assert (first.requests_running, first.requests_waiting) == (24.0, 6.0)
    assert (second.prompt_tokens_total, second.generation_tokens_total) == (406037.0, 215380.0)
    assert second.queue_mean_s == pytest.approx(1.2 / 10)
    assert second.itl_mean_s == pytest.approx(0.17 / 10)
    assert second.kv_cache_usage is None and second.ttft_mean_s is None


# --------------------------------------------------------------------------- rules


def test_engine_detection_by_prefix_majority():
    assert detect_engine(page(FIXTURES / "vllm_metrics_idle.txt")) == "vllm"
    assert detect_engine(page(FIXTURES / "llamacpp_metrics_idle.txt")) == "llamacpp"
    assert detect_engine(page(DATA / "engine_tgi_busy.txt")) == "tgi"
    assert detect_engine(parse_exposition("process_cpu_seconds_total 1\n")) == "unknown"


def test_several_engines_sum_except_kv_usage_which_takes_the_fullest():
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="a"} 3',
            'vllm:num_requests_running{engine="1",model_name="a"} 5',
            'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75',
            'vllm:gpu_cache_usage_perc{engine="1",model_name="a"} 0.1',
        ]
    )
    reading, _ = reading_from_exposition(parse_exposition(text), 0, "u", 1)
    assert reading.requests_running == 8.0
    assert reading.kv_cache_usage == 0.75  # and the current name wins over the v0 one
    assert reading.requests_waiting is None


def test_window_mean_rules():
    assert window_mean(HistogramTotals(10.0, 5), None) is None
    assert window_mean(HistogramTotals(10.0, 5), HistogramTotals(10.0, 5)) is None  # nothing finished
    assert window_mean(HistogramTotals(13.0, 7), HistogramTotals(10.0, 5)) == 1.5
    # The count went down: the server restarted, the window is everything since.
    assert window_mean(HistogramTotals(2.0, 4), HistogramTotals(10.0, 5)) == 0.5


def test_scraper_rejects_bad_configuration():
    with pytest.raises(ValueError, match="must be http"):
        EngineScraper("ftp://127.0.0.1/metrics")
    with pytest.raises(ValueError, match="unknown engine 'triton'"):
        EngineScraper("http://127.0.0.1:8000/metrics", engine="triton")
    with pytest.raises(ValueError, match="not a TCP port"):
        EngineScraper("http://127.0.0.1:8000/metrics", server_port=70000)
    assert EngineScraper("https://llm.internal/metrics").server_port == 443


# --------------------------------------------------------------------------- over real HTTP


class _MetricsHandler(BaseHTTPRequestHandler):
    pages: list[bytes] = []
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's naming)
        body = self.pages.pop(0) if self.status == 200 else b"nope"
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain; version=1.0.0; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    handler = type("Handler", (_MetricsHandler,), {"pages": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


def test_scrapes_a_live_server_twice_and_reports_failures_as_scrape_errors(metrics_server):
    server, handler = metrics_server
    handler.pages = [(FIXTURES / f"vllm_metrics_{name}.txt").read_bytes() for name in ("idle", "busy")]
    scraper = EngineScraper(f"http://127.0.0.1:{server.server_port}/metrics")
    first, second = scraper.read(ts_ns=1), scraper.read(ts_ns=2)
    assert first.ttft_mean_s is None and second.ttft_mean_s is not None
    assert second.server_port == server.server_port and second.requests_waiting == 2.0

    handler.status = 503
    with pytest.raises(ScrapeError, match="HTTP 503"):
        scraper.read(ts_ns=3)


def test_unreachable_server_is_a_scrape_error():
    with ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler) as closed:
        port = closed.server_port
    with pytest.raises(ScrapeError, match=f"127.0.0.1:{port}"):
        EngineScraper(f"http://127.0.0.1:{port}/metrics", timeout_s=5).read(ts_ns=0)
