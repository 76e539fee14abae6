"""Segments: what the probes report of one read()/write() (a timestamp, the first bytes of the
call, its full length, its last bytes), checked and put in one form for both HTTP assemblers."""

from __future__ import annotations

# More requests than this without a finished response (hostile pipelining)
# stops parsing the connection rather than growing the queue without bound.
MAX_OPEN_EXCHANGES = 1024
# No read()/write() is this large; bigger lengths are malformed input.
MAX_SEGMENT_BYTES = 1 << 40


def normalise_segment(ts_ns, head, total_len, tail) -> tuple[int, bytes, int, bytes] | None:
    """(ts, head, gap, tail) of a segment description, or None if it is malformed."""
    if type(head) is bytes and type(total_len) is int and total_len == len(head) and type(ts_ns) is int \
            and tail == b"":  # the common case, whole: nothing to check further or copy
        return ts_ns, head, 0, b""
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

