"""HTTP/2 assembler: the two byte streams of one HTTP/2 connection → one record per stream.

Fed like the HTTP/1.1 assembler (assembler.py): segments of
(timestamp, captured head, call length, captured tail), the bytes between head
and tail a gap of known size. Each direction is a frame parser that follows
frames across segments (a frame split over writes, many frames in one write)
and keeps its own HPACK decoder: HPACK's dynamic table is shared by every
header block of a direction since the connection began, so the parser must
see the connection from its preface and every header block whole.

That is also where it stops: a connection picked up after its preface
(`h2_midstream`), or a capture gap over a frame header, a header block or a
control frame (`h2_gap`), leaves its header state unknown. The connection is
then marked unreadable with that reason, its open streams end truncated, and
nothing more is parsed: header fields are never guessed. A gap inside a DATA
payload only costs that stream's body bytes, as in HTTP/1.

Every stream a client opens becomes one `H2Exchange` (the HTTP/1 Exchange
with the stream id and gRPC fields), with the same timestamps: request first
byte (its HEADERS frame) and last byte (END_STREAM), response first byte and
last byte, and one token event per SSE event carrying generated text (the
HTTP/1 SSE reader is used as is) or, for gRPC, per response message.

Which connections are HTTP/2 is the caller's decision: `starts_http2` reads a
connection's first bytes (the client preface, or the server's SETTINGS, which
may come first); `resembles_http2_frames` recognises HTTP/2 traffic on a
connection picked up mid-way, so that it is counted as unreadable, not lost.
"""

from __future__ import annotations

import logging
import struct
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields

import hpack

from ....contract.tenant import DEFAULT_TENANT_HEADER, tenant_header_name, tenant_id
from ..exchange import MAX_TOKEN_EVENTS, OUTCOME_BY_CLOSE_REASON, Exchange
from .bodies import RequestBody, path_of, response_body_reader
from .grpc import GrpcMessages, grpc_message_text, grpc_status_code, is_grpc
from .segments import MAX_OPEN_EXCHANGES, normalise_segment

__all__ = ["PREFACE", "UNREADABLE_REASONS", "H2Exchange", "Http2ConnectionAssembler",
           "resembles_http2_frames", "starts_http2"]

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
UNREADABLE_REASONS = (
    "h2_midstream",  # picked up after the connection preface: header state unknown
    "h2_gap",  # a capture gap outside DATA payloads
    "h2_hpack",  # a header block that does not decode
    "h2_protocol",  # frames that break RFC 9113's rules
    "h2_limit",  # a header block or stream count past the bounds kept
    "h2_internal",  # a bug in this parser
)

# The largest HPACK dynamic table kept per direction (the default is 4 KiB; servers allow 64 KiB).
MAX_TABLE_BYTES = 1 << 20

_FRAME_HEADER = struct.Struct(">BHBBL")  # 24-bit length as 8 + 16 bits, type, flags, stream id
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")

_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, \
    _WINDOW_UPDATE, _CONTINUATION = range(10)
_END_STREAM = 0x1  # also SETTINGS' and PING's ACK
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY_FLAG = 0x20
_SETTINGS_HEADER_TABLE_SIZE = 1
_ERROR_CODES = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR",
                "SETTINGS_TIMEOUT", "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL",
                "COMPRESSION_ERROR", "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY",
                "HTTP_1_1_REQUIRED")
# Payload bytes of a control frame that are read; the rest (GOAWAY debug data) is skipped.
_KEEP = {_RST_STREAM: 4, _GOAWAY: 8, _SETTINGS: 6 * 64}
_HEADER_BLOCK_FRAMES = (_HEADERS, _PUSH_PROMISE, _CONTINUATION)
_STREAM_FRAMES = (_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _PUSH_PROMISE, _CONTINUATION)
_CONNECTION_FRAMES = (_SETTINGS, _PING, _GOAWAY)
# Flags each frame type defines (RFC 9113, section 6); senders leave the others unset.
_DEFINED_FLAGS = (_END_STREAM | _PADDED, _END_STREAM | _END_HEADERS | _PADDED | _PRIORITY_FLAG, 0, 0,
                  _END_STREAM, _END_HEADERS | _PADDED, _END_STREAM, 0, 0, _END_HEADERS)
_FIXED_LENGTHS = {_PRIORITY: 5, _RST_STREAM: 4, _PING: 8, _WINDOW_UPDATE: 4}

# Parser states of one direction.
_PREFACE = 0  # the client's connection preface, possibly in pieces
_FRAME = 1  # a 9-byte frame header, possibly in pieces
_PAYLOAD = 2  # `_left` payload bytes of the current frame


def _error_name(code: int) -> str:
    return _ERROR_CODES[code] if code < len(_ERROR_CODES) else f"error 0x{code:x}"


def starts_http2(head: bytes, *, is_request: bool) -> bool | None:
    """Whether a connection whose first bytes in one direction are `head` is HTTP/2
    from its start; None while `head` is too short to tell.

    Requests start with the preface; responses with the server's SETTINGS frame,
    which a server may write before the client's preface arrives."""
    if is_request:
        if not PREFACE.startswith(head[:len(PREFACE)]):
            return False
        return True if len(head) >= 4 else None  # "PRI " cannot begin an HTTP/1 request
    if len(head) < _FRAME_HEADER.size:
        return None
    high, low, ftype, flags, stream_id = _FRAME_HEADER.unpack_from(head)
    return ftype == _SETTINGS and flags == 0 and stream_id == 0 and ((high << 16) | low) % 6 == 0


def resembles_http2_frames(data: bytes) -> bool:
    """Whether a segment of a connection picked up mid-way reads as whole HTTP/2
    frames from its first byte: every frame header in it is one a conforming peer
    writes (known type, only that type's flags, the right stream id and length).

    A heuristic, only for naming why such a connection is not read (h2_midstream,
    e.g. by handing it to Http2ConnectionAssembler): nothing is parsed from it."""
    pos = frames = 0
    while pos + _FRAME_HEADER.size <= len(data):
        high, low, ftype, flags, stream_id = _FRAME_HEADER.unpack_from(data, pos)
        length = (high << 16) | low
        if ftype > _CONTINUATION or flags & ~_DEFINED_FLAGS[ftype] or stream_id >> 31 \
                or _wrong_stream(ftype, stream_id) or _FIXED_LENGTHS.get(ftype, length) != length:
            return False
        frames += 1
        pos += _FRAME_HEADER.size + length
    return frames > 0


def _wrong_stream(ftype: int, stream_id: int) -> bool:
    return (ftype in _STREAM_FRAMES and not stream_id) or (ftype in _CONNECTION_FRAMES and stream_id != 0)


@dataclass(slots=True)
class H2Exchange(Exchange):
    """One HTTP/2 stream: the HTTP/1 Exchange's fields (`api` is "grpc" for application/grpc*) plus the stream's own.

    `seq` numbers streams in the order the client opened them. For gRPC, each
    response message is one entry of `token_event_ns`."""

    stream_id: int = 0
    grpc_status: int | None = None  # from the trailers (or a trailers-only response)
    grpc_message: str | None = None
    request_messages: int = 0  # gRPC length-prefixed messages and their payload bytes
    request_message_bytes: int = 0
    response_messages: int = 0
    response_message_bytes: int = 0
    largest_response_message_bytes: int = 0


class _Stream:
    """A stream being assembled: its record, body readers and the progress of its halves."""

    __slots__ = ("exchange", "request_body", "response_body", "request_done", "response_done",
                 "request_headers_seen", "final_response_seen")

    def __init__(self, exchange: H2Exchange) -> None:
        self.exchange = exchange
        self.request_body = None
        self.response_body = None
        self.request_done = False
        self.response_done = False
        self.request_headers_seen = False
        self.final_response_seen = False


class _Unreadable(Exception):
    """The connection cannot be followed any further: args are (reason code, words)."""


class Http2ConnectionAssembler:
    """Assembles the streams of ONE HTTP/2 connection from its two byte streams.

    Feed methods and close() never raise on any input; they return the streams
    that finished (both halves ended, reset, refused, or cut off), as H2Exchange
    records in the order they finished. Every record passed to on_request_start
    is returned exactly once. `unreadable` names why the connection stopped
    being parsed (one of UNREADABLE_REASONS), None while it is followed."""

    def __init__(self, *, fingerprint_key: bytes, max_header_bytes: int = 65536,
                 on_request_start: Callable[[Exchange], None] | None = None,
                 tenant_header: str | None = DEFAULT_TENANT_HEADER) -> None:
        if not isinstance(fingerprint_key, (bytes, bytearray)) or len(fingerprint_key) > 64:
            raise ValueError("fingerprint_key must be bytes of at most 64 bytes (a BLAKE2b key)")
        if not isinstance(max_header_bytes, int) or max_header_bytes < 64:
            raise ValueError("max_header_bytes must be an integer of at least 64")
        self._fingerprint_key = bytes(fingerprint_key)
        tenant_header = tenant_header_name(tenant_header)
        self._tenant_field = None if tenant_header is None else tenant_header.encode("ascii")
        self._on_request_start = on_request_start
        self._max_header_bytes = max_header_bytes
        self._streams: dict[int, _Stream] = {}
        self._last_client_stream = 0
        self._next_seq = 0
        self._ready: list[H2Exchange] = []
        self._closed = False
        self.unreadable: str | None = None
        self._error: str | None = None
        self._request = _Direction(self, is_request=True)
        self._response = _Direction(self, is_request=False)

    @property
    def error(self) -> str | None:
        """The last per-connection error, in plain words; None if there was none."""
        return self._error

    def continue_upgraded(self, request: Exchange) -> None:
        """The connection was upgraded from HTTP/1.1 (`Upgrade: h2c`, RFC 7540 section 3.2) and is read
        from the end of the 101 on: `request`, read whole in HTTP/1.1, is stream 1, whose response
        comes in HTTP/2; the streams after it number on from its seq. Call before any feed."""
        exchange = H2Exchange(**{f.name: getattr(request, f.name) for f in fields(Exchange)}, stream_id=1)
        exchange.resp_start_ns = None  # the 101 is not the response: stream 1's HEADERS start it
        stream = _Stream(exchange)
        stream.request_headers_seen = stream.request_done = True
        self._streams[1] = stream
        self._last_client_stream = 1
        self._next_seq = request.seq + 1

    def open_exchanges(self) -> list[H2Exchange]:
        """The streams started and not yet returned, oldest first; for looking at, never changing."""
        return [stream.exchange for stream in self._streams.values()]

    def feed_request_bytes(self, ts_ns: int, head: bytes, total_len: int,
                           tail: bytes = b"") -> list[H2Exchange]:
        """One segment travelling towards the server."""
        return self._feed(self._request, ts_ns, head, total_len, tail)

    def feed_response_bytes(self, ts_ns: int, head: bytes, total_len: int,
                            tail: bytes = b"") -> list[H2Exchange]:
        """One segment travelling towards the client."""
        return self._feed(self._response, ts_ns, head, total_len, tail)

    def close(self, ts_ns: int, reason: str) -> list[H2Exchange]:
        """The connection closed (reason: one of exchange.CLOSE_REASONS):
        every stream still open is returned. Later feeds are ignored."""
        if self._closed:
            return []
        self._closed = True
        outcome = OUTCOME_BY_CLOSE_REASON.get(reason) if isinstance(reason, str) else None
        if outcome is None:
            self._error = "unknown close reason; open streams recorded as truncated"
            outcome = "truncated"
        self._end_all(outcome, None)
        return self._take_ready()

    # -- driving ------------------------------------------------------------

    def _feed(self, direction: _Direction, ts_ns, head, total_len, tail) -> list[H2Exchange]:
        if self._closed or self.unreadable:
            return []
        try:
            segment = normalise_segment(ts_ns, head, total_len, tail)
            if segment is None:
                raise _Unreadable("h2_protocol", f"malformed {direction.noun} segment description")
            ts, head, gap, tail = segment
            if head:
                direction.data(ts, head)
            if gap:
                direction.gap(ts, gap)
            if tail:
                direction.data(ts, tail)
        except _Unreadable as exc:
            self._stop(*exc.args)
        except Exception as exc:  # safety net: a parser bug must not take down the agent
            # Only the type and location are logged: an exception's message may quote payload bytes.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            log.warning("HTTP/2 assembler internal error %s at %s:%s; connection no longer parsed",
                        type(exc).__name__, frame.name, frame.lineno)
            self._stop("h2_internal", f"internal parser error ({type(exc).__name__})")
        return self._take_ready()

    def _take_ready(self) -> list[H2Exchange]:
        ready, self._ready = self._ready, []
        return ready

    def _stop(self, reason: str, words: str) -> None:
        self.unreadable = reason
        self._error = f"{reason}: {words}; connection no longer parsed"
        self._end_all("truncated", self._error)

    def _end_all(self, outcome: str, error: str | None) -> None:
        for stream in self._streams.values():
            self._end_stream(stream, outcome, error)
        self._streams.clear()

    def _end_stream(self, stream: _Stream, outcome: str, error: str | None) -> None:
        """A stream ends before both halves did: its readers finish where they are."""
        if not stream.request_done:
            self._finish_body(stream, request_side=True)
        if not stream.response_done:
            self._finish_body(stream, request_side=False)
            exchange = stream.exchange
            if exchange.outcome == "complete":
                exchange.outcome = outcome
            exchange.error = exchange.error or error
        self._ready.append(stream.exchange)

    # -- streams --------------------------------------------------------------

    def _frame_started(self, ts: int, is_request: bool, ftype: int, stream_id: int,
                       nbytes: int) -> _Stream | None:
        """The open stream a frame belongs to, its bytes counted; a client's HEADERS
        on a new stream id opens the stream (its first byte is the request's)."""
        stream = self._streams.get(stream_id)
        if stream is None and is_request and ftype == _HEADERS:
            stream = self._open_stream(ts, stream_id)
        if stream is None:  # closed, never opened, or pushed by the server: not recorded
            return None
        exchange = stream.exchange
        if is_request:
            exchange.req_bytes += nbytes
        else:
            exchange.resp_bytes += nbytes
            if ftype == _HEADERS and exchange.resp_start_ns is None:
                exchange.resp_start_ns = ts
        return stream

    def _open_stream(self, ts: int, stream_id: int) -> _Stream | None:
        if stream_id % 2 == 0:
            raise _Unreadable("h2_protocol", f"client opened even-numbered stream {stream_id}")
        if stream_id <= self._last_client_stream:  # HEADERS for a stream that already ended
            return None
        if len(self._streams) >= MAX_OPEN_EXCHANGES:
            raise _Unreadable("h2_limit", f"more than {MAX_OPEN_EXCHANGES} streams open at once")
        self._last_client_stream = stream_id
        stream = _Stream(H2Exchange(seq=self._next_seq, stream_id=stream_id, req_start_ns=ts))
        self._next_seq += 1
        self._streams[stream_id] = stream
        if self._on_request_start is not None:
            self._on_request_start(stream.exchange)
        return stream

    def _header_block(self, ts: int, is_request: bool, stream: _Stream | None,
                      fields: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        if stream is not None:
            if is_request:
                self._request_headers(stream, fields)
            else:
                self._response_headers(stream, fields)
        if end_stream:
            self._half_ended(ts, is_request, stream)

    def _request_headers(self, stream: _Stream, fields: list[tuple[bytes, bytes]]) -> None:
        if stream.request_headers_seen:  # trailers: nothing in them is recorded
            return
        stream.request_headers_seen = True
        tenant_field = self._tenant_field
        exchange = stream.exchange
        content_type = ""
        for name, value in fields:
            if name == b":method":
                exchange.method = value.decode("ascii", "replace")[:32]
            elif name == b":path":
                exchange.path = path_of(value)
            elif name == b"content-type":
                content_type = value.decode("latin-1").lower()
            elif name == tenant_field and not exchange.tenant:
                exchange.tenant = tenant_id(value.decode("latin-1"))
        if is_grpc(content_type):
            exchange.api = "grpc"
            stream.request_body = GrpcMessages()
        else:
            stream.request_body = RequestBody(
                exchange, self._fingerprint_key,
                read_fields=not content_type or "json" in content_type)

    def _response_headers(self, stream: _Stream, fields: list[tuple[bytes, bytes]]) -> None:
        exchange = stream.exchange
        wanted: dict[str, str] = {}
        for name, value in fields:
            if name in _RESPONSE_FIELDS:
                wanted[name.decode("ascii")] = value.decode("latin-1")
        if "grpc-status" in wanted:  # trailers, or a trailers-only response
            exchange.grpc_status = grpc_status_code(wanted["grpc-status"])
            exchange.grpc_message = grpc_message_text(wanted.get("grpc-message"))
        status = wanted.get(":status", "")
        if stream.final_response_seen or not (len(status) == 3 and status.isascii() and status.isdigit()):
            return
        exchange.status = int(status)
        if exchange.status < 200:  # interim: the final response's headers follow
            return
        stream.final_response_seen = True
        if exchange.api == "grpc" or is_grpc(wanted.get("content-type", "")):
            exchange.api = "grpc"
            stream.response_body = GrpcMessages(exchange.token_event_ns, MAX_TOKEN_EVENTS)
        else:
            stream.response_body = response_body_reader(exchange, wanted)

    def _half_ended(self, ts: int, is_request: bool, stream: _Stream | None) -> None:
        """END_STREAM in one direction; the stream is returned once both ended."""
        if stream is None or (stream.request_done if is_request else stream.response_done):
            return
        self._finish_body(stream, request_side=is_request)
        if is_request:
            stream.exchange.req_end_ns = ts
            stream.request_done = True
        else:
            stream.exchange.resp_end_ns = ts
            stream.response_done = True
        if stream.request_done and stream.response_done:
            del self._streams[stream.exchange.stream_id]
            self._ready.append(stream.exchange)

    def _finish_body(self, stream: _Stream, *, request_side: bool) -> None:
        body = stream.request_body if request_side else stream.response_body
        if body is None:
            return
        if request_side:
            stream.request_body = None
        else:
            stream.response_body = None
        body.finish()
        if isinstance(body, GrpcMessages):
            exchange = stream.exchange
            if request_side:
                exchange.request_messages, exchange.request_message_bytes = \
                    body.messages, body.message_bytes
            else:
                exchange.response_messages, exchange.response_message_bytes = \
                    body.messages, body.message_bytes
                exchange.largest_response_message_bytes = body.largest_message_bytes
            exchange.error = exchange.error or body.error

    def _reset(self, is_request: bool, stream: _Stream | None, code: int) -> None:
        if stream is None:
            return
        del self._streams[stream.exchange.stream_id]
        by = "client" if is_request else "server"
        self._end_stream(stream, "client_closed" if is_request else "reset",
                         f"stream reset by the {by} ({_error_name(code)})")

    def _goaway(self, is_request: bool, last_stream_id: int, code: int) -> None:
        if code:
            self._error = f"GOAWAY from the {'client' if is_request else 'server'} ({_error_name(code)})"
        if is_request:  # the client's GOAWAY names server-initiated (pushed) streams only
            return
        refused = [stream for stream_id, stream in self._streams.items() if stream_id > last_stream_id]
        for stream in refused:
            del self._streams[stream.exchange.stream_id]
            self._end_stream(stream, "reset", f"refused by the server's GOAWAY ({_error_name(code)})")

    def _table_size_setting(self, is_request: bool, size: int) -> None:
        # A peer's SETTINGS_HEADER_TABLE_SIZE bounds the table the OTHER side's encoder uses.
        # Past MAX_TABLE_BYTES an encoder that uses it makes the connection unreadable
        # rather than the agent hold a table as large as a peer cares to allow.
        decoder = (self._response if is_request else self._request).decoder
        decoder.max_allowed_table_size = min(size, MAX_TABLE_BYTES)


_RESPONSE_FIELDS = frozenset({b":status", b"content-type", b"content-encoding", b"grpc-status",
                              b"grpc-message"})


class _Direction:
    """Frame parser and HPACK decoder for one direction of a connection."""

    __slots__ = ("conn", "is_request", "noun", "decoder", "state", "_buf", "_frame_ts", "_ftype",
                 "_flags", "_stream_id", "_stream", "_left", "_keep", "_pad_pending", "_data_left",
                 "_data_hidden", "_block", "_block_stream_id", "_block_stream", "_block_end_stream",
                 "_first_frame")

    def __init__(self, conn: Http2ConnectionAssembler, *, is_request: bool) -> None:
        self.conn = conn
        self.is_request = is_request
        self.noun = "request" if is_request else "response"
        self.decoder = hpack.Decoder(max_header_list_size=conn._max_header_bytes)
        self.state = _PREFACE if is_request else _FRAME
        self._buf = bytearray()  # preface or frame header in pieces; a control frame's payload
        self._frame_ts = 0  # the segment holding the current frame's first byte (when split)
        self._ftype = self._flags = self._stream_id = self._left = self._keep = 0
        self._stream: _Stream | None = None
        self._pad_pending = False  # a padded DATA frame's pad-length byte is next
        self._data_left = 0  # data (not padding) bytes left in the current DATA frame
        self._data_hidden = False  # a gap hid the pad length: the frame's rest is unknown
        self._block = bytearray()  # a header block across HEADERS/PUSH_PROMISE + CONTINUATION
        self._block_stream_id = 0  # non-zero while a header block waits for CONTINUATION
        self._block_stream: _Stream | None = None
        self._block_end_stream = False
        self._first_frame = True

    def data(self, ts: int, data: bytes) -> None:
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end:
            state = self.state
            if state == _PAYLOAD:
                take = min(self._left, end - pos)
                if self._ftype == _DATA:
                    self._data_payload(ts, view[pos:pos + take])
                elif len(self._buf) < self._keep:
                    self._buf += view[pos:pos + min(take, self._keep - len(self._buf))]
                pos += take
                self._left -= take
                if not self._left:
                    self._frame_done(ts)
            elif state == _FRAME:
                buf = self._buf
                if not buf:
                    self._frame_ts = ts
                    if end - pos >= _FRAME_HEADER.size:  # the common case: no copy
                        header = _FRAME_HEADER.unpack_from(view, pos)
                        pos += _FRAME_HEADER.size
                        self._frame_start(ts, *header)
                        continue
                need = _FRAME_HEADER.size - len(buf)
                buf += view[pos:pos + need]
                pos += min(need, end - pos)
                if len(buf) == _FRAME_HEADER.size:
                    header = _FRAME_HEADER.unpack(buf)
                    buf.clear()
                    self._frame_start(ts, *header)
            else:  # _PREFACE
                have = len(self._buf)
                piece = data[pos:pos + len(PREFACE) - have]
                if PREFACE[have:have + len(piece)] != piece:
                    raise _Unreadable("h2_midstream", "the connection's first bytes are not the "
                                      "HTTP/2 preface (picked up mid-connection)")
                self._buf += piece
                pos += len(piece)
                if len(self._buf) == len(PREFACE):
                    self._buf.clear()
                    self.state = _FRAME

    def gap(self, ts: int, nbytes: int) -> None:
        # Inside a payload the frame boundaries stay known: a gap there costs DATA
        # body bytes, or nothing when it covers only bytes that are skipped anyway.
        within_payload = self.state == _PAYLOAD and nbytes <= self._left
        if within_payload and self._ftype == _DATA:
            if self._pad_pending:  # the split between data and padding is unknown now
                self._pad_pending = False
                self._data_hidden = True
            if self._data_hidden:
                self._body_gap(ts, nbytes)
            else:
                hidden = min(nbytes, self._data_left)  # what follows the data is padding
                self._data_left -= hidden
                self._body_gap(ts, hidden)
        elif not (within_payload and len(self._buf) >= self._keep):
            self._raise_gap(nbytes)
        self._left -= nbytes
        if not self._left:
            self._frame_done(ts)

    def _raise_gap(self, nbytes: int) -> None:
        if self.state == _PREFACE:
            where = "the connection preface"
        elif self.state == _FRAME or self._ftype == _DATA:
            where = "a frame header"
        else:
            where = "a header block or control frame"
        raise _Unreadable("h2_gap", f"capture gap of {nbytes} bytes over {where} in the "
                                    f"{self.noun} stream")

    # -- frames -------------------------------------------------------------

    def _frame_start(self, ts: int, high: int, low: int, ftype: int, flags: int,
                     stream_id: int) -> None:
        length = (high << 16) | low
        stream_id &= 0x7FFFFFFF
        if self._first_frame:
            self._first_frame = False
            if ftype != _SETTINGS or flags & _END_STREAM:
                reason = "h2_protocol" if self.is_request else "h2_midstream"
                raise _Unreadable(reason, f"the {self.noun} stream does not start with SETTINGS")
        if self._block_stream_id and (ftype != _CONTINUATION or stream_id != self._block_stream_id):
            raise _Unreadable("h2_protocol", "a header block was interrupted by another frame")
        if ftype == _CONTINUATION and not self._block_stream_id:
            raise _Unreadable("h2_protocol", "CONTINUATION without a header block before it")
        if _wrong_stream(ftype, stream_id):
            raise _Unreadable("h2_protocol", f"frame type {ftype} on stream {stream_id}")
        self._ftype, self._flags, self._stream_id, self._left = ftype, flags, stream_id, length
        self._stream = self.conn._frame_started(self._frame_ts, self.is_request, ftype, stream_id,
                                                _FRAME_HEADER.size + length) if stream_id else None
        if ftype in _HEADER_BLOCK_FRAMES:
            if len(self._block) + length > self.conn._max_header_bytes:
                raise _Unreadable("h2_limit", f"{self.noun} header block larger than "
                                              f"{self.conn._max_header_bytes} bytes")
            self._keep = length
        else:
            self._keep = _KEEP.get(ftype, 0)
        if ftype == _DATA:
            self._pad_pending = bool(flags & _PADDED)
            self._data_left = 0 if self._pad_pending else length
            self._data_hidden = False
        self.state = _PAYLOAD
        if not length:
            self._frame_done(ts)

    def _data_payload(self, ts: int, chunk: memoryview) -> None:
        if self._pad_pending:
            self._pad_pending = False
            self._data_left = self._left - 1 - chunk[0]
            if self._data_left < 0:
                raise _Unreadable("h2_protocol", "DATA padding longer than the frame")
            chunk = chunk[1:]
        if self._data_hidden:
            self._body_gap(ts, len(chunk))
            return
        data = chunk[:self._data_left]  # what follows the data is padding
        self._data_left -= len(data)
        if data:
            body = self._body()
            if body is not None:
                body.data(ts, data)

    def _body(self):
        stream = self._stream
        if stream is None:
            return None
        return stream.request_body if self.is_request else stream.response_body

    def _body_gap(self, ts: int, nbytes: int) -> None:
        body = self._body()
        if body is not None and nbytes:
            body.gap(ts, nbytes)

    def _frame_done(self, ts: int) -> None:
        self.state = _FRAME
        ftype, flags = self._ftype, self._flags
        payload = self._buf
        conn = self.conn
        try:
            if ftype == _DATA:
                if flags & _END_STREAM:
                    conn._half_ended(ts, self.is_request, self._stream)
            elif ftype in _HEADER_BLOCK_FRAMES:
                self._header_fragment(ts, payload)
            elif ftype == _RST_STREAM:
                if len(payload) != 4:
                    raise _Unreadable("h2_protocol", "RST_STREAM frame of the wrong size")
                conn._reset(self.is_request, self._stream, _U32.unpack(payload)[0])
            elif ftype == _SETTINGS:
                if not flags & _END_STREAM:  # not an ACK
                    self._settings(payload)
            elif ftype == _GOAWAY:
                if len(payload) < 8:
                    raise _Unreadable("h2_protocol", "GOAWAY frame too short")
                last_stream_id, code = struct.unpack_from(">LL", payload)
                conn._goaway(self.is_request, last_stream_id & 0x7FFFFFFF, code)
        finally:
            payload.clear()
            self._stream = None

    def _settings(self, payload: bytearray) -> None:
        if len(payload) % 6:
            raise _Unreadable("h2_protocol", "SETTINGS frame of the wrong size")
        for identifier, value in _SETTING.iter_unpack(payload):
            if identifier == _SETTINGS_HEADER_TABLE_SIZE:
                self.conn._table_size_setting(self.is_request, value)

    def _header_fragment(self, ts: int, payload: bytearray) -> None:
        ftype, flags = self._ftype, self._flags
        start, pad = 0, 0
        if ftype != _CONTINUATION:
            if flags & _PADDED:
                if not payload:
                    raise _Unreadable("h2_protocol", "padded header frame without a pad length")
                pad, start = payload[0], 1
            if ftype == _HEADERS and flags & _PRIORITY_FLAG:
                start += 5
            elif ftype == _PUSH_PROMISE:
                start += 4  # the promised stream id; pushed streams are not recorded
            if start + pad > len(payload):
                raise _Unreadable("h2_protocol", "header frame padding longer than the frame")
            self._block_stream_id = self._stream_id
            self._block_stream = self._stream if ftype == _HEADERS else None
            self._block_end_stream = ftype == _HEADERS and bool(flags & _END_STREAM)
        with memoryview(payload) as view:  # released before the frame buffer is reused
            fragment = view[start:len(payload) - pad]
            if self._block or not flags & _END_HEADERS:
                self._block += fragment
            block = None if self._block else bytes(fragment)  # one frame: no second copy
            fragment.release()
        if not flags & _END_HEADERS:
            return
        if block is None:
            block = bytes(self._block)
            self._block.clear()
        stream, end_stream = self._block_stream, self._block_end_stream
        self._block_stream_id = 0
        self._block_stream = None
        try:
            fields = self.decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            raise _Unreadable("h2_limit", f"{self.noun} header list larger than "
                                          f"{self.conn._max_header_bytes} bytes") from None
        except (hpack.HPACKError, ValueError, IndexError) as exc:
            raise _Unreadable("h2_hpack", f"{self.noun} header block does not decode "
                                          f"({type(exc).__name__})") from None
        self.conn._header_block(ts, self.is_request, stream, fields, end_stream)
