"""The enforcement core: decisions in force, and per-request admission.

One ``Enforcer`` sits behind the gRPC server (shared by every gateway that
calls Check and by Envoy's rate limit adapter) and another inside each gateway
that caches decisions through WatchDecisions. It is a pure state machine over
an injected clock, so the rules below are tested without sockets:

- A decision lapses at its expiry (capped at ``max_lifetime_s`` from when it
  was applied): expired decisions are never enforced, so a dead controller
  leaves the gateways at normal (fail-open).
- Breakers: OPEN rejects every request (503) until ``issued_at + cooldown``,
  then admits ``probe_share`` of them; HALF_OPEN admits ``admitted_share``;
  CLOSED admits all. Shares are admitted by a deterministic credit counter,
  so 10% means exactly every tenth request, not a coin toss.
- Token budgets: a bucket per target. A request whose estimated tokens the
  bucket cannot cover within the budget's ``max_delay`` is rejected early
  (429, retry after the refill time, plus a uniform spread over the budget's
  ``retry_jitter`` so rejected clients do not return in step); one that fits within it is delayed. The
  tokens are reserved at admission — at most a full bucket, whatever the
  estimate — and the reservation settled when the real count arrives (the
  gateway settles every outcome: an error or a cut stream refunds what was
  not generated). A bucket owes at most one full bucket, so no request, or
  count, locks a tenant out for longer than two refills. A request with no
  tenant is the default tenant's, so budgets for it apply: leaving the
  tenant out escapes nothing.
- Retry-After never reaches past the decision's expiry: by then the request
  is admitted anyway.
- Minimum dwell: a decision that loosens a target (admits more) sooner than
  ``min_dwell_s`` after that target last changed is refused; tightening is
  always accepted, so protection is fast and relaxation is paced.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from ..contract.decisions import (
    BreakerAction,
    BreakerState,
    Decision,
    InvalidDecision,
    Target,
    TokenBudgetAction,
)
from .buckets import TokenBucket
from .tenant import DEFAULT_TENANT

log = logging.getLogger(__name__)

# An issued_at this far in the future means the controller's clock is wrong.
MAX_CLOCK_SKEW_S = 60.0
# The gateway caps a request's estimate at its context length per choice, and
# the choices at OpenAI's own limit on n.
DEFAULT_CONTEXT_TOKENS = 131_072
MAX_CHOICES = 128
# The most tokens one request is counted: counts beyond it (the wire carries
# any uint64) are clamped. A bucket is charged at most its burst at admission.
MAX_REQUEST_TOKENS = DEFAULT_CONTEXT_TOKENS * MAX_CHOICES


class VerdictKind(enum.IntEnum):
    # Values are the proto enum's numbers.
    ALLOW = 1
    DELAY = 2
    REJECT = 3


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    http_status: int = 0
    retry_after_s: float = 0.0
    delay_s: float = 0.0
    reservation_id: str = ""
    decision_id: str = ""
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.kind != VerdictKind.REJECT


ALLOW = Verdict(VerdictKind.ALLOW)


def retry_after_header(seconds: float) -> str:
    """An HTTP Retry-After value: whole seconds, rounded up, never 0 (that invites an instant retry)."""
    return str(max(1, math.ceil(seconds)))


class DwellViolation(Exception):
    """A decision would loosen a target too soon after its last change."""


class SubscriptionOverflow(Exception):
    """A watcher fell too far behind; it must resubscribe for a fresh snapshot."""


@dataclass(frozen=True)
class TargetStatus:
    decision: Decision
    effective_state: BreakerState | None  # None for token budgets
    admitted_share: float
    tokens_available: float  # 0 for breakers
    changed_at: float


def breaker_effective(action: BreakerAction, issued_at: float, now: float) -> tuple[BreakerState, float]:
    """The state a breaker decision enforces at `now`, and the share it admits."""
    if action.state == BreakerState.OPEN:
        if now < issued_at + action.cooldown_s:
            return BreakerState.OPEN, 0.0
        return BreakerState.HALF_OPEN, action.probe_share
    if action.state == BreakerState.HALF_OPEN:
        return BreakerState.HALF_OPEN, action.admitted_share
    return BreakerState.CLOSED, 1.0


class _BreakerEntry:
    def __init__(self, decision: Decision, changed_at: float):
        self.decision = decision
        self.changed_at = changed_at
        self.credit = 0.0  # accumulates the admitted share; a request passes per whole unit

    @property
    def action(self) -> BreakerAction:
        return self.decision.action  # type: ignore[return-value]

    @property
    def open_until(self) -> float:
        return self.decision.issued_at + self.action.cooldown_s

    def effective(self, now: float) -> tuple[BreakerState, float]:
        return breaker_effective(self.action, self.decision.issued_at, now)

    def last_change(self, now: float) -> float:
        # The end of a cool-down is a change too (OPEN -> probing).
        if self.action.state == BreakerState.OPEN and now >= self.open_until:
            return max(self.changed_at, self.open_until)
        return self.changed_at


class _BudgetEntry:
    def __init__(self, decision: Decision, changed_at: float, bucket: TokenBucket):
        self.decision = decision
        self.changed_at = changed_at
        self.bucket = bucket

    @property
    def action(self) -> TokenBudgetAction:
        return self.decision.action  # type: ignore[return-value]

    def last_change(self, now: float) -> float:
        return self.changed_at


_Entry = _BreakerEntry | _BudgetEntry


class _Table:
    """Entries by target, indexed by one target field for the per-request lookup."""

    def __init__(self, index_field: str):
        self._index_field = index_field
        self._by_index: dict[str, dict[Target, _Entry]] = {}

    def get(self, target: Target) -> _Entry | None:
        return self._by_index.get(getattr(target, self._index_field), {}).get(target)

    def put(self, target: Target, entry: _Entry) -> None:
        self._by_index.setdefault(getattr(target, self._index_field), {})[target] = entry

    def remove(self, target: Target) -> None:
        bucket = self._by_index.get(getattr(target, self._index_field))
        if bucket is not None:
            bucket.pop(target, None)
            if not bucket:
                del self._by_index[getattr(target, self._index_field)]

    def candidates(self, *index_values: str) -> Iterable[_Entry]:
        for value in index_values:
            yield from self._by_index.get(value, {}).values()

    def entries(self) -> list[_Entry]:
        return [entry for bucket in self._by_index.values() for entry in bucket.values()]


@dataclass
class _Reservation:
    charges: tuple[tuple[_BudgetEntry, float], ...]  # each bucket charged, and how much
    estimated_tokens: int
    created: float


class Subscription:
    """A watcher's view: the decisions in force when it subscribed, then each new one."""

    def __init__(self, snapshot: list[Decision], max_pending: int, on_close: Callable[[Subscription], None]):
        self.snapshot = snapshot
        self._pending: queue.Queue[Decision] = queue.Queue(maxsize=max_pending)
        self._overflowed = False
        self._on_close = on_close

    def next(self, timeout: float) -> Decision | None:
        """The next applied decision, or None if none came within `timeout` seconds."""
        if self._overflowed:
            raise SubscriptionOverflow("the watcher fell behind; resubscribe for a fresh snapshot")
        try:
            return self._pending.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._on_close(self)

    def offer(self, decision: Decision) -> bool:
        """Queue a newly applied decision; False once the watcher has fallen too far behind."""
        try:
            self._pending.put_nowait(decision)
        except queue.Full:
            self._overflowed = True
            return False
        return True


class Enforcer:
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        min_dwell_s: float = 3.0,
        max_lifetime_s: float = 600.0,
        shed_retry_after_s: float = 1.0,
        reservation_ttl_s: float = 600.0,
        max_reservations: int = 100_000,
        rng: random.Random | None = None,  # draws the Retry-After spread; seeded in tests
    ):
        if min_dwell_s < 0 or max_lifetime_s <= 0 or shed_retry_after_s <= 0:
            raise ValueError("min_dwell_s must be >= 0; max_lifetime_s and shed_retry_after_s > 0")
        self._clock = clock
        self._random = rng or random.Random()
        self.min_dwell_s = min_dwell_s
        self.max_lifetime_s = max_lifetime_s
        self._shed_retry_after_s = shed_retry_after_s
        self._reservation_ttl_s = reservation_ttl_s
        self._max_reservations = max_reservations
        self._lock = threading.Lock()
        self._breakers = _Table("upstream")
        self._budgets = _Table("tenant")
        self._reservations: OrderedDict[str, _Reservation] = OrderedDict()
        # A per-process prefix keeps reservation ids unique across restarts
        # without paying for a random id per request.
        self._reservation_prefix = os.urandom(6).hex() + "-"
        self._reservation_counter = itertools.count(1)
        self._subscriptions: list[Subscription] = []

    # -- decisions ---------------------------------------------------------

    def apply(self, decision: Decision) -> Decision:
        """Put `decision` in force; returns it as stored (expiry capped).

        Raises InvalidDecision or DwellViolation.
        """
        with self._lock:
            now = self._clock()
            stored = self._install(decision, now, check_dwell=True)
            self._subscriptions = [s for s in self._subscriptions if s.offer(stored)]
            return stored

    def replace_all(self, decisions: Iterable[Decision]) -> None:
        """Make exactly `decisions` the ones in force (a cache resynchronising).

        The source already enforced the dwell time, so it is not checked again;
        buckets of targets that stay keep their level. A decision this side
        cannot take (expired in transit, a skewed clock) is skipped.
        """
        with self._lock:
            now = self._clock()
            decisions = [d for d in decisions if d.expires_at > now]
            keep = {d.key for d in decisions}
            for entry in self._breakers.entries() + self._budgets.entries():
                if entry.decision.key not in keep:
                    self._table(entry.decision).remove(entry.decision.target)
            for decision in decisions:
                try:
                    self._install(decision, now, check_dwell=False)
                except InvalidDecision as error:
                    log.warning("skipping decision %s while resynchronising: %s", decision.id, error)

    def status(self) -> list[TargetStatus]:
        with self._lock:
            now = self._clock()
            self._purge_expired(now)
            statuses = []
            for entry in self._breakers.entries():
                state, share = entry.effective(now)
                statuses.append(TargetStatus(entry.decision, state, share, 0.0, entry.last_change(now)))
            for entry in self._budgets.entries():
                statuses.append(
                    TargetStatus(entry.decision, None, 1.0, entry.bucket.level(now), entry.last_change(now)))
            return statuses

    def subscribe(self, max_pending: int = 1024) -> Subscription:
        with self._lock:
            now = self._clock()
            self._purge_expired(now)
            snapshot = [entry.decision for entry in self._breakers.entries() + self._budgets.entries()]
            subscription = Subscription(snapshot, max_pending, self._unsubscribe)
            self._subscriptions.append(subscription)
            return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscriptions:
                self._subscriptions.remove(subscription)

    def _table(self, decision: Decision) -> _Table:
        return self._breakers if isinstance(decision.action, BreakerAction) else self._budgets

    def _install(self, decision: Decision, now: float, *, check_dwell: bool) -> Decision:
        decision.validate(now, self.max_lifetime_s)
        if decision.issued_at > now + MAX_CLOCK_SKEW_S:
            raise InvalidDecision(
                f"issued_at is {decision.issued_at - now:.0f} s in the future: check the controller's clock")
        if decision.expires_at > now + self.max_lifetime_s:
            decision = replace(decision, expires_at=now + self.max_lifetime_s)
        table = self._table(decision)
        current = table.get(decision.target)
        if current is not None and current.decision.expires_at <= now:
            table.remove(decision.target)
            current = None
        if current is None:
            table.put(decision.target, self._new_entry(decision, now))
            return decision
        changed = _enforces_differently(current, decision, now)
        if changed and check_dwell and _loosens(current, decision, now):
            since = now - current.last_change(now)
            if since < self.min_dwell_s:
                raise DwellViolation(
                    f"{decision.kind} for {decision.target.describe()} changed {since:.1f} s ago; "
                    f"loosening is allowed after {self.min_dwell_s:g} s")
        if isinstance(current, _BudgetEntry):
            action = decision.action
            current.bucket.reconfigure(action.tokens_per_second, action.burst_tokens, now)  # type: ignore[union-attr]
        current.decision = decision
        if changed:
            current.changed_at = now
        return decision

    @staticmethod
    def _new_entry(decision: Decision, now: float) -> _Entry:
        action = decision.action
        if isinstance(action, BreakerAction):
            return _BreakerEntry(decision, now)
        return _BudgetEntry(decision, now, TokenBucket(action.tokens_per_second, action.burst_tokens, now))

    def _purge_expired(self, now: float) -> None:
        for table in (self._breakers, self._budgets):
            for entry in table.entries():
                if entry.decision.expires_at <= now:
                    table.remove(entry.decision.target)

    # -- admission -----------------------------------------------------------

    def check(self, upstream: str, model: str, tenant: str, estimated_tokens: int) -> Verdict:
        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        tenant = tenant or DEFAULT_TENANT
        estimated_tokens = min(estimated_tokens, MAX_REQUEST_TOKENS)
        with self._lock:
            now = self._clock()
            rejection = self._check_breakers(upstream, model, tenant, now)
            if rejection is not None:
                return rejection
            return self._check_budgets(upstream, model, tenant, estimated_tokens, now)

    def _check_breakers(self, upstream: str, model: str, tenant: str, now: float) -> Verdict | None:
        for entry in self._breakers.candidates(upstream):
            if entry.decision.expires_at <= now or not entry.decision.target.matches(upstream, model, tenant):
                continue
            state, share = entry.effective(now)
            if share <= 0.0:
                return Verdict(VerdictKind.REJECT, 503, _until_expiry(entry, entry.open_until - now, now), 0.0,
                               "", entry.decision.id,
                               f"breaker open for {entry.decision.target.describe()}")
            if share < 1.0:
                entry.credit += share
                if entry.credit < 1.0 - 1e-9:  # tolerance: ten additions of 0.1 make 0.999...
                    return Verdict(VerdictKind.REJECT, 503, self._shed_retry_after_s, 0.0, "", entry.decision.id,
                                   f"breaker half-open, admitting {share:.0%} of requests")
                entry.credit -= 1.0
        return None

    def _check_budgets(self, upstream: str, model: str, tenant: str, tokens: int, now: float) -> Verdict:
        # Budgets are indexed by tenant; those with no tenant cover every tenant.
        index_values = (tenant, "")
        matched = tuple(
            entry for entry in self._budgets.candidates(*index_values)
            if entry.decision.expires_at > now and entry.decision.target.matches(upstream, model, tenant)
        )
        if not matched:
            return ALLOW
        longest_wait, limiting = 0.0, matched[0]
        for entry in matched:
            wait = entry.bucket.wait_for(tokens, now)
            if wait > entry.action.max_delay_s:
                retry_after = wait + self._random.uniform(0.0, entry.action.retry_jitter_s)
                return Verdict(VerdictKind.REJECT, 429, _until_expiry(entry, retry_after, now), 0.0, "",
                               entry.decision.id,
                               f"token budget of {entry.decision.target.describe()} exhausted")
            if wait > longest_wait:
                longest_wait, limiting = wait, entry
        charges = tuple((entry, entry.bucket.take(tokens, now)) for entry in matched)
        reservation_id = self._reserve(charges, tokens, now)
        if longest_wait > 0.0:
            return Verdict(VerdictKind.DELAY, 0, 0.0, longest_wait, reservation_id, limiting.decision.id,
                           f"token budget of {limiting.decision.target.describe()} paced")
        return Verdict(VerdictKind.ALLOW, reservation_id=reservation_id)

    def _reserve(self, charges: tuple[tuple[_BudgetEntry, float], ...], tokens: int, now: float) -> str:
        reservations = self._reservations
        while reservations:
            oldest = next(iter(reservations.values()))
            if len(reservations) < self._max_reservations and now - oldest.created < self._reservation_ttl_s:
                break
            reservations.popitem(last=False)  # unsettled: the estimate stands
        reservation_id = f"{self._reservation_prefix}{next(self._reservation_counter):x}"
        reservations[reservation_id] = _Reservation(charges, tokens, now)
        return reservation_id

    def settle(self, reservation_id: str, observed_tokens: int) -> int | None:
        """Charge or refund, to each bucket, the difference between the real tokens and its charge.

        Returns the adjustment (observed − estimated), or None when the
        reservation is unknown: already settled, or too old.
        """
        if observed_tokens < 0:
            raise ValueError(f"observed_tokens must be >= 0, got {observed_tokens}")
        with self._lock:
            reservation = self._reservations.pop(reservation_id, None)
            if reservation is None:
                return None
            now = self._clock()
            observed_tokens = min(observed_tokens, MAX_REQUEST_TOKENS)
            for entry, charge in reservation.charges:
                # A bucket replaced or expired since the admission is not charged.
                if self._budgets.get(entry.decision.target) is entry and entry.decision.expires_at > now:
                    entry.bucket.adjust(observed_tokens - charge, now)
            return observed_tokens - reservation.estimated_tokens


def _until_expiry(entry: _Entry, retry_after_s: float, now: float) -> float:
    return min(retry_after_s, entry.decision.expires_at - now)


def _enforces_differently(current: _Entry, decision: Decision, now: float) -> bool:
    if isinstance(current, _BreakerEntry):
        return current.effective(now) != breaker_effective(decision.action, decision.issued_at, now)  # type: ignore[arg-type]
    return current.action != decision.action


def _loosens(current: _Entry, decision: Decision, now: float) -> bool:
    if isinstance(current, _BreakerEntry):
        _, new_share = breaker_effective(decision.action, decision.issued_at, now)  # type: ignore[arg-type]
        return new_share > current.effective(now)[1]
    action: TokenBudgetAction = decision.action  # type: ignore[assignment]
    return (action.tokens_per_second > current.action.tokens_per_second
            or action.burst_tokens > current.action.burst_tokens)
