"""Shared pieces of the actuator tests: a token, decisions to apply, and waiting without tight timing."""

from __future__ import annotations

import itertools
import time

from tokenprobe.actuator import wire
from tokenprobe.actuator.v1 import actuator_pb2 as pb
from tokenprobe.contract.decisions import (
    BreakerAction,
    BreakerState,
    Decision,
    Target,
    TokenBudgetAction,
)

TOKEN = "test-token-0123456789abcdef"
RPC_TIMEOUT_S = 10.0
_upstream_numbers = itertools.count()


def unique_upstream() -> str:
    """Each test works on its own upstream, so tests sharing one server never meet."""
    return f"vllm-{next(_upstream_numbers)}"






def auth_metadata(token: str = TOKEN) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def breaker(upstream: str, state: BreakerState, ttl: float = 60.0, **fields) -> Decision:
    now = time.time()
    return Decision(target=Target(upstream=upstream), action=BreakerAction(state, **fields), issued_at=now,
                    expires_at=now + ttl, reason="test", issuer="pytest")


def budget(upstream: str, tenant: str, rate: float, burst: float, ttl: float = 60.0,
           max_delay_s: float = 0.0) -> Decision:
    now = time.time()
    return Decision(target=Target(upstream=upstream, tenant=tenant),
                    action=TokenBudgetAction(rate, burst, max_delay_s), issued_at=now, expires_at=now + ttl,
                    reason="test", issuer="pytest")


def apply(stub, decision: Decision) -> pb.ApplyDecisionResponse:
    return stub.ApplyDecision(pb.ApplyDecisionRequest(decision=wire.decision_to_proto(decision)),
                              metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)


def tokens_available(stub, upstream: str, tenant: str | None = None) -> float:
    """What the budget on `upstream` (and `tenant`, if given) has left, as the actuator reports it."""
    state = stub.GetState(pb.GetStateRequest(), metadata=auth_metadata(), timeout=RPC_TIMEOUT_S)
    return next(t.tokens_available for t in state.targets if t.decision.target.upstream == upstream
                and tenant in (None, t.decision.target.tenant))
