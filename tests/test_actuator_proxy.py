"""The gateway process (`python -m tokenprobe.actuator.proxy`) in front of the
real reference server, enforcing a real actuator's decisions over gRPC."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from tokenprobe.actuator.auth import ServerAuth
from tokenprobe.actuator.engine import Enforcer
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.actuator.v1 import actuator_pb2_grpc as pb_grpc
from tokenprobe.contract.decisions import BreakerState
from tokenprobe.refserver.loadgen import LoadConfig, burst

from tests.actuator_support import TOKEN, apply, breaker, unique_upstream
from tests.kernel_harness import reference_server
from tests.support import free_port, wait_for_port


@contextmanager
def gateway(tmp: Path, upstream_url: str, upstream: str, actuator: str) -> Iterator[int]:
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenprobe.actuator.proxy", "--upstream-url", upstream_url,
                                "--upstream", upstream, "--actuator", actuator, "--token-file", str(token_file),
                                "--port", str(port), "--deadline", "5.0"])
    try:
        wait_for_port(port)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=20)


def requests_through(port: int, n: int = 6):
    config = LoadConfig(port=port, requests=n, duration_s=None, max_tokens=(6, 12), stream_fraction=0.5,
                        include_usage_fraction=1.0, tenant="acme", seed=3)
    return burst(config, n=n, concurrency=2, per_connection=3).records


@pytest.fixture(scope="module")
def actuator():
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})), enforcer=Enforcer(min_dwell_s=0.0)) as running:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield running, pb_grpc.ActuatorStub(channel)


def test_streams_pass_through_unchanged_and_unbuffered(tmp_path, actuator):
    server, _ = actuator
    with reference_server(tmp_path, decode_ms=30.0) as (backend, _), \
            gateway(tmp_path, f"http://127.0.0.1:{backend}", unique_upstream(), f"127.0.0.1:{server.port}") as port:
        records = requests_through(port)
    assert [r.status for r in records] == [200] * len(records), [r.error for r in records]
    for record in records:
        assert record.response_id and record.completion_tokens and not record.error
        if record.stream:
            assert record.token_events == record.completion_tokens
            # Tokens 30 ms apart at the server arrive spread out, not in one buffered lump.
            assert record.last_token_ns - record.first_token_ns >= 0.5 * 30e6 * (record.token_events - 1)


def test_open_breaker_rejects_with_503(tmp_path, actuator):
    server, stub = actuator
    upstream = unique_upstream()
    with reference_server(tmp_path) as (backend, _), \
            gateway(tmp_path, f"http://127.0.0.1:{backend}", upstream, f"127.0.0.1:{server.port}") as port:
        assert all(r.status == 200 for r in requests_through(port, 2))
        apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=30.0, probe_share=0.1))
        rejected = requests_through(port, 4)
    assert [r.status for r in rejected] == [503] * 4


def test_unreachable_upstream_is_a_502_and_unreachable_actuator_fails_open(tmp_path):
    with gateway(tmp_path, f"http://127.0.0.1:{free_port()}", "nowhere:1", f"127.0.0.1:{free_port()}") as port:
        records = requests_through(port, 2)
    # The actuator is down, so the request is admitted; then the upstream is down too.
    assert [r.status for r in records] == [502, 502]
    assert all("upstream unreachable" in r.error for r in records), [r.error for r in records]
