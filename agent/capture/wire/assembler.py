"""HTTP/1.1 + SSE assembler: the two byte streams of one connection → one record per exchange.

The kernel probes report every read()/write() (or SSL_read/SSL_write) on a
connection as a *segment*: a timestamp, the first bytes of the call (`head`),
the call's full length and, for large calls, its last bytes (`tail`). The
bytes between head and tail were never captured: a *gap* of known size.

`HttpConnectionAssembler` is role-agnostic: the caller feeds the bytes that
travel towards the server as "request bytes" and the others as "response
bytes". Each direction is a message stream (http1.py) that finds HTTP/1.x
message boundaries across segments and gaps; responses are paired with requests
in FIFO order (that is what HTTP/1.1 pipelining guarantees). Bodies go to small
readers that keep bounded samples (bodies.py, sse.py), and what a response body
means is read by its API's dialect (dialects/). Of the request's header fields
only one value is kept: the tenant header's (contract/tenant.py). No prompt or
completion text is ever kept beyond these bounded samples, and none of it
appears in error strings.

Invariant the caller relies on: every exchange passed to `on_request_start`
is returned exactly once, by a feed method or by `close()`.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from ....contract.tenant import DEFAULT_TENANT_HEADER, tenant_header_name
from ..exchange import CLOSE_REASONS, OUTCOME_BY_CLOSE_REASON, Exchange, Txn
from .http1 import MessageStream, RequestStream, ResponseStream
from .segments import MAX_OPEN_EXCHANGES, normalise_segment
from .sse import SteadyTemplate

__all__ = ["CLOSE_REASONS", "Exchange", "HttpConnectionAssembler"]

log = logging.getLogger(__name__)

# What a feed returns when no exchange became complete, as most do: one shared list,
# never a new one per call. Callers only read what feeds return.
_NOTHING: list[Exchange] = []


@dataclass(slots=True)
class H2cUpgrade:
    """An h2c upgrade the server accepted (RFC 7540, section 3.2): the exchange whose request was
    read in HTTP/1.1 and whose response comes as HTTP/2 stream 1, and the response bytes after the
    101, as (ts, head, total_len) segments, for the HTTP/2 assembler that reads on from there."""

    exchange: Exchange
    response_segments: list[tuple[int, bytes, int]] = field(default_factory=list)


class HttpConnectionAssembler:
    """Assembles the exchanges of ONE HTTP/1.1 connection from its two byte streams.

    Feed methods and close() never raise on any input; they return the exchanges
    that became complete (response finished, or cut off by close), in order, in a
    list the caller must not change.

    `fast_path=False` reads every segment with the general framing and parses every
    event: the exchanges are the same (tests/test_fast_path.py proves it), only
    slower. It exists for that proof and for benchmarks/bench_assembler.py.
    """

    def __init__(self, *, fingerprint_key: bytes, max_header_bytes: int = 65536,
                 on_request_start: Callable[[Exchange], None] | None = None,
                 tenant_header: str | None = DEFAULT_TENANT_HEADER, fast_path: bool = True) -> None:
        if not isinstance(fingerprint_key, (bytes, bytearray)) or len(fingerprint_key) > 64:
            raise ValueError("fingerprint_key must be bytes of at most 64 bytes (a BLAKE2b key)")
        if not isinstance(max_header_bytes, int) or max_header_bytes < 64:
            raise ValueError("max_header_bytes must be an integer of at least 64")
        self._fingerprint_key = bytes(fingerprint_key)
        self._tenant_header = tenant_header_name(tenant_header)
        self._on_request_start = on_request_start
        # Lists, not deques: they hold one or two exchanges, and an empty deque costs over 700 bytes
        # on each of a node's (maybe 100k) idle keep-alive connections.
        self._open: list[Txn] = []  # started and not yet returned, in request order
        self._awaiting_response: list[Txn] = []  # their responses have not started
        self._ready: list[Exchange] = []
        self._next_seq = 0
        self._error: str | None = None
        # Set once a capture gap hid where requests start (a write larger than the kernel captures, or
        # events the ring buffer dropped): a response no request waits for then answers one in the gap.
        self._requests_hidden = False
        self._closed = False
        self._request = RequestStream(self, max_header_bytes)
        self._response = ResponseStream(self, max_header_bytes, fast_path=fast_path)
        self._steady_named: SteadyTemplate | None = None  # the last steady_template returned
        # Set once the server switched to HTTP/2 (`Upgrade: h2c`): this assembler reads no more,
        # its owner hands the connection to the HTTP/2 assembler.
        self.h2c_upgrade: H2cUpgrade | None = None

    def open_exchanges(self) -> list[Exchange]:
        """The exchanges started and not yet returned, oldest first; for looking at, never changing."""
        return [txn.exchange for txn in self._open]

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

    def steady_template(self, write: bytes) -> SteadyTemplate | None:
        """After a whole response segment was fed (kernel batching): the bytes around its text, if
        it was one whole chunk of one event that can be counted from its size alone and they are
        not of the shape of the template this returned last (the kernel keeps that one for the
        connection's next responses too); else None."""
        named = self._steady_named
        if named is not None and write.endswith(named.suffix) and write.startswith(named.prefix,
                                                                                   write.find(b"\n") + 1):
            return None  # the same template (a write that came before the kernel had it, or had escapes)
        template = None if self._closed else self._response.steady_template(write)
        if template is None or (named is not None and template.same_shape(named)):
            return None
        self._steady_named = template
        return template

    def feed_steady_response_writes(self, times: list[int], nbytes: int) -> bool:
        """Response writes at `times`, of `nbytes` together, that the kernel matched against a
        steady_template; False, with nothing read, when the response is not where such writes
        can be counted."""
        return not self._closed and self._response.steady_writes(times, nbytes)

    def close(self, ts_ns: int, reason: str) -> list[Exchange]:
        """The connection closed: every exchange still open is returned.

        reason is one of CLOSE_REASONS. Exchange timestamps come from segments,
        so ts_ns only marks the call; a close-delimited body ends at its last
        segment. Later feeds are ignored."""
        if self._closed:
            return _NOTHING
        self._closed = True
        try:
            outcome = OUTCOME_BY_CLOSE_REASON.get(reason) if isinstance(reason, str) else None
            if outcome is None:
                self._set_error("unknown close reason; open exchanges recorded as truncated")
                outcome = "truncated"
            self._response.end_of_stream(server_closed=reason == "server_closed")
            self._request.stop()
            self._awaiting_response.clear()
            while self._open:  # popped one by one: the safety net below must not return one twice
                txn = self._open.pop(0)
                exchange = txn.exchange
                if not txn.response_done and exchange.outcome == "complete":
                    exchange.outcome = outcome
                self._ready.append(exchange)
        except Exception as exc:  # safety net: a parser bug must not take down the agent
            self._internal_failure(exc)
        return self._take_ready()

    # -- internals shared with the two streams ---------------------------------

    def _feed(self, stream: MessageStream, ts_ns, head, total_len, tail) -> list[Exchange]:
        if self._closed:
            return _NOTHING
        try:
            segment = normalise_segment(ts_ns, head, total_len, tail)
            if segment is None:
                stream.lose_framing(stream.last_ts, f"malformed {stream.noun} segment description")
            else:
                stream.feed(*segment)
        except Exception as exc:  # safety net: a parser bug must not take down the agent
            self._internal_failure(exc)
        return self._take_ready() if self._ready else _NOTHING

    def _take_ready(self) -> list[Exchange]:
        ready = self._ready
        if not ready:
            return _NOTHING
        self._ready = []
        return ready

    def _set_error(self, message: str) -> None:
        self._error = message

    def _open_exchange(self, ts: int) -> Txn | None:
        if len(self._open) >= MAX_OPEN_EXCHANGES:
            self._stop(f"more than {MAX_OPEN_EXCHANGES} requests without a finished response; "
                       "connection no longer parsed")
            return None
        txn = Txn(Exchange(seq=self._next_seq, req_start_ns=ts))
        self._next_seq += 1
        self._open.append(txn)
        self._awaiting_response.append(txn)
        if self._on_request_start is not None:
            self._on_request_start(txn.exchange)
        return txn

    def _claim_response(self, ts: int) -> Txn | None:
        """The exchange a response starting at ts answers: the oldest one waiting,
        unless that request started later (then the response answers a request
        the capture missed)."""
        waiting = self._awaiting_response
        if waiting and waiting[0].exchange.req_start_ns <= ts:
            return waiting.pop(0)
        if self._requests_hidden:
            return self._hidden_request(ts)
        return None

    def _hidden_request(self, ts: int) -> Txn | None:
        """An exchange for a response whose request lay in a capture gap: a row of its own, its
        request unseen (issue 35: 1,000 requests pipelined in one write left 706 without a row)."""
        txn = self._open_exchange(ts)
        if txn is None:
            return None
        self._awaiting_response.remove(txn)
        txn.request_done = True
        txn.exchange.request_seen = False
        txn.exchange.error = "its request lay in a capture gap: only the response was read"
        return txn

    def _abandon(self, txn: Txn, reason: str, *, request_side: bool) -> None:
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
            self._ready.append(open_txns.pop(0).exchange)

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

    def _upgrade_to_http2(self, txn: Txn) -> bool:
        """The server answered txn's `Upgrade: h2c` with a 101: True, and h2c_upgrade set, if the
        connection can be followed into HTTP/2, i.e. that request was read whole and is the only one
        open (a client sends nothing more before the 101); else it is an upgrade like any other."""
        if not txn.request_done or self._open != [txn]:
            return False
        self._request.stop()
        self._open.clear()
        self._awaiting_response.clear()
        self.h2c_upgrade = H2cUpgrade(txn.exchange)
        return True

    def _handed_off(self, ts: int, head: bytes, total_len: int) -> None:
        self.h2c_upgrade.response_segments.append((ts, head, total_len))

    def _internal_failure(self, exc: Exception) -> None:
        # Only the type and location are logged: an exception's message may quote payload bytes.
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        log.warning("HTTP assembler internal error %s at %s:%s; connection no longer parsed",
                    type(exc).__name__, frame.name, frame.lineno)
        self._stop(f"internal parser error ({type(exc).__name__}); connection no longer parsed")
