"""The reference server and load generator, over real sockets on 127.0.0.1.

Wire-format tests compare against the real vLLM captures in tests/data/fixtures;
timing tests read the server's own truth log (CLOCK_MONOTONIC ns) with
generous bounds, since other test suites share this 2-core machine.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tokenprobe.refserver import (
    EngineTiming,
    LoadConfig,
    ReferenceServer,
    ServerConfig,
    burst,
    make_self_signed_cert,
    run_load,
)

# Real captures from real inference servers (tests/data/fixtures/README.md says how each was taken).
FIXTURES = Path(__file__).resolve().parent / "data" / "fixtures"
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
TRUTH_KEYS = {
    "id",
    "peer",
    "conn_seq",
    "tls",
    "accept_ns",
    "tls_done_ns",
    "wall_offset_ns",
    "method",
    "path",
    "model",
    "stream",
    "include_usage",
    "prompt_tokens",
    "completion_tokens",
    "status",
    "outcome",
    "error",
    "request_start_ns",
    "arrival_ns",
    "headers_ns",
    "engine_arrival_ns",
    "slot_ns",
    "prefill_done_ns",
    "preemptions",
    "token_ns",
    "done_ns",
}
IO_TIMEOUT_S = 30.0


# -- helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed_cert(tmp_path_factory.mktemp("tls"))


def client_tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def make_server(
    tmp_path: Path, tls_files: tuple[Path, Path] | None = None, max_connections: int = 512, **timing: Any
) -> ReferenceServer:
    cert, key = tls_files if tls_files else (None, None)
    config = ServerConfig(
        engine=EngineTiming(**{"prefill_base_ms": 5.0, "prefill_ms_per_token": 0.0, "decode_ms": 5.0, **timing}),
        truth_log=tmp_path / "truth.jsonl",
        tls_cert=cert,
        tls_key=key,
        max_connections=max_connections,
    )
    return ReferenceServer(config)


def connect(port: int, tls: bool = False) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
    return client_tls_context().wrap_socket(sock) if tls else sock


def exchange(port: int, raw: bytes, tls: bool = False) -> bytes:
    """Write raw request bytes and read until the server closes the connection."""
    with connect(port, tls) as sock:
        sock.sendall(raw)
        received = bytearray()
        while data := sock.recv(65536):
            received += data
    return bytes(received)


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = bytearray()
    while marker not in received:
        data = sock.recv(65536)
        assert data, f"connection closed before {marker!r}"
        received += data
    return bytes(received)


def post_raw(path: str, body: bytes, *, extra_headers: str = "") -> bytes:
    """A request like the fixture captures: Content-Length body, Connection: close."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: fixture-capture/1.0\r\n"
        f"Accept: text/event-stream\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{extra_headers}Connection: close\r\n\r\n"
    ).encode() + body


def split_response(data: bytes) -> tuple[int, dict[str, str], list[bytes]]:
    """Status, headers and the chunk payloads of a chunked response read to EOF.

    Fails on any framing error: sizes must be lowercase unpadded hex and the
    body must end with exactly `0\\r\\n\\r\\n`.
    """
    head, separator, rest = data.partition(b"\r\n\r\n")
    assert separator, f"no end of headers in {data[:200]!r}"
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in header_lines)}
    status = int(status_line.split(" ")[1])
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        assert size_line == b"%x" % size, f"chunk size {size_line!r} is not lowercase unpadded hex"
        if size == 0:
            assert rest == b"\r\n", f"bytes after the last chunk: {rest[:100]!r}"
            return status, headers, chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n", "chunk data not followed by CRLF"
        rest = rest[size + 2 :]


def sse_events(chunks: list[bytes]) -> list[Any]:
    """Each chunk must be exactly one SSE event; returns the parsed data payloads."""
    events = []
    for payload in chunks:
        assert payload.startswith(b"data: ") and payload.endswith(b"\n\n"), payload[:100]
        assert payload.count(b"\n\n") == 1, f"more than one event in a chunk: {payload!r}"
        data = payload[len(b"data: ") : -2]
        events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


def shape(value: Any) -> Any:
    """Key order and value types, not values: what must match the vLLM capture."""
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def read_truth(server: ReferenceServer, count: int) -> list[dict[str, Any]]:
    """Wait until the truth log holds `count` lines (written by a background thread)."""
    path = Path(server.config.truth_log)
    deadline = time.monotonic() + IO_TIMEOUT_S
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert len(lines) == count, f"expected {count} truth lines, found {len(lines)}"
    records = [json.loads(line) for line in lines]
    for record in records:
        check_truth_record(record)
    return records


def check_truth_record(record: dict[str, Any]) -> None:
    assert set(record) == TRUTH_KEYS
    assert record["wall_offset_ns"] + record["accept_ns"] > 1_600_000_000 * 10**9  # a plausible Unix time
    if record["path"] in COMPLETION_PATHS and record["status"] == 200 and record["outcome"] == "complete":
        assert record["id"].startswith("chatcmpl-" if record["path"] == COMPLETION_PATHS[0] else "cmpl-")
        assert record["completion_tokens"] == len(record["token_ns"]) >= 1
        steps = [
            record["accept_ns"],
            record["request_start_ns"],
            record["arrival_ns"],
            record["engine_arrival_ns"],
            record["slot_ns"],
            record["prefill_done_ns"],
            *record["token_ns"],
            record["done_ns"],
        ]
        assert steps == sorted(steps), f"timestamps out of order: {steps}"
        if record["stream"]:
            # The response head goes out before queueing, as with vLLM.
            assert record["arrival_ns"] <= record["headers_ns"] <= record["slot_ns"]


def chat_body(max_tokens: int, *, stream: bool = True, usage: bool = False, content: str = "hello there") -> bytes:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def stream_ttft(port: int, body: bytes) -> tuple[str, float]:
    """Send one streamed chat request; returns its response id and client-side TTFT in seconds."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT_S)
    try:
        sent = time.monotonic()
        connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response_id, first_token = "", None
        while line := response.readline():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                response_id = event["id"]
                if first_token is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    first_token = time.monotonic()
        assert first_token is not None
        return response_id, first_token - sent
    finally:
        connection.close()


def run_concurrently(count: int, target: Any) -> list[Any]:
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def run(index: int) -> None:
        start.wait()
        results[index] = target(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(IO_TIMEOUT_S)
    assert all(result is not None for result in results)
    return results


# -- wire format ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture,path,prefix,role_chunk",
    [
        ("vllm_sse_chat", "/v1/chat/completions", "chatcmpl-", True),
        ("vllm_sse_completions", "/v1/completions", "cmpl-", False),
    ],
)
def test_stream_has_the_vllm_wire_shape(tmp_path: Path, fixture: str, path: str, prefix: str, role_chunk: bool) -> None:
    request_body = (FIXTURES / f"{fixture}.request.json").read_bytes()
    v_status, v_headers, v_chunks = split_response((FIXTURES / f"{fixture}.bin").read_bytes())
    vllm_events = sse_events(v_chunks)

    with make_server(tmp_path) as server:
        status, headers, chunks = split_response(exchange(server.port, post_raw(path, request_body)))
        [truth] = read_truth(server, 1)
    events = sse_events(chunks)

    assert status == v_status == 200
    for name in ("content-type", "transfer-encoding", "connection"):
        assert headers[name] == v_headers[name]
    assert "content-length" not in headers
    # Same event sequence, key order and value types as the real vLLM stream.
    assert [shape(e) for e in events] == [shape(e) for e in vllm_events]
    max_tokens = json.loads(request_body)["max_tokens"]
    assert len(events) == max_tokens + 2 + role_chunk  # [role] + tokens + usage + [DONE]
    if role_chunk:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    token_events = events[role_chunk:-2]
    assert all(e["choices"][0]["finish_reason"] is None for e in token_events[:-1])
    assert token_events[-1]["choices"][0]["finish_reason"] == "length"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == max_tokens
    assert usage_event["usage"]["total_tokens"] == usage_event["usage"]["prompt_tokens"] + max_tokens
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {truth["id"]} and truth["id"].startswith(prefix)
    assert {e["model"] for e in events[:-1]} == {"small"}

    assert truth["prompt_tokens"] == usage_event["usage"]["prompt_tokens"]
    assert truth["completion_tokens"] == max_tokens and truth["include_usage"] and truth["stream"]
    # The prompt is never echoed or logged.
    prompt_word = "haiku" if role_chunk else "village"
    assert prompt_word not in json.dumps(events) and prompt_word not in json.dumps(truth)


def test_per_request_metrics_and_a_stream_that_fails_inside_its_200(tmp_path: Path) -> None:
    """As vLLM with --enable-per-request-metrics: each request's own figures from the engine's timestamps,
    on the last usage chunk and in a whole body; every 2nd stream fails after its first token with vLLM's
    error event, then [DONE]."""
    config = ServerConfig(engine=EngineTiming(slots=1, prefill_base_ms=5.0, prefill_ms_per_token=0.0, decode_ms=5.0),
                          truth_log=tmp_path / "truth.jsonl", per_request_metrics=True, fail_streams_every=2)
    with ReferenceServer(config) as server:
        replies = [exchange(server.port, post_raw("/v1/chat/completions", body))
                   for body in (chat_body(4, usage=True), chat_body(4, usage=True), chat_body(4, stream=False))]
        truth = read_truth(server, 3)
    (_, _, complete), (status, _, failed) = (split_response(reply) for reply in replies[:2])
    whole = replies[2].partition(b"\r\n\r\n")[2]
    record = truth[0]
    expected = {"time_to_first_token_ms": (record["token_ns"][0] - record["slot_ns"]) / 1e6,
                "generation_time_ms": (record["token_ns"][-1] - record["token_ns"][0]) / 1e6,
                "queue_time_ms": (record["slot_ns"] - record["arrival_ns"]) / 1e6}
    metrics = sse_events(complete)[-2]["metrics"]
    assert {name: metrics[name] for name in expected} == pytest.approx(expected)
    assert metrics["time_to_first_token_ms"] >= 5.0 and metrics["generation_time_ms"] > 10.0  # prefill; 3 decode steps
    assert set(metrics) == {*expected, "mean_itl_ms", "tokens_per_second"}
    # The failed stream: a 200, its role chunk and first token, the error event, [DONE]; no usage.
    events = sse_events(failed)
    assert status == 200 and len(events) == 4 and events[-1] == "[DONE]"
    assert events[2] == {"error": {"message": "the engine failed while generating", "type": "InternalServerError",
                                   "param": None, "code": 500}}
    assert (truth[1]["outcome"], truth[1]["error"], truth[1]["completion_tokens"]) == (
        "stream_error", "InternalServerError", 1)
    assert set(json.loads(whole)["metrics"]) == set(metrics)  # a whole body's, all fields, none dropped


def test_the_server_s_own_overhead_is_time_outside_its_engine_and_grows_with_load(tmp_path: Path) -> None:
    """As vLLM's API server: time on each request before the engine sees it (handling, tokenising), at idle and
    more for every other request the server holds; on the wire it is TTFT, in the engine's `metrics` it is not
    queue, and the truth log marks where it ends (``engine_arrival_ns``)."""
    config = ServerConfig(engine=EngineTiming(slots=4, prefill_base_ms=5.0, prefill_ms_per_token=0.0, decode_ms=5.0),
                          truth_log=tmp_path / "truth.jsonl", per_request_metrics=True,
                          overhead_ms=30.0, overhead_ms_per_request=20.0)
    with ReferenceServer(config) as server:
        idle = exchange(server.port, post_raw("/v1/chat/completions", chat_body(2, usage=True)))
        together = [connect(server.port) for _ in range(3)]  # 3 requests sent at once, then read
        for sock in together:
            sock.sendall(post_raw("/v1/chat/completions", chat_body(20, usage=True)))
        for sock in together:
            with sock:
                while sock.recv(65536):
                    pass
        truth = read_truth(server, 4)
    overhead_ms = sorted((t["engine_arrival_ns"] - t["arrival_ns"]) / 1e6 for t in truth)
    # 3 requests at once: each sees the others that arrived before it (0, 1, 2 of them, as the scheduler lets in)
    assert overhead_ms[0] == pytest.approx(30.0) and overhead_ms[-1] >= 50.0
    for t in truth:  # the engine saw nothing of it: its slot came at or after the overhead, free slots at once
        assert 0 <= (t["slot_ns"] - t["engine_arrival_ns"]) / 1e6 < 15
        assert (t["token_ns"][0] - t["arrival_ns"]) / 1e6 >= (t["engine_arrival_ns"] - t["arrival_ns"]) / 1e6 + 5.0
    metrics = sse_events(split_response(idle)[2])[-2]["metrics"]
    assert metrics["queue_time_ms"] < 15  # the overhead is not the engine's queue


def test_tls_stream_and_truth(tmp_path: Path, tls_files: tuple[Path, Path]) -> None:
    with make_server(tmp_path, tls_files) as server:
        assert server.url.startswith("https://")
        raw = exchange(
            server.port, post_raw("/v1/completions", b'{"prompt": "abc", "max_tokens": 4, "stream": true}'), tls=True
        )
        [truth] = read_truth(server, 1)
    status, _, chunks = split_response(raw)
    events = sse_events(chunks)
    assert status == 200 and len(events) == 5 and events[-1] == "[DONE]"  # 4 tokens, no usage asked
    assert truth["tls"] is True
    assert truth["accept_ns"] < truth["tls_done_ns"] < truth["request_start_ns"]


def test_chunked_request_body_and_expect_continue(tmp_path: Path) -> None:
    body = chat_body(3)
    chunked = b"%x\r\n%b\r\n%x;ext=1\r\n%b\r\n0\r\nX-Trailer: yes\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    with make_server(tmp_path) as server:
        raw = exchange(server.port, head + chunked)
        [truth] = read_truth(server, 1)
    interim, _, final = raw.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue"
    status, _, chunks = split_response(final)
    assert status == 200 and len(sse_events(chunks)) == 1 + 3 + 1
    assert truth["completion_tokens"] == 3


def test_keep_alive_serves_several_requests_on_one_connection(tmp_path: Path) -> None:
    with make_server(tmp_path) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=IO_TIMEOUT_S)
        connection.request("POST", "/v1/chat/completions", body=chat_body(2, usage=True))
        stream = connection.getresponse()
        assert stream.getheader("content-type") == "text/event-stream; charset=utf-8"
        stream_text = stream.read()
        connection.request("POST", "/v1/completions", body=b'{"prompt": "x", "max_tokens": 3, "model": "m2"}')
        whole = connection.getresponse()
        whole_body = json.loads(whole.read())
        connection.request("GET", "/v1/models")
        models = json.loads(connection.getresponse().read())
        local = "%s:%d" % connection.sock.getsockname()
        connection.close()
        records = read_truth(server, 3)

    assert stream_text.endswith(b"data: [DONE]\n\n")
    assert whole.status == 200 and whole.getheader("content-type") == "application/json"
    assert whole_body["object"] == "text_completion" and whole_body["model"] == "m2"
    assert whole_body["usage"]["completion_tokens"] == 3 and whole_body["choices"][0]["finish_reason"] == "length"
    assert models["data"][0]["id"] == "ref-model"
    assert [r["conn_seq"] for r in records] == [0, 1, 2]
    assert {r["peer"] for r in records} == {local}
    assert [r["path"] for r in records] == ["/v1/chat/completions", "/v1/completions", "/v1/models"]
    assert records[1]["id"] == whole_body["id"] and records[1]["stream"] is False


# -- bad input -----------------------------------------------------------------

BAD_REQUESTS = [
    (b"this is not http\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"GET /health HTTP/1.1\r\nbad header line\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n", 413),
    (post_raw("/v1/completions", b"{not json"), 400),
    (post_raw("/v1/completions", b"[1, 2]"), 400),
    (post_raw("/v1/completions", b'{"max_tokens": 3}'), 400),
    (post_raw("/v1/completions", b'{"prompt": ["a", "b"]}'), 400),
    (post_raw("/v1/completions", b'{"prompt": "a", "max_tokens": 0}'), 400),
    (post_raw("/v1/completions", b'{"prompt": "a", "stream": "yes"}'), 400),
    (post_raw("/v1/chat/completions", b'{"messages": []}'), 400),
    (post_raw("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'), 400),
    (post_raw("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'), 400),
    (post_raw("/v1/chat/completions", b"[" * 100000 + b"]" * 100000), 400),
    (b"GET /v1/chat/completions HTTP/1.1\r\nConnection: close\r\n\r\n", 405),
    (b"GET /nowhere HTTP/1.1\r\nConnection: close\r\n\r\n", 404),
]


def test_bad_requests_get_clear_errors_and_the_server_survives(tmp_path: Path) -> None:
    with make_server(tmp_path) as server:
        for raw, expected in BAD_REQUESTS:
            response = exchange(server.port, raw)
            head, _, body = response.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 %d " % expected), (raw[:80], response[:200])
            error = json.loads(body)["error"]
            assert error["code"] == expected and error["message"]
        # A client that disappears halfway through a request harms nothing.
        with connect(server.port) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"pro')
        assert exchange(server.port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        records = read_truth(server, len(BAD_REQUESTS) + 1)
    assert [r["status"] for r in records] == [expected for _, expected in BAD_REQUESTS] + [200]
    assert all(r["error"] for r in records[:-1])


def test_connections_beyond_the_limit_get_503(tmp_path: Path) -> None:
    with make_server(tmp_path, max_connections=2) as server:
        held = [connect(server.port) for _ in range(2)]
        deadline = time.monotonic() + IO_TIMEOUT_S
        while server.open_connections < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = exchange(server.port, b"GET /health HTTP/1.1\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503 ") and b"connection: close" in refused
        for sock in held:
            sock.close()
        while server.open_connections > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exchange(server.port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200 ")


def test_client_leaving_mid_stream_frees_its_slot(tmp_path: Path) -> None:
    with make_server(tmp_path, slots=1, decode_ms=10.0) as server:
        with connect(server.port) as sock:
            sock.sendall(post_raw("/v1/chat/completions", chat_body(2000)))
            read_until(sock, b"data: ")  # streaming has begun
        # The next write fails; the slot must come back for the next request.
        _, ttft = stream_ttft(server.port, chat_body(2))
        records = read_truth(server, 2)
        snapshot = server.snapshot()
    gone, ok = records
    assert gone["outcome"] == "client_gone" and 0 < gone["completion_tokens"] < 2000
    assert ok["outcome"] == "complete" and ok["slot_ns"] >= gone["token_ns"][-1]
    assert snapshot.aborted == 1 and snapshot.completed == 1 and snapshot.running == 0
    assert snapshot.generation_tokens_total == gone["completion_tokens"] + 2


def test_stop_ends_in_flight_streams(tmp_path: Path) -> None:
    server = make_server(tmp_path, decode_ms=20.0).start()
    with connect(server.port) as sock:
        sock.sendall(post_raw("/v1/completions", b'{"prompt": "x", "max_tokens": 4000, "stream": true}'))
        read_until(sock, b"data: ")
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10.0
    record = json.loads(Path(server.config.truth_log).read_text())
    assert record["outcome"] == "server_stopped" and record["completion_tokens"] < 4000


# -- engine timing -------------------------------------------------------------


def test_one_slot_queues_requests_in_order(tmp_path: Path) -> None:
    with make_server(tmp_path, slots=1, prefill_base_ms=20.0, decode_ms=25.0) as server:
        results = run_concurrently(3, lambda _: stream_ttft(server.port, chat_body(12)))
        records = read_truth(server, 3)
        snapshot = server.snapshot()
    by_slot = sorted(records, key=lambda r: r["slot_ns"])
    for earlier, later in zip(by_slot, by_slot[1:]):
        # The slot passes on only after the earlier request's last token.
        assert later["slot_ns"] >= earlier["token_ns"][-1]
        assert later["slot_ns"] >= earlier["done_ns"] - 250_000_000
    # Requests that arrived together waited in turn, so their TTFT grows in slot order.
    ttft = dict(results)
    ordered_ttft = [ttft[r["id"]] for r in by_slot]
    assert ordered_ttft == sorted(ordered_ttft)
    queue_ms = [(r["slot_ns"] - r["arrival_ns"]) / 1e6 for r in by_slot]
    assert queue_ms[2] > queue_ms[1] > 200  # each waited for at least one whole request (~300 ms)
    assert snapshot.completed == 3 and snapshot.waiting == 0 and snapshot.generation_tokens_total == 36


def engine_gauge(port: int, name: str) -> float:
    """One series' value on the server's simulated vLLM /metrics page."""
    from tokenprobe.agent.sampling.prom_text import parse_exposition

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT_S)
    try:
        connection.request("GET", "/metrics")
        page = parse_exposition(connection.getresponse().read().decode())
    finally:
        connection.close()
    (series,) = page.series_by_name()[name]
    return series.value


def kv_usage(port: int) -> float:
    return engine_gauge(port, "vllm:kv_cache_usage_perc")


def test_a_kv_cache_sized_to_the_slots_fills_with_load(tmp_path: Path) -> None:
    """The simulated vLLM gauge the controller's matrix reads rises with the batch, before anything queues."""

    config = ServerConfig(engine=EngineTiming(slots=2, prefill_base_ms=5.0, prefill_ms_per_token=0.0, decode_ms=20.0),
                          simulated_metrics=True, kv_cache_blocks=2)
    with ReferenceServer(config) as server:
        idle = kv_usage(server.port)
        streams = threading.Thread(target=run_concurrently, args=(2, lambda _: stream_ttft(server.port, chat_body(60))))
        streams.start()
        # Each running stream holds its prompt and what it generated so far: the cache fills as they decode.
        readings = []
        while streams.is_alive():
            readings.append((server.snapshot().running, kv_usage(server.port)))
            time.sleep(0.05)
        streams.join()
    assert idle == 0.0
    assert max(usage for running, usage in readings if running == 2) == 1.0


def test_a_full_kv_cache_preempts_the_request_admitted_last_which_recomputes(tmp_path: Path) -> None:
    """vLLM's recompute preemption: two streams that together outgrow the cache both finish, the one
    admitted last after giving up its blocks, requeueing and recomputing its prompt and tokens so far."""
    config = ServerConfig(engine=EngineTiming(slots=2, prefill_base_ms=5.0, prefill_ms_per_token=1.0, decode_ms=10.0,
                                              kv_cache_blocks=6),
                          truth_log=tmp_path / "truth.jsonl", simulated_metrics=True)
    with ReferenceServer(config) as server:
        streams = threading.Thread(target=run_concurrently, args=(2, lambda _: stream_ttft(server.port, chat_body(60))))
        streams.start()
        usage = []
        while streams.is_alive():
            usage.append(kv_usage(server.port))  # the page reports the blocks in use, as they are
            time.sleep(0.02)
        streams.join()
        completions = [r for r in read_truth(server, 2 + len(usage)) if r["path"] in COMPLETION_PATHS]
        first, last = sorted(completions, key=lambda r: r["slot_ns"])
        snapshot = server.snapshot()
        preemptions = engine_gauge(server.port, "vllm:num_preemptions_total")
    assert first["preemptions"] == 0 and last["preemptions"] == 1
    assert first["completion_tokens"] == last["completion_tokens"] == 60
    # Preempted when the cache filled, it waited for the first to finish, then recomputed every token it held.
    gaps = [(b - a, a) for a, b in zip(last["token_ns"], last["token_ns"][1:])]
    stall_ns, stalled_at = max(gaps)
    resumed_at = stalled_at + stall_ns
    held = last["prompt_tokens"] + last["token_ns"].index(resumed_at)
    assert resumed_at >= first["token_ns"][-1] + (5.0 + held * 1.0) * 1e6
    assert stalled_at < first["token_ns"][-1]
    assert snapshot.preemptions_total == 1 and snapshot.kv_blocks_used == 0 and snapshot.kv_blocks_total == 6
    assert preemptions == 1.0 and max(usage) == 1.0
    assert all(round(u * 6, 9).is_integer() for u in usage), usage  # whole blocks of the 6, never the coarse model


def test_a_bounded_engine_cache_is_not_also_given_a_gauge_size() -> None:
    with pytest.raises(ValueError, match="reported as it is"):
        ServerConfig(engine=EngineTiming(kv_cache_blocks=6), kv_cache_blocks=6)


def test_a_request_the_whole_kv_cache_cannot_hold_is_refused(tmp_path: Path) -> None:
    with make_server(tmp_path, kv_cache_blocks=4) as server:
        head, _, body = exchange(server.port, post_raw("/v1/chat/completions", chat_body(64))).partition(b"\r\n\r\n")
        _, ttft = stream_ttft(server.port, chat_body(8))  # one that fits is served
    assert head.startswith(b"HTTP/1.1 400 ")
    assert json.loads(body)["error"]["message"].startswith("this model's maximum context length is 64 tokens")
    assert ttft > 0


def test_prefill_time_grows_with_prompt_size(tmp_path: Path) -> None:
    with make_server(tmp_path, slots=4, prefill_base_ms=10.0, prefill_ms_per_token=0.5) as server:
        for content in ("x" * 40, "x" * 2000):
            stream_ttft(server.port, chat_body(1, content=content))
        small, large = read_truth(server, 2)
    for record in (small, large):
        expected_ms = 10.0 + 0.5 * record["prompt_tokens"]
        prefill_ms = (record["prefill_done_ns"] - record["slot_ns"]) / 1e6
        assert expected_ms - 0.5 <= prefill_ms <= expected_ms + 250
    assert large["prompt_tokens"] == small["prompt_tokens"] + (2000 - 40) // 4
    assert large["prefill_done_ns"] - large["slot_ns"] > small["prefill_done_ns"] - small["slot_ns"] + 200e6


def test_decode_interval_is_accurate_on_average(tmp_path: Path) -> None:
    with make_server(tmp_path, decode_ms=25.0) as server:
        stream_ttft(server.port, chat_body(21))
        [record] = read_truth(server, 1)
        server.set_slowdown(2.0)
        stream_ttft(server.port, chat_body(11))
        _, slowed = read_truth(server, 2)
    for r, interval_ns in ((record, 25_000_000), (slowed, 50_000_000)):
        tokens = r["token_ns"]
        # Prefill yields token 1; the absolute schedule never runs a token early ...
        assert all(t >= r["prefill_done_ns"] + k * interval_ns for k, t in enumerate(tokens))
        # ... and late wake-ups do not accumulate into drift.
        mean_gap_ns = (tokens[-1] - r["prefill_done_ns"]) / (len(tokens) - 1)
        assert mean_gap_ns <= 1.6 * interval_ns


# -- load generator ------------------------------------------------------------


def test_open_loop_load_completes_with_poisson_arrivals(tmp_path: Path) -> None:
    rate = 40.0
    with make_server(tmp_path, slots=8, decode_ms=5.0) as server:
        config = LoadConfig(
            port=server.port,
            rate=rate,
            requests=60,
            duration_s=30.0,
            prompt_tokens=(4, 64),
            max_tokens=(2, 6),
            stream_fraction=0.8,
            seed=7,
            max_connections=16,
        )
        result = run_load(config)
        records = read_truth(server, 60)

    assert len(result.records) == 60 and result.errors == []
    assert all(r.status == 200 for r in result.records)
    truth = {r["id"]: r for r in records}
    assert {r.response_id for r in result.records} == set(truth)
    for r in result.records:
        server_side = truth[r.response_id]
        assert server_side["peer"] == r.local_addr and server_side["stream"] == r.stream
        if r.stream:
            assert r.token_events == server_side["completion_tokens"] == r.max_tokens
        if r.include_usage:
            assert r.completion_tokens == r.max_tokens and r.prompt_tokens == server_side["prompt_tokens"]
    assert {r.path for r in result.records} == set(COMPLETION_PATHS)
    assert any(r.include_usage for r in result.records) and not all(r.include_usage for r in result.records)
    assert any(r.reused_connection for r in result.records)  # the keep-alive pool works

    scheduled = sorted(r.scheduled_ns for r in result.records)
    mean_gap_s = (scheduled[-1] - scheduled[0]) / (len(scheduled) - 1) / 1e9
    assert 0.6 / rate < mean_gap_s < 1.5 / rate
    summary = result.summary()
    assert summary.requests == 60 and summary.errors == 0
    assert 0.5 * rate < summary.achieved_rate < 2.0 * rate
    assert summary.ttft_p50_ms is not None and 0 < summary.ttft_p50_ms <= summary.ttft_p99_ms


def test_open_loop_rate_ramps_linearly(tmp_path: Path) -> None:
    with make_server(tmp_path, slots=16, decode_ms=1.0) as server:
        result = run_load(LoadConfig(port=server.port, rate=5.0, ramp_to_rate=60.0, duration_s=3.0,
                                     prompt_tokens=(4, 8), max_tokens=(1, 2), seed=3))
    offsets = [(r.scheduled_ns - result.started_ns) / 1e9 for r in result.records]
    thirds = [sum(1 for t in offsets if k <= t < k + 1) for k in range(3)]
    # Expected about 14, 32 and 51 arrivals: rates 5 -> 23, 23 -> 42, 42 -> 60 requests/s.
    assert thirds[0] < thirds[1] < thirds[2] and thirds[2] > 2 * thirds[0]
    assert all(r.status == 200 for r in result.records)


def test_retrying_clients_resend_at_once_on_rejection(tmp_path: Path) -> None:
    """Clients without backoff: every 503 comes straight back as the same request, until retries run out."""
    with make_server(tmp_path, max_connections=1) as server, connect(server.port):
        time.sleep(0.2)  # the held connection is accepted, so every load connection is over the limit
        result = run_load(LoadConfig(port=server.port, rate=20.0, requests=3, retries=2, seed=5))
    by_request: dict[int, list] = {}
    for record in result.records:
        by_request.setdefault(record.index, []).append(record)
    assert sorted(by_request) == [0, 1, 2]
    for attempts in by_request.values():
        attempts.sort(key=lambda r: r.attempt)
        assert [(r.attempt, r.status) for r in attempts] == [(0, 503), (1, 503), (2, 503)]
        for earlier, retry in zip(attempts, attempts[1:]):
            assert retry.send_ns - earlier.end_ns < 100_000_000  # no backoff


def test_closed_loop_burst_over_tls_reuses_connections(tmp_path: Path, tls_files: tuple[Path, Path]) -> None:
    with make_server(tmp_path, tls_files) as server:
        config = LoadConfig(port=server.port, tls=True, requests=6, max_tokens=(2, 4), seed=3)
        result = burst(config, n=6, concurrency=2, per_connection=3)
        records = read_truth(server, 6)
    assert len(result.records) == 6 and result.errors == []
    by_peer: dict[str, list[int]] = {}
    for record in records:
        assert record["tls"] is True
        by_peer.setdefault(record["peer"], []).append(record["conn_seq"])
    assert sorted(by_peer.values()) == [[0, 1, 2], [0, 1, 2]]
    assert [r.reused_connection for r in result.records].count(False) == 2


def test_command_line_serve_and_load(tmp_path: Path) -> None:
    truth_path, report_path = tmp_path / "truth.jsonl", tmp_path / "load.json"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenprobe.refserver",
            "serve",
            "--port",
            "0",
            "--decode-ms",
            "5",
            "--truth-log",
            str(truth_path),
            "--log-level",
            "WARNING",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = serve.stderr.readline()
        match = re.search(r"serving on http://127\.0\.0\.1:(\d+)", banner)
        assert match, banner
        load = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenprobe.refserver",
                "load",
                "--port",
                match.group(1),
                "--closed-loop",
                "--requests",
                "4",
                "--concurrency",
                "2",
                "--max-tokens",
                "2",
                "3",
                "--json",
                str(report_path),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert load.returncode == 0, load.stderr
        assert "4 requests, 0 errors" in load.stdout
    finally:
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=30) == 0
        serve.stderr.close()
    report = json.loads(report_path.read_text())
    assert report["summary"]["requests"] == 4 and len(report["requests"]) == 4
    assert len(truth_path.read_text().splitlines()) == 4
