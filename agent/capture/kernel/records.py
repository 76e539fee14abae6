"""The ring buffer's records (struct event in bpf/shared.c, struct steady_batch in bpf/steady.c) and
their decoding: the agent's hottest path, so `struct`, not ctypes. Every record is checked
against its own length fields, so a corrupt record is counted and skipped, never trusted."""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Protocol

HEAD_CAP = 65536  # a call up to this size is captured whole (see bpf/shared.c)
TAIL_CAP = 4096

# Must match struct event in bpf/shared.c, up to data[].
_HEADER = struct.Struct("<QQQQIIIIBBBBiIIIHH16s16s")
HEADER_SIZE = _HEADER.size

EV_ACCEPT, EV_CONNECT, EV_DATA, EV_CLOSE, EV_TLS_DONE, EV_EXEC, EV_EXIT = 1, 2, 3, 4, 5, 6, 7
EV_STEADY_BATCH = 8
DIR_READ, DIR_WRITE = 0, 1
ROLE_SERVER, ROLE_CLIENT = 0, 1


@dataclass(slots=True)
class KernelEvent:
    kind: int
    ts_ns: int
    conn_ns: int
    # The connection's counters before this event, per direction (DIR_READ,
    # DIR_WRITE): bytes moved and data events emitted by the kernel.
    bytes_before: tuple[int, int]
    events_before: tuple[int, int]
    tgid: int
    fd: int
    dir: int
    tls: bool
    role: int
    ret: int
    total_len: int
    head: bytes
    tail: bytes
    local_port: int
    peer_port: int
    peer_addr: str
    comm: str


@dataclass(frozen=True, slots=True)
class UnseenEnd:
    """A connection's end the agent received no close record of (struct unseen_end in
    bpf/shared.c): its close() the ring buffer refused, or a close no probe saw, found
    when the fd was reused. Its counters are those a close record would have carried."""

    conn_ns: int   # the connection's generation; 0 for one adopted or restarted
    ts_ns: int     # close()'s time; 0 when the close was never traced
    bytes_before: tuple[int, int]
    events_before: tuple[int, int]


# struct steady_batch (bpf/steady.c): laid out as struct event up to `kind`, then the words
# used, the batched writes' bytes together, the writes carried whole, a field of the kernel's own,
# where each of those starts among the words, and the words.
STEADY_WORDS, STEADY_WHOLE_MAX = 512, 16  # words of a batch record, writes carried whole in one (the kernel's)
_STEADY_HEADER = struct.Struct(f"<QQQQIIIIBBBBIQII{STEADY_WHOLE_MAX}H")
KIND_OFFSET = 48  # of `kind`, in both records
# What a template may hold (the kernel's STEADY_PREFIX_CAP, STEADY_SUFFIX_CAP, STEADY_WRITE_MAX): a prefix
# of a word or more, a suffix of a byte or more.
STEADY_PART_MIN, STEADY_PART_CAP, STEADY_WRITE_MAX = 8, 256, 1024


class SteadyShape(Protocol):
    """What the kernel matches a connection's steady writes against (the wire room's
    SteadyTemplate): the bytes before and after the text, and the prefix's spans of digits
    and of plain string bytes."""

    prefix: bytes
    suffix: bytes
    digits: tuple[tuple[int, int], ...]
    plain: tuple[tuple[int, int], ...]


def steady_template_fits(template: SteadyShape) -> bool:
    """Whether the kernel can hold this template."""
    return (STEADY_PART_MIN <= len(template.prefix) <= STEADY_PART_CAP
            and 1 <= len(template.suffix) <= STEADY_PART_CAP)


@dataclass(slots=True)
class SteadyBatch:
    """Writes of a steady SSE stream that the kernel took in as one record: each one whole
    HTTP chunk with the bytes of the connection's template around plain text."""

    kind: int
    ts_ns: int  # the last write's
    conn_ns: int
    bytes_before: tuple[int, int]  # the connection's counters before the first write
    events_before: tuple[int, int]
    tgid: int
    fd: int
    tls: bool  # always writes (DIR_WRITE), of a server (ROLE_SERVER): the agent names templates for no others
    write_ns: list[int]  # each batched write's time
    nbytes: int  # the batched writes' bytes together
    # The writes the kernel carried whole (bpf/steady.c), in their order among
    # the batched ones.
    whole: tuple[WholeWrite, ...] = ()


@dataclass(frozen=True, slots=True)
class WholeWrite:
    """A write a batch carries whole: it came after write_ns[:after], the batched writes since the
    one carried whole before it held run_bytes."""

    after: int
    run_bytes: int
    ts_ns: int
    data: bytes


class EventDecodeError(ValueError):
    pass


_addr_cache: dict[bytes, str] = {}


def _peer_text(raw: bytes) -> str:
    text = _addr_cache.get(raw)
    if text is None:
        addr = ipaddress.IPv6Address(raw)
        text = str(addr.ipv4_mapped or addr)
        if len(_addr_cache) < 65536:
            _addr_cache[raw] = text
    return text


def decode_steady_batch(buf: bytes) -> SteadyBatch:
    if len(buf) < _STEADY_HEADER.size:
        raise EventDecodeError(f"batch record of {len(buf)} bytes is shorter than its header")
    (ts, conn_ns, bytes_rd, bytes_wr, tgid, fd, events_rd, events_wr, kind, _, tls, _,
     count, nbytes, wholes, _, *whole_at) = _STEADY_HEADER.unpack_from(buf)
    base = _STEADY_HEADER.size
    if not 0 < count <= STEADY_WORDS or len(buf) != base + count * 8 or wholes > STEADY_WHOLE_MAX:
        raise EventDecodeError(f"batch record of {len(buf)} bytes says it holds {count} words")
    # The times in one step, as the kernel wrote them (native u64s): no object per write but its int.
    words = memoryview(buf)[base:].cast("Q")
    if not wholes:
        return SteadyBatch(kind, ts, conn_ns, (bytes_rd, bytes_wr), (events_rd, events_wr), tgid, fd, bool(tls),
                           words.tolist(), nbytes)
    times: list[int] = []
    whole = []
    at = 0
    for start in whole_at[:wholes]:
        size = words[start + 1] & 0xFFFFFFFF if at <= start < count - 1 else 0
        end = start + 2 + (size + 7) // 8
        if not size or end > count:
            raise EventDecodeError(f"batch record of {count} words carries a write outside them")
        times += words[at:start].tolist()
        data = base + (start + 2) * 8
        whole.append(WholeWrite(len(times), words[start + 1] >> 32, words[start], bytes(buf[data:data + size])))
        at = end
    times += words[at:count].tolist()
    return SteadyBatch(kind, ts, conn_ns, (bytes_rd, bytes_wr), (events_rd, events_wr), tgid, fd, bool(tls),
                       times, nbytes, tuple(whole))


def decode_event(buf: bytes) -> KernelEvent | SteadyBatch:
    """One ring-buffer record → KernelEvent (or SteadyBatch); EventDecodeError if malformed."""
    if len(buf) > KIND_OFFSET and buf[KIND_OFFSET] == EV_STEADY_BATCH:
        return decode_steady_batch(buf)
    if len(buf) < HEADER_SIZE:
        raise EventDecodeError(f"record of {len(buf)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (ts, conn_ns, bytes_rd, bytes_wr, tgid, fd, events_rd, events_wr, kind, direction, tls, role, ret,
     total, head_len, tail_len, lport, pport, addr, comm) = _HEADER.unpack_from(buf)
    if not EV_ACCEPT <= kind <= EV_EXIT:
        raise EventDecodeError(f"unknown event kind {kind}")
    end = HEADER_SIZE + head_len + tail_len
    if end > len(buf) or head_len + tail_len > total or head_len > HEAD_CAP or tail_len > TAIL_CAP:
        raise EventDecodeError(
            f"inconsistent lengths: head {head_len} + tail {tail_len} of {total} in a {len(buf)}-byte record")
    # The command name matters where a connection or process begins; on the per-token data events it
    # is left undecoded (the tracker reads /proc for a connection first seen through its data).
    name = "" if kind == EV_DATA else comm.split(b"\0", 1)[0].decode("utf-8", "replace")
    return KernelEvent(
        kind, ts, conn_ns, (bytes_rd, bytes_wr), (events_rd, events_wr), tgid, fd, direction, bool(tls), role, ret, total,
        buf[HEADER_SIZE:HEADER_SIZE + head_len], buf[HEADER_SIZE + head_len:end],
        lport, pport, _peer_text(addr), name)

