"""The /metrics readers against hostile input: the Prometheus text parser, the dcgm-exporter reader and the
engine reader, fuzzed with hypothesis, plus the bounds that keep their memory flat on garbage.

The property for every reader: any bytes give either a parsed page whose readings can be stored (they fit the
gpu_samples and engine_samples columns), or a ScrapeError that says why; no other exception, ever.
"""

from __future__ import annotations

import os
import random
import socketserver
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenprobe.agent.sampling.dcgm import readings_from_exposition
from tokenprobe.agent.sampling.engine_metrics import (
    ENGINES,
    histogram_totals,
    reading_from_exposition,
)
from tokenprobe.agent.sampling.prom_text import (
    MAX_PAGE_BYTES,
    MAX_PROBLEMS,
    MAX_SERIES,
    ScrapeError,
    parse_exposition,
    parse_page,
    scrape,
)
from tokenprobe.agent.sampling.samplers import engine_samples_arrow, gpu_samples_arrow

DATA = Path(__file__).resolve().parent / "data"
# Real captures: vLLM and llama.cpp (tests/data/fixtures/README.md), dcgm-exporter and SGLang/TGI pages.
REAL_PAGES = {path.name: path.read_bytes()
              for path in [*sorted((DATA / "fixtures").glob("*_metrics_*.txt")), *sorted(DATA.glob("*.txt"))]}
ENGINE_KINDS = [None, *(spec.kind for spec in ENGINES)]  # None: detected from the page
MiB = 1024 * 1024
GARBAGE_BYTES = 4 * MiB
PEAK_BOUND = 64 * MiB  # what reading one 4 MiB garbage page may allocate at its peak, all three readers together


def read_everything(body: bytes) -> str:
    """Run every reader on ``body`` as the samplers do; returns what happened (for the fuzz statistics)."""
    try:
        exposition = parse_page(body)
    except ScrapeError as error:
        assert str(error)
        return "refused"
    assert len(exposition.problems) <= MAX_PROBLEMS
    assert exposition.problems_omitted == 0 or len(exposition.problems) == MAX_PROBLEMS
    dcgm = readings_from_exposition(exposition, 1)
    gpu_samples_arrow(dcgm.readings, "node-a")  # every reading fits its table
    for engine in ENGINE_KINDS:
        totals = histogram_totals(exposition, engine or "vllm")
        halved = {name: type(total)(total.sum / 2, total.count / 2) for name, total in totals.items()}
        reading, _ = reading_from_exposition(exposition, 2, "http://127.0.0.1:8000/metrics", 8000, engine, halved)
        engine_samples_arrow([reading], "node-a")
    return "parsed"


# --------------------------------------------------------------------------- strategies

METRIC_NAMES = ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_SM_CLOCK",
                "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_XID_ERRORS", "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_sum",
                "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_bucket",
                "sglang:token_usage", "tgi_queue_size", "tgi_request_duration_sum", "tgi_request_duration_count",
                "llamacpp:requests_processing", "up", "x_total", "x_created", "build_info"]
LABEL_NAMES = ["UUID", "uuid", "gpu", "GPU_I_ID", "GPU_I_PROFILE", "modelName", "pod", "namespace", "container",
               "model_name", "engine", "le", "quantile", "simulated", "err_code", "DCGM_FI_DRIVER_VERSION"]
# Values that have broken readers before: out of every column's range, not finite, not numbers at all.
TOKENS = ["0", "1", "-5", "4.0", "1.796e+09", "1e308", "1e400", "-1e400", "NaN", "+Inf", "-Inf", "inf", "1_0",
          "0x10", "²", "١٢", "65536", "4294967296", "18446744073709551616", "9" * 5000, "true", "GPU-1", ""]
label_values = st.one_of(st.sampled_from(TOKENS), st.text(max_size=12))


def sample_line(name: str, labels: dict[str, str], value: str, timestamp: str = "") -> str:
    """``name{labels} value timestamp``, label values escaped as the format says."""
    escaped = {key: text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               for key, text in labels.items()}
    label_text = ",".join(f'{key}="{text}"' for key, text in escaped.items())
    return f"{name}{{{label_text}}} {value}{timestamp}"


@st.composite
def exposition_lines(draw) -> str:
    """One line near the grammar: a sample, a HELP/TYPE line, or one of those with a piece broken."""
    kind = draw(st.sampled_from(["sample", "sample", "sample", "help", "type", "junk"]))
    name = draw(st.one_of(st.sampled_from(METRIC_NAMES), st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}",
                                                                       fullmatch=True)))
    if kind == "help":
        return f"# HELP {name} {draw(st.text(max_size=20))}"
    if kind == "type":
        return f"# TYPE {name} {draw(st.sampled_from(['counter', 'gauge', 'histogram', 'summary', 'x', '']))}"
    if kind == "junk":
        return draw(st.text(max_size=40))
    labels = draw(st.dictionaries(st.sampled_from(LABEL_NAMES), label_values, max_size=5))
    value = draw(st.one_of(st.sampled_from(TOKENS), st.floats().map(repr)))
    timestamp = draw(st.sampled_from(["", " 1700000000000", " -1", " 1.5", " x"]))
    line = sample_line(name, labels, value, timestamp)
    cut = draw(st.integers(0, len(line)))
    return line if draw(st.booleans()) else line[:cut] + draw(st.text(max_size=3)) + line[cut:]


pages = st.lists(exposition_lines(), max_size=40).map(lambda lines: "\n".join(lines).encode("utf-8", "replace"))


@st.composite
def mutated_real_pages(draw) -> bytes:
    """A real capture with bytes flipped, inserted or cut out."""
    page = bytearray(REAL_PAGES[draw(st.sampled_from(sorted(REAL_PAGES)))])
    for _ in range(draw(st.integers(1, 20))):
        position = draw(st.integers(0, len(page)))
        edit = draw(st.sampled_from(["flip", "insert", "delete"]))
        if edit == "flip" and position < len(page):
            page[position] = draw(st.integers(0, 255))
        elif edit == "insert":
            page[position:position] = draw(st.binary(min_size=1, max_size=8))
        else:
            del page[position:position + draw(st.integers(1, 64))]
    return bytes(page)


# --------------------------------------------------------------------------- fuzzing


@pytest.mark.parametrize("name", sorted(REAL_PAGES))
def test_every_real_page_is_read_without_problems(name):
    assert read_everything(REAL_PAGES[name]) == "parsed"
    assert parse_page(REAL_PAGES[name]).problems == []


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_are_read_or_refused_clearly(body):
    read_everything(body)


@settings(max_examples=600, deadline=None)
@given(pages)
def test_pages_near_the_grammar_are_read_or_refused_clearly(body):
    read_everything(body)


@settings(max_examples=150, deadline=None)
@given(mutated_real_pages())
def test_damaged_real_pages_are_read_or_refused_clearly(body):
    read_everything(body)


@st.composite
def valid_samples(draw) -> list[tuple[str, dict[str, str], float, int | None]]:
    name = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
    labels = st.dictionaries(st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True), st.text(max_size=20),
                             max_size=4)
    timestamp = st.one_of(st.none(), st.integers(-(2**62), 2**62))
    return draw(st.lists(st.tuples(name, labels, st.floats(allow_nan=False), timestamp), max_size=20))


def render(value: float) -> str:
    return {float("inf"): "+Inf", float("-inf"): "-Inf"}.get(value, repr(value))


@settings(max_examples=300, deadline=None)
@given(valid_samples())
def test_every_valid_sample_reads_back_exactly(samples):
    """The fuzzing above cannot pass by refusing everything: what is well formed must come back unchanged."""
    lines = [sample_line(name, labels, render(value), "" if timestamp is None else f" {timestamp}")
             for name, labels, value, timestamp in samples]
    exposition = parse_page("\n".join(lines).encode())
    assert exposition.problems == []
    read = [(sample.name, sample.labels, sample.value, sample.timestamp_ms) for sample in exposition.samples]
    assert sorted(read, key=repr) == sorted(samples, key=repr)


class _RawServer(socketserver.ThreadingTCPServer):
    """Answers every request with ``response``, byte for byte, then closes: no HTTP library in between."""

    daemon_threads = True
    allow_reuse_address = True
    response = b""


class _RawHandler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.settimeout(5)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = self.request.recv(4096)
            if not chunk:
                return
            received += chunk
        self.request.sendall(self.server.response)


@pytest.fixture(scope="module")
def raw_server():
    server = _RawServer(("127.0.0.1", 0), _RawHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


http_responses = st.one_of(
    st.binary(max_size=512),
    st.tuples(st.sampled_from(["HTTP/1.1 200 OK", "HTTP/1.1 500 Oops", "HTTP/1.0 200", "HTTP/9 x", "200 OK"]),
              st.lists(st.sampled_from(["Content-Length: 10", "Content-Length: -1", "Content-Length: x",
                                        "Transfer-Encoding: chunked", "Content-Type: text/plain; charset=zlib",
                                        "Content-Type: text/plain; charset=idna", "X: " + "y" * 70000]), max_size=3),
              st.one_of(pages, st.binary(max_size=64)))
    .map(lambda parts: (parts[0] + "\r\n" + "".join(h + "\r\n" for h in parts[1]) + "\r\n").encode() + parts[2]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(http_responses)
def test_any_http_answer_is_a_page_or_a_scrape_error(raw_server, response):
    raw_server.response = response
    try:
        scrape(f"http://127.0.0.1:{raw_server.server_address[1]}/metrics", timeout_s=5)
    except ScrapeError as error:
        assert f"127.0.0.1:{raw_server.server_address[1]}" in str(error)


# --------------------------------------------------------------------------- bounds


def peak_allocated(read: Callable[[], object]) -> tuple[object, int]:
    """What ``read`` returns, and the most memory it held allocated at once (bytes)."""
    tracemalloc.start()
    try:
        result = read()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_bad_lines_are_counted_but_only_the_first_are_kept():
    lines = GARBAGE_BYTES // 2  # 4 MiB of "x\n": the page that once made two million problems (429 MiB)
    exposition, peak = peak_allocated(lambda: parse_page(b"x\n" * lines))
    assert len(exposition.problems) == MAX_PROBLEMS
    assert exposition.problems_omitted == lines - MAX_PROBLEMS
    assert [problem.line_number for problem in exposition.problems] == list(range(1, MAX_PROBLEMS + 1))
    print(f"\n{lines} bad lines (4 MiB): {MAX_PROBLEMS} kept, {exposition.problems_omitted} counted, "
          f"peak {peak / MiB:.1f} MiB allocated")
    assert peak < PEAK_BOUND


def test_both_readers_pass_on_the_count_of_lines_not_listed():
    exposition = parse_exposition('DCGM_FI_DEV_GPU_UTIL{UUID="GPU-1"} 5\n' + "garbage\n" * (MAX_PROBLEMS + 7))
    problems = readings_from_exposition(exposition, 1).problems
    assert [problem.message for problem in problems][-1] == "7 more dcgm-exporter lines skipped"
    assert len(problems) == MAX_PROBLEMS + 1
    reading, _ = reading_from_exposition(exposition, 1, "http://127.0.0.1:8000/metrics", 8000)
    assert (len(reading.problems), reading.problems_omitted) == (MAX_PROBLEMS, 7)


def test_a_problem_quotes_only_the_start_of_a_huge_line():
    (problem,) = parse_exposition("x 1 " + "2 " * MiB).problems
    assert len(problem.line) <= 60 and len(problem.reason) < 200, problem
    assert "unexpected text after its value" in problem.reason


def test_a_page_over_the_size_limit_is_refused_clearly(raw_server):
    at_limit = b"#" * MAX_PAGE_BYTES
    assert parse_page(at_limit).samples == []
    with pytest.raises(ScrapeError, match=f"over {MAX_PAGE_BYTES} bytes"):
        parse_page(at_limit + b"\n")
    with pytest.raises(ScrapeError, match=f"over the {MAX_PAGE_BYTES}"):
        parse_exposition("#" * (MAX_PAGE_BYTES + 1))
    raw_server.response = b"HTTP/1.1 200 OK\r\n\r\n" + at_limit + b"\n"
    url = f"http://127.0.0.1:{raw_server.server_address[1]}/metrics"
    with pytest.raises(ScrapeError, match=f"^{url}: metrics page is over {MAX_PAGE_BYTES} bytes"):
        scrape(url, timeout_s=10)


@pytest.mark.parametrize("line, what", [("a 1", "samples"), ("# TYPE a gauge", "families")])
def test_a_page_with_too_many_series_is_refused_clearly(line, what):
    numbered = [line.replace("a", f"a{i}", 1) for i in range(MAX_SERIES + 1)]
    parse_exposition("\n".join(numbered[:MAX_SERIES]))  # the limit itself is fine
    with pytest.raises(ScrapeError, match=f"more than {MAX_SERIES} {what}"):
        parse_exposition("\n".join(numbered))


def garbage_pages() -> dict[str, bytes]:
    """4 MiB pages of the kinds of garbage a broken or hostile server sends."""
    rng = random.Random(14)
    vllm = REAL_PAGES["vllm_metrics_busy.txt"]
    wide_line = "wide{" + ",".join(f'label_{i}="v"' for i in range(1000)) + "} 1\n"
    shapes = {
        "random bytes": os.urandom(GARBAGE_BYTES),
        "lines of printable junk": "".join(rng.choice("abc{}=\", #\n") for _ in range(GARBAGE_BYTES)).encode(),
        "one 4 MiB line": b"x 1 " + b"2" * (GARBAGE_BYTES - 4),
        "distinct tiny samples (refused past MAX_SERIES)": "".join(f"s{i} 1\n" for i in range(GARBAGE_BYTES // 8))
        .encode(),
        "distinct TYPE lines (refused past MAX_SERIES)": "".join(f"# TYPE t{i} gauge\n"
                                                                 for i in range(GARBAGE_BYTES // 18)).encode(),
        "samples with 1000 labels each": wide_line.encode() * (GARBAGE_BYTES // len(wide_line)),
        "a real vLLM page, repeated": vllm * (GARBAGE_BYTES // len(vllm)),
    }
    return {name: page[:GARBAGE_BYTES] for name, page in shapes.items()}


@pytest.mark.parametrize("shape", list(garbage_pages()))
def test_reading_a_4_mib_garbage_page_stays_within_its_memory_bound(shape):
    body = garbage_pages()[shape]
    outcome, peak = peak_allocated(lambda: read_everything(body))
    print(f"\n{shape}: {outcome}, peak {peak / MiB:.1f} MiB allocated (bound {PEAK_BOUND // MiB} MiB)")
    assert peak < PEAK_BOUND
