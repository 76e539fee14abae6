"""Synthetic traffic from a simulated slot server, with its ground truth, as ``tokenprobe.requests`` rows.

The reference server (``refserver``) is the real thing and needs the kernel
probes to be observed; this is its model in a few lines, for tests that
check the analytics' arithmetic on known data, and for trying the analytics
without a live server. A server has ``slots`` decode slots and a FIFO queue;
a request holds a slot from the end of its queue wait through prefill
(``prefill_base_ms + prefill_ms_per_token × prompt tokens``) to its last
token (one per ``decode_ms``). Arrivals are Poisson at each phase's rate.

Each ``SimulatedRequest`` carries the row the agent would have written and
the truth the analytics try to recover (queue and prefill time).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MS = 1_000_000


@dataclass(frozen=True)
class SlotServer:
    slots: int = 4
    prefill_base_ms: float = 20.0
    prefill_ms_per_token: float = 0.1
    decode_ms: float = 10.0
    request_overhead_bytes: int = 300  # headers and JSON around the prompt
    bytes_per_token: float = 4.0
    network_in_ms: float = 0.2
    network_out_ms: float = 0.3


@dataclass(frozen=True)
class LoadPhase:
    duration_s: float
    rate: float  # mean arrivals per second


@dataclass(frozen=True)
class SimulatedRequest:
    row: dict  # a tokenprobe.requests row
    queue_ms: float  # truth
    prefill_ms: float  # truth
    phase: int  # index of the LoadPhase it arrived in


def simulate(server: SlotServer, phases: Sequence[LoadPhase], *, start_ns: int, seed: int = 0,
             node: str = "sim-node", port: int = 8000, model: str = "sim-model",
             prompt_tokens: tuple[int, int] = (16, 512), output_tokens: tuple[int, int] = (8, 32),
             usage_fraction: float = 0.5, clients: Sequence[str] = ("10.0.0.1", "10.0.0.2", "10.0.0.3"),
             retry_fraction: float = 0.0) -> list[SimulatedRequest]:
    """Requests arriving through ``phases`` one after another, served FIFO by ``server``.

    ``retry_fraction`` of requests repeat an earlier request of the same
    client (same fingerprint) a few seconds later, as a client retrying would.
    """
    rng = np.random.default_rng(seed)
    arrivals: list[tuple[int, int]] = []  # (arrival ns, phase)
    phase_start = start_ns
    for index, phase in enumerate(phases):
        t = phase_start
        while True:
            t += int(rng.exponential(1.0 / phase.rate) * 1e9)
            if t >= phase_start + phase.duration_s * 1e9:
                break
            arrivals.append((t, index))
        phase_start += int(phase.duration_s * 1e9)

    free_at = [start_ns] * server.slots  # when each slot is next free: a min-heap
    requests = []
    last_body_of: dict[str, tuple[int, int]] = {}  # client -> (body_fp, bytes_in) of its latest request
    for index, (req_start, phase) in enumerate(arrivals):
        client = clients[index % len(clients)]
        if retry_fraction and client in last_body_of and rng.random() < retry_fraction:
            body_fp, bytes_in = last_body_of[client]
            prompt = round((bytes_in - server.request_overhead_bytes) / server.bytes_per_token)
        else:
            prompt = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
            bytes_in = server.request_overhead_bytes + int(prompt * server.bytes_per_token)
            body_fp = int(rng.integers(1, 2**63))
        last_body_of[client] = (body_fp, bytes_in)
        tokens = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        req_end = req_start + int(server.network_in_ms * MS)
        slot = max(req_end, heapq.heappop(free_at))
        prefill_ns = int((server.prefill_base_ms + server.prefill_ms_per_token * prompt) * MS)
        first_token = slot + prefill_ns
        offsets_us = [int(k * server.decode_ms * 1000) for k in range(tokens)]
        last_token = first_token + offsets_us[-1] * 1000
        heapq.heappush(free_at, last_token)
        usage = rng.random() < usage_fraction
        row = {
            "node": node, "conn_id": index + 1, "req_seq": 0, "role": "server", "pid": 4242, "comm": "sim",
            "server_port": port, "client_addr": client, "client_port": 40000 + index % 20000, "tenant": "", "tls": False,
            "accept_ts": req_start - MS, "tls_done_ts": None, "req_start": req_start, "req_end": req_end,
            "resp_start": req_end + 50_000, "first_token": first_token, "last_token": last_token,
            "resp_end": last_token + int(server.network_out_ms * MS), "method": "POST",
            "path": "/v1/chat/completions", "status": 200, "model": model, "response_id": f"chatcmpl-sim-{index}",
            "streamed": True, "token_events": tokens, "sse_events": tokens + 3, "token_offsets_us": offsets_us,
            "prompt_tokens": prompt if usage else None, "completion_tokens": tokens if usage else None,
            "inflight_at_arrival": 0, "bytes_in": bytes_in, "bytes_out": 200 + 60 * tokens,
            "body_fp": body_fp, "outcome": "complete", "error": "", "capture": "exact", "bytes_unseen": 0, "protocol": "http/1.1", "stream_id": 0, "unreadable_reason": "",
        }  # fmt: skip
        requests.append(SimulatedRequest(row, (slot - req_end) / MS, prefill_ns / MS, phase))
    _count_in_flight([request.row for request in requests])
    return requests


def _count_in_flight(rows: list[dict]) -> None:
    """Set each row's inflight_at_arrival as the agent counts it: requests started and not yet finished."""
    starts = sorted(row["req_start"] for row in rows)
    ends = sorted(row["resp_end"] for row in rows)
    for row in rows:
        started_before = bisect.bisect_left(starts, row["req_start"])
        finished_by = bisect.bisect_right(ends, row["req_start"])
        row["inflight_at_arrival"] = started_before - finished_by
