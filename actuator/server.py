"""The actuator's gRPC server.

One port serves, all behind the same authentication:
- tokenprobe.actuator.v1.Actuator (decisions in, admissions out),
- envoy.service.ratelimit.v3.RateLimitService (Envoy and Istio gateways),
- grpc.health.v1.Health and server reflection (grpcurl, probes).

Run it with ``python -m tokenprobe.actuator --help``.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from concurrent import futures

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..contract.decisions import InvalidDecision
from . import wire
from .auth import ServerAuth
from .engine import DwellViolation, Enforcer, SubscriptionOverflow
from .envoy_rls import DEFAULT_DOMAIN, RateLimitAdapter
from .v1 import actuator_pb2 as pb
from .v1 import actuator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ACTUATOR_SERVICE = pb.DESCRIPTOR.services_by_name["Actuator"].full_name
RATE_LIMIT_SERVICE = rls_pb2.DESCRIPTOR.services_by_name["RateLimitService"].full_name
# How often a watch stream wakes to notice that its client left or the server stops.
_WATCH_POLL_S = 0.5
DEFAULT_MAX_WATCHERS = 1024


class ActuatorServicer(pb_grpc.ActuatorServicer):
    def __init__(self, enforcer: Enforcer, max_watchers: int, stopping: threading.Event):
        self._enforcer = enforcer
        # Each open watch stream holds a worker thread: cap them so Check always has threads left.
        self._watch_slots = threading.BoundedSemaphore(max_watchers)
        self._stopping = stopping

    def ApplyDecision(self, request: pb.ApplyDecisionRequest, context) -> pb.ApplyDecisionResponse:
        try:
            decision = wire.decision_from_proto(request.decision)
            stored = self._enforcer.apply(decision)
        except InvalidDecision as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except DwellViolation as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        log.info("decision %s applied: %s for %s (%s), expires in %.0f s", stored.id, stored.kind,
                 stored.target.describe(), stored.reason, stored.expires_at - stored.issued_at)
        return pb.ApplyDecisionResponse(decision=wire.decision_to_proto(stored))

    def GetState(self, request: pb.GetStateRequest, context) -> pb.GetStateResponse:
        response = pb.GetStateResponse(targets=[wire.target_status_to_proto(s) for s in self._enforcer.status()])
        response.server_time.GetCurrentTime()
        return response

    def WatchDecisions(self, request: pb.WatchDecisionsRequest, context):
        if not self._watch_slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many watchers; retry later or use Check")
        subscription = self._enforcer.subscribe()
        try:
            for decision in subscription.snapshot:
                yield pb.WatchDecisionsResponse(decision=wire.decision_to_proto(decision))
            yield pb.WatchDecisionsResponse(end_of_snapshot=True)
            while context.is_active() and not self._stopping.is_set():
                decision = subscription.next(timeout=_WATCH_POLL_S)
                if decision is not None:
                    yield pb.WatchDecisionsResponse(decision=wire.decision_to_proto(decision))
        except SubscriptionOverflow as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        finally:
            subscription.close()
            self._watch_slots.release()

    def Check(self, request: pb.CheckRequest, context) -> pb.CheckResponse:
        verdict = self._enforcer.check(request.upstream, request.model, request.tenant, request.estimated_tokens)
        return wire.verdict_to_proto(verdict)

    def Settle(self, request: pb.SettleRequest, context) -> pb.SettleResponse:
        adjustment = self._enforcer.settle(request.reservation_id, request.observed_tokens)
        if adjustment is None:
            return pb.SettleResponse(settled=False)
        return pb.SettleResponse(settled=True, adjustment_tokens=adjustment)


class ActuatorServer:
    """The gRPC server around one Enforcer; start() returns the bound port."""

    def __init__(
        self,
        auth: ServerAuth,
        *,
        listen: str = "127.0.0.1:0",
        enforcer: Enforcer | None = None,
        envoy_domain: str = DEFAULT_DOMAIN,
        max_workers: int = 32,
        max_watchers: int = DEFAULT_MAX_WATCHERS,
    ):
        if auth.tls is None and not _is_loopback(listen):
            raise ValueError(f"plaintext gRPC would expose bearer tokens on {listen}: configure TLS "
                             "or listen on a loopback address")
        if max_workers < 4 or max_watchers < 1:
            raise ValueError("max_workers must be at least 4, max_watchers at least 1")
        self.enforcer = enforcer or Enforcer()
        self._auth = auth
        self._listen = listen
        self._stopping = threading.Event()
        # A watch stream holds its worker thread for as long as the gateway
        # watches; the pool has a thread per watcher on top of `max_workers`,
        # so hundreds of watching gateways never starve the Check calls. A
        # waiting thread costs a stack's resident pages, not CPU.
        pool = futures.ThreadPoolExecutor(max_workers=max_workers + max_watchers, thread_name_prefix="actuator")
        self._server = grpc.server(pool, interceptors=[auth.interceptor()])
        pb_grpc.add_ActuatorServicer_to_server(
            ActuatorServicer(self.enforcer, max_watchers=max_watchers, stopping=self._stopping), self._server)
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(
            RateLimitAdapter(self.enforcer, envoy_domain), self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (ACTUATOR_SERVICE, RATE_LIMIT_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self.port: int | None = None

    def start(self) -> int:
        credentials = self._auth.server_credentials()
        if credentials is None:
            port = self._server.add_insecure_port(self._listen)
        else:
            port = self._server.add_secure_port(self._listen, credentials)
        if port == 0:
            raise OSError(f"could not listen on {self._listen}")
        self._server.start()
        for service in ("", ACTUATOR_SERVICE, RATE_LIMIT_SERVICE):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        log.info("actuator listening on %s (port %d, %s)", self._listen, port,
                 "mutual TLS" if self._auth.mutual_tls else "TLS" if self._auth.tls else "plaintext, loopback")
        return port

    def stop(self, grace_s: float = 1.0) -> None:
        self._health.enter_graceful_shutdown()
        self._stopping.set()
        self._server.stop(grace_s).wait()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self) -> ActuatorServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _is_loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
