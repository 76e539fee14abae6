"""Pushing the controller's decisions to the actuator, and recording each in ``tokenprobe.decisions``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc

from ..contract.decisions import DECISIONS_TABLE, BreakerAction, Decision
from . import wire
from .auth import ClientAuth
from .v1 import actuator_pb2 as pb
from .v1 import actuator_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class PushOutcome:
    decision: Decision
    outcome: str  # applied / refused / unreachable
    detail: str = ""


class DecisionPublisher:
    """Pushes decisions to the actuator with ApplyDecision."""

    def __init__(self, target: str, auth: ClientAuth, deadline_s: float = 2.0):
        self._channel = auth.channel(target)
        self._stub = pb_grpc.ActuatorStub(self._channel)
        self._metadata = auth.metadata()
        self._deadline_s = deadline_s

    def publish(self, decisions: Sequence[Decision]) -> list[PushOutcome]:
        outcomes = []
        for decision in decisions:
            request = pb.ApplyDecisionRequest(decision=wire.decision_to_proto(decision))
            try:
                response = self._stub.ApplyDecision(request, timeout=self._deadline_s, metadata=self._metadata)
            except grpc.RpcError as error:
                code = error.code()
                unreachable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                outcomes.append(PushOutcome(decision, "unreachable" if unreachable else "refused",
                                            f"{code.name}: {error.details()}"))
                continue
            stored = wire.decision_from_proto(response.decision)
            outcomes.append(PushOutcome(replace(decision, expires_at=stored.expires_at), "applied"))
        return outcomes

    def close(self) -> None:
        self._channel.close()


def decision_row(outcome: PushOutcome, recorded_at: float) -> dict:
    """The tokenprobe.decisions row for one pushed decision (timestamps in ns)."""
    decision = outcome.decision
    action = decision.action
    is_breaker = isinstance(action, BreakerAction)
    return {
        "issued_at": _ns(decision.issued_at),
        "recorded_at": _ns(recorded_at),
        "decision_id": decision.id,
        "kind": decision.kind,
        "upstream": decision.target.upstream,
        "model": decision.target.model,
        "tenant": decision.target.tenant,
        "breaker_state": action.state.name if is_breaker else "",
        "admitted_share": action.admitted_share if is_breaker else 1.0,
        "cooldown_s": action.cooldown_s if is_breaker else 0.0,
        "tokens_per_second": 0.0 if is_breaker else action.tokens_per_second,
        "burst_tokens": 0.0 if is_breaker else action.burst_tokens,
        "reason": decision.reason,
        "evidence_name": [e.name for e in decision.evidence],
        "evidence_value": [e.value for e in decision.evidence],
        "evidence_threshold": [e.threshold for e in decision.evidence],
        "evidence_unit": [e.unit for e in decision.evidence],
        "expires_at": _ns(decision.expires_at),
        "issuer": decision.issuer,
        "outcome": outcome.outcome,
        "outcome_detail": outcome.detail,
    }


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


class DecisionRecorder:
    """Writes pushed decisions to tokenprobe.decisions through the store."""

    def __init__(self, store):
        self._store = store

    def record(self, outcomes: Sequence[PushOutcome], recorded_at: float) -> None:
        if outcomes:
            self._store.insert_rows(DECISIONS_TABLE, [decision_row(o, recorded_at) for o in outcomes])
