import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BreakerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BREAKER_STATE_UNSPECIFIED: _ClassVar[BreakerState]
    BREAKER_STATE_CLOSED: _ClassVar[BreakerState]
    BREAKER_STATE_OPEN: _ClassVar[BreakerState]
    BREAKER_STATE_HALF_OPEN: _ClassVar[BreakerState]

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_ALLOW: _ClassVar[Verdict]
    VERDICT_DELAY: _ClassVar[Verdict]
    VERDICT_REJECT: _ClassVar[Verdict]
BREAKER_STATE_UNSPECIFIED: BreakerState
BREAKER_STATE_CLOSED: BreakerState
BREAKER_STATE_OPEN: BreakerState
BREAKER_STATE_HALF_OPEN: BreakerState
VERDICT_UNSPECIFIED: Verdict
VERDICT_ALLOW: Verdict
VERDICT_DELAY: Verdict
VERDICT_REJECT: Verdict

class Target(_message.Message):
    __slots__ = ("upstream", "model", "tenant")
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    upstream: str
    model: str
    tenant: str
    def __init__(self, upstream: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class BreakerDecision(_message.Message):
    __slots__ = ("state", "admitted_share", "cooldown", "probe_share")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    COOLDOWN_FIELD_NUMBER: _ClassVar[int]
    PROBE_SHARE_FIELD_NUMBER: _ClassVar[int]
    state: BreakerState
    admitted_share: float
    cooldown: _duration_pb2.Duration
    probe_share: float
    def __init__(self, state: _Optional[_Union[BreakerState, str]] = ..., admitted_share: _Optional[float] = ..., cooldown: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., probe_share: _Optional[float] = ...) -> None: ...

class TokenBudget(_message.Message):
    __slots__ = ("tokens_per_second", "burst_tokens", "max_delay", "retry_jitter")
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BURST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_FIELD_NUMBER: _ClassVar[int]
    RETRY_JITTER_FIELD_NUMBER: _ClassVar[int]
    tokens_per_second: float
    burst_tokens: float
    max_delay: _duration_pb2.Duration
    retry_jitter: _duration_pb2.Duration
    def __init__(self, tokens_per_second: _Optional[float] = ..., burst_tokens: _Optional[float] = ..., max_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., retry_jitter: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Evidence(_message.Message):
    __slots__ = ("name", "value", "threshold", "unit")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    threshold: float
    unit: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., threshold: _Optional[float] = ..., unit: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("id", "target", "breaker", "token_budget", "reason", "evidence", "issued_at", "expires_at", "issuer")
    ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ISSUER_FIELD_NUMBER: _ClassVar[int]
    id: str
    target: Target
    breaker: BreakerDecision
    token_budget: TokenBudget
    reason: str
    evidence: _containers.RepeatedCompositeFieldContainer[Evidence]
    issued_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    issuer: str
    def __init__(self, id: _Optional[str] = ..., target: _Optional[_Union[Target, _Mapping]] = ..., breaker: _Optional[_Union[BreakerDecision, _Mapping]] = ..., token_budget: _Optional[_Union[TokenBudget, _Mapping]] = ..., reason: _Optional[str] = ..., evidence: _Optional[_Iterable[_Union[Evidence, _Mapping]]] = ..., issued_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., issuer: _Optional[str] = ...) -> None: ...

class ApplyDecisionRequest(_message.Message):
    __slots__ = ("decision",)
    DECISION_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class ApplyDecisionResponse(_message.Message):
    __slots__ = ("decision",)
    DECISION_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetState(_message.Message):
    __slots__ = ("decision", "effective_state", "admitted_share", "tokens_available", "changed_at")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_STATE_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_AT_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    effective_state: BreakerState
    admitted_share: float
    tokens_available: float
    changed_at: _timestamp_pb2.Timestamp
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ..., effective_state: _Optional[_Union[BreakerState, str]] = ..., admitted_share: _Optional[float] = ..., tokens_available: _Optional[float] = ..., changed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("targets", "server_time")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[TargetState]
    server_time: _timestamp_pb2.Timestamp
    def __init__(self, targets: _Optional[_Iterable[_Union[TargetState, _Mapping]]] = ..., server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchDecisionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchDecisionsResponse(_message.Message):
    __slots__ = ("decision", "end_of_snapshot")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    END_OF_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    end_of_snapshot: bool
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ..., end_of_snapshot: _Optional[bool] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("upstream", "model", "tenant", "estimated_tokens")
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    upstream: str
    model: str
    tenant: str
    estimated_tokens: int
    def __init__(self, upstream: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., estimated_tokens: _Optional[int] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("verdict", "http_status", "retry_after", "delay", "reservation_id", "decision_id", "reason")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    http_status: int
    retry_after: _duration_pb2.Duration
    delay: _duration_pb2.Duration
    reservation_id: str
    decision_id: str
    reason: str
    def __init__(self, verdict: _Optional[_Union[Verdict, str]] = ..., http_status: _Optional[int] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reservation_id: _Optional[str] = ..., decision_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SettleRequest(_message.Message):
    __slots__ = ("reservation_id", "observed_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    observed_tokens: int
    def __init__(self, reservation_id: _Optional[str] = ..., observed_tokens: _Optional[int] = ...) -> None: ...

class SettleResponse(_message.Message):
    __slots__ = ("settled", "adjustment_tokens")
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    ADJUSTMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    settled: bool
    adjustment_tokens: int
    def __init__(self, settled: _Optional[bool] = ..., adjustment_tokens: _Optional[int] = ...) -> None: ...
