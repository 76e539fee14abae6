"""Conversion between the plain decision values and tokenprobe.actuator.v1 messages."""

from __future__ import annotations

import math

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from ..contract.decisions import (
    BreakerAction,
    BreakerState,
    Decision,
    Evidence,
    InvalidDecision,
    Target,
    TokenBudgetAction,
)
from .engine import TargetStatus, Verdict, VerdictKind
from .v1 import actuator_pb2 as pb


def seconds_to_timestamp(seconds: float) -> Timestamp:
    whole = math.floor(seconds)
    return Timestamp(seconds=whole, nanos=int(round((seconds - whole) * 1e9)) % 1_000_000_000)


def timestamp_to_seconds(timestamp: Timestamp) -> float:
    return timestamp.seconds + timestamp.nanos / 1e9


def seconds_to_duration(seconds: float) -> Duration:
    whole = math.floor(seconds)
    return Duration(seconds=whole, nanos=int(round((seconds - whole) * 1e9)) % 1_000_000_000)


def duration_to_seconds(duration: Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def decision_to_proto(decision: Decision) -> pb.Decision:
    message = pb.Decision(
        id=decision.id,
        target=pb.Target(upstream=decision.target.upstream, model=decision.target.model,
                         tenant=decision.target.tenant),
        reason=decision.reason,
        evidence=[pb.Evidence(name=e.name, value=e.value, threshold=e.threshold, unit=e.unit)
                  for e in decision.evidence],
        issued_at=seconds_to_timestamp(decision.issued_at),
        expires_at=seconds_to_timestamp(decision.expires_at),
        issuer=decision.issuer,
    )
    action = decision.action
    if isinstance(action, BreakerAction):
        message.breaker.CopyFrom(pb.BreakerDecision(
            state=int(action.state), admitted_share=action.admitted_share,
            cooldown=seconds_to_duration(action.cooldown_s), probe_share=action.probe_share))
    else:
        message.token_budget.CopyFrom(pb.TokenBudget(
            tokens_per_second=action.tokens_per_second, burst_tokens=action.burst_tokens,
            max_delay=seconds_to_duration(action.max_delay_s), retry_jitter=seconds_to_duration(action.retry_jitter_s)))
    return message


def decision_from_proto(message: pb.Decision) -> Decision:
    """The decision in `message`; InvalidDecision when it lacks what every decision needs."""
    which = message.WhichOneof("action")
    if which == "breaker":
        try:
            state = BreakerState(message.breaker.state)
        except ValueError:
            raise InvalidDecision(f"unknown breaker state {message.breaker.state}") from None
        action: BreakerAction | TokenBudgetAction = BreakerAction(
            state=state, admitted_share=message.breaker.admitted_share,
            cooldown_s=duration_to_seconds(message.breaker.cooldown), probe_share=message.breaker.probe_share)
    elif which == "token_budget":
        budget = message.token_budget
        action = TokenBudgetAction(tokens_per_second=budget.tokens_per_second, burst_tokens=budget.burst_tokens,
                                   max_delay_s=duration_to_seconds(budget.max_delay),
                                   retry_jitter_s=duration_to_seconds(budget.retry_jitter))
    else:
        raise InvalidDecision("a decision needs an action: breaker or token_budget")
    if not message.HasField("expires_at"):
        raise InvalidDecision("a decision needs expires_at")
    if not message.HasField("issued_at"):
        raise InvalidDecision("a decision needs issued_at")
    return Decision(
        id=message.id,
        target=Target(message.target.upstream, message.target.model, message.target.tenant),
        action=action,
        expires_at=timestamp_to_seconds(message.expires_at),
        issued_at=timestamp_to_seconds(message.issued_at),
        reason=message.reason,
        evidence=tuple(Evidence(e.name, e.value, e.threshold, e.unit) for e in message.evidence),
        issuer=message.issuer,
    )


def verdict_to_proto(verdict: Verdict) -> pb.CheckResponse:
    response = pb.CheckResponse(verdict=int(verdict.kind), http_status=verdict.http_status,
                                reservation_id=verdict.reservation_id, decision_id=verdict.decision_id,
                                reason=verdict.reason)
    if verdict.retry_after_s:
        response.retry_after.CopyFrom(seconds_to_duration(verdict.retry_after_s))
    if verdict.delay_s:
        response.delay.CopyFrom(seconds_to_duration(verdict.delay_s))
    return response


def verdict_from_proto(response: pb.CheckResponse) -> Verdict:
    return Verdict(
        kind=VerdictKind(response.verdict),
        http_status=response.http_status,
        retry_after_s=duration_to_seconds(response.retry_after),
        delay_s=duration_to_seconds(response.delay),
        reservation_id=response.reservation_id,
        decision_id=response.decision_id,
        reason=response.reason,
    )


def target_status_to_proto(status: TargetStatus) -> pb.TargetState:
    return pb.TargetState(
        decision=decision_to_proto(status.decision),
        effective_state=int(status.effective_state) if status.effective_state is not None else 0,
        admitted_share=status.admitted_share,
        tokens_available=status.tokens_available,
        changed_at=seconds_to_timestamp(status.changed_at),
    )
