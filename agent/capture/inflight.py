"""A read-only snapshot of the requests the tracker holds open, as ``inflight_samples`` rows.

Call it on the thread that feeds the tracker (the agent's capture loop): the
tracker and its assemblers are not locked, and the snapshot only reads them.
"""

from __future__ import annotations

from ...contract.inflight import RECEIVING, STREAMING, WAITING
from .kernel.records import ROLE_CLIENT
from .tracker import ConnectionTracker


def inflight_snapshot(tracker: ConnectionTracker, now_ns: int) -> list[dict]:
    """Every request started and not finished at ``now_ns`` (CLOCK_MONOTONIC), one row each."""
    wall = tracker.clock.to_wall_ns
    rows = []
    for conn in tracker.connections.values():
        if conn.assembler is None:  # protocol not chosen yet, or not readable
            continue
        client = conn.role == ROLE_CLIENT
        for oldest, exchange in enumerate(conn.assembler.open_exchanges(), 1):
            tokens = exchange.token_event_ns
            first = tokens[0] if tokens else None
            if exchange.req_end_ns is None:
                stage, progress = RECEIVING, exchange.req_start_ns
            # Response writes the kernel still holds in a batch (kernel batching) are the oldest open
            # exchange's: its text events from the first on (a batch opens at one).
            elif oldest == 1 and (held := tracker.held_writes(conn)) is not None:
                stage, progress, first = STREAMING, held[1], held[0] if first is None else first
            else:
                stage, progress = (STREAMING, tokens[-1]) if tokens else (WAITING, exchange.req_end_ns)
            rows.append({
                "sampled_at": wall(now_ns), "node": tracker.node,
                "server_port": conn.peer_port if client else conn.local_port,
                "role": "client" if client else "server", "tenant": exchange.tenant,
                "model": exchange.resp_model or exchange.req_model or "", "conn_id": conn.conn_id,
                "req_seq": exchange.seq, "req_start": wall(exchange.req_start_ns),
                "first_token": None if first is None else wall(first), "stage": stage, "token_events": len(tokens),
                "bytes_in": exchange.req_bytes,
                "age_ms": (now_ns - exchange.req_start_ns) / 1e6, "since_progress_ms": (now_ns - progress) / 1e6,
            })
    return rows
