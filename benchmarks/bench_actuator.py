"""Admission throughput of the actuator over real gRPC on loopback.

Starts an actuator (bearer token, 127.0.0.1), puts a breaker and a token
budget in force, then for a fixed time measures:

- Check calls/s and their latency, from several client threads (ask mode);
- Envoy's ShouldRateLimit calls/s on the same buckets;
- admissions/s of a gateway in watch mode (decisions cached, no call).

    python benchmarks/bench_actuator.py --seconds 5 --threads 4
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from tokenprobe.actuator import wire
from tokenprobe.actuator.auth import ClientAuth, ServerAuth
from tokenprobe.actuator.gateway import GatewayGuard
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.actuator.v1 import actuator_pb2 as pb
from tokenprobe.actuator.v1 import actuator_pb2_grpc as pb_grpc
from tokenprobe.contract.decisions import (
    BreakerAction,
    BreakerState,
    Decision,
    Target,
    TokenBudgetAction,
)

TOKEN = "bench-token-0123456789abcdef"
METADATA = (("authorization", f"Bearer {TOKEN}"),)


def put_decisions_in_force(stub) -> None:
    now = time.time()
    decisions = [
        # A half-open breaker on one upstream: Check runs the share counter.
        Decision(Target(upstream="vllm-b"), BreakerAction(BreakerState.HALF_OPEN, admitted_share=0.5),
                 issued_at=now, expires_at=now + 600),
        # A budget large enough that the bench measures admission, not rejection.
        Decision(Target(upstream="vllm-a", tenant="acme"), TokenBudgetAction(1e9, 1e12),
                 issued_at=now, expires_at=now + 600),
    ]
    for decision in decisions:
        stub.ApplyDecision(pb.ApplyDecisionRequest(decision=wire.decision_to_proto(decision)), metadata=METADATA,
                           timeout=10)


def run_threads(threads: int, seconds: float, one_call) -> tuple[int, list[float]]:
    """Call `one_call` from `threads` threads for `seconds`; returns the count and latencies (s)."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    stop = threading.Event()

    def loop(mine: list[float]) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            one_call()
            mine.append(time.perf_counter() - started)

    workers = [threading.Thread(target=loop, args=(mine,)) for mine in latencies]
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    merged = [latency for mine in latencies for latency in mine]
    return len(merged), merged


def report(name: str, count: int, latencies: list[float], seconds: float) -> None:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(f"{name:<34} {count / seconds:>10.0f} calls/s   p50 {statistics.median(ordered) * 1e3:7.3f} ms"
          f"   p99 {p99 * 1e3:7.3f} ms   ({count} calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each measurement")
    parser.add_argument("--threads", type=int, default=4, help="client threads")
    args = parser.parse_args()

    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN}))) as server:
        target = f"127.0.0.1:{server.port}"
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.ActuatorStub(channel)
            put_decisions_in_force(stub)
            print(f"actuator on {target}; {args.threads} client threads, {args.seconds:g} s per measurement")
            budgeted = pb.CheckRequest(upstream="vllm-a", model="small", tenant="acme", estimated_tokens=600)
            count, latencies = run_threads(args.threads, args.seconds,
                                           lambda: stub.Check(budgeted, metadata=METADATA, timeout=5))
            report("Check (token budget)", count, latencies, args.seconds)
            shed = pb.CheckRequest(upstream="vllm-b", model="small", tenant="acme", estimated_tokens=600)
            count, latencies = run_threads(args.threads, args.seconds,
                                           lambda: stub.Check(shed, metadata=METADATA, timeout=5))
            report("Check (half-open breaker)", count, latencies, args.seconds)
            envoy = rls_pb2_grpc.RateLimitServiceStub(channel)
            request = rls_pb2.RateLimitRequest(domain="tokenprobe", hits_addend=600, descriptors=[
                ratelimit_pb2.RateLimitDescriptor(entries=[
                    ratelimit_pb2.RateLimitDescriptor.Entry(key="upstream", value="vllm-a"),
                    ratelimit_pb2.RateLimitDescriptor.Entry(key="tenant", value="acme")])])
            count, latencies = run_threads(args.threads, args.seconds,
                                           lambda: envoy.ShouldRateLimit(request, metadata=METADATA, timeout=5))
            report("Envoy ShouldRateLimit", count, latencies, args.seconds)
        with GatewayGuard(target, ClientAuth(bearer_token=TOKEN), watch=True) as watcher:
            if not watcher.wait_synced(30):
                raise SystemExit("the watch stream did not deliver the decisions within 30 s")
            count, latencies = run_threads(args.threads, args.seconds,
                                           lambda: watcher.check("vllm-a", "small", "acme", 600))
            report("watch-mode local check", count, latencies, args.seconds)


if __name__ == "__main__":
    main()
