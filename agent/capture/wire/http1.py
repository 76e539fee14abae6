"""HTTP/1.x message framing of one direction of a connection, across segments and gaps.

A direction's bytes are a `MessageStream`: start line and header fields, then a
body delimited by Content-Length, chunked coding or the connection's close.
Requests and responses differ in what may start a message and what a header
block means (`RequestStream`, `ResponseStream`). Body bytes go to a reader
chosen from the header block (`bodies.response_body_reader`); framing never looks at them.

When framing is lost (a gap in headers, garbage, oversized headers, or a
connection picked up mid-message) the message at hand ends as "truncated" with
an error, and the stream waits for a segment that starts with a new message: a
request line or "HTTP/1." (or the beginning of one, when the segment ends
before the line does). A gap over a chunked body's framing (a write larger
than the capture) keeps the message: the body reader is told of the gap, and
framing resumes at the first place after it where a chain of whole chunks
runs to the end of the bytes seen (`proven_chunk_boundary`).
"""

from __future__ import annotations

import re
from typing import Protocol

from ....contract.tenant import FRAMING_HEADERS, printable, tenant_id
from ..exchange import Txn
from .bodies import RequestBody, path_of, response_body_reader
from .sse import NdjsonBody, SseBody, SteadyTemplate


class Connection(Protocol):
    """What a message stream asks of the connection that pairs its messages (assembler.py's
    HttpConnectionAssembler): opening and claiming exchanges, and reporting what went wrong."""

    _tenant_header: str | None
    _fingerprint_key: bytes
    _requests_hidden: bool

    def _open_exchange(self, ts: int) -> Txn | None: ...
    def _claim_response(self, ts: int) -> Txn | None: ...
    def _abandon(self, txn: Txn, reason: str, *, request_side: bool) -> None: ...
    def _settle(self) -> None: ...
    def _set_error(self, message: str) -> None: ...
    def _stop(self, reason: str) -> None: ...
    def _upgrade_to_http2(self, txn: Txn) -> bool: ...
    def _handed_off(self, ts: int, head: bytes, total_len: int) -> None: ...

__all__ = ["FramingError", "RequestStream", "ResponseStream", "foreign_protocol"]

CHUNK_SIZE_LINE_MAX = 4096

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
_CHUNK_HUNT = 10  # a capture gap hid chunk framing: look for the next chunk boundary the bytes prove
_HANDED_OFF = 11  # HTTP/2 after an h2c upgrade: the bytes go to the connection's HTTP/2 reader

# How a message's body is delimited, decided from its header block.
_NO_BODY = 0
_LENGTH = 1
_CHUNKED = 2
_UNTIL_CLOSE = 3
_INTERIM = 4  # a 1xx response: the final response for the same request follows
_STOP = 5  # the connection stopped being HTTP/1.x
_SWITCH = 6  # the connection speaks HTTP/2 from the end of this 101 (an accepted `Upgrade: h2c`)

_TOO_LONG = object()  # marker returned by the line/block readers when a cap is hit

_BLANK_LINE = re.compile(rb"\n\r?\n")
_NOT_CRLF = re.compile(rb"[^\r\n]")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})\r\n")  # the plain form: no extension, no blanks
_HEX_DIGITS_AT_END = re.compile(rb"[0-9A-Fa-f]{0,16}\r?")  # a chunk-size line cut by the segment's end
_DIGITS = re.compile(r"[0-9]{1,18}")
_REQUEST_LINE = re.compile(rb"([A-Z][A-Z0-9_-]{0,31}) ([^\x00-\x20\x7f]+) HTTP/1\.[01]")
_REQUEST_LINE_AT_START = re.compile(rb"[A-Z][A-Z0-9_-]{0,31} [^\x00-\x20\x7f]+ HTTP/1\.[01]\r?\n")
# What a segment that ends inside a request line holds; group 1 must begin "HTTP/1.x\r".
_REQUEST_LINE_PREFIX = re.compile(
    rb"[A-Z][A-Z0-9_-]{0,31}(?: [^\x00-\x20\x7f]*(?: ([^\x00-\x20\x7f]*\r?))?)?")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-9][0-9]{2})(?:[ \t][^\r\n]*)?")


class FramingError(Exception):
    """A header block that cannot be framed; its message is a plain-words error."""


def foreign_protocol(head: bytes) -> str | None:
    """Why a stream that starts with `head` is not HTTP/1.x, or None."""
    if head.startswith(b"PRI * HTTP/2"):
        return "HTTP/2 connection (prior-knowledge preface); only HTTP/1.x is parsed"
    # A TLS record header: content type 20-23, protocol major version 3.
    if len(head) >= 3 and 0x14 <= head[0] <= 0x17 and head[1] == 3 and head[2] <= 4:
        return "TLS records at the start of the stream: the payload is encrypted; nothing parsed"
    return None



class MessageStream:
    """HTTP/1.x message framing for one direction of a connection.

    This class finds message boundaries across segments and capture gaps; the
    subclasses say what may start a message and what a header block means."""

    noun = "message"
    # Set as the connection's error when the stream's first bytes are not a message start.
    _mid_stream_note = ""

    def __init__(self, conn: Connection, max_header_bytes: int) -> None:
        self._conn = conn
        self._max_header_bytes = max_header_bytes
        self._state = _RESYNC  # a connection may have been picked up mid-stream
        self._pending_note: str | None = self._mid_stream_note
        self._saw_bytes = False
        self._buf = bytearray()  # a header block, chunk-size line or trailer section in pieces
        self._remaining = 0
        self._txn: Txn | None = None  # None while between messages, or for an unmatched response
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

    def _on_message_end(self, ts: int, txn: Txn | None, body) -> None:
        raise NotImplementedError

    def _on_framing_lost(self, ts: int, reason: str, txn: Txn | None, body,
                         between_messages: bool) -> None:
        raise NotImplementedError

    # Driving the stream.
    def feed(self, ts: int, head: bytes, gap: int, tail: bytes) -> None:
        self.last_ts = ts
        if head and not self._saw_bytes:
            self._saw_bytes = True
            foreign = foreign_protocol(head)
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
            elif state == _CHUNK_HUNT:
                pos = self._hunt_chunk_boundary(ts, data, pos, segment_start)
            elif state == _RESYNC:
                if pos == 0 and segment_start and self._starts_message(data):
                    self._state = _IDLE
                else:
                    if self._pending_note:
                        self._conn._set_error(self._pending_note)
                        self._pending_note = None
                    pos = end
            elif state == _HANDED_OFF:
                self._conn._handed_off(ts, data[pos:], end - pos)
                return
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
        elif state == _CHUNK_DATA and nbytes <= self._remaining:
            self._body_gap(ts, nbytes)
            self._remaining -= nbytes
            if self._remaining == 0:
                self._state = _CHUNK_DATA_END
        elif state in (_CHUNK_DATA, _CHUNK_SIZE, _CHUNK_DATA_END, _CHUNK_HUNT):
            # The hole spans chunk framing: the body goes on, its boundaries are looked for after it.
            self._buf.clear()
            self._state = _CHUNK_HUNT
            self._body_gap(ts, nbytes)
        elif state == _BODY_UNTIL_CLOSE:
            self._body_gap(ts, nbytes)
        elif state == _HANDED_OFF:
            self._conn._handed_off(ts, b"", nbytes)
        elif state == _IDLE:
            self.lose_framing(ts, f"capture gap hides the start of a {self.noun}")
        elif state == _HEADERS:
            self.lose_framing(ts, f"capture gap inside the {self.noun} headers")
        elif state == _TRAILERS:
            self.lose_framing(ts, f"capture gap hides the chunked framing of a {self.noun} body")
        # _RESYNC and _STOPPED: there is no framing to lose.

    def _hunt_chunk_boundary(self, ts: int, data: bytes, pos: int, segment_start: bool) -> int:
        """After a gap over chunk framing: the bytes up to the first proven chunk
        boundary are body the framing cannot place (a gap to the body reader);
        chunk framing resumes there. A segment that starts a new message instead
        says the body ended inside the gap."""
        if pos == 0 and segment_start and self._starts_message(data):
            self.lose_framing(ts, f"capture gap hides the end of a chunked {self.noun} body")
            return pos
        boundary = proven_chunk_boundary(data, pos)
        if boundary is None:
            self._body_gap(ts, len(data) - pos)
            return len(data)
        if boundary > pos:
            self._body_gap(ts, boundary - pos)
        self._state = _CHUNK_SIZE
        return boundary

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
        block, pos = self._take_capped_block(ts, data, pos, f"{self.noun} header block")
        if block is None:
            return pos
        try:
            mode, length = self._on_header_block(ts, block)
        except FramingError as exc:
            self.lose_framing(ts, str(exc))
            return len(data)
        if mode == _STOP:
            return len(data)
        if mode == _SWITCH:
            self._state = _HANDED_OFF
            return pos
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
        block, pos = self._take_capped_block(ts, data, pos, "chunked trailer section")
        if block is not None:
            self._finish_message(ts)
        return pos

    def _take_capped_block(self, ts: int, data: bytes, pos: int, what: str):
        """_take_block, where a block over the cap loses the framing: (block or None, new pos)."""
        block, pos = self._take_block(data, pos)
        if block is _TOO_LONG:
            self.lose_framing(ts, f"{what} larger than {self._max_header_bytes} bytes")
            return None, len(data)
        return block, pos

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
                return self._hold(data, pos, stop, self._max_header_bytes)
            end = match.end()
        self._count(end - pos)
        return (self._release(data, pos, end) if buf else data[pos:end]), end

    def _take_line(self, data: bytes, pos: int, limit: int):
        """Collect bytes up to an LF. Returns (line without the LF, or None if more
        bytes are needed, or _TOO_LONG past `limit` bytes; new pos)."""
        buf = self._buf
        stop = min(len(data), pos + limit - len(buf))
        newline = data.find(b"\n", pos, stop)
        if newline < 0:
            return self._hold(data, pos, stop, limit)
        self._count(newline + 1 - pos)
        return (self._release(data, pos, newline) if buf else data[pos:newline]), newline + 1

    def _hold(self, data: bytes, pos: int, stop: int, cap: int):
        """Keep data[pos:stop] until the next segment: (None, or _TOO_LONG at `cap` bytes; new pos)."""
        self._count(stop - pos)
        self._buf += data[pos:stop]
        if len(self._buf) >= cap:
            return _TOO_LONG, len(data)
        return None, stop

    def _release(self, data: bytes, pos: int, end: int) -> bytes:
        """The held bytes followed by data[pos:end]; the hold is emptied."""
        buf = self._buf
        buf += data[pos:end]
        held = bytes(buf)
        buf.clear()
        return held


class RequestStream(MessageStream):
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
            exchange.path = path_of(match[2])
        return True

    def _on_header_block(self, ts: int, block: bytes) -> tuple[int, int]:
        tenant_header = self._conn._tenant_header
        start_line, headers = _parse_header_block(block, first_only=tenant_header)
        if not self._record_request_line(start_line):
            raise FramingError("invalid HTTP/1.x request line")
        exchange = self._txn.exchange if self._txn is not None else None
        if exchange is not None and tenant_header in headers:
            exchange.tenant = tenant_id(headers[tenant_header])
        mode, length = _body_framing(headers, is_request=True)
        if exchange is not None and mode != _NO_BODY:
            content_type = headers.get("content-type", "").lower()
            self._body = RequestBody(exchange, self._conn._fingerprint_key,
                                      read_fields=not content_type or "json" in content_type)
        return mode, length

    def _on_message_end(self, ts: int, txn: Txn | None, body) -> None:
        if txn is None:
            return
        txn.exchange.req_end_ns = ts
        if body is not None:
            body.finish()
        txn.request_done = True
        self._conn._settle()

    def _on_framing_lost(self, ts: int, reason: str, txn: Txn | None, body,
                         between_messages: bool) -> None:
        # The exchange keeps its place in the response queue: the server got the
        # whole request (the gap is only in the capture) and will answer it.
        self._conn._set_error(f"{reason}; waiting for the next request line")
        if reason.startswith("capture gap"):  # whole requests may lie in it: their responses still come
            self._conn._requests_hidden = True
        if txn is not None:
            self._conn._abandon(txn, reason, request_side=True)


class ResponseStream(MessageStream):
    noun = "response"
    _mid_stream_note = ("response stream picked up in the middle of a message; "
                        "waiting for the next status line")

    def __init__(self, conn: Connection, max_header_bytes: int, *, fast_path: bool = True) -> None:
        super().__init__(conn, max_header_bytes)
        self._awaiting_final = False  # an interim 1xx was seen: the final response follows
        self._fast_path = fast_path

    def feed(self, ts: int, head: bytes, gap: int, tail: bytes) -> None:
        # The fast path: a streamed response's write is whole chunks of whole SSE events.
        if (self._fast_path and not gap and not tail and self._state == _CHUNK_SIZE and not self._buf
                and type(self._body) is SseBody):
            done = self._whole_chunks(ts, head)
            if done:
                self.last_ts = ts
                if done == len(head):
                    return
                head = head[done:]
        super().feed(ts, head, gap, tail)

    def _whole_chunks(self, ts: int, data: bytes) -> int:
        """Read the whole chunks of whole events that start data, each in one step
        (SseBody.whole_events), as the general path would; return the bytes read."""
        pos, end = 0, len(data)
        while pos < end:
            size_line = _CHUNK_SIZE_LINE.match(data, pos)
            if size_line is None:
                break
            start = size_line.end()
            stop = start + int(size_line[1], 16)
            if (stop == start or not data.startswith(b"\r\n", stop)
                    or not self._body.whole_events(ts, data, start, stop)):
                break
            self._txn.exchange.resp_bytes += stop + 2 - pos  # a body is read only for a matched response
            pos = stop + 2
        return pos

    def steady_template(self, write: bytes) -> SteadyTemplate | None:
        """The bytes around the text of `write`, just read whole, if it was one whole chunk of one
        event that can be counted from its size alone (SseBody.steady_text); else None."""
        body = self._steady_body()
        size_line = _CHUNK_SIZE_LINE.match(write) if body is not None else None
        if size_line is None:
            return None
        start = size_line.end()
        stop = start + int(size_line[1], 16)
        if stop + 2 != len(write) or write[stop:] != b"\r\n":
            return None
        found = body.steady_text(write, start, stop)
        if found is None:
            return None
        text_start, text_end, digits, plain = found
        return SteadyTemplate(write[start:text_start], write[text_end:],
                              tuple((a - start, b - start) for a, b in digits),
                              tuple((a - start, b - start) for a, b in plain))

    def steady_writes(self, times: list[int], nbytes: int) -> bool:
        """Writes at `times`, of `nbytes` together, that the kernel took in around a template
        steady_template named, each one whole chunk of one such event; False, with nothing read,
        when the stream is not in step."""
        body = self._steady_body()
        if body is None or not body.steady_events(times):
            return False
        self._count(nbytes)
        self.last_ts = times[-1]
        return True

    def _steady_body(self) -> SseBody | NdjsonBody | None:
        """The event stream read between two chunks, as the fast path reads it; None otherwise."""
        body = self._body
        if self._fast_path and self._state == _CHUNK_SIZE and not self._buf and type(body) in (SseBody, NdjsonBody):
            return body
        return None

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
            raise FramingError("invalid HTTP/1.x status line")
        status = int(match[1])
        txn = self._txn
        exchange = txn.exchange if txn is not None else None
        if status == 101:
            protocol = printable(headers.get("upgrade", "")) or "another protocol"
            if protocol.lower() == "h2c" and txn is not None and self._conn._upgrade_to_http2(txn):
                return _SWITCH, 0
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
            self._body = response_body_reader(exchange, headers, scan=self._fast_path)
        if method == "HEAD" or status in (204, 304):
            return _NO_BODY, 0
        return _body_framing(headers, is_request=False)

    def _end_http(self, ts: int, txn: Txn | None, status: int, reason: str) -> None:
        """The connection leaves HTTP/1.x after this response's header block."""
        if txn is not None:
            exchange = txn.exchange
            exchange.status = status
            exchange.resp_end_ns = ts
            exchange.error = reason
            txn.response_done = True
        self._conn._stop(reason)

    def _on_message_end(self, ts: int, txn: Txn | None, body) -> None:
        if txn is None:
            return
        if body is not None:
            body.finish()
        txn.exchange.resp_end_ns = ts
        txn.response_done = True
        self._conn._settle()

    def _on_framing_lost(self, ts: int, reason: str, txn: Txn | None, body,
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


def proven_chunk_boundary(data: bytes, pos: int = 0) -> int | None:
    """The first offset at or after `pos` where chunked framing provably resumes, or None.

    An offset is proven when, read from there, whole chunks (plain size lines,
    data of that size, CRLF) run exactly to the end of `data`, or to the last
    chunk; one whole chunk proves it, two where the chain runs into a chunk
    that `data` cuts off. Candidates are `pos` and every offset after a CRLF
    (the end of the previous chunk)."""
    candidate = pos
    while not _chunk_chain_holds(data, candidate):
        crlf = data.find(b"\r\n", candidate)
        if crlf < 0:
            return None
        candidate = crlf + 2
    return candidate


def _chunk_chain_holds(data: bytes, pos: int) -> bool:
    end, whole = len(data), 0
    while True:
        if pos == end:
            return whole >= 1
        size_line = _CHUNK_SIZE_LINE.match(data, pos)
        if size_line is None:  # only the start of a size line may be left
            return whole >= 2 and _HEX_DIGITS_AT_END.fullmatch(data, pos) is not None
        size = int(size_line[1], 16)
        start = size_line.end()
        if size == 0:  # the last chunk, then the trailers' blank line (or the segment's end)
            return whole >= 1 and b"\r\n".startswith(data[start:start + 2])
        stop = start + size
        if stop + 2 > end:  # the chunk runs past what was captured
            return whole >= 2 and b"\r\n".startswith(data[stop:end])
        if data[stop:stop + 2] != b"\r\n":
            return False
        whole += 1
        pos = stop + 2


def _parse_header_block(block: bytes, first_only: str | None = None) -> tuple[bytes, dict[str, str]]:
    """The start line and the header fields that matter here (lower-case names;
    repeated fields joined with commas), plus the field named `first_only`, whose
    first occurrence alone is kept. Raises FramingError on malformed lines."""
    lines = block.split(b"\n")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        line = raw.removesuffix(b"\r")
        if not line or line[0] in (0x20, 0x09):  # the closing blank line; obs-fold (unsupported)
            continue
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise FramingError("malformed header field line")
        key = name.decode("ascii").lower()
        if key in FRAMING_HEADERS:
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
            raise FramingError("request Transfer-Encoding does not end in chunked")
        return _UNTIL_CLOSE, 0
    content_length = headers.get("content-length")
    if content_length is not None:
        values = {value.strip() for value in content_length.split(",")}
        if len(values) != 1:
            raise FramingError("conflicting Content-Length values")
        value = values.pop()
        if not _DIGITS.fullmatch(value):
            raise FramingError("invalid Content-Length")
        return _LENGTH, int(value)
    return (_NO_BODY, 0) if is_request else (_UNTIL_CLOSE, 0)
