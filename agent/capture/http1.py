"""HTTP/1.1 + SSE assembler: the two byte streams of one connection → one record per exchange.

The kernel probes report every read()/write() (or SSL_read/SSL_write) on a
connection as a *segment*: a timestamp, the first bytes of the call (`head`),
the call's full length and, for large calls, its last bytes (`tail`). The
bytes between head and tail were never captured: a *gap* of known size.

`HttpConnectionAssembler` is role-agnostic: the caller feeds the bytes that
travel towards the server as "request bytes" and the others as "response
bytes". Each direction is a `_MessageStream` that finds HTTP/1.x message
boundaries (start line, headers, Content-Length / chunked / close-delimited
bodies) across segments and gaps; responses are paired with requests in FIFO
order (that is what HTTP/1.1 pipelining guarantees). Bodies go to small
readers that keep bounded samples: the request body's head and tail (model,
stream flag, keyed fingerprint), a JSON response's head and tail (id, model,
usage), or an SSE parser that timestamps every event carrying generated text.
Of the request's header fields only one value is kept: the tenant header's
(`x-tenant-id` unless configured otherwise), an identifier the gateway also reads.

When framing is lost (a gap in headers or chunk framing, garbage, oversized
headers, or a connection picked up mid-message) the exchange at hand ends as
"truncated" with an error, and the stream waits for a segment that starts with
a new message: a request line or "HTTP/1." (or the beginning of one, when the
segment ends before the line does). No prompt or completion text is ever kept
beyond these bounded samples, and none of it appears in error strings.

Invariant the caller relies on: every exchange passed to `on_request_start`
is returned exactly once, by a feed method or by `close()`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CLOSE_REASONS", "DEFAULT_TENANT_HEADER", "Exchange", "HttpConnectionAssembler",
           "tenant_header_name", "tenant_id"]

log = logging.getLogger(__name__)

CLOSE_REASONS = ("server_closed", "client_closed", "reset", "agent_stop")
_OUTCOME_BY_CLOSE_REASON = {
    "server_closed": "truncated",
    "client_closed": "client_closed",
    "reset": "reset",
    "agent_stop": "truncated",
}

# Bounded samples (see docs/ROW_SCHEMA.md: body_fp covers the first 4 KiB and last 1 KiB).
REQUEST_BODY_HEAD = 4096
REQUEST_BODY_TAIL = 1024
RESPONSE_BODY_HEAD = 4096
RESPONSE_BODY_TAIL = 4096
# SSE events up to this size are parsed with json.loads; larger ones (and events
# damaged by a capture gap) are read with regexes over their head and tail.
SSE_EVENT_JSON_MAX = 65536
SSE_EVENT_TAIL = 4096
CHUNK_SIZE_LINE_MAX = 4096
# Token event timestamps kept per exchange (far above any model's output length);
# an endless stream must not grow the list without bound.
MAX_TOKEN_EVENTS = 1 << 18
# More requests than this without a finished response (hostile pipelining)
# stops parsing the connection rather than growing the queue without bound.
MAX_OPEN_EXCHANGES = 1024
# No read()/write() is this large; bigger lengths are malformed input.
MAX_SEGMENT_BYTES = 1 << 40
_MAX_FIELD_CHARS = 256  # model names and response ids are cut to this length
_MAX_COUNT = 0xFFFFFFFF  # token counts are UInt32 in the row
# The request header that names the tenant: the actuator's gateway hook reads the same one by
# default, so its token budgets and the agent's server-side token counts agree on who a tenant is.
DEFAULT_TENANT_HEADER = "x-tenant-id"
MAX_TENANT_CHARS = 128  # tenant ids are short; a longer value is cut, not refused

# Framing states of one direction's byte stream.
_RESYNC = 0  # framing unknown: wait for a segment that starts with a new message
_IDLE = 1  # between messages: the next byte starts one
_HEADERS = 2  # start line and header fields, up to the blank line
_BODY_LENGTH = 3  # Content-Length body: `_remaining` bytes left
_CHUNK_SIZE = 4  # a chunk-size line (with optional extensions)
_CHUNK_DATA = 5  # chunk data: `_remaining` bytes left
_CHUNK_DATA_END = 6  # the CRLF that follows chunk data
_TRAILERS = 7  # trailer fields after the last chunk, up to the blank line
_BODY_UNTIL_CLOSE = 8  # body delimited by the connection's close
_STOPPED = 9  # not HTTP/1.x any more (upgrade, TLS, HTTP/2) or connection closed

# How a message's body is delimited, decided from its header block.
_NO_BODY = 0
_LENGTH = 1
_CHUNKED = 2
_UNTIL_CLOSE = 3
_INTERIM = 4  # a 1xx response: the final response for the same request follows
_STOP = 5  # the connection stopped being HTTP/1.x

_TOO_LONG = object()  # marker returned by the line/block readers when a cap is hit

_BLANK_LINE = re.compile(rb"\n\r?\n")
_NOT_CRLF = re.compile(rb"[^\r\n]")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]{1,18}")
_REQUEST_LINE = re.compile(rb"([A-Z][A-Z0-9_-]{0,31}) ([^\x00-\x20\x7f]+) HTTP/1\.[01]")
_REQUEST_LINE_AT_START = re.compile(rb"[A-Z][A-Z0-9_-]{0,31} [^\x00-\x20\x7f]+ HTTP/1\.[01]\r?\n")
# What a segment that ends inside a request line holds; group 1 must begin "HTTP/1.x\r".
_REQUEST_LINE_PREFIX = re.compile(
    rb"[A-Z][A-Z0-9_-]{0,31}(?: [^\x00-\x20\x7f]*(?: ([^\x00-\x20\x7f]*\r?))?)?")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-9][0-9]{2})(?:[ \t][^\r\n]*)?")
_SSE_LINE_END = re.compile(rb"\r\n|\r|\n")
# Header fields that decide framing or how the body is read; the others are skipped.
_USED_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "content-type", "content-encoding", "upgrade"})

# Regex fallbacks for JSON that is too large to parse or cut by a capture gap.
# A key only counts when an unescaped quote opens it right after `{` or `,`:
# the same words inside a JSON string (prompt text) appear as `\"model\"`.
_JSON_STRING_VALUE = rb'"((?:[^"\\\x00-\x1f]|\\.){1,256})"'
_MODEL_KEY = re.compile(rb'[{,]\s*"model"\s*:\s*' + _JSON_STRING_VALUE)
_ID_KEY = re.compile(rb'[{,]\s*"id"\s*:\s*' + _JSON_STRING_VALUE)
_STREAM_KEY = re.compile(rb'[{,]\s*"stream"\s*:\s*(true|false)\b')
_PROMPT_TOKENS_KEY = re.compile(rb'[{,]\s*"prompt_tokens"\s*:\s*([0-9]{1,12})')
_COMPLETION_TOKENS_KEY = re.compile(rb'[{,]\s*"completion_tokens"\s*:\s*([0-9]{1,12})')
# A non-empty generated-text string, or a non-empty tool_calls list.
_GENERATED_TEXT = re.compile(
    rb'[{,]\s*"(?:(?:content|reasoning_content|reasoning|text)"\s*:\s*"(?:[^"\\]|\\.)'
    rb'|tool_calls"\s*:\s*\[\s*\{)')


@dataclass(slots=True)
class Exchange:
    """One request and its response on a connection. Timestamps are the probes'
    CLOCK_MONOTONIC ns of the segment holding the byte in question; None if unseen."""

    seq: int  # 0-based index on the connection
    method: str = ""
    path: str = ""  # query string removed: it may hold user data
    req_start_ns: int = 0
    req_end_ns: int | None = None
    req_bytes: int = 0  # on the wire: headers, body, chunk framing, uncaptured gaps
    req_model: str | None = None
    req_stream: bool | None = None
    body_fp: int = 0  # keyed hash of the request body; 0 if empty or not fully captured
    status: int = 0
    resp_start_ns: int | None = None
    resp_end_ns: int | None = None
    resp_bytes: int = 0  # includes interim 1xx responses
    streamed: bool = False  # Content-Type text/event-stream
    token_event_ns: list[int] = field(default_factory=list)
    sse_events: int = 0
    done_seen: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    resp_model: str | None = None
    response_id: str | None = None
    outcome: str = "complete"  # complete | client_closed | reset | truncated
    error: str | None = None
    inflight_at_arrival: int = 0  # filled by the caller from on_request_start
    tenant: str = ""  # the tenant header's value (an identifier, never content); "" if absent


class _Txn:
    """An exchange being assembled, with the progress of its two halves."""

    __slots__ = ("exchange", "request_done", "response_done")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.request_done = False
        self.response_done = False


class _FramingError(Exception):
    """A header block that cannot be framed; its message is a plain-words error."""


class HttpConnectionAssembler:
    """Assembles the exchanges of ONE HTTP/1.1 connection from its two byte streams.

    Feed methods and close() never raise on any input; they return the exchanges
    that became complete (response finished, or cut off by close), in order.
    """

    def __init__(self, *, fingerprint_key: bytes, max_header_bytes: int = 65536,
                 on_request_start: Callable[[Exchange], None] | None = None,
                 tenant_header: str | None = DEFAULT_TENANT_HEADER) -> None:
        if not isinstance(fingerprint_key, (bytes, bytearray)) or len(fingerprint_key) > 64:
            raise ValueError("fingerprint_key must be bytes of at most 64 bytes (a BLAKE2b key)")
        if not isinstance(max_header_bytes, int) or max_header_bytes < 64:
            raise ValueError("max_header_bytes must be an integer of at least 64")
        self._fingerprint_key = bytes(fingerprint_key)
        self._tenant_header = tenant_header_name(tenant_header)
        self._on_request_start = on_request_start
        self._open: deque[_Txn] = deque()  # started and not yet returned, in request order
        self._awaiting_response: deque[_Txn] = deque()  # their responses have not started
        self._ready: list[Exchange] = []
        self._next_seq = 0
        self._error: str | None = None
        self._closed = False
        self._request = _RequestStream(self, max_header_bytes)
        self._response = _ResponseStream(self, max_header_bytes)

    @property
    def error(self) -> str | None:
        """The last per-connection error, in plain words; None if there was none."""
        return self._error

    def feed_request_bytes(self, ts_ns: int, head: bytes, total_len: int,
                           tail: bytes = b"") -> list[Exchange]:
        """One segment travelling towards the server."""
        return self._feed(self._request, ts_ns, head, total_len, tail)

    def feed_response_bytes(self, ts_ns: int, head: bytes, total_len: int,
                            tail: bytes = b"") -> list[Exchange]:
        """One segment travelling towards the client."""
        return self._feed(self._response, ts_ns, head, total_len, tail)

    def close(self, ts_ns: int, reason: str) -> list[Exchange]:
        """The connection closed: every exchange still open is returned.

        reason is one of CLOSE_REASONS. Exchange timestamps come from segments,
        so ts_ns only marks the call; a close-delimited body ends at its last
        segment. Later feeds are ignored."""
        if self._closed:
            return []
        self._closed = True
        try:
            outcome = _OUTCOME_BY_CLOSE_REASON.get(reason) if isinstance(reason, str) else None
            if outcome is None:
                self._set_error("unknown close reason; open exchanges recorded as truncated")
                outcome = "truncated"
            self._response.end_of_stream(server_closed=reason == "server_closed")
            self._request.stop()
            self._awaiting_response.clear()
            while self._open:  # popped one by one: the safety net below must not return one twice
                txn = self._open.popleft()
                exchange = txn.exchange
                if not txn.response_done and exchange.outcome == "complete":
                    exchange.outcome = outcome
                self._ready.append(exchange)
        except Exception as exc:  # safety net: a parser bug must not take down the agent
            self._internal_failure(exc)
        return self._take_ready()

    # -- internals shared with the two streams ---------------------------------

    def _feed(self, stream: _MessageStream, ts_ns, head, total_len, tail) -> list[Exchange]:
        if self._closed:
            return []
        try:
            segment = _normalise_segment(ts_ns, head, total_len, tail)
            if segment is None:
                stream.lose_framing(stream.last_ts, f"malformed {stream.noun} segment description")
            else:
                stream.feed(*segment)
        except Exception as exc:  # safety net: a parser bug must not take down the agent
            self._internal_failure(exc)
        return self._take_ready()

    def _take_ready(self) -> list[Exchange]:
        ready, self._ready = self._ready, []
        return ready

    def _set_error(self, message: str) -> None:
        self._error = message

    def _open_exchange(self, ts: int) -> _Txn | None:
        if len(self._open) >= MAX_OPEN_EXCHANGES:
            self._stop(f"more than {MAX_OPEN_EXCHANGES} requests without a finished response; "
                       "connection no longer parsed")
            return None
        txn = _Txn(Exchange(seq=self._next_seq, req_start_ns=ts))
        self._next_seq += 1
        self._open.append(txn)
        self._awaiting_response.append(txn)
        if self._on_request_start is not None:
            self._on_request_start(txn.exchange)
        return txn

    def _claim_response(self, ts: int) -> _Txn | None:
        """The exchange a response starting at ts answers: the oldest one waiting,
        unless that request started later (then the response answers a request
        the capture missed)."""
        waiting = self._awaiting_response
        if waiting and waiting[0].exchange.req_start_ns <= ts:
            return waiting.popleft()
        return None

    def _abandon(self, txn: _Txn, reason: str, *, request_side: bool) -> None:
        """One half of an exchange lost its framing: that half ends, truncated."""
        exchange = txn.exchange
        exchange.outcome = "truncated"
        exchange.error = reason
        if request_side:
            txn.request_done = True
        else:
            txn.response_done = True
        self._settle()

    def _settle(self) -> None:
        """Return the exchanges whose two halves are done. Both halves finish in
        FIFO order, so only the oldest open exchange can be the next one."""
        open_txns = self._open
        while open_txns and open_txns[0].request_done and open_txns[0].response_done:
            self._ready.append(open_txns.popleft().exchange)

    def _stop(self, reason: str) -> None:
        """Stop parsing the connection: every open exchange is returned; those
        whose response had not finished are truncated."""
        self._set_error(reason)
        self._request.stop()
        self._response.stop()
        for txn in self._open:
            exchange = txn.exchange
            if not txn.response_done:
                exchange.outcome = "truncated"
                exchange.error = exchange.error or reason
            self._ready.append(exchange)
        self._open.clear()
        self._awaiting_response.clear()

    def _internal_failure(self, exc: Exception) -> None:
        # Only the type and location are logged: an exception's message may quote payload bytes.
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        log.warning("HTTP assembler internal error %s at %s:%s; connection no longer parsed",
                    type(exc).__name__, frame.name, frame.lineno)
        self._stop(f"internal parser error ({type(exc).__name__}); connection no longer parsed")


def tenant_id(header_value: str) -> str:
    """The tenant id a header value names, as stored: printable ASCII, at most MAX_TENANT_CHARS.
    Gateways normalise with this too, so both sides name a tenant alike."""
    return _printable(header_value, MAX_TENANT_CHARS)


def tenant_header_name(name: str | None) -> str | None:
    """The lower-case header name that carries the tenant, or None when None or "" turns it off.

    Raises ValueError for a name that is not an HTTP field name, or names a header
    that frames the message (its value is read differently)."""
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not _TOKEN.fullmatch(name.encode("ascii", "replace")):
        raise ValueError(f"tenant header {name!r} is not an HTTP header name")
    name = name.lower()
    if name in _USED_HEADERS:
        raise ValueError(f"tenant header {name!r} is a header that frames the message, not a tenant")
    return name


def _normalise_segment(ts_ns, head, total_len, tail) -> tuple[int, bytes, int, bytes] | None:
    """(ts, head, gap, tail) of a segment description, or None if it is malformed."""
    if not isinstance(ts_ns, int) or not isinstance(total_len, int):
        return None
    if not (isinstance(head, (bytes, bytearray, memoryview))
            and isinstance(tail, (bytes, bytearray, memoryview))):
        return None
    if total_len < 0 or total_len > MAX_SEGMENT_BYTES:
        return None
    head, tail = bytes(head), bytes(tail)
    if total_len <= len(head):
        return ts_ns, head[:total_len], 0, b""
    overlap = len(head) + len(tail) - total_len
    if overlap > 0:  # a short call whose head and tail overlap: keep each byte once
        tail = tail[overlap:]
    return ts_ns, head, total_len - len(head) - len(tail), tail


def _foreign_protocol(head: bytes) -> str | None:
    """Why a stream that starts with `head` is not HTTP/1.x, or None."""
    if head.startswith(b"PRI * HTTP/2"):
        return "HTTP/2 connection (prior-knowledge preface); only HTTP/1.x is parsed"
    # A TLS record header: content type 20-23, protocol major version 3.
    if len(head) >= 3 and 0x14 <= head[0] <= 0x17 and head[1] == 3 and head[2] <= 4:
        return "TLS records at the start of the stream: the payload is encrypted; nothing parsed"
    return None


# -- message framing ------------------------------------------------------------


class _MessageStream:
    """HTTP/1.x message framing for one direction of a connection.

    This class finds message boundaries across segments and capture gaps; the
    subclasses say what may start a message and what a header block means."""

    noun = "message"
    # Set as the connection's error when the stream's first bytes are not a message start.
    _mid_stream_note = ""

    def __init__(self, conn: HttpConnectionAssembler, max_header_bytes: int) -> None:
        self._conn = conn
        self._max_header_bytes = max_header_bytes
        self._state = _RESYNC  # a connection may have been picked up mid-stream
        self._pending_note: str | None = self._mid_stream_note
        self._saw_bytes = False
        self._buf = bytearray()  # a header block, chunk-size line or trailer section in pieces
        self._remaining = 0
        self._txn: _Txn | None = None  # None while between messages, or for an unmatched response
        self._body = None  # the current body's reader, if it is read
        self.last_ts = 0

    # Hooks for the subclasses.
    def _starts_message(self, data: bytes) -> bool:
        raise NotImplementedError

    def _may_start(self, first_byte: int) -> bool:
        raise NotImplementedError

    def _count(self, nbytes: int) -> None:
        raise NotImplementedError

    def _begin_message(self, ts: int) -> None:
        raise NotImplementedError

    def _on_header_block(self, ts: int, block: bytes) -> tuple[int, int]:
        raise NotImplementedError

    def _on_message_end(self, ts: int, txn: _Txn | None, body) -> None:
        raise NotImplementedError

    def _on_framing_lost(self, ts: int, reason: str, txn: _Txn | None, body,
                         between_messages: bool) -> None:
        raise NotImplementedError

    # Driving the stream.
    def feed(self, ts: int, head: bytes, gap: int, tail: bytes) -> None:
        self.last_ts = ts
        if head and not self._saw_bytes:
            self._saw_bytes = True
            foreign = _foreign_protocol(head)
            if foreign:
                self._conn._stop(foreign)
                return
        if head:
            self._data(ts, head, segment_start=True)
        if gap:
            self._gap(ts, gap)
        if tail:
            self._data(ts, tail, segment_start=False)

    def stop(self) -> None:
        self._state = _STOPPED
        self._txn = None
        self._body = None
        self._buf.clear()

    def lose_framing(self, ts: int, reason: str) -> None:
        """The stream's framing is unknown from here: end the message at hand and
        wait for a segment that starts a new one."""
        if self._state == _STOPPED:
            return
        between_messages = self._state == _IDLE
        txn, body = self._txn, self._body
        self._txn = None
        self._body = None
        self._buf.clear()
        self._state = _RESYNC
        self._pending_note = None
        self._on_framing_lost(ts, reason, txn, body, between_messages)

    def _finish_message(self, ts: int) -> None:
        txn, body = self._txn, self._body
        self._txn = None
        self._body = None
        self._buf.clear()
        self._state = _IDLE
        self._on_message_end(ts, txn, body)

    def _data(self, ts: int, data: bytes, segment_start: bool) -> None:
        view = memoryview(data)  # body bytes are handed on without copying
        pos = 0
        end = len(data)
        while pos < end:
            state = self._state
            if state == _BODY_LENGTH or state == _CHUNK_DATA:
                take = min(self._remaining, end - pos)
                self._body_bytes(ts, view[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    if state == _BODY_LENGTH:
                        self._finish_message(ts)
                    else:
                        self._state = _CHUNK_DATA_END
            elif state == _HEADERS:
                pos = self._read_header_block(ts, data, pos)
            elif state == _IDLE:
                pos = self._read_message_start(ts, data, pos)
            elif state == _CHUNK_SIZE:
                pos = self._read_chunk_size(ts, data, pos)
            elif state == _CHUNK_DATA_END:
                pos = self._read_chunk_data_end(ts, data, pos)
            elif state == _TRAILERS:
                pos = self._read_trailers(ts, data, pos)
            elif state == _BODY_UNTIL_CLOSE:
                self._body_bytes(ts, view[pos:])
                pos = end
            elif state == _RESYNC:
                if pos == 0 and segment_start and self._starts_message(data):
                    self._state = _IDLE
                else:
                    if self._pending_note:
                        self._conn._set_error(self._pending_note)
                        self._pending_note = None
                    pos = end
            else:  # _STOPPED
                return

    def _gap(self, ts: int, nbytes: int) -> None:
        state = self._state
        if state == _BODY_LENGTH:
            take = min(nbytes, self._remaining)
            self._body_gap(ts, take)
            self._remaining -= take
            if self._remaining == 0:
                self._finish_message(ts)
            if nbytes > take:
                self.lose_framing(ts, f"capture gap hides the start of the next {self.noun}")
        elif state == _CHUNK_DATA:
            if nbytes > self._remaining:
                self.lose_framing(ts, f"capture gap hides the chunked framing of a {self.noun} body")
                return
            self._body_gap(ts, nbytes)
            self._remaining -= nbytes
            if self._remaining == 0:
                self._state = _CHUNK_DATA_END
        elif state == _BODY_UNTIL_CLOSE:
            self._body_gap(ts, nbytes)
        elif state == _IDLE:
            self.lose_framing(ts, f"capture gap hides the start of a {self.noun}")
        elif state == _HEADERS:
            self.lose_framing(ts, f"capture gap inside the {self.noun} headers")
        elif state in (_CHUNK_SIZE, _CHUNK_DATA_END, _TRAILERS):
            self.lose_framing(ts, f"capture gap hides the chunked framing of a {self.noun} body")
        # _RESYNC and _STOPPED: there is no framing to lose.

    def _body_bytes(self, ts: int, chunk: memoryview) -> None:
        self._count(len(chunk))
        if self._body is not None:
            self._body.data(ts, chunk)

    def _body_gap(self, ts: int, nbytes: int) -> None:
        self._count(nbytes)
        if self._body is not None:
            self._body.gap(ts, nbytes)

    def _read_message_start(self, ts: int, data: bytes, pos: int) -> int:
        # Empty lines between messages are tolerated (RFC 9112, section 2.2).
        match = _NOT_CRLF.search(data, pos)
        if match is None:
            return len(data)
        pos = match.start()
        if not self._may_start(data[pos]):
            self.lose_framing(ts, f"unexpected bytes where a {self.noun} should start")
            return len(data)
        self._state = _HEADERS
        self._buf.clear()
        self._begin_message(ts)
        return pos

    def _read_header_block(self, ts: int, data: bytes, pos: int) -> int:
        block, pos = self._take_block(data, pos)
        if block is None:
            return pos
        if block is _TOO_LONG:
            self.lose_framing(ts, f"{self.noun} header block larger than "
                                  f"{self._max_header_bytes} bytes")
            return len(data)
        try:
            mode, length = self._on_header_block(ts, block)
        except _FramingError as exc:
            self.lose_framing(ts, str(exc))
            return len(data)
        if mode == _STOP:
            return len(data)
        if mode == _INTERIM:
            self._state = _IDLE
        elif mode == _NO_BODY or (mode == _LENGTH and length == 0):
            self._finish_message(ts)
        elif mode == _LENGTH:
            self._state = _BODY_LENGTH
            self._remaining = length
        elif mode == _CHUNKED:
            self._state = _CHUNK_SIZE
        else:
            self._state = _BODY_UNTIL_CLOSE
        return pos

    def _read_chunk_size(self, ts: int, data: bytes, pos: int) -> int:
        line, pos = self._take_line(data, pos, CHUNK_SIZE_LINE_MAX)
        if line is None:
            return pos
        size_field = b"" if line is _TOO_LONG else line.split(b";", 1)[0].strip(b" \t\r")
        if not _HEX.fullmatch(size_field):
            self.lose_framing(ts, f"invalid chunk-size line in a {self.noun} body")
            return len(data)
        size = int(size_field, 16)
        if size:
            self._state = _CHUNK_DATA
            self._remaining = size
        else:
            self._state = _TRAILERS
            # The last-chunk line's LF, so that an immediate CRLF reads as the blank line.
            self._buf[:] = b"\n"
        return pos

    def _read_chunk_data_end(self, ts: int, data: bytes, pos: int) -> int:
        line, pos = self._take_line(data, pos, 2)
        if line is None:
            return pos
        if line is _TOO_LONG or line not in (b"", b"\r"):
            self.lose_framing(ts, f"chunk data not followed by CRLF in a {self.noun} body")
            return len(data)
        self._state = _CHUNK_SIZE
        return pos

    def _read_trailers(self, ts: int, data: bytes, pos: int) -> int:
        block, pos = self._take_block(data, pos)
        if block is None:
            return pos
        if block is _TOO_LONG:
            self.lose_framing(ts, f"chunked trailer section larger than "
                                  f"{self._max_header_bytes} bytes")
            return len(data)
        self._finish_message(ts)
        return pos

    def _take_block(self, data: bytes, pos: int):
        """Collect bytes up to and including a blank line (`\\n\\r?\\n`).

        Returns (block or None if more bytes are needed or _TOO_LONG, new pos).
        Each byte is searched once: a terminator split across segments is found
        by probing the buffered end together with the new start."""
        buf = self._buf
        stop = min(len(data), pos + self._max_header_bytes - len(buf))
        end = None
        if buf:
            buffered_end = bytes(buf[-2:])
            probe = buffered_end + data[pos:pos + 2]
            match = _BLANK_LINE.search(probe)
            if match and match.end() > len(buffered_end):
                end = pos + match.end() - len(buffered_end)
        if end is None:
            match = _BLANK_LINE.search(data, pos, stop)
            if match is None:
                self._count(stop - pos)
                buf += data[pos:stop]
                if len(buf) >= self._max_header_bytes:
                    return _TOO_LONG, len(data)
                return None, stop
            end = match.end()
        self._count(end - pos)
        if buf:
            buf += data[pos:end]
            block = bytes(buf)
            buf.clear()
        else:
            block = data[pos:end]
        return block, end

    def _take_line(self, data: bytes, pos: int, limit: int):
        """Collect bytes up to an LF. Returns (line without the LF, or None if more
        bytes are needed, or _TOO_LONG past `limit` bytes; new pos)."""
        buf = self._buf
        stop = min(len(data), pos + limit - len(buf))
        newline = data.find(b"\n", pos, stop)
        if newline < 0:
            self._count(stop - pos)
            buf += data[pos:stop]
            if len(buf) >= limit:
                return _TOO_LONG, len(data)
            return None, stop
        self._count(newline + 1 - pos)
        if buf:
            buf += data[pos:newline]
            line = bytes(buf)
            buf.clear()
        else:
            line = data[pos:newline]
        return line, newline + 1


class _RequestStream(_MessageStream):
    noun = "request"
    _mid_stream_note = ("request stream picked up in the middle of a message; "
                        "waiting for the next request line")

    def _starts_message(self, data: bytes) -> bool:
        if _REQUEST_LINE_AT_START.match(data, 0, self._max_header_bytes):
            return True
        # A segment may also end inside the request line (a client writing in pieces).
        if len(data) >= self._max_header_bytes or b"\n" in data:
            return False
        prefix = _REQUEST_LINE_PREFIX.fullmatch(data)
        if prefix is None:
            return False
        version = prefix[1] or b""
        return b"HTTP/1.0\r".startswith(version) or b"HTTP/1.1\r".startswith(version)

    def _may_start(self, first_byte: int) -> bool:
        return 0x41 <= first_byte <= 0x5A  # methods are upper-case tokens

    def _count(self, nbytes: int) -> None:
        if self._txn is not None:
            self._txn.exchange.req_bytes += nbytes

    def _begin_message(self, ts: int) -> None:
        self._txn = self._conn._open_exchange(ts)

    def lose_framing(self, ts: int, reason: str) -> None:
        # Headers cut by a gap or a cap may still hold a whole request line: keep what it says.
        if self._state == _HEADERS and self._txn is not None:
            line_end = self._buf.find(b"\n")
            if line_end >= 0:
                self._record_request_line(bytes(self._buf[:line_end]).removesuffix(b"\r"))
        super().lose_framing(ts, reason)

    def _record_request_line(self, line: bytes) -> bool:
        match = _REQUEST_LINE.fullmatch(line)
        if match is None:
            return False
        if self._txn is not None:
            exchange = self._txn.exchange
            exchange.method = match[1].decode("ascii")
            exchange.path = _path_of(match[2])
        return True

    def _on_header_block(self, ts: int, block: bytes) -> tuple[int, int]:
        tenant_header = self._conn._tenant_header
        start_line, headers = _parse_header_block(block, first_only=tenant_header)
        if not self._record_request_line(start_line):
            raise _FramingError("invalid HTTP/1.x request line")
        exchange = self._txn.exchange if self._txn is not None else None
        if exchange is not None and tenant_header in headers:
            exchange.tenant = tenant_id(headers[tenant_header])
        mode, length = _body_framing(headers, is_request=True)
        if exchange is not None and mode != _NO_BODY:
            content_type = headers.get("content-type", "").lower()
            self._body = _RequestBody(exchange, self._conn._fingerprint_key,
                                      read_fields=not content_type or "json" in content_type)
        return mode, length

    def _on_message_end(self, ts: int, txn: _Txn | None, body) -> None:
        if txn is None:
            return
        txn.exchange.req_end_ns = ts
        if body is not None:
            body.finish()
        txn.request_done = True
        self._conn._settle()

    def _on_framing_lost(self, ts: int, reason: str, txn: _Txn | None, body,
                         between_messages: bool) -> None:
        # The exchange keeps its place in the response queue: the server got the
        # whole request (the gap is only in the capture) and will answer it.
        self._conn._set_error(f"{reason}; waiting for the next request line")
        if txn is not None:
            self._conn._abandon(txn, reason, request_side=True)


class _ResponseStream(_MessageStream):
    noun = "response"
    _mid_stream_note = ("response stream picked up in the middle of a message; "
                        "waiting for the next status line")

    def __init__(self, conn: HttpConnectionAssembler, max_header_bytes: int) -> None:
        super().__init__(conn, max_header_bytes)
        self._awaiting_final = False  # an interim 1xx was seen: the final response follows

    def _starts_message(self, data: bytes) -> bool:
        # A segment may also be shorter than "HTTP/1." (a server writing in pieces).
        return data.startswith(b"HTTP/1.") or b"HTTP/1.".startswith(data)

    def _may_start(self, first_byte: int) -> bool:
        return first_byte == 0x48  # the "H" of "HTTP/1."

    def _count(self, nbytes: int) -> None:
        if self._txn is not None:
            self._txn.exchange.resp_bytes += nbytes

    def _begin_message(self, ts: int) -> None:
        if not self._awaiting_final:
            self._txn = self._conn._claim_response(ts)
            if self._txn is None:
                self._conn._set_error("response without a matching request (capture started "
                                      "mid-connection or the request was lost); skipped")
        self._awaiting_final = False
        if self._txn is not None:
            self._txn.exchange.resp_start_ns = ts

    def _on_header_block(self, ts: int, block: bytes) -> tuple[int, int]:
        start_line, headers = _parse_header_block(block)
        match = _STATUS_LINE.fullmatch(start_line)
        if match is None:
            raise _FramingError("invalid HTTP/1.x status line")
        status = int(match[1])
        txn = self._txn
        exchange = txn.exchange if txn is not None else None
        if status == 101:
            protocol = _printable(headers.get("upgrade", "")) or "another protocol"
            self._end_http(ts, txn, status, f"connection upgraded to {protocol}; "
                                            "HTTP parsing stopped")
            return _STOP, 0
        if status < 200:
            self._awaiting_final = True
            return _INTERIM, 0
        method = exchange.method if exchange is not None else ""
        if method == "CONNECT" and status < 300:
            self._end_http(ts, txn, status, "CONNECT tunnel established; HTTP parsing stopped")
            return _STOP, 0
        if exchange is not None:
            exchange.status = status
            self._body = _response_body_reader(exchange, headers)
        if method == "HEAD" or status in (204, 304):
            return _NO_BODY, 0
        return _body_framing(headers, is_request=False)

    def _end_http(self, ts: int, txn: _Txn | None, status: int, reason: str) -> None:
        """The connection leaves HTTP/1.x after this response's header block."""
        if txn is not None:
            exchange = txn.exchange
            exchange.status = status
            exchange.resp_end_ns = ts
            exchange.error = reason
            txn.response_done = True
        self._conn._stop(reason)

    def _on_message_end(self, ts: int, txn: _Txn | None, body) -> None:
        if txn is None:
            return
        if body is not None:
            body.finish()
        txn.exchange.resp_end_ns = ts
        txn.response_done = True
        self._conn._settle()

    def _on_framing_lost(self, ts: int, reason: str, txn: _Txn | None, body,
                         between_messages: bool) -> None:
        self._conn._set_error(f"{reason}; waiting for the next status line")
        self._awaiting_final = False
        if body is not None:
            body.finish()
        if txn is None and between_messages:
            # The lost bytes began the next response: it answers the oldest waiting request.
            txn = self._conn._claim_response(ts)
        if txn is not None:
            self._conn._abandon(txn, reason, request_side=False)

    def end_of_stream(self, *, server_closed: bool) -> None:
        """The connection closed: a close-delimited body is complete if the server
        closed; any other response in progress stops where it is."""
        if self._state == _BODY_UNTIL_CLOSE and server_closed:
            self._finish_message(self.last_ts)
        elif self._body is not None:
            self._body.finish()
        self.stop()


def _parse_header_block(block: bytes, first_only: str | None = None) -> tuple[bytes, dict[str, str]]:
    """The start line and the header fields that matter here (lower-case names;
    repeated fields joined with commas), plus the field named `first_only`, whose
    first occurrence alone is kept. Raises _FramingError on malformed lines."""
    lines = block.split(b"\n")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        line = raw.removesuffix(b"\r")
        if not line or line[0] in (0x20, 0x09):  # the closing blank line; obs-fold (unsupported)
            continue
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise _FramingError("malformed header field line")
        key = name.decode("ascii").lower()
        if key in _USED_HEADERS:
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]},{text}" if key in headers else text
        elif key == first_only and key not in headers:
            headers[key] = value.strip(b" \t").decode("latin-1")
    return lines[0].removesuffix(b"\r"), headers


def _body_framing(headers: dict[str, str], *, is_request: bool) -> tuple[int, int]:
    """How a message body is delimited (RFC 9112, section 6.3)."""
    transfer_encoding = headers.get("transfer-encoding")
    if transfer_encoding is not None:
        if transfer_encoding.rsplit(",", 1)[-1].strip().lower() == "chunked":
            return _CHUNKED, 0
        if is_request:
            raise _FramingError("request Transfer-Encoding does not end in chunked")
        return _UNTIL_CLOSE, 0
    content_length = headers.get("content-length")
    if content_length is not None:
        values = {value.strip() for value in content_length.split(",")}
        if len(values) != 1:
            raise _FramingError("conflicting Content-Length values")
        value = values.pop()
        if not _DIGITS.fullmatch(value):
            raise _FramingError("invalid Content-Length")
        return _LENGTH, int(value)
    return (_NO_BODY, 0) if is_request else (_UNTIL_CLOSE, 0)


def _path_of(target: bytes) -> str:
    return target.split(b"?", 1)[0].split(b"#", 1)[0].decode("utf-8", "replace")


def _printable(text: str, max_chars: int = 40) -> str:
    """text reduced to printable ASCII and cut to max_chars: safe in a row or a log line."""
    return "".join(ch for ch in text if "!" <= ch <= "~" or ch == " ")[:max_chars].strip()


# -- body readers -----------------------------------------------------------------


class _HeadTailSample:
    """The first `head_cap` and last `tail_cap` bytes of a byte stream of any
    length, with capture gaps: memory stays bounded whatever the stream's size.

    `head` holds bytes from offset 0 up to the first gap; `tail` holds the last
    bytes since the last gap."""

    __slots__ = ("head_cap", "tail_cap", "head", "tail", "length", "first_gap_at", "last_gap_end")

    def __init__(self, head_cap: int, tail_cap: int) -> None:
        self.head_cap = head_cap
        self.tail_cap = tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.length = 0
        self.first_gap_at: int | None = None
        self.last_gap_end = 0

    def reset(self) -> None:
        self.head.clear()
        self.tail.clear()
        self.length = 0
        self.first_gap_at = None
        self.last_gap_end = 0

    def add(self, data) -> None:
        size = len(data)
        if self.first_gap_at is None and len(self.head) < self.head_cap:
            self.head += data[:self.head_cap - len(self.head)]
        tail = self.tail
        if size >= self.tail_cap:
            tail[:] = data[size - self.tail_cap:]
        else:
            tail += data
            if len(tail) > self.tail_cap:
                del tail[:len(tail) - self.tail_cap]
        self.length += size

    def add_gap(self, nbytes: int) -> None:
        if self.first_gap_at is None:
            self.first_gap_at = self.length
        self.length += nbytes
        self.last_gap_end = self.length
        self.tail.clear()

    def whole(self) -> bytes | None:
        """All the bytes, if none fell in a gap and they fit in the head."""
        if self.first_gap_at is None and self.length <= self.head_cap:
            return bytes(self.head)
        return None

    def known_head(self, nbytes: int) -> bytes | None:
        """The first nbytes (at most head_cap), or None if part of them fell in a gap."""
        if self.first_gap_at is not None and self.first_gap_at < nbytes:
            return None
        return bytes(self.head[:nbytes])

    def known_tail(self, nbytes: int) -> bytes | None:
        """The last nbytes (at most tail_cap), or None if part of them fell in a gap."""
        if self.length - self.last_gap_end < nbytes:
            return None
        return bytes(self.tail[len(self.tail) - nbytes:]) if nbytes else b""


class _RequestBody:
    """Request body reader: keyed fingerprint, and `model` / `stream` from its head and tail."""

    __slots__ = ("_exchange", "_key", "_read_fields", "_sample")

    def __init__(self, exchange: Exchange, key: bytes, *, read_fields: bool) -> None:
        self._exchange = exchange
        self._key = key
        self._read_fields = read_fields
        self._sample = _HeadTailSample(REQUEST_BODY_HEAD, REQUEST_BODY_TAIL)

    def data(self, ts: int, chunk) -> None:
        self._sample.add(chunk)

    def gap(self, ts: int, nbytes: int) -> None:
        self._sample.add_gap(nbytes)

    def finish(self) -> None:
        exchange = self._exchange
        exchange.body_fp = _body_fingerprint(self._key, self._sample)
        if self._read_fields:
            exchange.req_model, exchange.req_stream = _request_fields(self._sample)


def _body_fingerprint(key: bytes, sample: _HeadTailSample) -> int:
    """BLAKE2b-64 keyed with `key` over (length as 8 bytes LE, first min(4096, len)
    bytes, last min(1024, len) bytes), as an unsigned little-endian int. 0 for an
    empty body or one whose hashed bytes were not all captured."""
    length = sample.length
    if length == 0:
        return 0
    head = sample.known_head(min(REQUEST_BODY_HEAD, length))
    tail = sample.known_tail(min(REQUEST_BODY_TAIL, length))
    if head is None or tail is None:
        return 0
    digest = hashlib.blake2b(length.to_bytes(8, "little") + head + tail,
                             key=key, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _request_fields(sample: _HeadTailSample) -> tuple[str | None, bool | None]:
    whole = sample.whole()
    body = _json_object(whole) if whole is not None else None
    if body is not None:
        model, stream = body.get("model"), body.get("stream")
        return (model[:_MAX_FIELD_CHARS] if isinstance(model, str) and model else None,
                stream if isinstance(stream, bool) else None)
    # A large body: openai-python puts `model` after `messages`, so look in the tail too.
    head, tail = bytes(sample.head), bytes(sample.tail)
    model = _first_json_string(_MODEL_KEY, head) or _last_json_string(_MODEL_KEY, tail)
    stream_match = _STREAM_KEY.search(head) or _last_match(_STREAM_KEY, tail)
    stream = None if stream_match is None else stream_match[1] == b"true"
    return model, stream


def _response_body_reader(exchange: Exchange, headers: dict[str, str]):
    content_type = headers.get("content-type", "").lower()
    exchange.streamed = content_type.startswith("text/event-stream")
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        exchange.error = f"response body is {_printable(encoding)}-encoded; its content was not read"
        return None
    if exchange.streamed:
        return _SseBody(exchange)
    if not content_type or "json" in content_type:
        return _JsonBody(exchange)
    return None


class _JsonBody:
    """Non-streamed JSON response: id, model and usage from its first and last 4 KiB."""

    __slots__ = ("_exchange", "_sample")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self._sample = _HeadTailSample(RESPONSE_BODY_HEAD, RESPONSE_BODY_TAIL)

    def data(self, ts: int, chunk) -> None:
        self._sample.add(chunk)

    def gap(self, ts: int, nbytes: int) -> None:
        self._sample.add_gap(nbytes)

    def finish(self) -> None:
        whole = self._sample.whole()
        body = _json_object(whole) if whole is not None else None
        if body is not None:
            _apply_json_fields(self._exchange, body)
        else:
            _apply_regex_fields(self._exchange, bytes(self._sample.head), bytes(self._sample.tail))


class _SseBody:
    """text/event-stream reader over the de-chunked body.

    Lines end in CRLF, LF or CR; a blank line ends an event; `data:` lines are
    joined with LF; comments and other fields are ignored. An event's time is
    that of the segment holding the end of its blank line."""

    __slots__ = ("_exchange", "_line", "_cr_ts", "_event", "_event_has_data", "_gap_bytes")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self._line = _HeadTailSample(SSE_EVENT_JSON_MAX, SSE_EVENT_TAIL)  # a line split across pieces
        self._cr_ts: int | None = None  # a piece ended in CR: it may be the first half of CRLF
        self._event = _HeadTailSample(SSE_EVENT_JSON_MAX, SSE_EVENT_TAIL)  # the event's data
        self._event_has_data = False
        self._gap_bytes = 0

    def data(self, ts: int, chunk) -> None:
        data = bytes(chunk)
        end = len(data)
        pos = 0
        if self._cr_ts is not None:
            cr_ts, self._cr_ts = self._cr_ts, None
            if data[:1] == b"\n":
                pos = 1
                self._end_line(ts, b"")
            else:
                self._end_line(cr_ts, b"")
        for match in _SSE_LINE_END.finditer(data, pos):
            start, stop = match.span()
            if stop == end and stop - start == 1 and data[start] == 0x0D:
                self._line.add(data[pos:start])
                self._cr_ts = ts
                return
            self._end_line(ts, data[pos:start])
            pos = stop
        if pos < end:
            self._line.add(data[pos:])

    def gap(self, ts: int, nbytes: int) -> None:
        self._flush_cr()
        self._line.add_gap(nbytes)
        self._gap_bytes += nbytes
        self._exchange.error = (f"{self._gap_bytes} bytes of the event stream were not captured; "
                                "events inside them were not counted")

    def finish(self) -> None:
        # An event without its closing blank line is incomplete and is not dispatched.
        self._flush_cr()

    def _flush_cr(self) -> None:
        if self._cr_ts is not None:
            cr_ts, self._cr_ts = self._cr_ts, None
            self._end_line(cr_ts, b"")

    def _end_line(self, ts: int, rest: bytes) -> None:
        pending = self._line
        if pending.length:  # the line began in an earlier piece
            pending.add(rest)
            line = pending.whole()
            if line is None:
                self._add_partial_data_line(pending)
                pending.reset()
                return
            pending.reset()
        else:
            line = rest
        if not line:
            self._dispatch(ts)
        elif line.startswith(b"data"):
            if len(line) == 4:
                self._add_data(b"")
            elif line[4] == 0x3A:  # "data:"
                self._add_data(line[6:] if line[5:6] == b" " else line[5:])
        # Comments (":...") and other fields carry nothing recorded here.

    def _add_data(self, value: bytes) -> None:
        if self._event_has_data:
            self._event.add(b"\n")
        self._event.add(value)
        self._event_has_data = True

    def _add_partial_data_line(self, line: _HeadTailSample) -> None:
        """A line too long to keep whole, or cut by a capture gap: its kept head
        and tail join the event, which is then read with the regex fallback."""
        head, tail = bytes(line.head), bytes(line.tail)
        if head.startswith(b"data:"):
            value_head = head[6:] if head[5:6] == b" " else head[5:]
        elif b"data:".startswith(head):  # empty or too short to tell: may be a data line
            value_head = b""
        else:
            return
        event = self._event
        if self._event_has_data:
            event.add(b"\n")
        event.add(value_head)
        # Mark the middle that was not kept (at least one byte, so the event is never "whole").
        event.add_gap(max(1, line.length - len(head) - len(tail)))
        event.add(tail)
        self._event_has_data = True

    def _dispatch(self, ts: int) -> None:
        if not self._event_has_data:  # a blank line after comments only: no event
            return
        exchange = self._exchange
        exchange.sse_events += 1
        event = self._event
        payload = event.whole()
        if payload is None:
            _apply_regex_event(exchange, ts, bytes(event.head), bytes(event.tail))
        elif payload.strip() == b"[DONE]":
            exchange.done_seen = True
        else:
            obj = _json_object(payload)
            if obj is None:
                _apply_regex_event(exchange, ts, payload, b"")
            else:
                _apply_json_fields(exchange, obj)
                if _carries_generated_text(obj):
                    _record_token_event(exchange, ts)
        event.reset()
        self._event_has_data = False


# -- reading JSON fields ------------------------------------------------------------


def _json_object(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _nonempty_str(value) -> bool:
    return isinstance(value, str) and value != ""


def _carries_generated_text(event: dict) -> bool:
    """True if the event's JSON carries generated text. A role-only or empty-content
    first chunk, or a `"choices":[]` usage chunk, does not."""
    choices = event.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if _nonempty_str(choice.get("text")):  # /v1/completions
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if (_nonempty_str(delta.get("content"))
                        or _nonempty_str(delta.get("reasoning_content"))
                        or _nonempty_str(delta.get("reasoning"))):
                    return True
                tool_calls = delta.get("tool_calls")
                if isinstance(tool_calls, list) and tool_calls:
                    return True
    token = event.get("token")  # TGI
    if isinstance(token, dict) and _nonempty_str(token.get("text")):
        return True
    return _nonempty_str(event.get("content"))  # llama.cpp /completion


def _token_count(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT:
        return value
    return None


def _apply_json_fields(exchange: Exchange, obj: dict) -> None:
    """id and model from the first event (or body) that has them; usage from any."""
    if exchange.response_id is None and _nonempty_str(obj.get("id")):
        exchange.response_id = obj["id"][:_MAX_FIELD_CHARS]
    if exchange.resp_model is None and _nonempty_str(obj.get("model")):
        exchange.resp_model = obj["model"][:_MAX_FIELD_CHARS]
    usage = obj.get("usage")
    if isinstance(usage, dict):
        prompt_tokens = _token_count(usage.get("prompt_tokens"))
        if prompt_tokens is not None:
            exchange.prompt_tokens = prompt_tokens
        completion_tokens = _token_count(usage.get("completion_tokens"))
        if completion_tokens is not None:
            exchange.completion_tokens = completion_tokens


def _apply_regex_fields(exchange: Exchange, head: bytes, tail: bytes) -> None:
    """The regex fallback of _apply_json_fields: id and model near the start,
    usage near the end (where OpenAI-style bodies put them)."""
    if exchange.response_id is None:
        exchange.response_id = _first_json_string(_ID_KEY, head)
    if exchange.resp_model is None:
        exchange.resp_model = _first_json_string(_MODEL_KEY, head)
    prompt_tokens = _last_count(_PROMPT_TOKENS_KEY, tail, head)
    if prompt_tokens is not None:
        exchange.prompt_tokens = prompt_tokens
    completion_tokens = _last_count(_COMPLETION_TOKENS_KEY, tail, head)
    if completion_tokens is not None:
        exchange.completion_tokens = completion_tokens


def _apply_regex_event(exchange: Exchange, ts: int, head: bytes, tail: bytes) -> None:
    """An SSE event too large for json.loads, cut by a gap, or not valid JSON."""
    if (tail or head).rstrip().endswith(b"[DONE]"):
        exchange.done_seen = True
    _apply_regex_fields(exchange, head, tail)
    if _GENERATED_TEXT.search(head) or _GENERATED_TEXT.search(tail):
        _record_token_event(exchange, ts)


def _record_token_event(exchange: Exchange, ts: int) -> None:
    if len(exchange.token_event_ns) < MAX_TOKEN_EVENTS:
        exchange.token_event_ns.append(ts)
    else:
        exchange.error = f"more than {MAX_TOKEN_EVENTS} token events; later ones not recorded"


def _json_string(raw: bytes) -> str | None:
    try:
        value = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return value[:_MAX_FIELD_CHARS] or None


def _last_match(pattern: re.Pattern, data: bytes) -> re.Match | None:
    last = None
    for last in pattern.finditer(data):
        pass
    return last


def _first_json_string(pattern: re.Pattern, data: bytes) -> str | None:
    match = pattern.search(data)
    return _json_string(match[1]) if match else None


def _last_json_string(pattern: re.Pattern, data: bytes) -> str | None:
    match = _last_match(pattern, data)
    return _json_string(match[1]) if match else None


def _last_count(pattern: re.Pattern, tail: bytes, head: bytes) -> int | None:
    match = _last_match(pattern, tail) or _last_match(pattern, head)
    if match is None:
        return None
    value = int(match[1])
    return value if value <= _MAX_COUNT else None
