"""Kernel batching of steady SSE streams, in the running kernel: the same requests, seen at
the same time by an agent with batching on and one with it off, give the same rows.

Both agents trace the same servers (the reference server plain, and over TLS through
CPython's ssl): every write is stamped by each agent's own probe, a few microseconds
apart, so the token times are compared to within that; every count is compared exactly.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import pytest
from tokenprobe.refserver.loadgen import LoadConfig, burst

from tests.kernel_harness import agent, read_rows, reference_server, require_kernel

pytestmark = pytest.mark.kernel

# Two programs stamp the same syscall one after the other.
STAMP_SKEW_NS = 200_000
EXACT_FIELDS = ("path", "status", "outcome", "error", "tls", "req_seq", "token_events", "sse_events",
                "completion_tokens", "prompt_tokens", "model", "bytes_in", "bytes_out", "api", "capture",
                "bytes_unseen")
TIMED_FIELDS = ("req_start_ns", "req_end_ns", "first_token_ns", "last_token_ns")
# Offsets are whole microseconds from the first token: each agent's skew moves them a little.
OFFSET_SLACK_US = STAMP_SKEW_NS // 1000


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


def _summary(log: str) -> tuple[int, int]:
    """(kernel events, writes that came in batches) from the agent's closing line."""
    match = re.search(r"from (\d+) kernel events \((\d+) writes in batches\)", log)
    assert match, log[-2000:]
    return int(match[1]), int(match[2])


def test_batched_rows_equal_full_capture(tmp_path: Path):
    with ExitStack() as stack:
        for name in ("plain", "tls", "on", "off"):
            (tmp_path / name).mkdir()
        ports = [(stack.enter_context(reference_server(tmp_path / name, tls=tls, decode_ms=2.0))[0], tls)
                 for name, tls in (("plain", False), ("tls", True))]
        watched = [port for port, _ in ports]
        batching = stack.enter_context(agent(tmp_path / "on", ports=watched))
        full = stack.enter_context(agent(tmp_path / "off", "--no-kernel-batching", ports=watched))
        for port, tls in ports:
            config = LoadConfig(port=port, tls=tls, requests=40, duration_s=None, max_tokens=(40, 300),
                                stream_fraction=1.0, include_usage_fraction=0.5, seed=port)
            result = burst(config, n=40, concurrency=4, per_connection=5)
            assert not result.errors, [r.error for r in result.errors][:5]
        assert batching.stop() == 0, batching.log()
        assert full.stop() == 0, full.log()

    on = {row["response_id"]: row for row in read_rows(batching.store_url) if row["path"].startswith("/v1/")}
    off = {row["response_id"]: row for row in read_rows(full.store_url) if row["path"].startswith("/v1/")}
    assert len(off) == 80 and on.keys() == off.keys()
    for rid, expected in off.items():
        got = on[rid]
        assert expected["capture"] == "exact" and expected["outcome"] == "complete", expected
        for name in EXACT_FIELDS:
            assert got[name] == expected[name], (name, got, expected)
        for name in TIMED_FIELDS:
            assert abs(got[name] - expected[name]) <= STAMP_SKEW_NS, (name, got[name], expected[name])
        assert len(got["token_offsets_us"]) == len(expected["token_offsets_us"]) == expected["token_events"]
        assert all(abs(int(a) - int(b)) <= OFFSET_SLACK_US
                   for a, b in zip(got["token_offsets_us"], expected["token_offsets_us"])), rid

    events_on, batched = _summary(batching.log())
    events_off, unbatched = _summary(full.log())
    tokens = sum(row["token_events"] for row in off.values())
    print(f"kernel events: {events_on} with batching ({batched} of {tokens} token writes batched), "
          f"{events_off} without")
    assert unbatched == 0
    # Most token writes came in batch records (not the first of each response, nor those the
    # kernel met before it learnt the template: more of them the further the agent lags), and so
    # far fewer kernel events.
    assert batched >= tokens / 2 and events_on < events_off / 2, (events_on, batched, events_off, tokens)
