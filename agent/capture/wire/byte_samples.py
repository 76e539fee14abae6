"""Bounded samples of byte streams of any length, and the request body fingerprint."""

from __future__ import annotations

import hashlib

__all__ = ["HeadTailSample", "REQUEST_BODY_HEAD", "REQUEST_BODY_TAIL", "body_fingerprint"]

# What body_fp covers (docs/schema.md, rendered from contract/): the first 4 KiB and last 1 KiB.
REQUEST_BODY_HEAD = 4096
REQUEST_BODY_TAIL = 1024


class HeadTailSample:
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


def body_fingerprint(key: bytes, sample: HeadTailSample) -> int:
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
