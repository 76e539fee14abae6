"""The agent's user-space half without the kernel: decoding ring-buffer
records (including garbage), and the tracker turning events into rows."""

from __future__ import annotations

import errno
import inspect
import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenprobe.actuator.asgi import ActuatorMiddleware
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock, measure_offset
from tokenprobe.agent.capture.kernel.headers import choose_headers
from tokenprobe.agent.capture.kernel.records import (
    DIR_READ,
    DIR_WRITE,
    EV_ACCEPT,
    EV_CLOSE,
    EV_DATA,
    EV_EXIT,
    EV_TLS_DONE,
    HEADER_SIZE,
    EventDecodeError,
    KernelEvent,
    UnseenEnd,
    decode_event,
)
from tokenprobe.agent.capture.tracker import ConnectionTracker, connection_id
from tokenprobe.contract.requests import REQUEST_COLUMNS
from tokenprobe.contract.tenant import DEFAULT_TENANT_HEADER

from tests.support.h2_wire import SSE_DONE, SSE_RESPONSE, H2Wire, chat_request
from tests.support.h2_wire import sse_chunk as h2_sse_chunk

HEADER = struct.Struct("<QQQQIIIIBBBBiIIIHH16s16s")
V4_MAPPED_LOOPBACK = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])


def record(kind=EV_DATA, ts=1000, conn_ns=500, tgid=42, fd=7, direction=DIR_READ, tls=0, role=0, ret=None,
           head=b"", tail=b"", total=None, lport=8000, pport=50000, comm=b"server",
           bytes_before=(0, 0), events_before=(0, 0)) -> bytes:
    total = len(head) + len(tail) if total is None else total
    ret = total if ret is None else ret
    return HEADER.pack(ts, conn_ns, *bytes_before, tgid, fd, *events_before, kind, direction, tls, role, ret,
                       total, len(head), len(tail), lport, pport, V4_MAPPED_LOOPBACK, comm) + head + tail


def test_decode_round_trip():
    ev = decode_event(record(head=b"GET / HTTP/1.1\r\n", tail=b"", total=16))
    assert (ev.kind, ev.tgid, ev.fd, ev.local_port, ev.peer_addr) == (EV_DATA, 42, 7, 8000, "127.0.0.1")
    assert ev.head == b"GET / HTTP/1.1\r\n" and ev.total_len == 16
    # The command name is decoded where a connection begins, not on every data event.
    assert decode_event(record(kind=EV_ACCEPT)).comm == "server" and ev.comm == ""
    counted = decode_event(record(bytes_before=(10, 2**40), events_before=(3, 7)))
    assert (counted.bytes_before, counted.events_before) == ((10, 2**40), (3, 7))
    big = decode_event(record(head=b"a" * 8192, tail=b"z" * 1024, total=100_000))
    assert len(big.head) == 8192 and big.tail == b"z" * 1024 and big.total_len == 100_000


@pytest.mark.parametrize("raw, message", [
    (b"", "shorter"),
    (b"\x00" * (HEADER_SIZE - 1), "shorter"),
    (record(kind=99), "unknown event kind"),
    (record(head=b"abc")[:-1], "inconsistent"),
    (record(head=b"abc", total=2), "inconsistent"),
])
def test_decode_rejects_malformed_records(raw, message):
    with pytest.raises(EventDecodeError, match=message):
        decode_event(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=HEADER_SIZE + 64))
def test_decode_never_fails_other_than_cleanly(raw):
    try:
        decode_event(raw)
    except EventDecodeError:
        pass


class Collector:
    def __init__(self):
        self.rows = []

    def __call__(self, row):
        self.rows.append(row)


def make_tracker(**kwargs):
    rows = Collector()
    tracker = ConnectionTracker(rows, clock=MonotonicWallClock(), fingerprint_key=b"k", node="n",
                                target_ports={8000}, **kwargs)
    return tracker, rows


def ev(kind, ts, *, fd=7, conn_ns=500, direction=DIR_READ, data=b"", ret=None, tls=False, lport=8000,
       bytes_before=(0, 0), events_before=(0, 0), total=None, tail=b"") -> KernelEvent:
    """A kernel event; the counters default to "not numbered", which the tracker
    reads as nothing lost."""
    total = len(data) + len(tail) if total is None else total
    return KernelEvent(kind, ts, conn_ns, bytes_before, events_before, 42, fd, direction, tls, 0,
                       total if ret is None else ret, total, data, tail, lport, 50000, "127.0.0.1", "server")


REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 45\r\n\r\n" + b'{"model": "m", "prompt": "hi", "stream": true}'[:45])
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def sse_chunk(payload: bytes) -> bytes:
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def serve_one(tracker, fd=7, t0=1_000_000, conn_ns=500, tls=False):
    """One streamed completion; with tls, as the libssl probes report it."""
    tracker.handle(ev(EV_DATA, t0, fd=fd, conn_ns=conn_ns, data=REQUEST, tls=tls))
    tracker.handle(ev(EV_DATA, t0 + 10_000, fd=fd, conn_ns=conn_ns, direction=DIR_WRITE, data=HEAD, tls=tls))
    for i in range(3):
        tok = b'{"id":"cmpl-1","model":"m","choices":[{"text":"w%d"}]}' % i
        tracker.handle(ev(EV_DATA, t0 + 50_000_000 + i * 20_000_000, fd=fd, conn_ns=conn_ns,
                          direction=DIR_WRITE, data=sse_chunk(tok), tls=tls))
    tracker.handle(ev(EV_DATA, t0 + 120_000_000, fd=fd, conn_ns=conn_ns, direction=DIR_WRITE,
                      data=sse_chunk(b"[DONE]") + b"0\r\n\r\n", tls=tls))


def test_one_streamed_request_becomes_one_row():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    tracker.handle(ev(EV_TLS_DONE, 900))
    serve_one(tracker, tls=True)
    assert len(rows.rows) == 1
    row = rows.rows[0]
    offset = tracker.clock.offset_ns
    assert row["req_start"] == 1_000_000 + offset and row["accept_ts"] == 500 + offset
    assert row["tls"] and row["tls_done_ts"] == 900 + offset
    assert row["first_token"] - row["req_end"] == 50_000_000
    assert row["token_events"] == 3 and row["token_offsets_us"] == [0, 20_000, 40_000]
    assert (row["method"], row["path"], row["status"], row["model"], row["outcome"]) == (
        "POST", "/v1/completions", 200, "m", "complete")
    assert row["response_id"] == "cmpl-1" and row["server_port"] == 8000 and row["client_addr"] == "127.0.0.1"
    assert row["body_fp"] != 0 and "hi" not in repr(row)  # the prompt never reaches the row


def with_headers(request: bytes, *lines: bytes) -> bytes:
    return request.replace(b"Host: x\r\n", b"Host: x\r\n" + b"".join(line + b"\r\n" for line in lines))


def test_row_has_exactly_the_documented_columns_in_order():
    tracker, rows = make_tracker()
    serve_one(tracker)
    assert list(rows.rows[0]) == REQUEST_COLUMNS


@pytest.mark.parametrize("tenant_header, tenant", [
    (None, ""), ("", ""), ("x-tenant-id", "acme"), ("X-Org", "org-7"),
])
def test_row_carries_the_tenant_from_the_configured_header(tenant_header, tenant):
    tracker, rows = make_tracker(tenant_header=tenant_header)
    tracker.handle(ev(EV_DATA, 1000, data=with_headers(REQUEST, b"X-Tenant-Id: acme", b"X-Org: org-7")))
    tracker.close_all(5000)
    assert [row["tenant"] for row in rows.rows] == [tenant]


def test_tenant_header_defaults_to_the_gateway_hooks_and_a_bad_one_is_refused_at_start():
    gateway_default = inspect.signature(ActuatorMiddleware).parameters["tenant_header"].default
    assert gateway_default.lower() == DEFAULT_TENANT_HEADER  # both sides must name the same tenants
    tracker, rows = make_tracker()
    for fd, lines in ((7, (b"x-tenant-id: acme",)), (8, ())):
        tracker.handle(ev(EV_DATA, 1000 + fd, fd=fd, data=with_headers(REQUEST, *lines)))
    tracker.close_all(5000)
    assert sorted(row["tenant"] for row in rows.rows) == ["", "acme"]
    with pytest.raises(ValueError, match="not an HTTP header name"):
        make_tracker(tenant_header="x tenant")


def test_inflight_counts_other_requests_on_the_same_port():
    tracker, rows = make_tracker()
    for fd in (7, 8, 9):
        tracker.handle(ev(EV_DATA, 1000 + fd, fd=fd, data=REQUEST))
    serve_one(tracker, fd=10, t0=2000)
    assert rows.rows[0]["inflight_at_arrival"] == 3


def test_the_agent_s_own_connections_are_counted_apart_and_never_rows():
    asked = []

    def own_connection(peer_port: int, local_port: int, accept_ns: int) -> bool:
        asked.append((peer_port, local_port, accept_ns))
        return accept_ns == 500  # the agent's socket with these ports was open when conn_ns 500 was accepted

    tracker, rows = make_tracker(own_connection=own_connection)
    serve_one(tracker, fd=7, conn_ns=500)  # the agent's scrape
    serve_one(tracker, fd=8, conn_ns=900, t0=5_000_000)  # a client reusing the ports later
    tracker.close_all(200_000_000)
    assert [row["conn_id"] for row in rows.rows] == [connection_id(42, 8, 900)]
    assert asked == [(50000, 8000, 500), (50000, 8000, 900)]  # once per connection, at its first data
    assert (tracker.stats.own_connections, tracker.stats.requests, sum(tracker.stats.inflight.values())) == (1, 1, 0)


def test_fd_reuse_without_a_seen_close_ends_the_old_connection():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500, conn_ns=500))
    tracker.handle(ev(EV_DATA, 1000, data=REQUEST))
    tracker.handle(ev(EV_ACCEPT, 2000, conn_ns=2000))  # same fd, new connection
    assert [r["outcome"] for r in rows.rows] == ["truncated"]
    serve_one(tracker, t0=3000, conn_ns=2000)
    assert [r["outcome"] for r in rows.rows] == ["truncated", "complete"]
    assert rows.rows[0]["conn_id"] != rows.rows[1]["conn_id"]


@pytest.mark.parametrize("error, outcome", [(-errno.ECONNRESET, "reset"), (-errno.EPIPE, "client_closed"),
                                            (0, "client_closed")])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_outcome_follows_how_the_connection_ended(error, outcome, tls):
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_DATA, 1000, data=REQUEST, tls=tls))
    tracker.handle(ev(EV_DATA, 2000, direction=DIR_WRITE if error == -errno.EPIPE else DIR_READ, ret=error,
                      tls=tls))
    tracker.handle(ev(EV_CLOSE, 3000))
    assert [r["outcome"] for r in rows.rows] == [outcome]


def test_ciphertext_before_the_ssl_probes_is_ignored():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_DATA, 900, data=b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"))  # ClientHello
    tracker.handle(ev(EV_DATA, 1000, data=REQUEST, tls=True))
    tracker.handle(ev(EV_CLOSE, 3000))
    assert len(rows.rows) == 1 and rows.rows[0]["error"] == "" and rows.rows[0]["tls"]


def test_agent_stop_writes_open_requests_as_truncated():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_DATA, 1000, data=REQUEST))
    tracker.close_all(5000)
    assert [r["outcome"] for r in rows.rows] == ["truncated"] and not tracker.connections


class Numbered:
    """Events of one connection numbered as the kernel numbers them; `lose`
    skips one, as a full ring buffer does."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.bytes, self.events = [0, 0], [0, 0]
        self.ts = 1_000_000
        self.conn_ns = 500

    def restart(self, tgid, fd, generation):
        """What Probes.restart_connection does to the kernel's entry."""
        assert (tgid, fd, generation) == (42, 7, self.conn_ns)
        self.bytes, self.events, self.conn_ns = [0, 0], [0, 0], 0

    def send(self, direction, data=b"", *, total=None, tail=b"", lose=False, kind=EV_DATA):
        self.ts += 1_000_000
        total = len(data) + len(tail) if total is None else total
        event = ev(kind, self.ts, direction=direction, data=data, tail=tail, total=total, conn_ns=self.conn_ns,
                   bytes_before=tuple(self.bytes), events_before=tuple(self.events))
        if kind == EV_DATA:
            self.bytes[direction] += total
            self.events[direction] += 1
        if not lose:
            self.tracker.handle(event)


def stream_tokens(conn: Numbered, n: int, lose: int | None = None) -> None:
    conn.send(DIR_READ, REQUEST)
    conn.send(DIR_WRITE, HEAD)
    for i in range(n):
        conn.send(DIR_WRITE, sse_chunk(b'{"id":"cmpl-1","choices":[{"text":"w%d"}]}' % i), lose=i == lose)
    conn.send(DIR_WRITE, sse_chunk(b"[DONE]") + b"0\r\n\r\n")


def test_sequence_gap_marks_the_open_exchange_dropped_and_keeps_the_next_exact():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    conn = Numbered(tracker)
    stream_tokens(conn, 5, lose=2)
    stream_tokens(conn, 5)
    conn.send(DIR_READ, kind=EV_CLOSE)
    lost = len(sse_chunk(b'{"id":"cmpl-1","choices":[{"text":"w2"}]}'))
    assert [(r["capture"], r["bytes_unseen"]) for r in rows.rows] == [("dropped", lost), ("exact", 0)]
    assert rows.rows[1]["token_events"] == 5 and rows.rows[1]["outcome"] == "complete"
    assert (tracker.stats.lost_events, tracker.stats.bytes_unseen) == (1, lost)


def test_lost_last_events_are_found_at_close():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    conn = Numbered(tracker)
    conn.send(DIR_READ, REQUEST)
    conn.send(DIR_WRITE, HEAD, lose=True)
    conn.send(DIR_READ, kind=EV_CLOSE)
    assert [(r["capture"], r["bytes_unseen"]) for r in rows.rows] == [("dropped", len(HEAD))]


def test_capture_gaps_in_a_response_make_the_row_gaps_but_a_sized_request_body_does_not():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    conn = Numbered(tracker)
    body = b'{"model": "m", "stream": true, "prompt": "' + b"p" * 20_000 + b'"}'
    head = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body)
    request = head + body
    conn.send(DIR_READ, request[:8192], tail=request[-1024:], total=len(request))
    conn.send(DIR_WRITE, HEAD)
    conn.send(DIR_WRITE, sse_chunk(b'{"id":"c","choices":[{"text":"a"}]}') + sse_chunk(b"[DONE]") + b"0\r\n\r\n")
    event = sse_chunk(b'{"id":"c","choices":[{"text":"' + b"x" * 20_000 + b'"}]}')
    conn.send(DIR_READ, REQUEST)
    response = HEAD + event + sse_chunk(b"[DONE]") + b"0\r\n\r\n"
    conn.send(DIR_WRITE, response[:8192], tail=response[-1024:], total=len(response))
    assert [(r["capture"], r["bytes_unseen"], r["outcome"]) for r in rows.rows] == [
        ("exact", len(request) - 9216, "complete"), ("gaps", len(response) - 9216, "complete")]


def test_process_exit_ends_its_connections_and_their_inflight_count():
    forgotten = []
    tracker, rows = make_tracker(forget_connection=lambda tgid, fd, generation: forgotten.append((tgid, fd)))
    for fd in (7, 8):
        tracker.handle(ev(EV_ACCEPT, 500, fd=fd))
        tracker.handle(ev(EV_DATA, 1000, fd=fd, data=REQUEST))
    assert tracker.stats.inflight == {8000: 2}
    tracker.handle(ev(EV_EXIT, 2000, fd=0))
    assert [r["outcome"] for r in rows.rows] == ["truncated", "truncated"]
    assert tracker.stats.inflight == {8000: 0} and not tracker.connections
    assert sorted(forgotten) == [(42, 7), (42, 8)]


IDLE_S = 60
IDLE_NS = IDLE_S * 1_000_000_000


class KeptEnds:
    """The kernel's `unseen_ends` map for one connection numbered by `Numbered`: what
    bpf/tokenprobe.c keeps when the ring buffer refuses a close's record, or when an accept
    reuses the fd of a connection whose close no probe saw."""

    def __init__(self, conn: Numbered):
        self.conn = conn
        self.ends: dict[tuple[int, int], UnseenEnd] = {}

    def keep(self, traced: bool) -> None:
        conn = self.conn
        conn.ts += 1_000_000
        self.ends[(42, 7)] = UnseenEnd(conn.conn_ns, conn.ts if traced else 0, tuple(conn.bytes), tuple(conn.events))

    def take_unseen_end(self, tgid: int, fd: int) -> UnseenEnd | None:
        return self.ends.pop((tgid, fd), None)


def half_served(clock: MonotonicWallClock, lose_last: bool, **kwargs):
    """A tracker on `clock` whose connection has a request answered with a header and two
    tokens, the second maybe lost, and no end yet; returns the tracker, its rows, the
    connection and the kernel's kept ends."""
    tracker, rows = make_tracker(**kwargs)
    tracker.clock = clock
    tracker.handle(ev(EV_ACCEPT, 500))
    conn = Numbered(tracker)
    kernel = KeptEnds(conn)
    tracker.unseen_ends = kernel
    conn.send(DIR_READ, REQUEST)
    conn.send(DIR_WRITE, HEAD)
    conn.send(DIR_WRITE, sse_chunk(b'{"id":"cmpl-1","choices":[{"text":"a"}]}'))
    conn.send(DIR_WRITE, sse_chunk(b'{"id":"cmpl-1","choices":[{"text":"b"}]}'), lose=lose_last)
    return tracker, rows, conn, kernel


@pytest.mark.parametrize("lose_last", [False, True], ids=["nothing_else_lost", "last_write_lost"])
@pytest.mark.parametrize("found_by", ["accept", "data_after_a_lost_accept", "idle_eviction", "agent_stop"])
def test_a_close_whose_record_the_ring_buffer_refused_gives_the_row_its_record_would_have(found_by, lose_last):
    """The kernel keeps the end of a connection whose close record it could not send. Found
    when the fd is reused (by an accept, or by a data event of the next connection whose accept
    was lost too), when the connection idles, or at the agent's stop, it gives the very row the close record would
    have given: its time and outcome, and `dropped` exactly when the counters say events were
    lost. Without the kept end a lost last write would leave the row `exact`, and the agent's
    stop would call the connection's open exchange truncated by the stop."""
    clock = MonotonicWallClock()

    def served(close: str) -> list[dict]:
        tracker, rows, conn, kernel = half_served(clock, lose_last, idle_timeout_s=IDLE_S)
        if close == "delivered":
            conn.send(DIR_READ, kind=EV_CLOSE)
            return rows.rows
        kernel.keep(traced=True)
        if found_by == "accept":
            tracker.handle(ev(EV_ACCEPT, conn.ts + 5_000_000, conn_ns=conn.ts + 5_000_000))
        elif found_by == "data_after_a_lost_accept":
            tracker.handle(ev(EV_DATA, conn.ts + 6_000_000, conn_ns=conn.ts + 5_000_000, data=REQUEST))
        elif found_by == "idle_eviction":
            assert tracker.evict_idle(conn.ts + IDLE_NS) == 0 and tracker.stats.idle_evicted == 0
            assert not tracker.connections
        else:
            tracker.close_all(conn.ts + 10_000_000)
        assert not kernel.ends, "the agent took the kept end"
        return rows.rows

    delivered, refused = served("delivered"), served("refused")
    assert refused == delivered and len(refused) == 1
    assert refused[0]["capture"] == ("dropped" if lose_last else "exact")


def test_a_close_no_probe_saw_is_dated_when_found_and_counts_what_its_counters_say_was_lost():
    """close_range or dup2 over the fd: no close record, and the kernel keeps the connection's
    counters when an accept reuses its fd. The row is the one a close record at that moment
    would have given: a lost last write reads as `dropped`. An end kept of an older connection
    on the fd is not this one's: its counters are not this connection's (nothing is counted
    from them), and this one's end is unknown (see the next test)."""
    clock = MonotonicWallClock()
    for lose_last, capture in ((False, "exact"), (True, "dropped")):
        served = []
        for close in ("delivered", "unseen"):
            tracker, rows, conn, kernel = half_served(clock, lose_last)
            found_ns = conn.ts + 5_000_000
            if close == "delivered":
                tracker.handle(ev(EV_CLOSE, found_ns, conn_ns=conn.conn_ns, bytes_before=tuple(conn.bytes),
                                  events_before=tuple(conn.events)))
            else:
                kernel.keep(traced=False)
                tracker.handle(ev(EV_ACCEPT, found_ns, conn_ns=found_ns))
            served.append(rows.rows)
        assert served[0] == served[1] and [r["capture"] for r in served[1]] == [capture]

    tracker, rows, conn, kernel = half_served(clock, lose_last=False)
    kernel.ends[(42, 7)] = UnseenEnd(400, 450, (9999, 9999), (99, 99))  # the connection before this one
    tracker.handle(ev(EV_ACCEPT, conn.ts + 5_000_000, conn_ns=conn.ts + 5_000_000))
    assert [(r["capture"], r["bytes_unseen"]) for r in rows.rows] == [("dropped", 0)] and not kernel.ends


@pytest.mark.parametrize("found_by", ["accept", "data_after_a_lost_accept"])
def test_a_connection_found_gone_with_no_end_kept_says_its_last_events_are_unknown(found_by):
    """The kernel keeps the end of every connection it follows whose close the agent gets no
    record of, so a connection whose fd is reused with no end kept is one the kernel lost track
    of (its LRU let the kept end, or the connection, go): its open exchange may lack its last
    writes, and says `dropped` (with no unseen bytes it could count), not `exact`; counted. A
    tracker with no kernel to ask (a replay) cannot tell, and leaves the row as it was."""
    clock = MonotonicWallClock()
    for with_kernel, capture, unknown in ((True, "dropped", 1), (False, "exact", 0)):
        tracker, rows, conn, _ = half_served(clock, lose_last=False)
        if not with_kernel:
            tracker.unseen_ends = None
        found_ns = conn.ts + 5_000_000
        if found_by == "accept":
            tracker.handle(ev(EV_ACCEPT, found_ns, conn_ns=found_ns))
        else:
            tracker.handle(ev(EV_DATA, found_ns + 1_000_000, conn_ns=found_ns, data=REQUEST))
        assert [(r["capture"], r["bytes_unseen"], r["outcome"]) for r in rows.rows] == [
            (capture, 0, "truncated")], with_kernel
        assert tracker.stats.unknown_ends == unknown


def test_idle_connections_are_evicted_with_their_open_request_truncated():
    restarted = []
    tracker, rows = make_tracker(idle_timeout_s=IDLE_S,
                                 restart_connection=lambda tgid, fd, generation: restarted.append((tgid, fd)))
    for fd in (7, 8):
        tracker.handle(ev(EV_ACCEPT, 500, fd=fd))
    tracker.handle(ev(EV_DATA, 1000, fd=7, data=REQUEST))       # in flight, then silent
    serve_one(tracker, fd=8, t0=IDLE_NS // 2)                   # busy until half-way
    assert tracker.evict_idle(IDLE_NS) == 0, "no connection has idled for the timeout yet"
    assert tracker.evict_idle(IDLE_NS + 2000) == 1
    assert list(tracker.connections) == [(42, 8)] and tracker.stats.inflight == {8000: 0}
    assert restarted == [(42, 7)]  # its kernel entry
    evicted = rows.rows[-1]
    assert (evicted["outcome"], evicted["capture"], evicted["path"]) == ("truncated", "exact", "/v1/completions")
    assert f"no I/O for {IDLE_S} s" in evicted["error"]
    assert tracker.evict_idle(IDLE_NS // 2 + 120_000_000 + IDLE_NS + 1) == 1 and not tracker.connections
    assert tracker.stats.idle_evicted == 2 and len(rows.rows) == 2  # the idle keep-alive one had nothing open


def test_an_evicted_connection_that_speaks_again_is_adopted_afresh_without_a_wrong_row():
    tracker, rows = make_tracker(idle_timeout_s=IDLE_S)
    tracker.handle(ev(EV_ACCEPT, 500))
    conn = Numbered(tracker)
    tracker.restart_connection = conn.restart
    conn.send(DIR_READ, REQUEST)
    conn.send(DIR_WRITE, HEAD)
    tracker.evict_idle(conn.ts + IDLE_NS + 1)
    conn.ts += IDLE_NS
    # The rest of that response, then a whole exchange: the tail is not read as a row of its own.
    conn.send(DIR_WRITE, sse_chunk(b'{"id":"cmpl-1","choices":[{"text":"late"}]}'))
    conn.send(DIR_WRITE, sse_chunk(b"[DONE]") + b"0\r\n\r\n")
    stream_tokens(conn, 4)
    conn.send(DIR_READ, kind=EV_CLOSE)
    assert [(r["outcome"], r["capture"], r["token_events"]) for r in rows.rows] == [
        ("truncated", "exact", 0), ("complete", "exact", 4)]
    first, again = rows.rows
    assert first["conn_id"] != again["conn_id"] and again["req_seq"] == 0 and again["accept_ts"] is None
    assert (tracker.stats.lost_events, tracker.stats.bytes_unseen) == (0, 0)
    assert tracker.stats.inflight == {8000: 0} and not tracker.connections


def test_the_idle_timeout_must_be_positive():
    with pytest.raises(ValueError, match="idle timeout"):
        make_tracker(idle_timeout_s=0)


def test_clock_offset_maps_monotonic_to_wall():
    import time
    clock = MonotonicWallClock()
    assert abs(clock.now_wall_ns() - time.time_ns()) < 50_000_000
    assert abs(measure_offset() - clock.offset_ns) < 5_000_000


def test_headers_fall_back_to_the_nearest_debian_pair(tmp_path: Path):
    src = tmp_path / "src"
    for version in ("6.12.10+deb12", "6.12.117+deb12", "6.1.0-9"):
        for part, subdirs in (("amd64", ("include/generated", "arch/x86/include/generated")),
                              ("common", ("include/linux", "arch/x86/include/asm"))):
            for sub in subdirs:
                (src / f"linux-headers-{version}-{part}" / sub).mkdir(parents=True)
    (src / "linux-headers-6.12.117+deb12-cloud-amd64" / "include").mkdir(parents=True)
    choice = choose_headers("6.18.44-custom", cache_dir=tmp_path / "cache", modules_dir=tmp_path / "none",
                            src_dir=src)
    assert not choice.exact and choice.version == "6.12.117+deb12" and "nearest" in choice.note
    merged = choice.kernel_source
    assert (merged / "include" / "linux").is_dir() and (merged / "include" / "generated").is_dir()
    assert (merged / "arch" / "x86" / "include" / "generated").is_dir()
    assert os.path.realpath(merged / "include" / "generated").endswith("6.12.117+deb12-amd64/include/generated")


def test_headers_say_what_to_do_when_none_exist(tmp_path: Path):
    choice = choose_headers("6.18.0", cache_dir=tmp_path, modules_dir=tmp_path, src_dir=tmp_path)
    assert choice.kernel_source is None and "install" in choice.note


def h2_wire_with_two_streams() -> H2Wire:
    """Two streamed chats on one h2c connection; the server's SETTINGS written first."""
    wire = H2Wire()
    for stream_id in (1, 3):
        headers, body = chat_request([("x-tenant-id", f"t{stream_id}")])
        wire.request(stream_id, headers, body)
        wire.respond(stream_id, SSE_RESPONSE)
        wire.send(stream_id, h2_sse_chunk("hi"))
        wire.send(stream_id, SSE_DONE, end_stream=True)
    return wire


def feed_wire(tracker, segments, *, accept=True, split_first=False, tls=False) -> None:
    """Feeds (ts, is_request, bytes) segments; without accept, as a connection the kernel
    picked up mid-way (no accept time)."""
    conn_ns = 500 if accept else 0
    if accept:
        tracker.handle(ev(EV_ACCEPT, conn_ns))
    for ts, is_request, data in segments:
        direction = DIR_READ if is_request else DIR_WRITE
        pieces = [data[:3], data[3:]] if split_first and is_request and data.startswith(b"PRI") else [data]
        for piece in pieces:
            tracker.handle(ev(EV_DATA, ts, conn_ns=conn_ns, direction=direction, data=piece, tls=tls))
    tracker.handle(ev(EV_CLOSE, segments[-1][0] + 1, conn_ns=conn_ns))


@pytest.mark.parametrize("split_first, tls, protocol", [(False, False, "h2c"), (True, True, "h2")])
def test_http2_connections_become_one_row_per_stream(split_first, tls, protocol):
    """The protocol is chosen at the first bytes, whichever side wrote them (here the
    server's SETTINGS), and a preface too short to tell is held for the next segment."""
    tracker, rows = make_tracker()
    feed_wire(tracker, h2_wire_with_two_streams().segments, split_first=split_first, tls=tls)
    assert [(r["stream_id"], r["req_seq"], r["tenant"], r["protocol"], r["status"], r["token_events"],
             r["outcome"], r["unreadable_reason"], r["tls"]) for r in rows.rows] == [
        (1, 0, "t1", protocol, 200, 1, "complete", "", tls), (3, 1, "t3", protocol, 200, 1, "complete", "", tls)]
    assert list(rows.rows[0]) == REQUEST_COLUMNS and tracker.stats.inflight == {8000: 0}


def test_http2_picked_up_midway_is_one_unsupported_row():
    segments = h2_wire_with_two_streams().segments
    first_response = next(i for i, (_, is_request, data) in enumerate(segments)
                          if not is_request and b"text/event-stream" not in data and i > 2)
    tracker, rows = make_tracker()
    feed_wire(tracker, segments[first_response:], accept=False)
    [row] = rows.rows
    assert (row["outcome"], row["unreadable_reason"], row["protocol"], row["method"]) == (
        "unsupported", "h2_midstream", "h2c", "")
    assert row["bytes_in"] + row["bytes_out"] > 0 and tracker.stats.unreadable_connections == 1


@pytest.mark.parametrize("data, reason", [
    (b"\x16\x03\x01\x02\x00", "tls_unprobed"),  # a ClientHello's record header, read alone
    (b"SSH-2.0-OpenSSH_9.2\r\n", "unknown_protocol"),
])
def test_connections_that_cannot_be_read_are_one_unsupported_row(data, reason):
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    tracker.handle(ev(EV_DATA, 900, data=data))
    tracker.handle(ev(EV_DATA, 920, data=b"\x01\x00\x01\xfc\x03\x03" + bytes(16)))  # the record's payload
    tracker.handle(ev(EV_DATA, 950, direction=DIR_WRITE, data=b"\x17\x03\x03\x00\x10" + bytes(16)))
    tracker.handle(ev(EV_CLOSE, 3000))
    [row] = rows.rows
    assert (row["outcome"], row["unreadable_reason"], row["status"], row["req_seq"]) == (
        "unsupported", reason, 0, 0)
    assert reason.split("_")[0] in row["error"].lower() or "neither" in row["error"]


@pytest.mark.parametrize("accept_seen, reason", [(True, "tls_unprobed"), (False, "tls_midstream")],
                         ids=["from-its-accept", "opened-before-the-agent"])
def test_ciphertext_never_named_by_libssl_is_one_unsupported_row(accept_seen: bool, reason: str):
    """A TLS connection that ends with no plaintext from libssl is named: a library the probes
    do not read, or, for one opened before the agent, a connection that ended before its next
    libssl read bound it."""
    tracker, rows = make_tracker()
    conn_ns = 500 if accept_seen else 0
    if accept_seen:
        tracker.handle(ev(EV_ACCEPT, 500))
    tracker.handle(ev(EV_DATA, 950, conn_ns=conn_ns, direction=DIR_WRITE, data=b"\x17\x03\x03\x00\x10" + bytes(16)))
    tracker.handle(ev(EV_CLOSE, 3000, conn_ns=conn_ns))
    [row] = rows.rows
    assert (row["outcome"], row["unreadable_reason"], row["tls"]) == ("unsupported", reason, False), row
    assert "TLS records" in row["error"] and tracker.stats.unreadable_connections == 1


WEBSOCKET_UPGRADE = [
    (DIR_READ, b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"),
    (DIR_WRITE, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"),
    (DIR_WRITE, b"\x81\x05hello"),
]
TLS_NO_PROBE_SAW = [  # hellos, then application data both ways: a handshake done where no probe looks
    (DIR_READ, b"\x16\x03\x01\x02\x00" + bytes(24)), (DIR_WRITE, b"\x16\x03\x03\x00\x7a" + bytes(24)),
    (DIR_READ, b"\x17\x03\x03\x00\x40" + bytes(24)), (DIR_WRITE, b"\x17\x03\x03\x00\x40" + bytes(24)),
]


@pytest.mark.parametrize("segments, reason", [
    (TLS_NO_PROBE_SAW, "tls_unprobed"),
    ([(DIR_READ, b"SSH-2.0-OpenSSH_9.2\r\n" + bytes(8))], "unknown_protocol"),
    (WEBSOCKET_UPGRADE, "websocket"),
])
def test_an_unreadable_connection_is_counted_when_found_and_written_at_close(segments, reason):
    """A long-lived connection is counted while it is open, once, and still written as one row at its close."""
    counted = []
    tracker, rows = make_tracker(on_unreadable=lambda port, why: counted.append((port, why)))
    tracker.handle(ev(EV_ACCEPT, 500))
    for ts, (direction, data) in enumerate(segments + segments[-1:] * 3, start=1000):
        tracker.handle(ev(EV_DATA, ts, direction=direction, data=data))
    assert counted == [(8000, reason)] and tracker.stats.unreadable_connections == 1
    assert all(r["outcome"] != "unsupported" for r in rows.rows)
    tracker.handle(ev(EV_CLOSE, 5000))
    assert counted == [(8000, reason)]
    assert [r["unreadable_reason"] for r in rows.rows if r["outcome"] == "unsupported"] == [reason]


def test_tls_seen_only_one_way_is_counted_at_close():
    """Raw records one way only may still be read (a probe binds the SSL at its first write):
    such a connection is decided, and counted, when it closes."""
    counted = []
    tracker, rows = make_tracker(on_unreadable=lambda port, why: counted.append((port, why)))
    tracker.handle(ev(EV_ACCEPT, 500))
    tracker.handle(ev(EV_DATA, 900, data=TLS_NO_PROBE_SAW[2][1]))
    assert counted == []
    tracker.handle(ev(EV_CLOSE, 3000))
    assert counted == [(8000, "tls_unprobed")] and [r["outcome"] for r in rows.rows] == ["unsupported"]


def test_traffic_after_a_websocket_upgrade_is_one_unsupported_row():
    tracker, rows = make_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    tracker.handle(ev(EV_DATA, 1000, data=b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                                           b"Connection: Upgrade\r\n\r\n"))
    tracker.handle(ev(EV_DATA, 2000, direction=DIR_WRITE, data=b"HTTP/1.1 101 Switching Protocols\r\n"
                                                                b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n"))
    tracker.handle(ev(EV_DATA, 3000, direction=DIR_WRITE, data=b"\x81\x05hello"))
    tracker.handle(ev(EV_CLOSE, 4000))
    assert [(r["req_seq"], r["status"], r["outcome"], r["unreadable_reason"]) for r in rows.rows] == [
        (0, 101, "complete", ""), (1, 0, "unsupported", "websocket")]


def test_an_h2c_upgrade_continues_in_http2_with_the_upgraded_request_as_stream_1():
    """`Upgrade: h2c`: the 101 and the server's SETTINGS in one write, the GET answered on stream 1
    in HTTP/2, then a stream the client opens itself; no blind spot counted."""
    wire = H2Wire(upgrade_path="/v1/chat/completions?stream=1")
    upgrade_request = wire.segments[0][2]
    for stream_id in (1, 3):
        if stream_id == 3:
            wire.request(stream_id, *chat_request([("x-tenant-id", "t3")]))
        wire.respond(stream_id, SSE_RESPONSE)
        wire.send(stream_id, h2_sse_chunk("hi"))
        wire.send(stream_id, h2_sse_chunk("there"))
        wire.send(stream_id, SSE_DONE, end_stream=True)
    tracker, rows = make_tracker()
    feed_wire(tracker, wire.segments)
    assert [(r["stream_id"], r["req_seq"], r["method"], r["path"], r["tenant"], r["protocol"], r["status"],
             r["token_events"], r["outcome"], r["error"], r["unreadable_reason"]) for r in rows.rows] == [
        (1, 0, "GET", "/v1/chat/completions", "", "h2c", 200, 2, "complete", "", ""),
        (3, 1, "POST", "/v1/chat/completions", "t3", "h2c", 200, 2, "complete", "", "")]
    upgraded = rows.rows[0]
    assert upgraded["bytes_in"] == len(upgrade_request)
    assert upgraded["req_end"] <= upgraded["resp_start"] <= upgraded["first_token"]
    assert tracker.stats.unreadable_connections == 0 and tracker.stats.inflight == {8000: 0}
