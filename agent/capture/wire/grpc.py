"""gRPC over HTTP/2: length-prefixed messages in a stream's DATA, status in its trailers.

A gRPC body is a sequence of messages, each behind a 5-byte prefix (a
compressed flag and a big-endian uint32 length), cut into DATA frames with no
regard for message boundaries. `GrpcMessages` follows that framing across
frames and capture gaps and counts messages and their sizes; on the response
side every finished message is one token event (the generic rule for a gRPC
streaming API: one streamed message per generated piece). No message content
is kept, only the 5-byte prefixes while they are in pieces.
"""

from __future__ import annotations

import struct
from urllib.parse import unquote

__all__ = ["GrpcMessages", "grpc_message_text", "grpc_status_code", "is_grpc"]

_PREFIX = struct.Struct(">BL")
# A message longer than this (gRPC's own default cap is 4 MiB) means the prefix
# was not a prefix: the framing is lost rather than followed into nonsense.
MAX_MESSAGE_BYTES = 1 << 31
_MAX_MESSAGE_CHARS = 256


def is_grpc(content_type: str) -> bool:
    """application/grpc, application/grpc+proto, application/grpc+json, …; not grpc-web."""
    content_type = content_type.strip().lower()
    return content_type == "application/grpc" or content_type.startswith(("application/grpc+",
                                                                          "application/grpc;"))


def grpc_status_code(value: str | None) -> int | None:
    """The grpc-status trailer as an int (0 = OK), or None if absent or malformed."""
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 3 else None


def grpc_message_text(value: str | None) -> str | None:
    """The grpc-message trailer, percent-decoded, printable and cut to 256 characters.

    It is the server's error text (never the payload), kept to say why a call failed."""
    if not value:
        return None
    text = unquote(value, errors="replace")
    return "".join(ch if ch.isprintable() else " " for ch in text)[:_MAX_MESSAGE_CHARS] or None


class GrpcMessages:
    """Counts the length-prefixed messages of one direction of a gRPC stream.

    Fed like the HTTP body readers: data(ts, chunk), gap(ts, nbytes), finish().
    When `events` is a list, the time of the segment holding each message's last
    byte is appended to it, up to `max_events` (the response side: those are the
    token events, appended straight to the record's list)."""

    __slots__ = ("messages", "message_bytes", "largest_message_bytes", "error", "_events", "_max_events", "_prefix",
                 "_remaining", "_lost")

    def __init__(self, events: list[int] | None = None, max_events: int = 0) -> None:
        self.messages = 0
        self.message_bytes = 0  # payload bytes of the messages, prefixes excluded
        self.largest_message_bytes = 0
        self.error: str | None = None
        self._events = events
        self._max_events = max_events
        self._prefix = bytearray()  # a message prefix split across DATA frames
        self._remaining = 0  # payload bytes of the current message still to come
        self._lost = False  # a gap hid a prefix: message framing unknown from there on

    def data(self, ts: int, chunk) -> None:
        pos, end = 0, len(chunk)
        while pos < end and not self._lost:
            if self._remaining:
                take = min(self._remaining, end - pos)
                self._remaining -= take
                pos += take
                if not self._remaining:
                    self._message_done(ts)
                continue
            need = _PREFIX.size - len(self._prefix)
            piece = chunk[pos:pos + need]
            pos += len(piece)
            if len(piece) < need or self._prefix:
                self._prefix += piece
                if len(self._prefix) < _PREFIX.size:
                    continue
                flag, length = _PREFIX.unpack(self._prefix)
                self._prefix.clear()
            else:
                flag, length = _PREFIX.unpack(piece)
            if flag > 1 or length > MAX_MESSAGE_BYTES:
                self._lose("gRPC message prefix is invalid; messages after it were not counted")
                return
            self.message_bytes += length
            self.largest_message_bytes = max(self.largest_message_bytes, length)
            self._remaining = length
            if not length:
                self._message_done(ts)

    def gap(self, ts: int, nbytes: int) -> None:
        if self._lost:
            return
        if self._prefix or nbytes > self._remaining:
            self._lose(f"capture gap of {nbytes} bytes hides a gRPC message prefix; "
                       "messages after it were not counted")
            return
        self._remaining -= nbytes
        if not self._remaining:
            self._message_done(ts)

    def finish(self) -> None:
        if not self._lost and (self._remaining or self._prefix):
            self.error = "gRPC stream ended inside a message"

    def _message_done(self, ts: int) -> None:
        self.messages += 1
        events = self._events
        if events is not None:
            if len(events) < self._max_events:
                events.append(ts)
            else:
                self.error = f"more than {self._max_events} messages; later ones not timed"

    def _lose(self, reason: str) -> None:
        self._lost = True
        self._prefix.clear()
        self.error = reason
