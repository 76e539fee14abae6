"""The actuator server over real gRPC on loopback: API, auth, Envoy's RLS, fail-open, recording."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf.wrappers_pb2 import UInt64Value
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenprobe.actuator import wire
from tokenprobe.actuator.auth import ClientAuth, ServerAuth, ServerTls
from tokenprobe.actuator.controller import Controller, ControllerPolicy
from tokenprobe.actuator.engine import Enforcer, VerdictKind
from tokenprobe.actuator.gateway import GatewayGuard
from tokenprobe.actuator.publisher import DecisionPublisher, DecisionRecorder
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.actuator.v1 import actuator_pb2 as pb
from tokenprobe.actuator.v1 import actuator_pb2_grpc as pb_grpc
from tokenprobe.contract.decisions import BreakerState, WindowFigures

from tests.actuator_support import (
    RPC_TIMEOUT_S,
    TOKEN,
    apply,
    auth_metadata,
    breaker,
    budget,
    unique_upstream,
)
from tests.support import WAIT_S, free_port, wait_until


@pytest.fixture(scope="module")
def server():
    # A 3 s dwell as in production; tests that loosen use fresh targets.
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})), enforcer=Enforcer(min_dwell_s=3.0)) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as opened:
        yield opened


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.ActuatorStub(channel)


def check(stub, upstream: str, tenant: str = "acme", tokens: int = 10, model: str = "small") -> pb.CheckResponse:
    return stub.Check(pb.CheckRequest(upstream=upstream, model=model, tenant=tenant, estimated_tokens=tokens),
                      metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)


# --------------------------------------------------------------------------- the API


def test_apply_check_and_get_state(stub):
    upstream = unique_upstream()
    stored = apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=30.0, probe_share=0.1)).decision
    assert stored.target.upstream == upstream and stored.breaker.state == pb.BREAKER_STATE_OPEN
    rejected = check(stub, upstream)
    assert (rejected.verdict, rejected.http_status, rejected.decision_id) == (pb.VERDICT_REJECT, 503, stored.id)
    assert 25 < wire.duration_to_seconds(rejected.retry_after) <= 30
    assert check(stub, unique_upstream()).verdict == pb.VERDICT_ALLOW
    state = stub.GetState(pb.GetStateRequest(), metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)
    mine = [t for t in state.targets if t.decision.id == stored.id]
    assert len(mine) == 1
    assert mine[0].effective_state == pb.BREAKER_STATE_OPEN and mine[0].admitted_share == 0.0
    assert mine[0].decision.reason == "test" and mine[0].decision.issuer == "pytest"


def test_budget_check_and_settle(stub):
    upstream = unique_upstream()
    apply(stub, budget(upstream, "acme", rate=1.0, burst=1000.0, ttl=600.0))
    admitted = check(stub, upstream, tokens=900)
    assert admitted.verdict == pb.VERDICT_ALLOW and admitted.reservation_id
    over = check(stub, upstream, tokens=500)
    assert (over.verdict, over.http_status) == (pb.VERDICT_REJECT, 429)
    assert wire.duration_to_seconds(over.retry_after) > 300  # 1 token/s refill
    settled = stub.Settle(pb.SettleRequest(reservation_id=admitted.reservation_id, observed_tokens=200),
                          metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)
    assert (settled.settled, settled.adjustment_tokens) == (True, -700)
    assert check(stub, upstream, tokens=500).verdict == pb.VERDICT_ALLOW
    unknown = stub.Settle(pb.SettleRequest(reservation_id="nope", observed_tokens=1), metadata=auth_metadata(),
                          timeout=RPC_TIMEOUT_S)
    assert not unknown.settled


def test_bad_decisions_and_early_loosening_are_refused_with_their_code(stub):
    upstream = unique_upstream()
    no_expiry = wire.decision_to_proto(breaker(upstream, BreakerState.CLOSED))
    no_expiry.ClearField("expires_at")
    with pytest.raises(grpc.RpcError) as refused:
        stub.ApplyDecision(pb.ApplyDecisionRequest(decision=no_expiry), metadata=auth_metadata(),
                           timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expires_at" in refused.value.details()
    with pytest.raises(grpc.RpcError) as empty:
        stub.ApplyDecision(pb.ApplyDecisionRequest(), metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    apply(stub, breaker(upstream, BreakerState.HALF_OPEN, admitted_share=0.1))
    with pytest.raises(grpc.RpcError) as flapping:
        apply(stub, breaker(upstream, BreakerState.CLOSED))
    assert flapping.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=5.0, probe_share=0.1))  # tightening: accepted


def test_watch_streams_snapshot_then_new_decisions(stub):
    upstream = unique_upstream()
    first = apply(stub, budget(upstream, "acme", 10.0, 100.0)).decision
    stream = stub.WatchDecisions(pb.WatchDecisionsRequest(), metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)
    snapshot = []
    for message in stream:
        if message.end_of_snapshot:
            break
        snapshot.append(message.decision.id)
    assert first.id in snapshot
    second = apply(stub, budget(upstream, "globex", 10.0, 100.0)).decision
    assert next(stream).decision.id == second.id
    stream.cancel()


# --------------------------------------------------------------------------- health, reflection, auth


def test_health_and_reflection_are_served(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tokenprobe.actuator.v1.Actuator", "envoy.service.ratelimit.v3.RateLimitService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), metadata=auth_metadata(),
                              timeout=RPC_TIMEOUT_S)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)
    services = {s.name for s in next(answers).list_services_response.service}
    assert {"tokenprobe.actuator.v1.Actuator", "envoy.service.ratelimit.v3.RateLimitService",
            "grpc.health.v1.Health"} <= services


def _every_kind_of_call(channel, metadata):
    """One call of each service and streaming shape the server offers."""
    actuator = pb_grpc.ActuatorStub(channel)
    yield lambda: actuator.Check(pb.CheckRequest(upstream="u"), metadata=metadata, timeout=RPC_TIMEOUT_S)
    yield lambda: actuator.GetState(pb.GetStateRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S)
    yield lambda: next(actuator.WatchDecisions(pb.WatchDecisionsRequest(), metadata=metadata,
                                               timeout=RPC_TIMEOUT_S))
    yield lambda: rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(
        rls_pb2.RateLimitRequest(domain="tokenprobe"), metadata=metadata, timeout=RPC_TIMEOUT_S)
    yield lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata,
                                                            timeout=RPC_TIMEOUT_S)
    yield lambda: next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata,
        timeout=RPC_TIMEOUT_S))


@pytest.mark.parametrize("metadata", [(), auth_metadata("wrong-token-0123456789"), (("authorization", TOKEN),)],
                         ids=["none", "wrong", "not-bearer"])
def test_every_call_without_a_valid_token_is_unauthenticated(channel, metadata):
    for call in _every_kind_of_call(channel, metadata):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_every_call_with_the_token_is_accepted(channel):
    for call in _every_kind_of_call(channel, auth_metadata()):
        call()


def test_server_refuses_to_run_unauthenticated_or_exposed():
    with pytest.raises(ValueError, match="bearer tokens or mutual TLS"):
        ServerAuth()
    with pytest.raises(ValueError, match="at least 16"):
        ServerAuth(bearer_tokens=frozenset({"short"}))
    with pytest.raises(ValueError, match="loopback"):
        ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})), listen="0.0.0.0:0")


def _openssl(*arguments: str) -> None:
    subprocess.run(["openssl", *arguments], check=True, capture_output=True, timeout=60)


def _issue(directory: Path, name: str, ca: str, subject_alt_name: str) -> tuple[bytes, bytes]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _openssl("req", "-new", "-x509", "-nodes", "-days", "2", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
             "-addext", f"subjectAltName={subject_alt_name}", "-CA", str(directory / f"{ca}.pem"),
             "-CAkey", str(directory / f"{ca}.key"))
    return cert.read_bytes(), key.read_bytes()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1, and client certificates from it and from a stranger CA."""
    directory = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "stranger-ca"):
        _openssl("req", "-x509", "-nodes", "-days", "2", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:prime256v1", "-keyout", str(directory / f"{ca}.key"),
                 "-out", str(directory / f"{ca}.pem"), "-subj", f"/CN={ca}")
    return {
        "ca": (directory / "ca.pem").read_bytes(),
        "server": _issue(directory, "server", "ca", "IP:127.0.0.1"),
        "controller": _issue(directory, "controller", "ca", "DNS:controller.tokenprobe"),
        "intruder": _issue(directory, "intruder", "ca", "DNS:intruder.tokenprobe"),
        "stranger": _issue(directory, "stranger", "stranger-ca", "DNS:controller.tokenprobe"),
    }


def test_mutual_tls(pki):
    server_cert, server_key = pki["server"]
    tls = ServerTls(server_cert, server_key, client_ca=pki["ca"],
                    allowed_identities=frozenset({"controller.tokenprobe"}))
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN}), tls=tls)) as running:
        target = f"127.0.0.1:{running.port}"

        def get_state(client_cert: str | None, token: str | None = None):
            cert, key = pki[client_cert] if client_cert else (None, None)
            auth = ClientAuth(bearer_token=token, root_certificates=pki["ca"], certificate_chain=cert,
                              private_key=key)
            with auth.channel(target) as opened:
                return pb_grpc.ActuatorStub(opened).GetState(pb.GetStateRequest(), metadata=auth.metadata(),
                                                             timeout=RPC_TIMEOUT_S)

        get_state("controller")  # an allowed identity needs no token
        get_state("intruder", token=TOKEN)  # a certificate from the CA plus a token
        with pytest.raises(grpc.RpcError) as unauthenticated:
            get_state("intruder")
        assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for client_cert in (None, "stranger"):  # the TLS handshake itself fails
            with pytest.raises(grpc.RpcError) as refused:
                get_state(client_cert, token=TOKEN)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- Envoy's rate limit service


def rate_limit(channel, domain: str, *descriptors, hits_addend: int = 0, token: str = TOKEN):
    """A call exactly as Envoy's ratelimit filter makes it, through Envoy's published proto."""
    request = rls_pb2.RateLimitRequest(domain=domain, hits_addend=hits_addend)
    for entries, addend in descriptors:
        descriptor = request.descriptors.add(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries.items()])
        if addend is not None:
            descriptor.hits_addend.CopyFrom(UInt64Value(value=addend))
    return rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(request, metadata=auth_metadata(token),
                                                                     timeout=RPC_TIMEOUT_S)


def test_envoy_rate_limit_counts_tokens_in_the_same_buckets(stub, channel):
    upstream = unique_upstream()
    apply(stub, budget(upstream, "acme", rate=1.0, burst=1000.0, ttl=600.0))
    tenant = {"upstream": upstream, "tenant": "acme"}
    ok = rate_limit(channel, "tokenprobe", (tenant, 600))
    assert ok.overall_code == rls_pb2.RateLimitResponse.OK
    assert [s.code for s in ok.statuses] == [rls_pb2.RateLimitResponse.OK]
    # Check and Envoy draw on one bucket: 400 left.
    assert check(stub, upstream, tokens=300).verdict == pb.VERDICT_ALLOW
    over = rate_limit(channel, "tokenprobe", ({"generic_key": "x"}, None), (tenant, None), hits_addend=200)
    assert over.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT
    assert [s.code for s in over.statuses] == [rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT]
    assert over.statuses[1].duration_until_reset.seconds >= 90
    headers = {h.key: h.value for h in over.response_headers_to_add}
    assert int(headers["retry-after"]) >= 90
    other_domain = rate_limit(channel, "someone-else", (tenant, 10_000))
    assert other_domain.overall_code == rls_pb2.RateLimitResponse.OK and len(other_domain.statuses) == 1


def test_envoy_rate_limit_honours_an_open_breaker(stub, channel):
    upstream = unique_upstream()
    apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=20.0, probe_share=0.1))
    answer = rate_limit(channel, "tokenprobe", ({"upstream": upstream, "tenant": "acme"}, None))
    assert answer.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT


# --------------------------------------------------------------------------- fail-open


def test_unreachable_actuator_fails_open_fast():
    with GatewayGuard(f"127.0.0.1:{free_port()}", ClientAuth(bearer_token=TOKEN), deadline_s=0.05) as guard:
        started = time.monotonic()
        verdicts = [guard.check("vllm-a", "small", "acme", 100) for _ in range(5)]
        elapsed = time.monotonic() - started
    assert all(v.kind == VerdictKind.ALLOW and "fail-open" in v.reason for v in verdicts)
    assert guard.fail_open_total == 5
    assert elapsed < 5.0  # bounded by the deadline, not by connection timeouts


def test_silent_actuator_fails_open_at_the_deadline():
    """A peer that accepts TCP but never speaks HTTP/2: the deadline bounds the wait."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        with GatewayGuard(f"127.0.0.1:{port}", ClientAuth(bearer_token=TOKEN), deadline_s=0.05) as guard:
            started = time.monotonic()
            verdict = guard.check("vllm-a", "small", "acme", 100)
            elapsed = time.monotonic() - started
    assert verdict.allowed and "fail-open" in verdict.reason
    assert elapsed < 5.0


def test_decisions_expire_on_the_server_and_in_a_watching_gateway_after_the_actuator_dies():
    upstream = unique_upstream()
    running = ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})))
    running.start()
    target = f"127.0.0.1:{running.port}"
    try:
        with grpc.insecure_channel(target) as opened:
            direct = pb_grpc.ActuatorStub(opened)
            expiring = apply(direct, breaker(upstream, BreakerState.OPEN, ttl=4.0, cooldown_s=60.0,
                                             probe_share=0.1)).decision
            expires_at = wire.timestamp_to_seconds(expiring.expires_at)
            watcher = GatewayGuard(target, ClientAuth(bearer_token=TOKEN), watch=True)
            assert watcher.wait_synced(WAIT_S)
            assert not watcher.check(upstream, "small", "acme", 1).allowed  # the cache enforces
            assert check(direct, upstream).verdict == pb.VERDICT_REJECT
            wait_until(lambda: time.time() > expires_at + 0.1)
            assert check(direct, upstream).verdict == pb.VERDICT_ALLOW  # expired on the server
    finally:
        running.stop()
    # The controller and the actuator are gone; a fresh decision in the cache still lapses on time.
    watcher._cache.apply(breaker(upstream, BreakerState.OPEN, ttl=1.5, cooldown_s=60.0, probe_share=0.1))
    assert not watcher.check(upstream, "small", "acme", 1).allowed
    wait_until(lambda: watcher.check(upstream, "small", "acme", 1).allowed)
    watcher.close()


def test_watching_gateway_picks_up_new_decisions(server, stub):
    upstream = unique_upstream()
    with GatewayGuard(f"127.0.0.1:{server.port}", ClientAuth(bearer_token=TOKEN), watch=True) as watcher:
        assert watcher.wait_synced(WAIT_S)
        assert watcher.check(upstream, "small", "acme", 1).allowed
        apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=30.0, probe_share=0.1))
        wait_until(lambda: not watcher.check(upstream, "small", "acme", 1).allowed)


def test_hundreds_of_watching_gateways_are_served_and_checks_still_answer():
    upstream = unique_upstream()
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN}))) as running, \
            grpc.insecure_channel(f"127.0.0.1:{running.port}") as opened, ExitStack() as watchers:
        direct = pb_grpc.ActuatorStub(opened)
        guards = [watchers.enter_context(GatewayGuard(f"127.0.0.1:{running.port}", ClientAuth(bearer_token=TOKEN),
                                                      watch=True)) for _ in range(200)]
        assert all(guard.wait_synced(WAIT_S) for guard in guards)
        started = time.monotonic()
        assert check(direct, upstream).verdict == pb.VERDICT_ALLOW
        assert time.monotonic() - started < 1.0  # the watchers hold no thread Check needs
        apply(direct, breaker(upstream, BreakerState.OPEN, cooldown_s=30.0, probe_share=0.1))
        wait_until(lambda: not any(guard.check(upstream, "small", "acme", 1).allowed for guard in guards))


def test_watching_gateway_with_no_actuator_allows_everything():
    with GatewayGuard(f"127.0.0.1:{free_port()}", ClientAuth(bearer_token=TOKEN), watch=True) as watcher:
        assert watcher.check("vllm-a", "small", "acme", 10**6).allowed


# --------------------------------------------------------------------------- the controller's side


def test_controller_decisions_are_pushed_and_recorded(server, tmp_path):
    from tokenprobe.store import open_store
    upstream = unique_upstream()
    controller = Controller(ControllerPolicy(window_s=5.0))
    now = time.time()
    windows = [WindowFigures(upstream, now - 10 + 5 * i, 12.0, 2.0, 10.0, 0.4, {"acme": 3000, "globex": 100})
               for i in range(3)]
    decisions = [d for w in windows for d in controller.decide(w)]
    assert {d.kind for d in decisions} == {"breaker", "token_budget"}
    publisher = DecisionPublisher(f"127.0.0.1:{server.port}", ClientAuth(bearer_token=TOKEN))
    outcomes = publisher.publish(decisions)
    refused = publisher.publish([breaker(upstream, BreakerState.CLOSED)])  # loosening right after opening
    publisher.close()
    assert [o.outcome for o in outcomes] == ["applied"] * len(decisions)
    assert refused[0].outcome == "refused" and refused[0].detail.startswith("FAILED_PRECONDITION")
    unreachable = DecisionPublisher(f"127.0.0.1:{free_port()}", ClientAuth(bearer_token=TOKEN), deadline_s=0.5)
    lost = unreachable.publish(decisions[:1])
    unreachable.close()
    assert lost[0].outcome == "unreachable"

    store = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    try:
        store.ensure_schema()
        DecisionRecorder(store).record(outcomes + refused + lost, recorded_at=time.time())
        rows = store.query_rows(
            "SELECT kind, tenant, breaker_state, outcome, evidence_name, evidence_value, reason"
            " FROM tokenprobe.decisions WHERE upstream = {u:String} ORDER BY recorded_at, kind, tenant",
            {"u": upstream})
    finally:
        store.close()
    assert len(rows) == len(decisions) + 2
    opened = next(r for r in rows if r[2] == "OPEN" and r[3] == "applied")
    assert "request_rate" in opened[4] and 12.0 in opened[5] and "overloaded" in opened[6]
    assert {r[3] for r in rows} == {"applied", "refused", "unreachable"}


# --------------------------------------------------------------------------- the command line


def test_command_line_server_serves_until_terminated(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{TOKEN}\n")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenprobe.actuator", "--listen", f"127.0.0.1:{port}",
                                "--token-file", str(token_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as opened:
            health = health_pb2_grpc.HealthStub(opened)
            answer = health.Check(health_pb2.HealthCheckRequest(), metadata=auth_metadata(), timeout=WAIT_S,
                                  wait_for_ready=True)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "actuator listening" in process.stdout.read()


def test_command_line_refuses_a_bad_configuration(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tokenprobe.actuator", "--listen", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "bearer tokens or mutual TLS" in result.stderr


def test_concurrent_checks_share_one_bucket_exactly(stub):
    """Many gateway threads draining one bucket admit exactly what it holds."""
    upstream = unique_upstream()
    apply(stub, budget(upstream, "acme", rate=0.001, burst=1000.0))
    admitted = []

    def drain():
        for _ in range(25):
            admitted.append(check(stub, upstream, tokens=10).verdict == pb.VERDICT_ALLOW)
    threads = [threading.Thread(target=drain) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(admitted) == 100
