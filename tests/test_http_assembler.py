"""Tests for the HTTP/1.1 + SSE assembler (agent/capture/).

Byte streams are built by hand and from two real vLLM captures
(tests/data/fixtures/vllm_sse_*: real vLLM captures, see tests/data/fixtures/README.md,
with the request headers given in the fixtures' README).

Segmentation oracle: feeding a capture one byte per segment, each stamped with
T0 + its offset, gives every timestamp as "the offset of the byte that ended
it". Any other segmentation, with each segment stamped T0 + its first offset,
must give the same exchange with each timestamp moved to the start of the
segment holding that byte.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenprobe.agent.capture import exchange as exchange_module
from tokenprobe.agent.capture.exchange import Exchange
from tokenprobe.agent.capture.wire.assembler import (
    CLOSE_REASONS,
    HttpConnectionAssembler,
)
from tokenprobe.agent.capture.wire.http1 import proven_chunk_boundary
from tokenprobe.contract import tenant

DATA = Path(__file__).parent / "data"
KEY = b"assembler-test-key"
REQ_T0 = 1_000
RESP_T0 = 1_000_000
OUTCOME_BY_REASON = {"server_closed": "truncated", "client_closed": "client_closed",
                     "reset": "reset", "agent_stop": "truncated", "idle_timeout": "truncated"}


def expected_fp(body: bytes, key: bytes = KEY) -> int:
    """The documented body fingerprint, computed independently of the assembler."""
    if not body:
        return 0
    material = len(body).to_bytes(8, "little") + body[:4096] + body[-1024:]
    return int.from_bytes(hashlib.blake2b(material, key=key, digest_size=8).digest(), "little")


@dataclasses.dataclass(frozen=True)
class Capture:
    name: str
    path: str
    body: bytes
    request: bytes
    response: bytes
    response_id: str
    prompt_tokens: int
    sse_events: int


def load_capture(name: str, path: str, response_id: str, prompt_tokens: int,
                 sse_events: int) -> Capture:
    body = (DATA / "fixtures" / f"vllm_sse_{name}.request.json").read_bytes()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:8300\r\nUser-Agent: fixture-capture/1.0\r\n"
            "Accept: text/event-stream\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    response = (DATA / "fixtures" / f"vllm_sse_{name}.bin").read_bytes()
    return Capture(name, path, body, head + body, response, response_id, prompt_tokens, sse_events)


CHAT = load_capture("chat", "/v1/chat/completions", "chatcmpl-90137e70dd9c3d12", 37, 15)
COMPLETIONS = load_capture("completions", "/v1/completions", "cmpl-bd5f91a01d184133", 18, 14)
CAPTURES = pytest.mark.parametrize("cap", [CHAT, COMPLETIONS], ids=lambda c: c.name)


class Conn:
    """An assembler plus everything it reported."""

    def __init__(self, **kwargs) -> None:
        self.started: list[Exchange] = []
        self.finished: list[Exchange] = []
        self.asm = HttpConnectionAssembler(fingerprint_key=KEY, on_request_start=self.started.append,
                                           **kwargs)

    def request(self, ts, head, total_len=None, tail=b"") -> list[Exchange]:
        total = len(head) + len(tail) if total_len is None else total_len
        return self._keep(self.asm.feed_request_bytes(ts, head, total, tail))

    def response(self, ts, head, total_len=None, tail=b"") -> list[Exchange]:
        total = len(head) + len(tail) if total_len is None else total_len
        return self._keep(self.asm.feed_response_bytes(ts, head, total, tail))

    def close(self, ts, reason) -> list[Exchange]:
        return self._keep(self.asm.close(ts, reason))

    def _keep(self, exchanges: list[Exchange]) -> list[Exchange]:
        self.finished.extend(exchanges)
        return exchanges

    def only(self) -> Exchange:
        assert len(self.finished) == 1, self.finished
        return self.finished[0]


def pieces(data: bytes, cuts) -> list[tuple[int, bytes]]:
    """data cut at `cuts`: (first offset, bytes) of each piece."""
    bounds = [0, *sorted(set(cuts)), len(data)]
    return [(start, data[start:stop]) for start, stop in zip(bounds, bounds[1:])]


def feed_split(conn: Conn, side: str, t0: int, data: bytes, cuts) -> None:
    """Feed data as segments cut at `cuts`, each stamped t0 + its first offset."""
    feed = conn.request if side == "request" else conn.response
    for start, piece in pieces(data, cuts):
        feed(t0 + start, piece)


def run_capture(cap: Capture, req_cuts=(), resp_cuts=()) -> Exchange:
    conn = Conn()
    feed_split(conn, "request", REQ_T0, cap.request, req_cuts)
    feed_split(conn, "response", RESP_T0, cap.response, resp_cuts)
    assert conn.close(RESP_T0 + len(cap.response), "server_closed") == []
    return conn.only()


@functools.cache
def byte_by_byte(cap: Capture) -> Exchange:
    return run_capture(cap, range(1, len(cap.request)), range(1, len(cap.response)))


def as_if_split(ex: Exchange, req_cuts=(), resp_cuts=()) -> Exchange:
    """The byte-by-byte result moved onto another segmentation (see module doc)."""
    req_starts = [0, *sorted(set(req_cuts))]
    resp_starts = [0, *sorted(set(resp_cuts))]

    def req_ts(ts):
        return REQ_T0 + req_starts[bisect.bisect_right(req_starts, ts - REQ_T0) - 1]

    def resp_ts(ts):
        return RESP_T0 + resp_starts[bisect.bisect_right(resp_starts, ts - RESP_T0) - 1]

    return dataclasses.replace(
        ex, req_start_ns=req_ts(ex.req_start_ns), req_end_ns=req_ts(ex.req_end_ns),
        resp_start_ns=resp_ts(ex.resp_start_ns), resp_end_ns=resp_ts(ex.resp_end_ns),
        token_event_ns=[resp_ts(ts) for ts in ex.token_event_ns])


def http_request(method: str, target: str, body: bytes = b"", headers: tuple = ()) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1:8000", *headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def http_response(status: int, body: bytes = b"", headers: tuple = ("Content-Type: application/json",),
                  *, length: bool = True, version: str = "1.1") -> bytes:
    lines = [f"HTTP/{version} {status} Whatever", *headers]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunked(body: bytes, sizes=(64,), extension: bytes = b"", trailers: bytes = b"") -> bytes:
    """body in chunked transfer coding, chunk sizes cycling through `sizes`."""
    out, pos, i = [], 0, 0
    while pos < len(body):
        size = max(1, sizes[i % len(sizes)])
        piece = body[pos:pos + size]
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece))
        pos += size
        i += 1
    return b"".join(out) + b"0\r\n" + trailers + b"\r\n"


def sse_response(events: bytes, sizes=(64,)) -> bytes:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    return head + chunked(events, sizes)


def chat_body(model: str = "small", stream: bool = True, prompt: str = "hi", model_last=False) -> bytes:
    messages = [{"role": "user", "content": prompt}]
    body = ({"messages": messages, "model": model, "stream": stream} if model_last
            else {"model": model, "messages": messages, "stream": stream})
    return json.dumps(body).encode()


def json_completion(content: str = "hello", prompt_tokens: int = 5, completion_tokens: int = 7) -> bytes:
    return json.dumps({
        "id": "chatcmpl-json1", "object": "chat.completion", "model": "small",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }).encode()


def sse_event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token_event(text: str) -> bytes:
    return sse_event({"id": "chatcmpl-x", "model": "small", "choices": [{"delta": {"content": text}}]})


# -- the real vLLM captures ------------------------------------------------------------


@CAPTURES
def test_capture_in_one_segment_each(cap):
    conn = Conn()
    assert conn.request(REQ_T0, cap.request) == []
    assert len(conn.started) == 1
    ex = conn.response(RESP_T0, cap.response)[0]
    assert ex is conn.started[0]
    assert (ex.seq, ex.method, ex.path, ex.status) == (0, "POST", cap.path, 200)
    assert (ex.req_model, ex.req_stream, ex.resp_model) == ("small", True, "small")
    assert ex.body_fp == expected_fp(cap.body) != 0
    assert ex.streamed and ex.done_seen
    assert len(ex.token_event_ns) == 12
    assert ex.sse_events == cap.sse_events
    assert (ex.prompt_tokens, ex.completion_tokens) == (cap.prompt_tokens, 12)
    assert ex.response_id == cap.response_id
    assert (ex.req_bytes, ex.resp_bytes) == (len(cap.request), len(cap.response))
    assert (ex.req_start_ns, ex.req_end_ns, ex.resp_start_ns, ex.resp_end_ns) == (
        REQ_T0, REQ_T0, RESP_T0, RESP_T0)
    assert (ex.outcome, ex.error, conn.asm.error) == ("complete", None, None)
    assert conn.close(RESP_T0 + 1, "server_closed") == []


@CAPTURES
def test_capture_byte_by_byte(cap):
    ex = byte_by_byte(cap)
    assert as_if_split(ex) == run_capture(cap)  # the same exchange as from one segment per side
    assert (ex.req_start_ns, ex.req_end_ns) == (REQ_T0, REQ_T0 + len(cap.request) - 1)
    assert (ex.resp_start_ns, ex.resp_end_ns) == (RESP_T0, RESP_T0 + len(cap.response) - 1)
    # Each token event is stamped with the byte that ends it: the LF of its blank line.
    for ts in ex.token_event_ns:
        offset = ts - RESP_T0
        assert cap.response[offset - 1:offset + 1] == b"\n\n"
    assert len(set(ex.token_event_ns)) == 12


@CAPTURES
def test_capture_split_at_every_response_offset(cap):
    base = byte_by_byte(cap)
    for cut in range(1, len(cap.response)):
        assert run_capture(cap, resp_cuts=[cut]) == as_if_split(base, resp_cuts=[cut]), cut


@CAPTURES
def test_capture_split_at_every_request_offset(cap):
    base = byte_by_byte(cap)
    for cut in range(1, len(cap.request)):
        assert run_capture(cap, req_cuts=[cut]) == as_if_split(base, req_cuts=[cut]), cut


@CAPTURES
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_capture_random_multi_splits(cap, data):
    req_cuts = data.draw(st.lists(st.integers(1, len(cap.request) - 1), max_size=12))
    resp_cuts = data.draw(st.lists(st.integers(1, len(cap.response) - 1), max_size=60))
    assert run_capture(cap, req_cuts, resp_cuts) == as_if_split(byte_by_byte(cap), req_cuts, resp_cuts)


@pytest.mark.parametrize("reason", CLOSE_REASONS)
def test_stream_cut_by_close(reason):
    base = byte_by_byte(CHAT)
    cut = CHAT.response.index(b"data:", base.token_event_ns[5] - RESP_T0) + 20  # inside the 7th token
    conn = Conn()
    conn.request(REQ_T0, CHAT.request)
    assert conn.response(RESP_T0, CHAT.response[:cut]) == []
    ex = conn.close(RESP_T0 + cut, reason)[0]
    assert ex.outcome == OUTCOME_BY_REASON[reason]
    assert (ex.status, ex.resp_end_ns, ex.done_seen) == (200, None, False)
    assert ex.token_event_ns == [RESP_T0] * 6
    assert ex.sse_events == 7  # the role chunk and six tokens
    assert ex.req_end_ns == REQ_T0 and ex.error is None


# -- framing ----------------------------------------------------------------------------


def test_keep_alive_several_exchanges():
    conn = Conn()
    chat = http_request("POST", "/v1/chat/completions", chat_body(),
                        ("Content-Type: application/json",))
    conn.request(10, chat)
    [first] = conn.response(20, CHAT.response)
    plain = http_request("POST", "/v1/chat/completions", chat_body(stream=False))
    conn.request(30, plain)
    [second] = conn.response(40, http_response(200, json_completion(prompt_tokens=9)))
    conn.request(50, http_request("GET", "/metrics?token=secret&x=1"))
    [third] = conn.response(60, http_response(200, b"# HELP x\nx 1\n", ("Content-Type: text/plain",)))
    assert [ex.seq for ex in conn.finished] == [0, 1, 2]
    assert (len(first.token_event_ns), first.streamed, first.req_stream) == (12, True, True)
    assert (second.streamed, second.req_stream, second.sse_events) == (False, False, 0)
    assert (second.prompt_tokens, second.completion_tokens) == (9, 7)
    assert (second.response_id, second.resp_model) == ("chatcmpl-json1", "small")
    assert (third.method, third.path, third.status, third.body_fp) == ("GET", "/metrics", 200, 0)
    assert third.prompt_tokens is None and third.response_id is None
    assert all(ex.outcome == "complete" and ex.error is None for ex in conn.finished)
    assert conn.close(70, "client_closed") == []


def test_pipelined_requests_pair_fifo():
    conn = Conn()
    requests = (http_request("POST", "/v1/chat/completions", chat_body(stream=False))
                + http_request("HEAD", "/health") + http_request("GET", "/v1/models?page=2"))
    assert conn.request(10, requests) == []
    assert [ex.method for ex in conn.started] == ["POST", "HEAD", "GET"]
    head_response = http_response(200, headers=("Content-Length: 50",), length=False)
    responses = (http_response(200, json_completion()) + head_response
                 + http_response(404, b'{"error":"nope"}'))
    post, head, get = conn.response(20, responses)
    assert [ex.seq for ex in (post, head, get)] == [0, 1, 2]
    assert (post.status, post.completion_tokens) == (200, 7)
    assert (head.status, head.resp_bytes) == (200, len(head_response))  # HEAD: no body read
    assert (get.status, get.path) == (404, "/v1/models")
    assert all(ex.outcome == "complete" for ex in (post, head, get))


def test_pipelined_streamed_then_json():
    conn = Conn()
    conn.request(10, CHAT.request.replace(b"Connection: close\r\n", b"") + http_request("GET", "/x"))
    sse, json_ex = conn.response(20, CHAT.response + http_response(200, json_completion()))
    assert (len(sse.token_event_ns), sse.prompt_tokens, json_ex.path, json_ex.prompt_tokens) == (
        12, 37, "/x", 5)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=8),
       extension=st.sampled_from([b"", b";name=value", b';a="q;x"']),
       trailers=st.sampled_from([b"", b"X-Checksum: 1\r\n", b"A: 1\r\nB: 2\r\n"]),
       cuts=st.lists(st.integers(1, 12_000), max_size=10))
def test_chunked_request_body(sizes, extension, trailers, cuts):
    body = chat_body(model="small-model", prompt="word " * 1500, model_last=True)
    wire = (b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(body, sizes, extension, trailers))
    conn = Conn()
    feed_split(conn, "request", 0, wire, [c for c in cuts if c < len(wire)])
    ex = conn.started[0]
    assert ex.body_fp == expected_fp(body) != 0
    assert (ex.req_model, ex.req_stream, ex.req_bytes) == ("small-model", True, len(wire))
    assert ex.req_end_ns == max([0, *(c for c in cuts if c < len(wire))])
    [done] = conn.response(10**6, http_response(200, json_completion()))
    assert done is ex and done.outcome == "complete"


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 9000), cuts=st.lists(st.integers(1, 9100), max_size=10),
       seed=st.integers(0, 255))
def test_fingerprint_does_not_depend_on_segmentation(size, cuts, seed):
    body = bytes((seed + i * 7) % 256 for i in range(size))
    wire = http_request("POST", "/upload", body, ("Content-Type: application/octet-stream",))
    conn = Conn()
    feed_split(conn, "request", 0, wire, [c for c in cuts if c < len(wire)])
    ex = conn.started[0]
    assert ex.body_fp == expected_fp(body)
    assert ex.req_model is None and ex.req_stream is None  # not JSON: fields not read


def test_fingerprint_key_matters():
    body = chat_body()
    fps = []
    for key in (b"one", b"two"):
        asm = HttpConnectionAssembler(fingerprint_key=key, on_request_start=fps.append)
        asm.feed_request_bytes(1, http_request("POST", "/", body), len(http_request("POST", "/", body)))
    assert fps[0].body_fp == expected_fp(body, b"one") != fps[1].body_fp == expected_fp(body, b"two")


@pytest.mark.parametrize("reason, outcome", [("server_closed", "complete"),
                                             ("client_closed", "client_closed"),
                                             ("reset", "reset"), ("agent_stop", "truncated")])
def test_close_delimited_body(reason, outcome):
    conn = Conn()
    conn.request(1, http_request("GET", "/v1/thing"))
    body = json_completion(prompt_tokens=3, completion_tokens=4)
    assert conn.response(2, http_response(200, headers=(), length=False, version="1.0")) == []
    assert conn.response(3, body[:20]) == []
    assert conn.response(4, body[20:]) == []
    [ex] = conn.close(9, reason)
    assert (ex.status, ex.outcome, ex.resp_bytes > len(body)) == (200, outcome, True)
    assert ex.resp_end_ns == (4 if reason == "server_closed" else None)
    if reason == "server_closed":
        assert (ex.prompt_tokens, ex.completion_tokens, ex.response_id) == (3, 4, "chatcmpl-json1")


@pytest.mark.parametrize("reason", CLOSE_REASONS)
def test_request_without_response(reason):
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/completions", chat_body()))
    [ex] = conn.close(5, reason)
    assert (ex.status, ex.resp_start_ns, ex.req_end_ns, ex.req_model) == (0, None, 1, "small")
    assert ex.outcome == OUTCOME_BY_REASON[reason]


@pytest.mark.parametrize("reason", CLOSE_REASONS)
def test_request_cut_during_upload(reason):
    conn = Conn()
    wire = http_request("POST", "/v1/completions", chat_body(prompt="x" * 500))
    conn.request(1, wire[:300])
    [ex] = conn.close(5, reason)
    assert (ex.req_end_ns, ex.body_fp, ex.req_bytes) == (None, 0, 300)
    assert ex.outcome == OUTCOME_BY_REASON[reason]


def test_response_complete_before_request_upload_finished():
    conn = Conn()
    wire = http_request("POST", "/upload", b"x" * 1000)
    conn.request(1, wire[:200])
    assert conn.response(2, http_response(413, b"{}")) == []  # returned once both halves end
    [ex] = conn.close(3, "client_closed")
    assert (ex.status, ex.outcome) == (413, "complete")


def test_interim_100_continue_is_skipped():
    conn = Conn()
    body = chat_body()
    head = http_request("POST", "/v1/chat/completions", body, ("Expect: 100-continue",))[:-len(body)]
    conn.request(1, head)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert conn.response(2, interim) == []
    conn.request(3, body)
    final = http_response(200, json_completion())
    [ex] = conn.response(4, final)
    assert (ex.status, ex.resp_start_ns, ex.resp_end_ns, ex.req_end_ns) == (200, 4, 4, 3)
    assert ex.resp_bytes == len(interim) + len(final)


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_statuses(status):
    conn = Conn()
    conn.request(1, http_request("GET", "/a") + http_request("GET", "/b"))
    first, second = conn.response(2, http_response(status, headers=("Content-Length: 10",), length=False)
                                  + http_response(200, b"{}"))
    assert (first.status, second.status, second.path) == (status, 200, "/b")


def test_upgrade_ends_http_parsing():
    conn = Conn()
    conn.request(1, http_request("GET", "/ws", headers=("Upgrade: websocket", "Connection: Upgrade")))
    [ex] = conn.response(2, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                            b"Connection: Upgrade\r\n\r\n\x81\x05hello")
    assert (ex.status, ex.outcome, ex.resp_end_ns) == (101, "complete", 2)
    assert "upgraded to websocket" in ex.error and "upgraded to websocket" in conn.asm.error
    assert conn.request(3, b"\x81\x85abcd" + http_request("GET", "/")) == []
    assert conn.response(4, http_response(200)) == []
    assert conn.close(5, "server_closed") == [] and len(conn.started) == 1


def test_connect_tunnel_ends_http_parsing():
    conn = Conn()
    conn.request(1, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    [ex] = conn.response(2, b"HTTP/1.1 200 Connection established\r\n\r\n\x16\x03\x03")
    assert (ex.method, ex.status, ex.outcome) == ("CONNECT", 200, "complete")
    assert "CONNECT tunnel" in conn.asm.error
    assert conn.request(3, b"\x16\x03\x01 encrypted") == [] and conn.close(4, "reset") == []


@pytest.mark.parametrize("first_bytes, words", [
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04", "HTTP/2"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", "TLS"),
])
def test_foreign_protocols_are_refused(first_bytes, words):
    conn = Conn()
    assert conn.request(1, first_bytes) == []
    assert words in conn.asm.error
    assert conn.request(2, http_request("GET", "/")) == []
    assert conn.response(3, http_response(200)) == []
    assert conn.close(4, "server_closed") == [] and conn.started == []


# -- SSE --------------------------------------------------------------------------------

CLASSIFIED_EVENTS = [  # (event, carries generated text)
    (sse_event({"id": "c1", "model": "m", "choices": [{"delta": {"role": "assistant"}}]}), False),
    (sse_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), False),
    (sse_event({"choices": [{"delta": {"content": "Hi"}}]}), True),
    (sse_event({"choices": [{"delta": {"reasoning_content": "hmm"}}]}), True),
    (sse_event({"choices": [{"delta": {"reasoning": "so"}}]}), True),
    (sse_event({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}),
     True),
    (sse_event({"choices": [{"delta": {"tool_calls": []}}]}), False),
    (sse_event({"choices": [{"index": 0, "text": " world"}]}), True),
    (sse_event({"choices": [{"index": 0, "text": ""}]}), False),
    (sse_event({"token": {"id": 5, "text": "tok", "special": False}}), True),
    (sse_event({"content": "llama", "stop": False}), True),
    (sse_event({"content": "", "stop": True}), False),
    (b": keep-alive comment\n\n", None),  # not an event at all
    (b"event: message\nid: 7\nretry: 100\n"
     b"data: {\"choices\":[{\"delta\":\ndata: {\"content\":\"x\"}}]}\n\n",
     True),  # data lines joined with LF; other fields ignored
    (sse_event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4}}), False),
    (b"data: [DONE]\n\n", False),
]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("chunk_size", [1, 7, 100, 100_000])
def test_sse_event_classification(newline, chunk_size):
    events = b"".join(event for event, _ in CLASSIFIED_EVENTS).replace(b"\n", newline)
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/chat/completions", chat_body()))
    [ex] = conn.response(2, sse_response(events, (chunk_size,)))
    assert ex.sse_events == sum(1 for _, text in CLASSIFIED_EVENTS if text is not None)
    assert len(ex.token_event_ns) == sum(1 for _, text in CLASSIFIED_EVENTS if text)
    assert (ex.prompt_tokens, ex.completion_tokens, ex.done_seen) == (11, 4, True)
    assert (ex.response_id, ex.resp_model) == ("c1", "m")


@pytest.mark.parametrize("first, second", [
    (b"data: {\"content\":\"a\"}\r\n\r", b"\n"),  # CRLF blank line split between segments
    (b"data: {\"content\":\"a\"}\r", b"\r"),  # CR CR
    (b"data: {\"content\":\"a\"}\n", b"\n"),
])
def test_sse_event_stamped_by_segment_holding_its_end(first, second):
    conn = Conn()
    conn.request(1, http_request("GET", "/completion"))
    conn.response(2, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    conn.response(3, first)
    conn.response(4, second)
    [ex] = conn.close(5, "server_closed")
    assert (ex.token_event_ns, ex.sse_events, ex.outcome, ex.resp_end_ns) == ([4], 1, "complete", 4)


def test_sse_cr_separated_event_ending_a_segment_keeps_its_segment_time():
    conn = Conn()
    conn.request(1, http_request("GET", "/completion"))
    conn.response(2, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    conn.response(3, b"data: {\"content\":\"a\"}\r\r")
    conn.response(9, b"data: {\"content\":\"b\"}\r\r")
    [ex] = conn.close(10, "server_closed")
    assert ex.token_event_ns == [3, 9]


def test_sse_oversized_and_broken_events_use_regex_fallback():
    huge = sse_event({"id": "big-1", "model": "m", "choices": [{"delta": {"content": "y" * 100_000}}],
                      "usage": {"prompt_tokens": 8, "completion_tokens": 2}})
    broken = b'data: {"choices":[{"delta":{"content":"ab\n\n'  # cut JSON: not parseable
    empty_broken = b'data: {"choices":[{"delta":{"role":"assistant","content":""\n\n'
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/chat/completions", chat_body()))
    [ex] = conn.response(2, sse_response(huge + broken + empty_broken + b"data: [DONE]\n\n", (4096,)))
    assert (ex.sse_events, len(ex.token_event_ns), ex.done_seen) == (4, 2, True)
    assert (ex.prompt_tokens, ex.completion_tokens, ex.response_id) == (8, 2, "big-1")


def test_compressed_event_stream_is_not_read():
    conn = Conn()
    conn.request(1, http_request("GET", "/stream"))
    [ex] = conn.response(2, sse_response(b"\x1f\x8b\x08\x00binary gzip data\n\n")
                         .replace(b"transfer-encoding", b"Content-Encoding: gzip\r\ntransfer-encoding"))
    assert (ex.streamed, ex.sse_events, ex.outcome) == (True, 0, "complete")
    assert "gzip-encoded" in ex.error


def test_token_events_kept_are_capped(monkeypatch):
    monkeypatch.setattr(exchange_module, "MAX_TOKEN_EVENTS", 3)
    ex = run_capture(CHAT)
    assert (len(ex.token_event_ns), ex.sse_events, ex.completion_tokens) == (3, 15, 12)
    assert "more than 3 token events" in ex.error


def test_sse_gap_inside_chunk_data():
    tokens = [token_event(f"t{i}") for i in range(10)]
    events = b"".join(tokens) + b"data: [DONE]\n\n"
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                + b"%x\r\n" % len(events) + events + b"\r\n0\r\n\r\n")
    gap_start = response.index(tokens[2]) + 30  # inside the third event
    gap_end = response.index(tokens[7]) + 30  # inside the eighth event
    conn = Conn()
    conn.request(1, http_request("GET", "/stream"))
    [ex] = conn.response(2, response[:gap_start], len(response), response[gap_end:])
    # Events 1-2, then the 3rd and 8th merged across the gap, then 9, 10 and [DONE].
    assert (ex.sse_events, len(ex.token_event_ns), ex.done_seen) == (6, 5, True)
    assert (ex.outcome, ex.resp_bytes) == ("complete", len(response))
    assert "not captured" in ex.error


# -- gaps -------------------------------------------------------------------------------


def test_gap_inside_a_content_length_body_is_counted():
    body = chat_body(prompt="z" * 20_000, model_last=True)
    wire = http_request("POST", "/v1/chat/completions", body)
    head_len = len(wire) - len(body) + 5000
    conn = Conn()
    conn.request(7, wire[:head_len], len(wire), wire[-2000:])
    ex = conn.started[0]
    assert (ex.req_end_ns, ex.req_bytes, ex.body_fp) == (7, len(wire), expected_fp(body))
    assert (ex.req_model, ex.req_stream) == ("small", True)
    [done] = conn.response(8, http_response(200, json_completion()))
    assert done.outcome == "complete" and done.error is None


def test_gap_over_the_hashed_head_gives_no_fingerprint():
    body = b"q" * 10_000
    wire = http_request("POST", "/upload", body)
    conn = Conn()
    conn.request(1, wire[:len(wire) - len(body) + 100], len(wire), wire[-3000:])
    assert conn.started[0].body_fp == 0 and conn.started[0].req_end_ns == 1


def test_gap_in_large_json_response_body():
    body = json_completion(content="w" * 30_000, prompt_tokens=123, completion_tokens=456)
    response = http_response(200, body)
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/chat/completions", chat_body(stream=False)))
    [ex] = conn.response(2, response[:3000], len(response), response[-3000:])
    assert (ex.prompt_tokens, ex.completion_tokens) == (123, 456)
    assert (ex.response_id, ex.resp_model, ex.resp_bytes) == ("chatcmpl-json1", "small", len(response))
    assert ex.outcome == "complete"


def test_gap_in_request_headers_truncates_and_resyncs():
    conn = Conn()
    first = http_request("POST", "/v1/chat/completions", chat_body(),
                         ("User-Agent: " + "u" * 3000, "Content-Type: application/json"))
    conn.request(1, first[:200], len(first), first[-100:])
    assert "gap inside the request headers" in conn.asm.error
    # The server got the whole request: its response still pairs with it.
    [ex] = conn.response(2, http_response(200, json_completion()))
    assert (ex.outcome, ex.status, ex.method, ex.path) == (
        "truncated", 200, "POST", "/v1/chat/completions")
    assert "gap inside the request headers" in ex.error
    conn.request(3, http_request("GET", "/next"))
    [nxt] = conn.response(4, http_response(200, b"{}"))
    assert (nxt.path, nxt.outcome, nxt.error, nxt.seq) == ("/next", "complete", None, 1)


def test_gap_over_chunk_framing_resumes_at_a_proven_chunk_boundary():
    """A hole over chunk framing (a write larger than the capture) keeps the
    response: framing resumes where whole chunks run to the end of the bytes
    after it, so the stream's end is read; the events inside the hole are not
    counted, and the error says so."""
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/chat/completions", chat_body()))
    response = sse_response(b"".join(token_event(str(i)) for i in range(50)), (40,))
    conn.response(2, response[:500], len(response), response[-200:])
    [ex] = conn.finished
    assert (ex.outcome, ex.resp_bytes) == ("complete", len(response)) and "not captured" in ex.error
    assert 0 < len(ex.token_event_ns) < 50
    conn.request(3, http_request("GET", "/after"))
    [nxt] = conn.response(4, http_response(200, b"{}"))
    assert (nxt.path, nxt.status, nxt.outcome) == ("/after", 200, "complete")


def test_gap_hiding_the_end_of_a_chunked_body_truncates_it_at_the_next_response():
    conn = Conn()
    for ts in (1, 3):
        conn.request(ts, http_request("POST", "/v1/chat/completions", chat_body()))
    first = sse_response(b"".join(token_event(str(i)) for i in range(50)), (40,))
    conn.response(2, first[:500], len(first))  # nothing after the hole proves a chunk boundary
    second = sse_response(token_event("x"))
    [cut, nxt] = conn.response(4, second)
    assert cut.outcome == "truncated" and "hides the end of a chunked response body" in cut.error
    assert (nxt.outcome, len(nxt.token_event_ns)) == ("complete", 1)


@pytest.mark.parametrize("data, boundary", [
    (b"ta: x\n\n\r\n5\r\nhello\r\n", 9),                    # one whole chunk to the end
    (b"xx\r\n4\r\ndata\r\n0\r\n\r\n", 4),                    # one, then the last chunk
    (b"xx\r\n4\r\ndata\r\n5\r\nhello\r\n3\r\nab", 4),          # two, then one cut off
    (b"xx\r\n5\r\nhello\r\n3\r\nab", None),                   # one, then one cut off: not proven
    (b"xx\r\n5\r\nhello!\r\n", None),                        # a size that does not fit
    (b"no line end at all", None),
], ids=["one-chunk", "last-chunk", "two-then-cut", "one-then-cut", "wrong-size", "no-crlf"])
def test_proven_chunk_boundary(data: bytes, boundary: int | None):
    assert proven_chunk_boundary(data) == boundary


def test_gap_hiding_the_next_request_start():
    conn = Conn()
    first = http_request("POST", "/a", b"x" * 5000)
    second = http_request("POST", "/b", b"y" * 5000)
    wire = first + second
    conn.request(1, wire[:1000], len(wire), wire[-500:])  # first's end and second's start unseen
    assert conn.started[0].req_end_ns == 1 and len(conn.started) == 1
    assert "hides the start of the next request" in conn.asm.error
    ex, hidden = conn.response(2, http_response(200, b"{}") + http_response(201, b"{}"))
    assert (ex.path, ex.status, ex.outcome, ex.request_seen) == ("/a", 200, "complete", True)
    # The second's response answers the request the gap hid: a row of its own, its request unseen.
    assert (hidden.path, hidden.status, hidden.request_seen) == ("", 201, False)
    assert conn.close(3, "server_closed") == []


# -- garbage, resync, limits --------------------------------------------------------------


def test_garbage_before_a_request_is_skipped():
    conn = Conn()
    assert conn.request(1, b"\x00\xffnot http at all\r\n\r\n") == []
    assert conn.started == [] and "picked up in the middle" in conn.asm.error
    conn.request(2, http_request("GET", "/ok"))
    [ex] = conn.response(3, http_response(200, b"{}"))
    assert (ex.path, ex.outcome, ex.seq) == ("/ok", "complete", 0)


def test_garbage_between_requests_resyncs_both_sides():
    conn = Conn()
    conn.request(1, http_request("GET", "/one"))
    conn.response(2, http_response(200, b"{}"))
    assert conn.request(3, b"hello there\r\n\r\n") == []
    assert conn.response(4, b"\x00\x01\x02 junk") == []
    assert conn.asm.error
    conn.request(5, http_request("GET", "/two"))
    [ex] = conn.response(6, http_response(200, b"{}"))
    assert [e.path for e in conn.finished] == ["/one", "/two"] and ex.outcome == "complete"


def test_invalid_request_line_after_a_request_is_truncated_and_answered():
    conn = Conn()
    conn.request(1, http_request("GET", "/one"))
    conn.response(2, http_response(200, b"{}"))
    conn.request(3, b"HELLO WORLD\r\n\r\n")
    [bad] = conn.response(4, http_response(400, b"{}"))
    assert (bad.outcome, bad.status, bad.error) == ("truncated", 400, "invalid HTTP/1.x request line")


def test_oversized_headers():
    conn = Conn(max_header_bytes=1024)
    big = http_request("GET", "/big", headers=("X-Big: " + "b" * 2000,))
    conn.request(1, big[:600])
    conn.request(2, big[600:])
    assert "larger than 1024 bytes" in conn.asm.error
    [ex] = conn.response(3, http_response(431, b"{}"))
    assert (ex.status, ex.outcome) == (431, "truncated") and "larger than 1024" in ex.error
    conn.request(4, http_request("GET", "/small"))
    [ok] = conn.response(5, http_response(200, b"{}"))
    assert (ok.path, ok.outcome) == ("/small", "complete")


def test_oversized_response_headers():
    conn = Conn(max_header_bytes=1024)
    conn.request(1, http_request("GET", "/x"))
    [ex] = conn.response(2, b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 5000)
    assert ex.outcome == "truncated" and "response header block larger" in ex.error


def test_mid_stream_pickup():
    conn = Conn()
    # The agent starts while a request body is uploading and its SSE answer is streaming.
    assert conn.request(1, b'tent": "tail of a prompt"}], "stream": true}') == []
    assert conn.response(2, CHAT.response[900:1500]) == []
    assert conn.response(3, CHAT.response[1500:]) == []
    assert conn.started == [] and "picked up in the middle" in conn.asm.error
    conn.request(4, http_request("POST", "/v1/completions", chat_body()))
    [ex] = conn.response(5, CHAT.response)
    assert (ex.seq, ex.path, len(ex.token_event_ns), ex.outcome) == (
        0, "/v1/completions", 12, "complete")


def test_response_without_request_is_skipped():
    conn = Conn()
    assert conn.response(1, http_response(200, json_completion())) == []
    assert "without a matching request" in conn.asm.error
    # A response that started before the request did cannot answer it.
    conn.request(5, http_request("GET", "/late"))
    assert conn.response(4, http_response(200, b"{}")) == []
    [ex] = conn.response(6, http_response(202, b"{}"))
    assert (ex.path, ex.status) == ("/late", 202)


def test_query_string_removed_from_path():
    conn = Conn()
    conn.request(1, http_request("GET", "/v1/files/abc?api_key=secret#frag"))
    assert conn.started[0].path == "/v1/files/abc"


def test_request_model_read_from_head_or_tail_not_from_prompt_text():
    prompt = 'say "model": "evil", "stream": false ' + "pad " * 3000
    for model_last in (True, False):
        body = chat_body(model="real-model", stream=True, prompt=prompt, model_last=model_last)
        assert b'\\"model\\": \\"evil\\"' in body[:200]
        conn = Conn()
        conn.request(1, http_request("POST", "/v1/chat/completions", body))
        assert (conn.started[0].req_model, conn.started[0].req_stream) == ("real-model", True)
    small = chat_body(model="tiny", prompt='"model": "evil"', model_last=True)
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/chat/completions", small))
    assert conn.started[0].req_model == "tiny"


def test_on_request_start_sees_the_exchange_before_the_feed_returns():
    seen = []
    asm = HttpConnectionAssembler(fingerprint_key=KEY,
                                  on_request_start=lambda ex: seen.append((ex.seq, ex.req_start_ns)))
    wire = http_request("GET", "/a") + http_request("GET", "/b")
    asm.feed_request_bytes(42, wire[:5], len(wire[:5]))
    assert seen == [(0, 42)]
    asm.feed_request_bytes(43, wire[5:], len(wire[5:]))
    assert seen == [(0, 42), (1, 43)]


def test_too_many_pipelined_requests_stop_the_connection():
    conn = Conn()
    conn.request(1, http_request("GET", "/") * 1100)
    assert "more than 1024 requests" in conn.asm.error
    assert len(conn.started) == 1024 and conn.finished == conn.started
    assert all(ex.outcome == "truncated" for ex in conn.finished)
    assert conn.close(2, "server_closed") == []


def test_malformed_calls_never_raise():
    conn = Conn()
    assert conn.asm.feed_request_bytes(1, "text", 4) == []
    assert "malformed request segment" in conn.asm.error
    assert conn.asm.feed_request_bytes(1, b"abc", -1) == []
    assert conn.asm.feed_request_bytes(1, b"abc", 10**30) == []
    assert conn.asm.feed_response_bytes("soon", b"abc", 3) == []
    assert conn.asm.feed_response_bytes(1, b"abc", 10, None) == []
    conn.request(2, http_request("GET", "/fine"))
    conn.response(3, http_response(200, b"{}"))
    assert [ex.path for ex in conn.finished] == ["/fine"]
    conn.request(4, http_request("GET", "/open"))
    [ex] = conn.close(5, "no-such-reason")
    assert ex.outcome == "truncated" and "unknown close reason" in conn.asm.error
    assert conn.close(6, "server_closed") == []
    assert conn.request(7, http_request("GET", "/after-close")) == []


def test_constructor_validates_its_arguments():
    with pytest.raises(ValueError):
        HttpConnectionAssembler(fingerprint_key=b"k" * 65)
    with pytest.raises(ValueError):
        HttpConnectionAssembler(fingerprint_key="text")
    with pytest.raises(ValueError):
        HttpConnectionAssembler(fingerprint_key=b"k", max_header_bytes=0)


def test_memory_stays_bounded_on_endless_lines():
    conn = Conn()
    conn.request(1, http_request("GET", "/stream"))
    conn.response(2, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {\"content\":\"")
    segment = b"x" * 65536
    tracemalloc.start()
    try:
        for i in range(200):  # 13 MB of one SSE line, and of one header block on the request side
            conn.response(3 + i, segment)
            conn.request(3 + i, segment)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    [ex] = conn.close(1000, "server_closed")
    assert ex.sse_events == 0 and ex.outcome == "complete"


# -- the tenant header -------------------------------------------------------------------


def tenant_of(header_lines: tuple, **kwargs) -> str:
    """The tenant recorded for one request carrying header_lines."""
    conn = Conn(**kwargs)
    conn.request(1, http_request("POST", "/v1/chat/completions", chat_body(), header_lines))
    conn.response(2, http_response(200, json_completion()))
    return conn.only().tenant


@pytest.mark.parametrize("header_lines, tenant", [
    (("X-Tenant-Id: acme-42",), "acme-42"),
    (("x-tenant-id: acme-42",), "acme-42"),
    (("X-TENANT-ID:   acme 42 \t",), "acme 42"),  # optional whitespace around the value goes
    (("Accept: */*",), ""),
    (("X-Tenant-Id:",), ""),
    (("X-Tenant-Id: first", "Accept: */*", "x-tenant-id: second"), "first"),
    (("X-Tenant-Ids: not-this", "X-Tenant: nor-this"), ""),
], ids=["canonical", "lower-case", "upper-case-padded", "absent", "empty", "repeated", "similar-names"])
def test_tenant_comes_from_the_tenant_header(header_lines, tenant):
    assert tenant_of(header_lines) == tenant


def test_tenant_value_is_made_printable_and_capped():
    garbage = b"X-Tenant-Id: ac\x00me\x1b\x7f-\xc3\xa9\xff1\r\n"
    wire = http_request("GET", "/v1/models", headers=("Accept: */*",))
    conn = Conn()
    conn.request(1, wire.replace(b"Accept: */*\r\n", garbage))
    assert conn.started[0].tenant == "acme-1"
    assert tenant_of(("X-Tenant-Id: " + "t" * 127 + "0123456789",)) == "t" * 127 + "0"


def test_tenant_header_name_is_configurable_or_off():
    lines = ("X-Tenant-Id: acme", "X-Org: org-7")
    assert tenant_of(lines, tenant_header="X-Org") == "org-7"
    assert tenant_of(lines, tenant_header=None) == ""
    assert tenant_of(lines, tenant_header="") == ""


def test_only_the_tenant_header_value_is_kept():
    lines = ("Authorization: Bearer sk-secret-key", "X-Tenant-Id: acme", "Cookie: session=hunter2")
    conn = Conn()
    conn.request(1, http_request("POST", "/v1/chat/completions", chat_body(prompt="my prompt"), lines))
    conn.response(2, http_response(200, json_completion(content="my answer")))
    exchange = repr(conn.only())
    assert "acme" in exchange
    for secret in ("sk-secret-key", "hunter2", "my prompt", "my answer"):
        assert secret not in exchange


def test_each_request_on_a_connection_has_its_own_tenant():
    conn = Conn()
    for tenant_lines in (("X-Tenant-Id: acme",), (), ("X-Tenant-Id: globex",)):
        conn.request(1, http_request("GET", "/v1/models", headers=tenant_lines))
        conn.response(2, http_response(200, b"{}"))
    assert [ex.tenant for ex in conn.finished] == ["acme", "", "globex"]


def test_tenant_does_not_depend_on_segmentation():
    wire = http_request("POST", "/v1/completions", chat_body(), ("X-Tenant-Id: acme-42",))
    conn = Conn()
    feed_split(conn, "request", REQ_T0, wire, range(1, len(wire)))
    assert conn.started[0].tenant == "acme-42"


def test_tenant_cut_by_a_capture_gap_is_not_recorded_in_part():
    wire = http_request("GET", "/v1/models", headers=("X-Tenant-Id: acme",))
    head = wire[:wire.index(b"acme") + 2]
    conn = Conn()
    conn.request(1, head, len(wire), wire[-4:])
    [ex] = conn.response(2, http_response(200, b"{}"))
    assert ex.tenant == "" and ex.path == "/v1/models"


@pytest.mark.parametrize("name, message", [
    ("x tenant", "not an HTTP header name"),
    ("x-tenänt", "not an HTTP header name"),
    (b"x-tenant-id", "not an HTTP header name"),
    ("Content-Length", "frames the message"),
])
def test_bad_tenant_header_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        HttpConnectionAssembler(fingerprint_key=KEY, tenant_header=name)
    assert tenant.tenant_header_name("X-Tenant-Id") == "x-tenant-id"


# -- fuzzing ----------------------------------------------------------------------------

def assert_invariants(conn: Conn) -> None:
    """What must hold after any input: each started exchange returned exactly once,
    in order, with a valid outcome, and no parser bug caught by the safety net."""
    assert sorted(map(id, conn.finished)) == sorted(map(id, conn.started))
    assert len(set(map(id, conn.finished))) == len(conn.finished)
    assert [ex.seq for ex in conn.finished] == list(range(len(conn.finished)))
    for ex in conn.finished:
        assert ex.outcome in ("complete", "client_closed", "reset", "truncated")
        assert len(ex.token_event_ns) <= ex.sse_events
        assert "internal" not in (ex.error or "")
    assert "internal" not in (conn.asm.error or "")


REQUEST_LINES = [b"GET / HTTP/1.1\r\n", b"POST /v1/chat/completions?k=v HTTP/1.1\r\n",
                 b"HEAD /h HTTP/1.0\r\n", b"PUT /x HTTP/1.1\r\n"]
STATUS_LINES = [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.0 200 OK\r\n", b"HTTP/1.1 204 No Content\r\n",
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n", b"HTTP/1.1 404 NF\r\n",
                b"HTTP/1.1 304 NM\r\n", b"HTTP/1.1 101 Switching Protocols\r\n"]
HEADER_LINES = [b"Content-Type: application/json\r\n", b"Content-Type: text/event-stream\r\n",
                b"Connection: close\r\n", b"Expect: 100-continue\r\n", b"X-Junk: 1\r\n",
                b"Content-Encoding: gzip\r\n", b"Upgrade: websocket\r\n"]
PAYLOADS = [b"", json_completion(), chat_body(), b"".join(e for e, _ in CLASSIFIED_EVENTS),
            b"".join(token_event(str(i)) for i in range(30)), b"\x00\xffbinary\r\n\r\n"]


@st.composite
def http_messages(draw, start_lines, whole_messages):
    """A stream of well-formed HTTP/1.x messages (their meaning may still be odd)."""
    messages = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 4)) == 0:
            messages.append(draw(st.sampled_from(whole_messages)))
            continue
        head = draw(st.sampled_from(start_lines)) + b"".join(
            draw(st.lists(st.sampled_from(HEADER_LINES), max_size=3)))
        # A 204 or 304 has no body whatever its headers say (RFC 9110): bytes after one are no message.
        payload = b"" if head.startswith((b"HTTP/1.1 204", b"HTTP/1.1 304")) else draw(st.sampled_from(PAYLOADS))
        framing = draw(st.sampled_from(["none", "length", "chunked"]))
        if framing == "length":
            head += b"Content-Length: %d\r\n" % len(payload)
        elif framing == "chunked":
            head += b"Transfer-Encoding: chunked\r\n"
            payload = chunked(payload, draw(st.lists(st.integers(1, 300), min_size=1, max_size=3)))
        messages.append(head + b"\r\n" + (payload if framing != "none" else b""))
    return b"".join(messages)


def cut_points(stream: bytes):
    return st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=20).map(
        lambda cuts: sorted({c for c in cuts if 0 < c < len(stream)}))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_fuzz_clean_streams_do_not_depend_on_segmentation(data):
    requests = data.draw(http_messages(REQUEST_LINES, [CHAT.request, COMPLETIONS.request]))
    responses = data.draw(http_messages(STATUS_LINES, [CHAT.response, COMPLETIONS.response]))
    results = []
    for req_cuts, resp_cuts in (([], []), (data.draw(cut_points(requests)),
                                           data.draw(cut_points(responses)))):
        conn = Conn()
        # Every segment of a side carries the same time, so nothing may differ.
        for _, piece in pieces(requests, req_cuts):
            conn.request(1, piece)
        for _, piece in pieces(responses, resp_cuts):
            conn.response(2, piece)
        conn.close(3, "server_closed")
        assert_invariants(conn)
        results.append(conn.finished)
    assert results[0] == results[1]


@settings(max_examples=250, deadline=None)
@given(data=st.data(), reason=st.sampled_from(CLOSE_REASONS))
def test_fuzz_damaged_streams(data, reason):
    """Well-formed streams cut into segments, some with uncaptured middles, some
    replaced by garbage, both sides interleaved."""
    sides = {}
    for side, lines, whole in (("request", REQUEST_LINES, [CHAT.request]),
                               ("response", STATUS_LINES, [CHAT.response])):
        stream = data.draw(http_messages(lines, whole))
        segments = []
        for _, piece in pieces(stream, data.draw(cut_points(stream))):
            damage = data.draw(st.sampled_from(["none", "none", "none", "gap", "garbage"]))
            if damage == "gap" and len(piece) > 2:
                head_len = data.draw(st.integers(0, len(piece) - 1))
                tail_len = data.draw(st.integers(0, len(piece) - head_len - 1))
                segments.append((piece[:head_len], len(piece), piece[len(piece) - tail_len:]))
            elif damage == "garbage":
                garbage = data.draw(st.binary(min_size=1, max_size=30))
                segments.append((garbage, len(garbage), b""))
            else:
                segments.append((piece, len(piece), b""))
        sides[side] = segments
    order = data.draw(st.permutations(["request"] * len(sides["request"])
                                      + ["response"] * len(sides["response"])))
    conn = Conn()
    position = {"request": 0, "response": 0}
    for ts, side in enumerate(order):
        head, total, tail = sides[side][position[side]]
        position[side] += 1
        (conn.request if side == "request" else conn.response)(ts, head, total, tail)
    conn.close(len(order), reason)
    assert_invariants(conn)


FRAGMENTS = [
    b"GET / HTTP/1.1\r\n", b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n", b"HEAD /h HTTP/1.0\r\n",
    b"CONNECT host:443 HTTP/1.1\r\n", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.0 204 No\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 101 Switching\r\n", b"HTTP/1.1 304 NM\r\n",
    b"Content-Length: 5\r\n", b"Content-Length: 99999\r\n", b"Content-Length: 1,2\r\n",
    b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding: gzip\r\n", b"Content-Encoding: gzip\r\n",
    b"Content-Type: text/event-stream\r\n", b"Content-Type: application/json\r\n", b" folded\r\n",
    b"Expect: 100-continue\r\n", b"Upgrade: websocket\r\n", b"\r\n", b"\n", b"\r", b"\r\n\r\n",
    b"5\r\nhello\r\n", b"0\r\n\r\n", b"ffffffffffffffff\r\n", b"3;ext=1\r\nabc\r\n", b"zz\r\n",
    b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', b"data: [DONE]\n\n", b": ping\n\n",
    b'data: {"usage":{"prompt_tokens":1', b'{"model":"m","stream":true}', b"data:", b"\x00\xff",
    CHAT.response[:300], CHAT.response[300:1200], CHAT.response[-400:], CHAT.request[:150],
]
piece = st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=40))
segment_strategy = st.tuples(
    st.sampled_from(["request", "response"]),
    st.lists(piece, max_size=6).map(b"".join),
    st.one_of(st.just(0), st.just(0), st.integers(1, 70_000)),  # uncaptured middle
    st.lists(piece, max_size=3).map(b"".join),
)


@settings(max_examples=400, deadline=None)
@given(segments=st.lists(segment_strategy, max_size=25),
       reason=st.sampled_from([*CLOSE_REASONS, "bogus"]),
       max_header_bytes=st.sampled_from([64, 200, 65536]))
def test_fuzz_never_raises_and_returns_each_exchange_once(segments, reason, max_header_bytes):
    conn = Conn(max_header_bytes=max_header_bytes)
    for ts, (side, head, gap, tail) in enumerate(segments):
        total = len(head) + gap + len(tail)
        (conn.request if side == "request" else conn.response)(ts, head, total, tail)
    conn.close(len(segments), reason)
    assert_invariants(conn)


@settings(max_examples=200, deadline=None)
@given(segments=st.lists(st.tuples(st.binary(max_size=300), st.integers(-5, 400),
                                   st.binary(max_size=50)), max_size=20))
def test_fuzz_random_bytes_and_lengths(segments):
    conn = Conn()
    for ts, (head, total_len, tail) in enumerate(segments):
        conn.request(ts, head, total_len, tail)
        conn.response(ts, tail + head, total_len, head)
    conn.close(len(segments), "reset")
    assert_invariants(conn)


def test_requests_pipelined_in_one_write_past_the_capture_are_rows_that_say_so():
    """Issue 35: 1,000 requests pipelined in one write (223 KB) are captured as its first 64 KiB and last
    4 KiB; the requests in between were never opened and their responses skipped: 706 left no row, and
    nothing said so. Each response a request in the gap waits for is now a row, its request unseen
    (capture "dropped", never in a latency figure)."""
    from tokenprobe.agent.capture.kernel.records import HEAD_CAP, TAIL_CAP
    from tokenprobe.agent.capture.tracker import ConnectionTracker, Fidelity

    body = b'{"model": "m", "prompt": "' + b"x" * 100 + b'"}'
    one = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = one * 1000
    conn = Conn()
    conn.request(1, data[:HEAD_CAP], len(data), data[-TAIL_CAP:])
    for i in range(1000):
        conn.response(10 + i, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert len(conn.finished) == 1000
    seen = -(-HEAD_CAP // len(one))  # the last of them runs into the gap past its headers: a skipped body stretch
    assert HEAD_CAP % len(one) > data.index(b"\r\n\r\n") + 4
    assert all(ex.request_seen and ex.path == "/v1/completions" for ex in conn.finished[:seen])
    hidden = conn.finished[seen:]
    assert all(not ex.request_seen and ex.status == 200 and "capture gap" in ex.error for ex in hidden)
    assert {ConnectionTracker._capture(ex, Fidelity()) for ex in hidden} == {"dropped"}
    assert ConnectionTracker._capture(conn.finished[0], Fidelity()) == "exact"
