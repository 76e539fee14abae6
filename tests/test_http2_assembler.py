"""Tests for the HTTP/2 and gRPC assembler (agent/capture/wire/http2.py, grpc.py).

Every byte stream is real HTTP/2: written by the h2 library's client and
server state machines (tests/support/h2_wire.py), each flush one segment, as
the probes see one write(). Expected timestamps are those of the writes that
carried the byte in question, taken from the same run.
"""

from __future__ import annotations

import dataclasses
import itertools

import h2.settings
import hyperframe.frame
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenprobe.agent.capture.wire.grpc import (
    GrpcMessages,
    grpc_message_text,
    grpc_status_code,
    is_grpc,
)
from tokenprobe.agent.capture.wire.http2 import (
    PREFACE,
    UNREADABLE_REASONS,
    H2Exchange,
    Http2ConnectionAssembler,
    resembles_http2_frames,
    starts_http2,
)

from tests.support.h2_wire import (
    GRPC_RESPONSE,
    SSE_DONE,
    SSE_RESPONSE,
    H2Wire,
    assemble,
    chat_request,
    grpc_message,
    grpc_request,
    sse_chunk,
)

KEY = b"h2-test-key"


def feed(segments, assembler: Http2ConnectionAssembler | None = None,
         close: str | None = "server_closed") -> tuple[list[H2Exchange], Http2ConnectionAssembler]:
    assembler = assembler or Http2ConnectionAssembler(fingerprint_key=KEY)
    return assemble(segments, assembler, close), assembler


def frame_types(segments, is_request: bool) -> list[str]:
    """The frames of one direction, read by hyperframe (an independent parser)."""
    data = b"".join(d for _, req, d in segments if req == is_request)
    if is_request:
        data = data.removeprefix(PREFACE)
    types, pos = [], 0
    while pos < len(data):
        frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(data[pos:pos + 9]))
        types.append(type(frame).__name__)
        pos += 9 + length
    return types


def streamed_chat(wire: H2Wire, stream_id: int, texts: list[str], *, tenant: str = "acme",
                  pad_length: int | None = None) -> dict:
    """A whole streamed chat completion on one stream; returns the expected timestamps."""
    headers, body = chat_request([("x-tenant-id", tenant)])
    req_start = wire.ts + 1000
    req_end = wire.request(stream_id, headers, body)
    resp_start = wire.respond(stream_id, SSE_RESPONSE)
    wire.send(stream_id, sse_chunk(role=True))
    tokens = [wire.send(stream_id, sse_chunk(text), pad_length=pad_length) for text in texts]
    wire.send(stream_id, sse_chunk(usage=(7, len(texts))))
    resp_end = wire.send(stream_id, SSE_DONE, end_stream=True)
    return {"req_start_ns": req_start, "req_end_ns": req_end, "resp_start_ns": resp_start,
            "resp_end_ns": resp_end, "token_event_ns": tokens}


def test_streamed_sse_chat_completion_over_h2c():
    wire = H2Wire()
    expected = streamed_chat(wire, 1, ["Hel", "lo", ",", " world"], pad_length=9)
    assert starts_http2(wire.segments[0][2], is_request=False)  # the server's SETTINGS came first
    assert starts_http2(PREFACE[:4], is_request=True) and starts_http2(PREFACE[:3], is_request=True) is None
    assert starts_http2(b"POST /v1/chat", is_request=True) is False
    assert starts_http2(b"HTTP/1.1 200 OK\r\n", is_request=False) is False

    records, assembler = feed(wire.segments, close=None)

    assert assembler.unreadable is None and assembler.error is None
    [row] = records
    assert dataclasses.asdict(row) | expected == dataclasses.asdict(row)
    assert (row.stream_id, row.seq, row.method, row.path, row.status) == \
        (1, 0, "POST", "/v1/chat/completions", 200)
    assert (row.streamed, row.sse_events, row.done_seen) == (True, 7, True)
    assert (row.prompt_tokens, row.completion_tokens) == (7, 4)
    assert (row.req_model, row.req_stream, row.resp_model) == ("llama-3-8b", True, "llama-3-8b")
    assert (row.response_id, row.tenant, row.outcome, row.api) == ("chatcmpl-42", "acme", "complete", "openai.chat")
    assert row.body_fp != 0
    # Bytes on the wire: every frame of stream 1, frame headers and padding included.
    stream_bytes = {True: 0, False: 0}
    for _, is_request, data in wire.segments:
        stream_bytes[is_request] += len(data)
    assert 0 < row.req_bytes < stream_bytes[True] and 0 < row.resp_bytes < stream_bytes[False]
    assert "DataFrame" in frame_types(wire.segments, is_request=False)


def test_interleaved_concurrent_streams_each_get_their_own_row():
    # A larger table than HPACK's default: the client's encoder announces it in a block.
    wire = H2Wire(server_settings={h2.settings.SettingCodes.HEADER_TABLE_SIZE: 65536})
    expected = {}
    for stream_id in (1, 3, 5):
        headers, body = chat_request([("x-tenant-id", f"t{stream_id}")])
        start = wire.ts + 1000
        expected[stream_id] = {"req_start_ns": start, "req_end_ns": wire.request(stream_id, headers, body),
                               "token_event_ns": []}
    for stream_id in (5, 1, 3):
        expected[stream_id]["resp_start_ns"] = wire.respond(stream_id, SSE_RESPONSE)
    for round_ in range(3):  # one token per stream per round, stream 3 gets one more
        for stream_id in (1, 3, 5):
            expected[stream_id]["token_event_ns"].append(wire.send(stream_id, sse_chunk(f"{round_}")))
    expected[3]["token_event_ns"].append(wire.send(3, sse_chunk("extra")))
    for stream_id in (3, 5, 1):  # they finish in another order than they started
        expected[stream_id]["resp_end_ns"] = wire.send(stream_id, SSE_DONE, end_stream=True)

    records, assembler = feed(wire.segments, close=None)

    assert assembler.unreadable is None
    assert [row.stream_id for row in records] == [3, 5, 1]
    for row in records:
        assert {key: getattr(row, key) for key in expected[row.stream_id]} == expected[row.stream_id]
        assert (row.seq, row.tenant, row.outcome) == ((row.stream_id - 1) // 2, f"t{row.stream_id}", "complete")
        assert row.sse_events == len(expected[row.stream_id]["token_event_ns"]) + 1


def test_header_blocks_in_continuation_frames():
    wire = H2Wire()
    long_value = "".join(chr(0x21 + (i * 7919) % 90) for i in range(40_000))  # defeats Huffman
    headers, body = chat_request([("x-trace", long_value), ("x-tenant-id", "after-the-long-one")])
    wire.request(1, headers, body)
    wire.respond(1, [*SSE_RESPONSE, ("x-debug", long_value)])
    token = wire.send(1, sse_chunk("x"))
    wire.send(1, SSE_DONE, end_stream=True)
    assert frame_types(wire.segments, True).count("ContinuationFrame") >= 2
    assert frame_types(wire.segments, False).count("ContinuationFrame") >= 2

    records, assembler = feed(wire.segments, close=None)

    [row] = records
    assert assembler.unreadable is None
    assert (row.tenant, row.path, row.status, row.streamed, row.token_event_ns) == \
        ("after-the-long-one", "/v1/chat/completions", 200, True, [token])

    # The same block past the configured bound: unreadable, not half-read.
    records, assembler = feed(wire.segments, Http2ConnectionAssembler(
        fingerprint_key=KEY, max_header_bytes=16384))
    assert assembler.unreadable == "h2_limit"
    assert [(row.outcome, row.error.split(":")[0]) for row in records] == [("truncated", "h2_limit")]


def short_exchange() -> H2Wire:
    wire = H2Wire()
    wire.request(1, [(":method", "GET"), (":scheme", "http"), (":authority", "a"),
                     (":path", "/v1/models")], None)
    wire.respond(1, SSE_RESPONSE)
    wire.send(1, sse_chunk("a") + sse_chunk("b"), pad_length=3)
    wire.send(1, SSE_DONE, end_stream=True)
    return wire


SHORT = short_exchange().segments
SHORT_ROWS, _ = feed(SHORT)


def split(segments, cuts: dict[int, list[int]]):
    """Each segment cut at the given offsets; every piece keeps its segment's timestamp."""
    pieces = []
    for index, (ts, is_request, data) in enumerate(segments):
        bounds = [0, *sorted(set(cuts.get(index, []))), len(data)]
        pieces += [(ts, is_request, data[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
    return pieces


def test_timestamps_come_from_the_segment_holding_the_byte():
    # The GET's HEADERS frame (its first byte starts the request, its last ends it) and the
    # response's last write, each cut after their first byte, the rest written 500 ns later.
    request_at = next(i for i, (_, req, data) in enumerate(SHORT) if req and data[3] == 1)
    pieces = []
    for index, (ts, is_request, data) in enumerate(SHORT):
        if index in (request_at, len(SHORT) - 1):
            pieces += [(ts, is_request, data[:1]), (ts + 500, is_request, data[1:])]
        else:
            pieces.append((ts, is_request, data))
    [row], _ = feed(pieces)
    [whole] = SHORT_ROWS
    assert (row.req_start_ns, row.req_end_ns) == (whole.req_start_ns, whole.req_end_ns + 500)
    assert (row.resp_start_ns, row.resp_end_ns) == (whole.resp_start_ns, whole.resp_end_ns + 500)


def test_every_single_byte_offset_split_gives_the_same_rows():
    [row] = SHORT_ROWS
    assert (row.path, row.status, len(row.token_event_ns), row.outcome) == ("/v1/models", 200, 2, "complete")
    for index, (_, _, data) in enumerate(SHORT):
        for offset in range(1, len(data)):
            rows, assembler = feed(split(SHORT, {index: [offset]}))
            assert assembler.unreadable is None, (index, offset)
            assert rows == SHORT_ROWS, (index, offset)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(SHORT) - 1), st.integers(1, 400)), max_size=40))
def test_any_segmentation_gives_the_same_rows(cuts):
    by_segment: dict[int, list[int]] = {}
    for index, offset in cuts:
        by_segment.setdefault(index, []).append(offset % len(SHORT[index][2]))
    rows, _ = feed(split(SHORT, by_segment))
    assert rows == SHORT_ROWS


def with_gap(segment, head: int, tail: int):
    """A segment as the probes report a large call: only its head and tail captured."""
    ts, is_request, data = segment
    return ts, is_request, data[:head], len(data), data[len(data) - tail:] if tail else b""


def feed_described(assembler, described):
    rows = []
    for ts, is_request, head, total, tail in described:
        feed_one = assembler.feed_request_bytes if is_request else assembler.feed_response_bytes
        rows += feed_one(ts, head, total, tail)
    return rows


def test_gap_inside_a_header_block_makes_the_connection_unreadable():
    wire = H2Wire()
    streamed_chat(wire, 1, ["a"])
    headers_at = len(wire.segments)
    streamed_chat(wire, 3, ["b", "c"])  # stream 3's HEADERS refer to stream 1's table entries
    streamed_chat(wire, 5, ["d"])
    described = [(ts, req, data, len(data), b"") for ts, req, data in wire.segments]
    _, is_request, data = wire.segments[headers_at]
    assert is_request and frame_types([wire.segments[headers_at]], True)[0] == "HeadersFrame"
    assert len(data) > 9 + 2 + 2  # a HEADERS frame whose block uses stream 1's table entries
    described[headers_at] = with_gap(wire.segments[headers_at], 9 + 2, 2)  # hides part of the block

    assembler = Http2ConnectionAssembler(fingerprint_key=KEY)
    rows = feed_described(assembler, described)
    rows += assembler.close(wire.ts + 1, "server_closed")

    assert assembler.unreadable == "h2_gap"
    assert "capture gap" in assembler.error and "header block" in assembler.error
    # Stream 1 finished before the gap. Stream 3 had begun, so it is returned, truncated
    # and with nothing of its header block guessed; stream 5 is never seen.
    assert [(row.stream_id, row.outcome, row.path, row.error == assembler.error)
            for row in rows] == [(1, "complete", "/v1/chat/completions", False), (3, "truncated", "", True)]


def test_gap_inside_data_only_costs_that_streams_events():
    wire = H2Wire()
    wire.request(1, *chat_request())
    wire.respond(1, SSE_RESPONSE)
    big = wire.send(1, b"".join(sse_chunk(f"t{i}") for i in range(20)))
    last = wire.send(1, sse_chunk("last"))
    wire.send(1, SSE_DONE, end_stream=True)
    index = next(i for i, seg in enumerate(wire.segments) if seg[0] == big)
    described = [(ts, req, data, len(data), b"") for ts, req, data in wire.segments]
    described[index] = with_gap(wire.segments[index], 400, 200)

    assembler = Http2ConnectionAssembler(fingerprint_key=KEY)
    [row] = feed_described(assembler, described)

    assert assembler.unreadable is None
    assert row.outcome == "complete" and "were not captured" in row.error
    assert row.token_event_ns[-1] == last and 2 <= len(row.token_event_ns) < 21


@pytest.mark.parametrize("pad_length", [None, 40])
def test_gap_over_a_frame_header_is_unreadable_but_one_hiding_padding_is_not(pad_length):
    wire = H2Wire()
    wire.request(1, *chat_request())
    wire.respond(1, SSE_RESPONSE)
    events = b"".join(sse_chunk(f"t{i}") for i in range(20))
    wire.server.send_data(1, events[:1500], pad_length=pad_length)
    big = wire.send(1, events[1500:])  # two DATA frames in one write
    last = wire.send(1, sse_chunk("last"))
    wire.send(1, SSE_DONE, end_stream=True)
    index = next(i for i, seg in enumerate(wire.segments) if seg[0] == big)
    segment = wire.segments[index]
    assert len(segment[2]) > 1509
    first_frame = 9 + (1 + 1500 + 40 if pad_length else 1500)
    described = [(ts, req, data, len(data), b"") for ts, req, data in wire.segments]

    # The first frame's payload not captured (with it the pad length: how much of it
    # was data is unknown); the second frame, in the tail, still read.
    described[index] = with_gap(segment, 9, len(segment[2]) - first_frame)
    assembler = Http2ConnectionAssembler(fingerprint_key=KEY)
    [row] = feed_described(assembler, described)
    assert assembler.unreadable is None and row.outcome == "complete"
    assert row.token_event_ns[-1] == last and f"{first_frame - 9} bytes" in row.error

    # A gap that runs on past the first frame hides the second frame's header.
    described = [(ts, req, data, len(data), b"") for ts, req, data in wire.segments]
    described[index] = with_gap(segment, first_frame - 5, len(segment[2]) - first_frame - 2)
    assembler = Http2ConnectionAssembler(fingerprint_key=KEY)
    rows = feed_described(assembler, described)
    assert assembler.unreadable == "h2_gap" and "frame header" in assembler.error
    assert [(row.outcome, row.error) for row in rows] == [("truncated", assembler.error)]


def mixed_connection() -> H2Wire:
    """Two SSE streams and a gRPC stream, interleaved, with large writes."""
    wire = H2Wire()
    wire.request(1, *chat_request())
    wire.request(3, grpc_request(), grpc_message(b"\x0a\x02hi"))
    wire.request(5, *chat_request())
    for stream_id, headers in ((1, SSE_RESPONSE), (3, GRPC_RESPONSE), (5, SSE_RESPONSE)):
        wire.respond(stream_id, headers)
    for i in range(6):
        wire.server.send_data(1, b"".join(sse_chunk(f"a{i}.{j}") for j in range(8)))
        wire.server.send_data(3, b"".join(grpc_message(b"m" * (40 * j)) for j in range(i + 2)))
        wire.send(5, sse_chunk(f"b{i}"))
    wire.send(1, SSE_DONE, end_stream=True)
    wire.trailers(3, [("grpc-status", "0")])
    wire.send(5, SSE_DONE, end_stream=True)
    return wire


MIXED = mixed_connection().segments
MIXED_ROWS = {row.stream_id: row for row in feed(MIXED)[0]}


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([i for i, seg in enumerate(MIXED) if not seg[1]]),
                       st.tuples(st.integers(0, 2000), st.integers(0, 2000)), max_size=4))
def test_a_row_without_error_is_exactly_right_whatever_the_capture_missed(captures):
    """Response writes captured as head + tail only, at random sizes: the connection may
    become unreadable and rows may carry errors, but a row that says it is complete
    and error-free equals the row of the full capture, and every stream is returned once."""
    described = [(ts, req, data, len(data), b"") for ts, req, data in MIXED]
    for index, (head, tail) in captures.items():
        described[index] = with_gap(MIXED[index], head, min(tail, max(0, len(MIXED[index][2]) - head)))
    started = []
    assembler = Http2ConnectionAssembler(fingerprint_key=KEY, on_request_start=started.append)
    rows = feed_described(assembler, described) + assembler.close(MIXED[-1][0] + 1, "server_closed")

    assert sorted(map(id, rows)) == sorted(map(id, started))
    assert assembler.unreadable in (None, "h2_gap")
    for row in rows:
        if row.outcome == "complete" and row.error is None:
            assert row == MIXED_ROWS[row.stream_id]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(MIXED) - 1), st.integers(0, 1 << 16), st.integers(0, 255)),
                min_size=1, max_size=4))
def test_corrupted_bytes_end_in_a_named_reason_never_a_parser_failure(flips):
    segments = [list(segment) for segment in MIXED]
    for index, offset, value in flips:
        data = bytearray(segments[index][2])
        data[offset % len(data)] = value
        segments[index][2] = bytes(data)
    started = []
    assembler = Http2ConnectionAssembler(fingerprint_key=KEY, on_request_start=started.append)
    rows = assemble([tuple(segment) for segment in segments], assembler)
    assert sorted(map(id, rows)) == sorted(map(id, started))
    assert assembler.unreadable != "h2_internal", assembler.error


def test_adopted_mid_connection_is_unreadable_never_guessed():
    wire = H2Wire()
    streamed_chat(wire, 1, ["a"])
    first_new = len(wire.segments)
    streamed_chat(wire, 3, ["b"])
    later = wire.segments[first_new:]  # no preface, no SETTINGS, stream 1's table entries unseen

    rows, assembler = feed(later)
    assert (rows, assembler.unreadable) == ([], "h2_midstream")

    server_first = [seg for seg in later if not seg[1]] + [seg for seg in later if seg[1]]
    rows, assembler = feed(server_first)
    assert (rows, assembler.unreadable) == ([], "h2_midstream")
    assert set(UNREADABLE_REASONS) >= {"h2_midstream", "h2_gap"}


def test_stream_reset_by_the_client_and_goaway_refusal():
    wire = H2Wire()
    wire.request(1, *chat_request())
    wire.request(3, *chat_request())
    wire.respond(1, SSE_RESPONSE)
    token = wire.send(1, sse_chunk("a"))
    wire.client.reset_stream(1, error_code=8)  # CANCEL: the user pressed stop
    wire.flush()
    wire.server.close_connection(last_stream_id=1)  # stream 3 is refused
    wire.flush()

    records, assembler = feed(wire.segments, close=None)
    assert [(row.stream_id, row.outcome, row.error) for row in records] == [
        (1, "client_closed", "stream reset by the client (CANCEL)"),
        (3, "reset", "refused by the server's GOAWAY (NO_ERROR)"),
    ]
    assert records[0].token_event_ns == [token] and assembler.close(wire.ts, "client_closed") == []


def test_close_returns_open_streams_once():
    wire = H2Wire()
    wire.request(1, *chat_request())
    wire.respond(1, SSE_RESPONSE)
    wire.send(1, sse_chunk("a"))
    seen = []
    assembler = Http2ConnectionAssembler(fingerprint_key=KEY, on_request_start=seen.append)
    rows, _ = feed(wire.segments, assembler, close="reset")
    assert [(row.outcome, len(row.token_event_ns)) for row in rows] == [("reset", 1)]
    assert seen == rows and assembler.close(wire.ts, "reset") == []
    assert assembler.feed_response_bytes(wire.ts, b"\x00" * 9, 9) == []


def grpc_call(wire: H2Wire, stream_id: int, messages: list[bytes], frames: list[int],
              trailers: list[tuple[str, str]]) -> list[int]:
    """A server-streaming gRPC call; the response bytes are cut into DATA frames at
    `frames` (offsets), regardless of message boundaries. Returns the times at which
    each message's last byte was written."""
    wire.request(stream_id, grpc_request(), grpc_message(b"\x0a\x05hello"))
    wire.respond(stream_id, GRPC_RESPONSE)
    body = b"".join(grpc_message(m) for m in messages)
    ends, offset = [], 0
    for m in messages:
        offset += 5 + len(m)
        ends.append(offset)
    bounds = [0, *frames, len(body)]
    times = []
    for a, b in itertools.pairwise(bounds):
        ts = wire.send(stream_id, body[a:b])
        times += [ts for end in ends if a < end <= b]
    wire.trailers(stream_id, trailers)
    return times


def test_grpc_server_streaming_with_ok_status():
    wire = H2Wire()
    messages = [b"\x0a\x03abc", b"", b"x" * 300, b"\x0a\x01z"]
    # Frame 1 ends inside message 2's prefix; message 3 spans two frames; the last
    # frame holds two messages' ends.
    times = grpc_call(wire, 1, messages, [12, 200, 280], [("grpc-status", "0")])

    [row], assembler = feed(wire.segments, close=None)

    assert assembler.unreadable is None
    assert (row.api, row.path, row.status, row.grpc_status, row.grpc_message) == \
        ("grpc", "/inference.Generator/Generate", 200, 0, None)
    assert (row.response_messages, row.response_message_bytes, row.largest_response_message_bytes) == \
        (4, sum(map(len, messages)), 300)
    assert (row.request_messages, row.request_message_bytes) == (1, 7)
    assert row.token_event_ns == times and len(times) == 4
    assert (row.outcome, row.error, row.streamed, row.req_model, row.sse_events) == \
        ("complete", None, False, None, 0)
    assert row.resp_end_ns == wire.ts


def test_grpc_error_status_from_trailers_and_trailers_only():
    wire = H2Wire()
    grpc_call(wire, 1, [b"partial"], [], [("grpc-status", "13"), ("grpc-message", "KV%20cache%20full")])
    wire.request(3, grpc_request(), grpc_message(b""))
    wire.trailers(3, [*GRPC_RESPONSE, ("grpc-status", "8"), ("grpc-message", "quota")])

    records, _ = feed(wire.segments, close=None)

    assert [(r.stream_id, r.grpc_status, r.grpc_message, r.response_messages, r.outcome)
            for r in records] == [(1, 13, "KV cache full", 1, "complete"), (3, 8, "quota", 0, "complete")]


def test_grpc_message_reader_edges():
    assert is_grpc("application/grpc") and is_grpc("application/grpc+proto")
    assert not is_grpc("application/grpc-web") and not is_grpc("application/json")
    assert grpc_message_text("a%0Ab%ZZ") == "a b%ZZ"
    assert (grpc_status_code("14"), grpc_status_code("\xb2"), grpc_status_code(None)) == (14, None, None)
    events: list[int] = []
    reader = GrpcMessages(events, max_events=2)
    reader.data(1, grpc_message(b"abc") + grpc_message(b"d")[:3])
    reader.data(2, grpc_message(b"d")[3:])
    reader.gap(3, 2)  # inside nothing: the next bytes would be a prefix
    assert (reader.messages, events) == (2, [1, 2])
    assert "prefix" in reader.error
    reader = GrpcMessages()
    reader.data(1, b"\x07\x00\x00\x00\x01x")  # flag 7 is not a gRPC prefix
    assert reader.messages == 0 and "invalid" in reader.error


def test_mid_connection_segments_are_recognised_as_http2_frames():
    """What lets a tracker name an adopted connection's traffic h2_midstream, not silence."""
    later = [data for _, _, data in MIXED[4:]]
    assert all(resembles_http2_frames(data) for data in later)
    http1 = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n",
             sse_chunk("x"), b'{"model": "m"}', b"\x00\x00", b""]
    assert not any(resembles_http2_frames(data) for data in http1)
    # A frame header with a flag its type does not define, or a PING of the wrong size.
    assert not resembles_http2_frames(b"\x00\x00\x00\x00\x02\x00\x00\x00\x01")
    assert not resembles_http2_frames(b"\x00\x00\x04\x06\x00\x00\x00\x00\x00" + b"\x00" * 4)


@pytest.mark.parametrize("garbage", [b"\x00\x00\x04\x08\x00\x00\x00\x00\x00", b"GET / HTTP/1.1\r\n"])
def test_bad_first_bytes(garbage):
    assembler = Http2ConnectionAssembler(fingerprint_key=KEY)
    assert assembler.feed_request_bytes(1, garbage, len(garbage)) == []
    assert assembler.unreadable == "h2_midstream"
