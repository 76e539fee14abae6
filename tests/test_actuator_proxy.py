"""The gateway process (`python -m tokenprobe.actuator.proxy`) in front of the
real reference server, enforcing a real actuator's decisions over gRPC."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from tokenprobe.actuator.auth import ServerAuth
from tokenprobe.actuator.engine import Enforcer
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.actuator.tenant import DEFAULT_TENANT, tenant_of_key
from tokenprobe.actuator.v1 import actuator_pb2_grpc as pb_grpc
from tokenprobe.contract.decisions import BreakerState
from tokenprobe.refserver.loadgen import LoadConfig, burst

from tests.actuator_support import (
    TOKEN,
    apply,
    breaker,
    budget,
    tokens_available,
    unique_upstream,
)
from tests.gateway_support import RecordingUpstream, gateway, raw_request
from tests.kernel_harness import reference_server
from tests.support import free_port, wait_until


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


# --------------------------------------------------------------------------- attacks on the gateway, over sockets


@pytest.fixture
def recording_upstream():
    upstream = RecordingUpstream()
    yield upstream
    upstream.close()


BYPASSES = {
    # Encodings that split or end the path differently on each side: refused.
    "/v1/chat/completions%3F": 400, "/v1/chat/completions%23": 400, "/v1/chat%2Fcompletions": 400,
    "/v1/chat/completions%00": 400, "/v1/chat/completions%252F": 400, "/v1/chat/completions%zz": 400,
    "/v1\\chat/completions": 400,
    # Path parameters and spaces, which some servers cut off or trim: refused.
    "/v1/chat/completions;x=1": 400, "/v1/chat/completions%3Bx=1": 400, "/v1/chat/completions%20": 400,
    "/v1/chat%20/completions": 400,
    # Spellings of an inference route, and the routes of other dialects: guarded.
    "/v1/./chat/completions": 503, "//v1/chat/completions": 503, "/v1/x/../chat/completions": 503,
    "/v1/chat/completion%73": 503, "/v1/chat/completions/": 503, "/V1/Chat/Completions": 503,
    "/%2e%2e/v1/chat/completions": 503, "/v1/responses": 503, "/v1/messages": 503, "/generate": 503,
    "/generate_stream": 503, "/api/chat": 503, "/api/generate": 503, "/completion": 503, "/v1/embeddings": 503,
    "/v1/audio/speech": 503, "/tokenize": 503, "/detokenize": 503, "/openai/v1/chat/completions": 503,
    "/openai/deployments/gpt/chat/completions": 503, "/api/v1/chat/completions": 503, "/x/v1/messages": 503,
    "/v1/engines/gpt/chat/completions": 503, "/v1/batches": 503, "/v1beta/models/g:streamGenerateContent": 503,
}
# Methods other than POST on an inference route: refused, unless safe and bodiless (a listing, a preflight).
METHODS = {"PUT": 405, "PATCH": 405, "DELETE": 405, "GET": 405}


def test_open_breaker_cannot_be_walked_past_by_spelling_the_path(tmp_path, actuator, recording_upstream):
    server, stub = actuator
    upstream = unique_upstream()
    with gateway(tmp_path, f"http://127.0.0.1:{recording_upstream.port}", upstream,
                 f"127.0.0.1:{server.port}") as port:
        apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=60.0, probe_share=0.1))
        answers = {target: raw_request(port, target)[0] for target in BYPASSES}
        methods = {method: raw_request(port, "/v1/chat/completions", method=method)[0] for method in METHODS}
        assert raw_request(port, "/health", method="GET", body=b"")[0] == 200
    assert answers == BYPASSES
    assert methods == METHODS
    # Not one of them reached the server; the health check did, as sent.
    assert [(method, path) for method, path, _ in recording_upstream.requests] == [("GET", "/health")]


def test_forwarded_path_is_the_canonical_one_and_stays_under_the_base_path(tmp_path, actuator, recording_upstream):
    server, _ = actuator
    with gateway(tmp_path, f"http://127.0.0.1:{recording_upstream.port}/base/", unique_upstream(),
                 f"127.0.0.1:{server.port}") as port:
        for target in ("/../../secret", "/%2e%2e/secret", "//a/./b/../secret?q=%2F..", "/v1/chat%22x"):
            assert raw_request(port, target, method="GET", body=b"")[0] == 200
    assert [path for _, path, _ in recording_upstream.requests] == [
        "/base/secret", "/base/secret", "/base/a/secret?q=%2F..", "/base/v1/chat%22x"]


def test_ambiguous_framing_is_refused_and_hop_by_hop_headers_stay_on_their_hop(tmp_path, actuator,
                                                                               recording_upstream):
    server, _ = actuator
    body = b'{"model": "m", "max_tokens": 4, "prompt": "hi"}'
    with gateway(tmp_path, f"http://127.0.0.1:{recording_upstream.port}", unique_upstream(),
                 f"127.0.0.1:{server.port}") as port:
        smuggled = raw_request(port, "/v1/chat/completions", body=b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n",
                               headers=(f"Content-Length: {len(body)}", "Transfer-Encoding: chunked"))[0]
        conflicting = raw_request(port, "/v1/chat/completions", body=body,
                                  headers=(f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 1}"))[0]
        assert recording_upstream.requests == []
        status, head = raw_request(port, "/v1/chat/completions", body=body, headers=(
            f"Content-Length: {len(body)}", "Keep-Alive: timeout=5", "X-Client-Hop: secret",
            "Proxy-Connection: keep-alive", "Connection: close, X-Client-Hop",
            # Headers some frameworks route by instead of the request line.
            "X-HTTP-Method-Override: PUT", "X-Original-URL: /admin", "X-Rewrite-URL: /admin"))
    assert (smuggled, conflicting, status) == (400, 400, 200)
    received = recording_upstream.requests[0][2]
    assert not {"x-client-hop", "keep-alive", "proxy-connection", "x-http-method-override", "x-original-url",
                "x-rewrite-url"} & received.keys(), received
    assert b"x-upstream-hop" not in head.lower()


def chat_body(max_tokens) -> bytes:
    return b'{"model": "m", "prompt": "hi", "max_tokens": %s}' % str(max_tokens).encode()


def test_a_client_cannot_spend_another_tenants_budget_or_escape_its_own(tmp_path, actuator, recording_upstream):
    server, stub = actuator
    upstream = unique_upstream()
    victim = tenant_of_key("sk-victim-0123456789")
    with gateway(tmp_path, f"http://127.0.0.1:{recording_upstream.port}", upstream,
                 f"127.0.0.1:{server.port}") as port:
        apply(stub, budget(upstream, victim, rate=0.001, burst=1000.0))
        apply(stub, budget(upstream, DEFAULT_TENANT, rate=0.001, burst=1000.0))
        body = chat_body(900)
        # The attacker names the victim in the tenant header, with its own key, then with none.
        spoofed = raw_request(port, "/v1/chat/completions", body=body, headers=(
            f"Content-Length: {len(body)}", f"X-Tenant-Id: {victim}", "Authorization: Bearer sk-attacker-0123"))
        anonymous = []
        for _ in range(2):
            # Each is charged to the unknown keys' bucket and settled at 2 tokens by a call after its answer.
            wait_until(lambda: tokens_available(stub, upstream, DEFAULT_TENANT) > 900)
            anonymous.append(raw_request(port, "/v1/chat/completions", body=body, headers=(
                f"Content-Length: {len(body)}", f"X-Tenant-Id: {victim}"))[0])
        wait_until(lambda: tokens_available(stub, upstream, DEFAULT_TENANT) > 900)
        assert tokens_available(stub, upstream, victim) == pytest.approx(1000.0, abs=1)
    assert spoofed[0] == 200 and anonymous == [200, 200]
    # The agent at the server reads the tenant the gateway charged, not the one the client named: the
    # attacker's key is new to the gateway, so it is charged to the bucket of unknown keys too.
    assert [headers["x-tenant-id"] for _, _, headers in recording_upstream.requests] == [DEFAULT_TENANT] * 3


def test_nonsense_sizes_are_400_and_huge_ones_cannot_push_retry_after_past_the_decision(tmp_path, actuator,
                                                                                       recording_upstream):
    server, stub = actuator
    upstream = unique_upstream()
    with gateway(tmp_path, f"http://127.0.0.1:{recording_upstream.port}", upstream,
                 f"127.0.0.1:{server.port}") as port:
        refused = {value: raw_request(port, "/v1/chat/completions", body=chat_body(value))[0]
                   for value in ("-1", "1.5", '"100"', "1e30", "18446744073709551616", "NaN", "true")}
        assert recording_upstream.requests == []
        apply(stub, budget(upstream, DEFAULT_TENANT, rate=0.001, burst=1000.0, ttl=30.0))
        # Far beyond any context: charged as one context's worth, which the bucket can owe.
        assert raw_request(port, "/v1/chat/completions", body=chat_body(2 ** 63))[0] == 200
        status, head = raw_request(port, "/v1/chat/completions", body=chat_body(2 ** 63))
    assert set(refused.values()) == {400}, refused
    retry_after = int(re.search(rb"(?im)^retry-after: *(\d+)", head).group(1))
    assert status == 429 and 1 <= retry_after <= 30


# --------------------------------------------------------------------------- failing open, visibly


def fail_open_counts(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {match[0]: float(match[1])
            for match in re.findall(r'^tokenprobe_gateway_fail_open_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE)}


@pytest.mark.parametrize("lost", ["actuator down", "credentials refused"])
def test_failing_open_is_counted_per_request_and_logged_once_per_episode(tmp_path, actuator, recording_upstream,
                                                                           lost):
    server, _ = actuator
    metrics_port = free_port()
    address = f"127.0.0.1:{free_port() if lost == 'actuator down' else server.port}"
    token = TOKEN if lost == "actuator down" else "not-the-actuators-token-0123"
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log, gateway(tmp_path, f"http://127.0.0.1:{recording_upstream.port}",
                                               unique_upstream(), address, "--metrics-port", str(metrics_port),
                                               token=token, log=log) as port:
        statuses = [raw_request(port, "/v1/chat/completions")[0] for _ in range(5)]
        counts = fail_open_counts(metrics_port)
    lines = log_path.read_text().splitlines()
    assert statuses == [200] * 5
    if lost == "actuator down":
        assert counts == {"unavailable": 5.0}
        assert sum("did not answer (unavailable)" in line for line in lines) == 1, lines
    else:
        # Not an outage: the gateway is misconfigured, and says so as an error.
        assert counts == {"unauthenticated": 5.0}
        assert sum(" ERROR " in line and "configuration error" in line for line in lines) == 1, lines
