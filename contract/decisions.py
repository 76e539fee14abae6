"""What the controller decides and the gateways enforce, as plain values.

A decision targets an upstream, a model and/or a tenant (an empty field
matches everything), carries one action — a breaker state or a token budget —
and always an expiry, so a controller that dies leaves nothing behind once
its decisions lapse. These classes mirror ``tokenprobe.actuator.v1.Decision``
(``wire`` converts); the engine and the controller work on them.
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from .tables import OPAQUE_CODEC, TIMESTAMP_CODEC, TIMESTAMP_TYPE, Column, Table

MAX_LABEL_LENGTH = 256
MAX_REASON_LENGTH = 1024
MAX_EVIDENCE_ITEMS = 64
MAX_DELAY_LIMIT_S = 60.0


class InvalidDecision(ValueError):
    """A decision that cannot be put in force, with the reason in its message."""


class BreakerState(enum.IntEnum):
    # Values are the proto enum's numbers, so conversion is a plain cast.
    CLOSED = 1
    OPEN = 2
    HALF_OPEN = 3


@dataclass(frozen=True)
class Target:
    upstream: str = ""
    model: str = ""
    tenant: str = ""

    def matches(self, upstream: str, model: str, tenant: str) -> bool:
        return (
            (not self.upstream or self.upstream == upstream)
            and (not self.model or self.model == model)
            and (not self.tenant or self.tenant == tenant)
        )

    def describe(self) -> str:
        parts = [f"{name}={value}" for name, value in
                 (("upstream", self.upstream), ("model", self.model), ("tenant", self.tenant)) if value]
        return ",".join(parts) or "everything"


@dataclass(frozen=True)
class BreakerAction:
    state: BreakerState
    admitted_share: float = 1.0  # HALF_OPEN only
    cooldown_s: float = 0.0  # OPEN only
    probe_share: float = 0.0  # OPEN only: the share admitted once the cool-down ends

    def validate(self, max_lifetime_s: float) -> None:
        if self.state == BreakerState.HALF_OPEN and not 0.0 < self.admitted_share <= 1.0:
            raise InvalidDecision(f"a HALF_OPEN breaker needs admitted_share in (0, 1], got {self.admitted_share}")
        if self.state == BreakerState.OPEN:
            if not 0.0 < self.cooldown_s <= max_lifetime_s:
                raise InvalidDecision(
                    f"an OPEN breaker needs a cooldown in (0, {max_lifetime_s:g}] s, got {self.cooldown_s}")
            if not 0.0 < self.probe_share <= 1.0:
                raise InvalidDecision(f"an OPEN breaker needs probe_share in (0, 1], got {self.probe_share}")


@dataclass(frozen=True)
class TokenBudgetAction:
    tokens_per_second: float
    burst_tokens: float
    max_delay_s: float = 0.0
    # A rejection's Retry-After is spread uniformly over this many more seconds, so clients
    # told to back off do not all come back at once (a retry storm).
    retry_jitter_s: float = 0.0

    def validate(self, max_lifetime_s: float) -> None:
        for name, value in (("tokens_per_second", self.tokens_per_second), ("burst_tokens", self.burst_tokens)):
            if not (math.isfinite(value) and value > 0):
                raise InvalidDecision(f"a token budget needs a positive, finite {name}, got {value}")
        for name, value in (("max_delay", self.max_delay_s), ("retry_jitter", self.retry_jitter_s)):
            if not 0.0 <= value <= MAX_DELAY_LIMIT_S:
                raise InvalidDecision(f"{name} must be within [0, {MAX_DELAY_LIMIT_S:g}] s, got {value}")


Action = BreakerAction | TokenBudgetAction


@dataclass(frozen=True)
class Evidence:
    name: str
    value: float
    threshold: float = 0.0
    unit: str = ""


@dataclass(frozen=True)
class Decision:
    target: Target
    action: Action
    expires_at: float  # wall-clock seconds since the epoch
    issued_at: float
    reason: str = ""
    evidence: tuple[Evidence, ...] = ()
    issuer: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def kind(self) -> str:
        return "breaker" if isinstance(self.action, BreakerAction) else "token_budget"

    @property
    def key(self) -> tuple[str, Target]:
        """Decisions with the same key replace each other."""
        return self.kind, self.target

    def validate(self, now: float, max_lifetime_s: float) -> None:
        """Raise InvalidDecision unless this decision can be put in force at `now`."""
        for name, value in (("id", self.id), ("upstream", self.target.upstream), ("model", self.target.model),
                            ("tenant", self.target.tenant), ("issuer", self.issuer)):
            if len(value) > MAX_LABEL_LENGTH:
                raise InvalidDecision(f"{name} is longer than {MAX_LABEL_LENGTH} characters")
        if not self.id:
            raise InvalidDecision("a decision needs an id")
        if len(self.reason) > MAX_REASON_LENGTH:
            raise InvalidDecision(f"reason is longer than {MAX_REASON_LENGTH} characters")
        if len(self.evidence) > MAX_EVIDENCE_ITEMS:
            raise InvalidDecision(f"more than {MAX_EVIDENCE_ITEMS} evidence items")
        if isinstance(self.action, BreakerAction):
            if not self.target.upstream:
                raise InvalidDecision("a breaker decision needs an upstream")
            if self.target.tenant:
                raise InvalidDecision("a breaker guards an upstream (and model), not a tenant: use a token budget")
        elif not (self.target.upstream or self.target.tenant):
            raise InvalidDecision("a token budget needs a tenant or an upstream")
        self.action.validate(max_lifetime_s)
        if not math.isfinite(self.expires_at) or self.expires_at <= 0:
            raise InvalidDecision("a decision needs an expiry")
        if self.expires_at <= now:
            raise InvalidDecision(f"the decision expired {now - self.expires_at:.3f} s ago")


@dataclass(frozen=True)
class IndicatorReading:
    """One lit (warn or crit) cell of the indicator matrix, as live analysis stored it for the upstream."""

    name: str  # an indicator of analytics/indicators.py
    state: str  # warn | crit
    value: float
    threshold: float  # the one it crossed: crit's when crit, else warn's


@dataclass(frozen=True)
class QueueSample:
    """Requests in flight still waiting for their first token, at two of the agent's in-flight samples."""

    before: int  # at the sample before the newest
    after: int  # at the newest, taken in the window
    span_s: float  # between the two


@dataclass(frozen=True)
class WindowFigures:
    """One upstream over one window, as the analytics measured it."""

    upstream: str
    window_end: float  # wall-clock seconds
    request_rate: float  # requests/s
    p99_ttft_s: float | None
    knee_capacity_rps: float | None
    baseline_p99_s: float | None
    # prompt + completion tokens each tenant used in the window, server-side counts, charged as they
    # leave: a stream still in flight is charged the tokens it streamed in the window
    tenant_tokens: Mapping[str, int] = field(default_factory=dict)
    model: str = ""  # empty: the breaker covers every model on the upstream
    arrived_p99_ttft_s: float | None = None  # of the requests that arrived in the window; judges probes
    # mean prompt + completion tokens of the requests that ended: turns a capacity in requests into tokens
    tokens_per_request: float | None = None
    # the matrix's lit indicators for the upstream, newest cell of each (empty: none lit, or none analysed)
    indicators: Mapping[str, IndicatorReading] = field(default_factory=dict)
    # the queue of requests in flight, when the agent sampled it in the window (None: not sampled)
    queue: QueueSample | None = None


_LABEL = "LowCardinality(String)"
_TIME = TIMESTAMP_TYPE
DECISIONS_TABLE = "decisions"
DECISIONS = Table(
    DECISIONS_TABLE,
    (
        Column("issued_at", _TIME, TIMESTAMP_CODEC),
        Column("recorded_at", _TIME, TIMESTAMP_CODEC),
        Column("decision_id", "String", OPAQUE_CODEC),
        Column("kind", _LABEL, OPAQUE_CODEC),
        Column("upstream", _LABEL, OPAQUE_CODEC),
        Column("model", _LABEL, OPAQUE_CODEC),
        Column("tenant", _LABEL, OPAQUE_CODEC),
        Column("breaker_state", _LABEL, OPAQUE_CODEC),
        Column("admitted_share", "Float64", OPAQUE_CODEC),
        Column("cooldown_s", "Float64", OPAQUE_CODEC),
        Column("tokens_per_second", "Float64", OPAQUE_CODEC),
        Column("burst_tokens", "Float64", OPAQUE_CODEC),
        Column("reason", "String", OPAQUE_CODEC),
        Column("evidence_name", f"Array({_LABEL})", OPAQUE_CODEC),
        Column("evidence_value", "Array(Float64)", OPAQUE_CODEC),
        Column("evidence_threshold", "Array(Float64)", OPAQUE_CODEC),
        Column("evidence_unit", f"Array({_LABEL})", OPAQUE_CODEC),
        Column("expires_at", _TIME, TIMESTAMP_CODEC),
        Column("issuer", _LABEL, OPAQUE_CODEC),
        Column("outcome", _LABEL, OPAQUE_CODEC),
        Column("outcome_detail", "String", OPAQUE_CODEC),
    ),
    order_by="upstream, issued_at", partition_by="issued_at", ttl_column="issued_at",
)
