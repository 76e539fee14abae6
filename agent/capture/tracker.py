"""Kernel events → connections → one row per request.

The tracker keeps one HttpConnectionAssembler per tracked connection, feeds it
the bytes in the right direction (a server reads requests and writes
responses; an outbound client the reverse), counts requests in flight per
server port, and turns each finished exchange into a `tokenprobe.requests`
row (contract/requests.py; docs/schema.md) with wall-clock timestamps.

Every row says how completely it was seen (`capture`). The kernel numbers
each connection's data events and bytes per direction, whether or not the
ring buffer took them, so a jump in those numbers names exactly the events
and bytes that were dropped: the exchanges open at that moment are
`dropped`, and the assembler is told the size of the hole so that its
framing stays in step. Bytes a delivered event did not carry (beyond its
head and tail) are counted too: a response with any, or a request whose
framing they broke, is `gaps`. Everything else is `exact`.

A close whose record the ring buffer refused, or one no probe saw
(`close_range`, `dup2` over the fd), leaves the connection open here until it
is found gone: its fd reused, idle, or the agent stopping. The kernel keeps
such a connection's end (`UnseenEnds`): the close's time and the counters its
record would have carried, so its rows end when it did and count its lost
last events as any close would.

Kernel batching (`steady`): after a whole response write that the assembler
reads as one chunk of one event of a steady SSE stream, the tracker names the
bytes around its text to the kernel (HttpConnectionAssembler.steady_template);
the kernel then sends the writes that match as batches of (time, size), which
the assembler counts as the same events, provided the stream is still in step
for them; if it is not (it moved on before the kernel learnt the template),
their bytes are booked as unseen. A batch also carries, in their places, the
writes of the response the kernel reads whole (its first text, escaped texts,
the closing chunks), read here as any write: one record from a response's first
text to its end. Batched writes carry sequence numbers like
any other, so a lost batch is a gap like any other.

The protocol is chosen per connection at its first captured bytes, in either
direction (a server's SETTINGS may precede the client's preface): HTTP/2
(`starts_http2`), else HTTP/1; too few bytes to tell and the segments are
held until the next one. A connection picked up mid-way whose bytes read as
HTTP/2 frames goes to the HTTP/2 assembler, which names it `h2_midstream`.
An HTTP/1.1 connection whose server accepts `Upgrade: h2c` moves to the
HTTP/2 assembler at the end of the 101, the upgraded request as stream 1.
A connection that cannot be read (HTTP/2 it lost track of, TLS no libssl
probe saw, TLS picked up mid-way that ended before libssl named it, what
follows another 101 upgrade, bytes of no known protocol) becomes one
`unsupported` row at its close, with the reason in `unreadable_reason`:
missing data never reads as health. It is counted (`on_unreadable`) as soon as
it is known to be unreadable, so a long-lived one does not stay invisible
until it closes.

The tracker's memory is bounded: a connection with no I/O for the idle
timeout is forgotten (`evict_idle`, called by the agent's loop), its open
exchanges written `truncated`. Its kernel entry stays, restarted
(`restart_connection`) as if adopted when the agent started: no accept time,
counters at zero. If the connection speaks again it is followed afresh under
a new conn_id, read from the middle, and nothing it said before is counted
twice or as lost; the tracker remembers nothing of it meanwhile.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import re
import socket
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from ...contract.tenant import DEFAULT_TENANT_HEADER, tenant_header_name
from .exchange import Exchange
from .kernel.clock import MonotonicWallClock
from .kernel.procfs import comm_of, socket_endpoints
from .kernel.records import (
    DIR_READ,
    DIR_WRITE,
    EV_ACCEPT,
    EV_CLOSE,
    EV_CONNECT,
    EV_DATA,
    EV_EXEC,
    EV_EXIT,
    EV_STEADY_BATCH,
    EV_TLS_DONE,
    ROLE_CLIENT,
    KernelEvent,
    SteadyBatch,
    UnseenEnd,
    steady_template_fits,
)
from .wire.assembler import H2cUpgrade, HttpConnectionAssembler
from .wire.http2 import (
    H2Exchange,
    Http2ConnectionAssembler,
    resembles_http2_frames,
    starts_http2,
)
from .wire.sse import SteadyTemplate

log = logging.getLogger("tokenprobe.tracker")

TLS_RECORD_START = (b"\x16\x03", b"\x17\x03", b"\x15\x03")  # handshake, data, alert
# Application data flows only after the handshake: met unread in both directions, no probe will read the connection.
TLS_APPLICATION_DATA = b"\x17\x03"
TLS_UNPROBED_WORDS = "TLS records on a connection no libssl probe saw (a TLS library the agent does not probe)"
TLS_MIDSTREAM_WORDS = ("TLS records on a connection opened before the agent started that no libssl read named "
                       "(it ended before one was seen, or its TLS library the agent does not probe)")
# How an HTTP/1 connection's first bytes begin: a request line's method, or a status line.
_HTTP1_REQUEST_START = re.compile(rb"[A-Z][A-Z_-]{2,19} ")
_HTTP1_RESPONSE_START = b"HTTP/1."
# What a connection's first bytes must hold before HTTP/1 or HTTP/2 can be told apart.
_PROTOCOL_PROBE_BYTES = 24
# Longer than servers' keep-alive timeouts (nginx 75 s, uvicorn 5 s) and than a long
# non-streamed generation waits for its response: what outlives it has lost its close.
DEFAULT_IDLE_TIMEOUT_S = 600.0


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname().encode()


_BOOT_ID = _boot_id()


def connection_id(tgid: int, fd: int, opened_ns: int) -> int:
    """A 63-bit id unique per node: boot, process, fd and open time."""
    digest = hashlib.blake2b(b"%s:%d:%d:%d" % (_BOOT_ID, tgid, fd, opened_ns), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_OFFSET_CAP_US = 0xFFFFFFFF  # the column's UInt32


def _offsets_us(times: list[int], first: int | None) -> list[int]:
    """Each token time's whole µs after the first, capped at the column's range (the cap is looked
    for once, not per token: a row holds thousands)."""
    if not times:
        return []
    if (max(times) - first) // 1000 <= _OFFSET_CAP_US:
        return [(t - first) // 1000 for t in times]
    return [min((t - first) // 1000, _OFFSET_CAP_US) for t in times]


class SteadyKernel(Protocol):
    """The kernel's side of batching steady SSE streams (probes.Probes)."""

    def arm_steady(self, tgid: int, fd: int, template: SteadyTemplate) -> bool: ...
    def take_steady_batch(self, tgid: int, fd: int) -> SteadyBatch | None: ...
    def held_steady_writes(self, tgid: int, fd: int) -> tuple[int, int] | None: ...


class UnseenEnds(Protocol):
    """The kernel's record of connections that ended where the agent saw no close (probes.Probes)."""

    def take_unseen_end(self, tgid: int, fd: int) -> UnseenEnd | None: ...


@dataclass(slots=True)
class Fidelity:
    """What the capture missed of one exchange while it was open."""

    dropped: bool = False       # kernel events lost (sequence gap)
    request_unseen: int = 0     # bytes towards the server not captured
    response_unseen: int = 0    # bytes towards the client not captured


@dataclass(slots=True)
class Connection:
    tgid: int
    fd: int
    opened_ns: int          # kernel accept/connect time; first event time if unseen
    accept_seen: bool
    role: int
    local_port: int
    peer_addr: str
    peer_port: int
    comm: str
    conn_id: int
    # Chosen at the first captured bytes (None until then, and for a connection not read).
    assembler: HttpConnectionAssembler | Http2ConnectionAssembler | None = None
    protocol: str = ""              # 'http/1.1', 'h2' or 'h2c' once chosen
    # Segments (is_request, ts, head, total_len, tail) held while the protocol is undecided.
    pending: list[tuple[bool, int, bytes, int, bytes]] = field(default_factory=list)
    unreadable: str | None = None   # why the connection is not read (a blind spot), if so
    unreadable_words: str = ""
    first_ns: int = 0               # the first data event's time
    last_ns: int = 0                # the latest event's time (idle eviction)
    rows: int = 0                   # rows written for the connection so far
    tls: bool = False
    tls_done_ns: int | None = None
    ciphertext_only: bool = False   # raw TLS bytes seen and no plaintext probe yet
    raw_application_data: set[int] = field(default_factory=set)  # directions it was seen in, unread
    peer_eof: bool = False
    reset: bool = False
    client_gone: bool = False
    # Next expected kernel counters per direction (DIR_READ, DIR_WRITE).
    next_event: list[int] = field(default_factory=lambda: [0, 0])
    next_byte: list[int] = field(default_factory=lambda: [0, 0])
    open: dict[int, Fidelity] = field(default_factory=dict)  # exchange seq → what it missed
    # The kernel's accept time of the connection, which its events carry (conn_ns); 0 if it had
    # none (adopted at start, restarted after idling). A field, not a property: every data event
    # compares it.
    generation: int = 0
    # The agent's own connection (its client is the agent: a scrape of the server's /metrics), found at
    # the first data event; None until then. Nothing of it is read or recorded.
    own: bool | None = None


@dataclass
class TrackerStats:
    connections: int = 0
    requests: int = 0
    events: int = 0
    parse_errors: int = 0
    dropped_connections: int = 0   # tracked by the kernel but not a target after all
    unknown_api_streams: int = 0   # event streams in no known API shape (rows with api 'unknown')
    lost_events: int = 0           # data events the kernel numbered and the agent never received
    bytes_unseen: int = 0          # bytes moved on tracked connections and not captured
    unreadable_connections: int = 0  # connections found unreadable (blind spots), each one `unsupported` row
    idle_evicted: int = 0          # connections forgotten after the idle timeout
    steady_writes: int = 0         # writes that came in the kernel's batches, not as events of their own
    steady_templates: int = 0      # templates named to the kernel
    unknown_ends: int = 0          # connections found gone (fd reused) with neither a close record nor a kept end
    own_connections: int = 0       # connections whose client was the agent itself, never recorded
    inflight: dict[int, int] = field(default_factory=dict)


class ConnectionTracker:
    def __init__(self, emit_row: Callable[[dict], None], *, clock: MonotonicWallClock,
                 fingerprint_key: bytes, node: str | None = None,
                 target_ports: set[int] | None = None, target_pids: set[int] | None = None,
                 forget_connection: Callable[[int, int, int], None] | None = None,
                 on_unreadable: Callable[[int, str], None] | None = None,
                 restart_connection: Callable[[int, int, int], None] | None = None,
                 tenant_header: str | None = DEFAULT_TENANT_HEADER,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, steady: SteadyKernel | None = None,
                 unseen_ends: UnseenEnds | None = None,
                 own_connection: Callable[[int, int, int], bool] | None = None) -> None:
        """`on_unreadable(server_port, reason)`: a connection was found unreadable, once per connection.
        `own_connection(peer_port, local_port, accept_ns)`: whether an accepted connection's client is the
        agent itself (kernel/loader.py); None: the agent's own traffic is not told apart."""
        if idle_timeout_s <= 0:
            raise ValueError("the idle timeout must be positive")
        self.emit_row = emit_row
        self.on_unreadable = on_unreadable
        self.clock = clock
        self.fingerprint_key = fingerprint_key
        # Checked here, not at the first connection: a bad name must stop the agent at start.
        self.tenant_header = tenant_header_name(tenant_header)
        self.node = node or socket.gethostname()
        self.target_ports = target_ports or set()
        self.target_pids = target_pids or set()
        self.forget_connection = forget_connection
        self.restart_connection = restart_connection  # the kernel's side of an idle eviction
        self.steady = steady  # None: kernel batching off (every write comes as its own event)
        self.unseen_ends = unseen_ends  # None: a close the agent did not see is known only from its fd's reuse
        self.own_connection = own_connection
        self.connections: dict[tuple[int, int], Connection] = {}
        self.idle_timeout_ns = int(idle_timeout_s * 1e9)
        self.stats = TrackerStats()
        self._handlers = {
            EV_ACCEPT: self._on_open, EV_CONNECT: self._on_open, EV_DATA: self._on_data,
            EV_CLOSE: self._on_close, EV_TLS_DONE: self._on_tls_done, EV_EXEC: self._on_exec,
            EV_EXIT: self._on_exit, EV_STEADY_BATCH: self._on_steady_batch,
        }

    # -- event dispatch --------------------------------------------------
    def handle(self, ev: KernelEvent) -> None:
        self.stats.events += 1
        self._handlers[ev.kind](ev)

    def _new_connection(self, ev: KernelEvent, accept_seen: bool) -> Connection:
        opened_ns = ev.conn_ns if accept_seen else ev.ts_ns
        conn = Connection(
            tgid=ev.tgid, fd=ev.fd, opened_ns=opened_ns, accept_seen=accept_seen, role=ev.role,
            local_port=ev.local_port, peer_addr=ev.peer_addr, peer_port=ev.peer_port,
            comm=ev.comm or comm_of(ev.tgid), conn_id=connection_id(ev.tgid, ev.fd, opened_ns),
            first_ns=ev.ts_ns, last_ns=ev.ts_ns, generation=ev.conn_ns)
        self.connections[(ev.tgid, ev.fd)] = conn
        self.stats.connections += 1
        return conn

    def _on_open(self, ev: KernelEvent) -> None:
        old = self.connections.pop((ev.tgid, ev.fd), None)
        if old is not None:  # the fd was reused and its close() was not seen
            self._close_unseen(old, ev.ts_ns, self._unseen_end(old))
        if ev.role != ROLE_CLIENT and ev.local_port == 0:
            # The kernel could not name the port (see accept_exit in the BPF
            # program): read it, and the peer, from /proc.
            endpoints = socket_endpoints(ev.tgid, ev.fd)
            if endpoints is None or (self.target_ports and endpoints[0] not in self.target_ports
                                     and ev.tgid not in self.target_pids):
                self.stats.dropped_connections += 1
                if self.forget_connection:
                    self.forget_connection(ev.tgid, ev.fd, ev.conn_ns)
                return
            ev.local_port, ev.peer_addr, ev.peer_port = endpoints
        self._new_connection(ev, accept_seen=True)

    def _connection_for(self, ev: KernelEvent) -> Connection:
        conn = self.connections.get((ev.tgid, ev.fd))
        if conn is not None and ev.conn_ns != conn.generation:
            # A newer connection on the same fd whose accept event was lost.
            self._close_unseen(conn, ev.ts_ns, self._unseen_end(conn))
            conn = None
        if conn is None:
            # Opened before the agent started, or its accept event was lost.
            conn = self._new_connection(ev, accept_seen=bool(ev.conn_ns))
        return conn

    def _is_own(self, conn: Connection) -> bool:
        """Whether the agent itself is the connection's client. Asked at its first data event: the client
        had connected before it could send (the kernel noted the agent's connect by then), and the
        server reads before it writes."""
        own = (self.own_connection is not None and conn.role != ROLE_CLIENT and conn.generation != 0
               and self.own_connection(conn.peer_port, conn.local_port, conn.generation))
        if own:
            self.stats.own_connections += 1
        return own

    def _is_request(self, conn: Connection, direction: int) -> bool:
        return (direction == DIR_READ) != (conn.role == ROLE_CLIENT)

    def _check_sequence(self, conn: Connection, ev: KernelEvent) -> None:
        """Accounts for data events the kernel numbered before `ev` that never
        arrived: the open exchanges lost them, and the assembler skips their
        bytes as a gap."""
        for direction in (DIR_READ, DIR_WRITE):
            lost = ev.events_before[direction] - conn.next_event[direction]
            if lost <= 0:  # nothing missing (or a counter the agent already passed)
                continue
            nbytes = max(0, ev.bytes_before[direction] - conn.next_byte[direction])
            conn.next_event[direction] = ev.events_before[direction]
            conn.next_byte[direction] = ev.bytes_before[direction]
            self.stats.lost_events += lost
            self.stats.bytes_unseen += nbytes
            is_request = self._is_request(conn, direction)
            for fidelity in conn.open.values():
                fidelity.dropped = True
            self._note_unseen(conn, is_request, nbytes)
            if nbytes:
                self._finish(conn, self._feed(conn, is_request, ev.ts_ns, b"", nbytes))

    @staticmethod
    def _note_unseen(conn: Connection, is_request: bool, nbytes: int) -> None:
        """Books unseen bytes to the exchange they belong to: a request's to the
        newest open exchange (the one being read), a response's to the oldest
        (the one being answered)."""
        if not nbytes or not conn.open:
            return
        if is_request:
            conn.open[next(reversed(conn.open))].request_unseen += nbytes
        else:
            conn.open[next(iter(conn.open))].response_unseen += nbytes

    def _on_data(self, ev: KernelEvent) -> None:
        conn = self._connection_for(ev)
        conn.last_ns = ev.ts_ns
        if conn.own is None:
            conn.own = self._is_own(conn)
        if conn.own:
            return
        if ev.events_before[0] > conn.next_event[0] or ev.events_before[1] > conn.next_event[1]:
            self._check_sequence(conn, ev)  # only then was anything lost
        direction = ev.dir & 1
        conn.next_event[direction] = max(conn.next_event[direction], ev.events_before[direction] + 1)
        conn.next_byte[direction] = max(conn.next_byte[direction], ev.bytes_before[direction] + max(ev.ret, 0))
        if ev.tls:
            conn.tls = True
            conn.ciphertext_only = False
        elif conn.tls or conn.ciphertext_only or ev.head.startswith(TLS_RECORD_START):
            # Ciphertext: read before libssl's probes named the connection, or TLS no probe
            # sees at all (whose reads may split a record's header from its payload).
            conn.ciphertext_only = True
            if not conn.tls and ev.head.startswith(TLS_APPLICATION_DATA):
                conn.raw_application_data.add(direction)
                if len(conn.raw_application_data) == 2:
                    self._mark_tls_unread(conn)
            return
        if ev.ret < 0:
            if ev.ret in (-errno.ECONNRESET, -errno.ETIMEDOUT):
                conn.reset = True
            elif ev.ret == -errno.EPIPE:
                conn.client_gone = True
            return
        if ev.ret == 0:
            conn.peer_eof = True
            return
        self._segment(conn, direction, ev.ts_ns, ev.head, ev.total_len, ev.tail)

    def _segment(self, conn: Connection, direction: int, ts: int, head: bytes, total_len: int, tail: bytes,
                 *, carried: bool = False) -> None:
        """The bytes a call moved (of them, those captured) to the connection's assembler. ``carried``:
        a write the kernel carried whole in a batch, which only a connection with a template has."""
        is_request = self._is_request(conn, direction)
        exchanges = self._feed(conn, is_request, ts, head, total_len, tail)
        # Booked after feeding: the segment may itself open the exchange it belongs to.
        unseen = max(0, total_len - len(head) - len(tail))
        if unseen:
            self.stats.bytes_unseen += unseen
            self._note_unseen(conn, is_request, unseen)
        elif self.steady is not None and direction == DIR_WRITE and not is_request and not tail and not carried:
            # A carried write is not followed: the kernel already holds a template (it opened the batch
            # with a write like it), and one a stream has left is named again from the first write it
            # sends as an event of its own.
            self._follow_steady(conn, head)
        self._finish(conn, exchanges)

    # -- kernel batching ---------------------------------------------------
    def _follow_steady(self, conn: Connection, write: bytes) -> None:
        """After a whole response write: names a new template to the kernel when the write shows one.
        (One the stream has left ends in the kernel at the first write that differs from it.)"""
        assembler = conn.assembler
        template = assembler.steady_template(write) if isinstance(assembler, HttpConnectionAssembler) else None
        if template is not None and steady_template_fits(template):
            self.stats.steady_templates += 1
            self.steady.arm_steady(conn.tgid, conn.fd, template)

    def held_writes(self, conn: Connection) -> tuple[int, int] | None:
        """The times of the first and last response writes the kernel holds in the connection's batch
        (not sent yet: the batch goes at the body's end), if it holds any; for looking at."""
        return self.steady.held_steady_writes(conn.tgid, conn.fd) if self.steady is not None else None

    def _take_kernel_batch(self, key: tuple[int, int]) -> None:
        """Reads a batch the kernel still holds for a connection from its map (kernel batching)."""
        batch = self.steady.take_steady_batch(*key) if self.steady is not None else None
        if batch is not None:
            self._on_steady_batch(batch)

    def _on_steady_batch(self, batch: SteadyBatch) -> None:
        """Response writes the kernel matched against the connection's template, each one chunk of
        one event of visible text, counted from its time and size; and, in their places among them,
        the writes it carried whole, read as any write."""
        conn = self.connections.get((batch.tgid, batch.fd))
        writes = len(batch.write_ns) + len(batch.whole)
        if conn is None or (conn.accept_seen and conn.opened_ns != batch.conn_ns):
            self.stats.lost_events += writes  # a connection this agent no longer follows
            return
        self._check_sequence(conn, batch)
        times, whole = batch.write_ns, batch.whole
        conn.next_event[DIR_WRITE] = max(conn.next_event[DIR_WRITE], batch.events_before[DIR_WRITE] + writes)
        conn.next_byte[DIR_WRITE] = max(conn.next_byte[DIR_WRITE], batch.bytes_before[DIR_WRITE] + batch.nbytes
                                        + sum(len(write.data) for write in whole))
        conn.last_ns = batch.ts_ns
        self.stats.steady_writes += len(times)
        if batch.tls:
            conn.tls = True
        done, run_bytes = 0, batch.nbytes
        for write in whole:
            if write.after > done:
                self._batched_writes(conn, times[done:write.after], write.run_bytes)
            done, run_bytes = write.after, run_bytes - write.run_bytes
            self._segment(conn, DIR_WRITE, write.ts_ns, write.data, len(write.data), b"", carried=True)
        if done < len(times):
            self._batched_writes(conn, times[done:] if done else times, run_bytes)

    def _batched_writes(self, conn: Connection, times: list[int], nbytes: int) -> None:
        assembler = conn.assembler
        if (isinstance(assembler, HttpConnectionAssembler) and not self._is_request(conn, DIR_WRITE)
                and assembler.feed_steady_response_writes(times, nbytes)):
            return
        # The stream is not where the template was named (it moved on before the kernel learnt
        # the template): what the writes held is unknown, and booked as unseen.
        self.stats.bytes_unseen += nbytes
        self._note_unseen(conn, False, nbytes)
        self._finish(conn, self._feed(conn, False, times[-1], b"", nbytes))

    def _on_close(self, ev: KernelEvent) -> None:
        conn = self.connections.pop((ev.tgid, ev.fd), None)
        if conn is None:
            return
        self._check_sequence(conn, ev)  # the last data events may be the ones lost
        self._close(conn, ev.ts_ns, self._close_reason(conn))

    @staticmethod
    def _close_reason(conn: Connection) -> str:
        if conn.reset:
            return "reset"
        if conn.peer_eof or conn.client_gone:
            return "client_closed"
        return "server_closed"

    def _unseen_end(self, conn: Connection) -> UnseenEnd | None:
        """The end the kernel kept of `conn` (`unseen_ends`): a close whose record the ring
        buffer refused, or a close no probe saw, found when the fd was reused. None if it kept
        none of this connection (its close was seen, it is still open, or the kernel's LRU
        let it go)."""
        end = self.unseen_ends.take_unseen_end(conn.tgid, conn.fd) if self.unseen_ends else None
        return end if end is not None and end.conn_ns == conn.generation else None  # not an older one's

    def _close_unseen(self, conn: Connection, found_ns: int, end: UnseenEnd | None) -> None:
        """Closes a connection found gone at `found_ns` whose close record never came. Its
        kept end dates the close (if it was traced) and carries the counters the close record
        would have, which say whether any of the connection's last events were lost; without
        one, the close is dated when it was found."""
        if end is None:
            if self.unseen_ends is not None:
                # The kernel keeps the end of every connection it follows to an unseen close, so
                # none kept means it lost track of this one (its LRU let the end, or the connection,
                # go): what its last events held is unknown, and its open exchanges may lack them.
                self.stats.unknown_ends += 1
                for fidelity in conn.open.values():
                    fidelity.dropped = True
            self._close(conn, found_ns, "server_closed")
            return
        if not end.ts_ns:  # a close no probe saw (close_range, dup2 over the fd, close on exec)
            end = replace(end, ts_ns=found_ns)
        self._check_sequence(conn, end)
        self._close(conn, end.ts_ns, self._close_reason(conn))

    def _on_tls_done(self, ev: KernelEvent) -> None:
        conn = self._connection_for(ev)
        conn.last_ns = ev.ts_ns
        self._check_sequence(conn, ev)
        conn.tls = True
        conn.tls_done_ns = ev.ts_ns

    def _on_exec(self, ev: KernelEvent) -> None:
        log.info("new target process %d (%s)", ev.tgid, ev.comm)

    def _on_exit(self, ev: KernelEvent) -> None:
        """The process died: the kernel closed its sockets without close()."""
        for key in [key for key in self.connections if key[0] == ev.tgid]:
            self._take_kernel_batch(key)  # no close() sent it
            conn = self.connections.pop(key)
            if self.forget_connection:
                self.forget_connection(conn.tgid, conn.fd, conn.generation)
            self._close(conn, ev.ts_ns, "server_closed")

    def evict_idle(self, now_ns: int) -> int:
        """Forgets every connection with no I/O for the idle timeout (its open
        exchanges written `truncated`); returns how many. One that ended where
        the agent saw no close, as the kernel kept its end, is closed instead."""
        deadline = now_ns - self.idle_timeout_ns
        idle = [key for key, conn in self.connections.items() if conn.last_ns < deadline]
        evicted = 0
        for key in idle:
            self._take_kernel_batch(key)  # a batch whose body end the kernel did not see waits for no write now
            conn = self.connections.pop(key)
            end = self._unseen_end(conn)
            if end is not None:
                self._close_unseen(conn, now_ns, end)
                continue
            if self.restart_connection:
                self.restart_connection(conn.tgid, conn.fd, conn.generation)
            self._close(conn, now_ns, "idle_timeout")
            evicted += 1
        self.stats.idle_evicted += evicted
        return evicted

    def close_all(self, ts_ns: int) -> None:
        """Agent stop: every exchange still open is written, marked truncated (or
        as its connection ended, where the kernel kept an end the agent did not see)."""
        for key, conn in list(self.connections.items()):
            self._take_kernel_batch(key)  # the writes of a stream still going that the kernel holds
            end = self._unseen_end(conn)
            if end is not None:
                self._close_unseen(conn, ts_ns, end)
            else:
                self._close(conn, ts_ns, "agent_stop")
        self.connections.clear()

    # -- protocols ---------------------------------------------------------
    def _feed(self, conn: Connection, is_request: bool, ts: int, head: bytes, total_len: int,
              tail: bytes = b"") -> list[Exchange]:
        """One segment (or a gap: no head, no tail) to the connection's assembler,
        choosing the assembler first if this is among the connection's first bytes."""
        if conn.unreadable:
            return []
        if conn.assembler is None:
            conn.pending.append((is_request, ts, head, total_len, tail))
            return self._decide(conn, closing=False)
        exchanges = self._feed_assembler(conn, is_request, ts, head, total_len, tail)
        self._note_http2_unreadable(conn)
        return exchanges

    def _feed_assembler(self, conn: Connection, is_request: bool, ts: int, head: bytes, total_len: int,
                        tail: bytes = b"") -> list[Exchange]:
        assembler = conn.assembler
        feed = assembler.feed_request_bytes if is_request else assembler.feed_response_bytes
        exchanges = feed(ts, head, total_len, tail)
        if isinstance(assembler, HttpConnectionAssembler) and assembler.h2c_upgrade is not None:
            exchanges = [*exchanges, *self._continue_in_http2(conn, assembler.h2c_upgrade)]
        return exchanges

    def _continue_in_http2(self, conn: Connection, upgrade: H2cUpgrade) -> list[Exchange]:
        """The server accepted `Upgrade: h2c`: the HTTP/2 assembler reads on from the end of the 101,
        the upgraded request as its stream 1."""
        conn.protocol = "h2" if conn.tls else "h2c"
        conn.assembler = assembler = self._new_assembler(conn, Http2ConnectionAssembler)
        assembler.continue_upgraded(upgrade.exchange)
        exchanges: list[Exchange] = []
        for segment in upgrade.response_segments:
            exchanges += assembler.feed_response_bytes(*segment)
        return exchanges

    def _note_http2_unreadable(self, conn: Connection) -> None:
        """The HTTP/2 assembler stopped reading the connection (lost track, limits): it is unreadable."""
        if isinstance(conn.assembler, Http2ConnectionAssembler) and conn.assembler.unreadable:
            self._mark_unreadable(conn, conn.assembler.unreadable, conn.assembler.error)

    def _decide(self, conn: Connection, *, closing: bool) -> list[Exchange]:
        """Chooses the connection's assembler and feeds it the held segments; [] while undecided."""
        if not self._choose_protocol(conn, closing=closing):
            return []
        segments, conn.pending = conn.pending, []
        exchanges: list[Exchange] = []
        for is_request, *segment in segments:
            exchanges += self._feed_assembler(conn, is_request, *segment)
        self._note_http2_unreadable(conn)
        return exchanges

    def _choose_protocol(self, conn: Connection, *, closing: bool) -> bool:
        """Picks the assembler from the held segments; False while they cannot tell yet
        (on `closing` they must), or when the connection is not read at all."""
        pending = conn.pending
        # Nothing lost before the first bytes held: the connection is seen from its start.
        from_start = conn.accept_seen and bool(pending[0][2])
        first = next((segment for segment in pending if segment[2]), None)
        if first is None:  # only gaps so far
            if not closing:
                return False
            is_request, head = True, b""
        else:
            is_request = first[0]
            head = b"".join(segment[2] for segment in pending if segment[0] == is_request)
        is_h2 = starts_http2(head[:_PROTOCOL_PROBE_BYTES], is_request=is_request)
        if not is_h2 and not from_start and resembles_http2_frames(head):
            is_h2 = True  # picked up mid-way: the HTTP/2 assembler says so (h2_midstream)
        if is_h2 is None and not closing and len(head) < _PROTOCOL_PROBE_BYTES:
            return False
        if is_h2:
            conn.protocol, assembler = ("h2" if conn.tls else "h2c"), Http2ConnectionAssembler
        elif from_start and head and not (_HTTP1_REQUEST_START.match(head) if is_request
                                          else head.startswith(_HTTP1_RESPONSE_START)):
            self._mark_unreadable(conn, "unknown_protocol", "the connection's first bytes are "
                                  "neither HTTP/1, HTTP/2 nor TLS")
            conn.pending.clear()
            return False
        else:
            conn.protocol, assembler = "http/1.1", HttpConnectionAssembler
        conn.assembler = self._new_assembler(conn, assembler)
        return True

    def _new_assembler(self, conn: Connection, assembler: type[HttpConnectionAssembler | Http2ConnectionAssembler]):
        return assembler(fingerprint_key=self.fingerprint_key, tenant_header=self.tenant_header,
                         on_request_start=lambda exchange: self._request_started(conn, exchange))

    def _mark_unreadable(self, conn: Connection, reason: str, words: str) -> None:
        """The connection cannot be read: counted now, written as one `unsupported` row at its close."""
        if conn.unreadable is None:
            conn.unreadable, conn.unreadable_words = reason, words
            self.stats.unreadable_connections += 1
            if self.on_unreadable:
                self.on_unreadable(self._server_port(conn), reason)

    def _mark_tls_unread(self, conn: Connection) -> None:
        """TLS records no probe read: a TLS library the agent does not probe, or, on a
        connection opened before the agent, one libssl had not named yet (the SSL object
        is bound at its next read)."""
        if conn.accept_seen:
            self._mark_unreadable(conn, "tls_unprobed", TLS_UNPROBED_WORDS)
        else:
            self._mark_unreadable(conn, "tls_midstream", TLS_MIDSTREAM_WORDS)

    def _close(self, conn: Connection, ts: int, reason: str) -> None:
        """The connection ended: its open exchanges are written, and if it could not
        be read, one `unsupported` row says why."""
        if conn.assembler is None and conn.pending:
            self._finish(conn, self._decide(conn, closing=True))
        if conn.assembler is not None:
            exchanges = conn.assembler.close(ts, reason)
            if reason == "idle_timeout":
                for exchange in exchanges:
                    exchange.error = exchange.error or (f"no I/O for {self.idle_timeout_ns / 1e9:g} s: the agent "
                                                        "stopped following the connection")
            self._finish(conn, exchanges)
            self._note_http2_unreadable(conn)
        elif conn.ciphertext_only and not conn.tls:
            self._mark_tls_unread(conn)
        if conn.unreadable:
            self._unsupported_row(conn, ts)

    def _unsupported_row(self, conn: Connection, ts: int) -> None:
        exchange = Exchange(seq=conn.rows, req_start_ns=conn.first_ns, req_end_ns=ts, outcome="unsupported",
                            error=conn.unreadable_words)
        exchange.req_bytes, exchange.resp_bytes = (conn.next_byte[DIR_READ], conn.next_byte[DIR_WRITE]) \
            if conn.role != ROLE_CLIENT else (conn.next_byte[DIR_WRITE], conn.next_byte[DIR_READ])
        conn.rows += 1
        self.emit_row(self._row(conn, exchange, Fidelity()))

    # -- requests --------------------------------------------------------
    @staticmethod
    def _server_port(conn: Connection) -> int:
        return conn.peer_port if conn.role == ROLE_CLIENT else conn.local_port

    def _request_started(self, conn: Connection, exchange: Exchange) -> None:
        inflight = self.stats.inflight
        server_port = self._server_port(conn)
        exchange.inflight_at_arrival = inflight.get(server_port, 0)
        inflight[server_port] = exchange.inflight_at_arrival + 1
        conn.open[exchange.seq] = Fidelity()

    def _finish(self, conn: Connection, exchanges: list[Exchange]) -> None:
        if not exchanges:  # what almost every event brings
            return
        server_port = self._server_port(conn)
        for exchange in exchanges:
            inflight = self.stats.inflight
            inflight[server_port] = max(0, inflight.get(server_port, 0) - 1)
            self.stats.requests += 1
            if exchange.error:
                self.stats.parse_errors += 1
            if exchange.api == "unknown":
                self.stats.unknown_api_streams += 1
            if exchange.status == 101:  # what follows the upgrade is not HTTP (the HTTP/1 reader stopped)
                upgraded_to = "websocket" if "upgraded to websocket" in (exchange.error or "").lower() else "upgraded"
                self._mark_unreadable(conn, upgraded_to, exchange.error or "connection upgraded")
            conn.rows += 1
            self.emit_row(self._row(conn, exchange, conn.open.pop(exchange.seq, Fidelity())))

    @staticmethod
    def _capture(ex: Exchange, fidelity: Fidelity) -> str:
        if fidelity.dropped or not ex.request_seen:
            return "dropped"
        # Unseen request bytes matter only where they broke the framing; a
        # skipped stretch of a sized body leaves every figure of the row intact.
        if fidelity.response_unseen or (fidelity.request_unseen and ex.error and "capture gap" in ex.error):
            return "gaps"
        return "exact"

    def _row(self, conn: Connection, ex: Exchange, fidelity: Fidelity) -> dict:
        wall = self.clock.to_wall_ns

        def ts(mono: int | None) -> int | None:
            return None if mono is None else wall(mono)

        first = ex.token_event_ns[0] if ex.token_event_ns else None
        h2 = ex if isinstance(ex, H2Exchange) else None
        return {
            "node": self.node,
            "conn_id": conn.conn_id,
            "req_seq": ex.seq,
            "role": "client" if conn.role == ROLE_CLIENT else "server",
            "pid": conn.tgid,
            "comm": conn.comm,
            "server_port": conn.peer_port if conn.role == ROLE_CLIENT else conn.local_port,
            "client_addr": "" if conn.role == ROLE_CLIENT else conn.peer_addr,
            "client_port": conn.local_port if conn.role == ROLE_CLIENT else conn.peer_port,
            "tenant": ex.tenant,
            "tls": conn.tls,
            "accept_ts": ts(conn.opened_ns) if conn.accept_seen else None,
            "tls_done_ts": ts(conn.tls_done_ns),
            "req_start": wall(ex.req_start_ns),
            "req_end": ts(ex.req_end_ns),
            "resp_start": ts(ex.resp_start_ns),
            "first_token": ts(first),
            "last_token": ts(ex.token_event_ns[-1]) if ex.token_event_ns else None,
            "resp_end": ts(ex.resp_end_ns),
            "method": ex.method or "",
            "path": ex.path or "",
            "status": ex.status or 0,
            "model": ex.resp_model or ex.req_model or "",
            "response_id": ex.response_id or "",
            "streamed": ex.streamed,
            "token_events": len(ex.token_event_ns),
            "sse_events": ex.sse_events,
            "token_offsets_us": _offsets_us(ex.token_event_ns, first),
            "prompt_tokens": ex.prompt_tokens,
            "completion_tokens": ex.completion_tokens,
            "inflight_at_arrival": ex.inflight_at_arrival,
            "bytes_in": ex.req_bytes,
            "bytes_out": ex.resp_bytes,
            "body_fp": ex.body_fp,
            "outcome": ex.outcome,
            "error": ex.error or "",
            "api": ex.api,
            "first_content_token": (None if ex.first_content_index is None
                                    else ts(ex.token_event_ns[ex.first_content_index])),
            "choices": ex.choices,
            "choice_events": ex.choice_events,
            "engine_prompt_ms": ex.engine_prompt_ms,
            "engine_decode_ms": ex.engine_decode_ms,
            "capture": self._capture(ex, fidelity),
            "bytes_unseen": fidelity.request_unseen + fidelity.response_unseen,
            "protocol": conn.protocol,
            "stream_id": h2.stream_id if h2 else 0,
            "grpc_status": h2.grpc_status if h2 else None,
            "unreadable_reason": (conn.unreadable or "") if ex.outcome == "unsupported" else "",
            "request_messages": h2.request_messages if h2 else 0,
            "request_message_bytes": h2.request_message_bytes if h2 else 0,
            "response_message_bytes": h2.response_message_bytes if h2 else 0,
            "largest_response_message_bytes": h2.largest_response_message_bytes if h2 else 0,
            "error_type": ex.error_type,
            "engine_queue_ms": ex.engine_queue_ms,
            # The process's pod and container: named by the agent's runner (agent/identity/) before the row
            # leaves, empty outside containers.
            "namespace": "", "pod": "", "container": "", "pod_uid": "", "container_id": "",
        }
