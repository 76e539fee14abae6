"""The circuit breaker for one upstream, stepped once per analysis window.

A breaker trips on two dimensions together, both relative to what was
measured for the upstream rather than fixed numbers:

- load: the request rate is above ``capacity_factor`` × the knee capacity
  (the rate past which latency stops being flat), and
- damage: the p99 time to first token is above ``latency_factor`` × the
  upstream's baseline p99 (its p99 when below the knee).

Load without damage is throttled (token budgets), never broken; damage
without load is not the gateway's to fix. Both for ``trip_windows``
consecutive windows open the breaker: every request is rejected for the
cool-down, then the breaker probes with a small share of traffic and raises
it step by step (``recovery_shares``) while each probe window stays
undamaged, closing after the last step; a damaged probe window re-opens it.

A stalled upstream (``stalled``: requests in flight have made no progress
for the in-flight stall's critical time) opens the breaker at once, closed or
probing: nothing ends on a jammed server, so its latency never shows the
damage, and every request admitted to it only joins the jam.

A probe window is judged by the requests that *arrived* in it (those that
ended by the time it is read), not by those that ended in it: requests
queued before the breaker opened still drain through the first probe
windows, and their waits say nothing of how the server treats what is
admitted now. While that backlog drains, the probes themselves wait behind
it and have not ended: no evidence, so the share is held.

Legal transitions: CLOSED → OPEN → HALF_OPEN → (OPEN | CLOSED).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..contract.decisions import BreakerState

LEGAL_TRANSITIONS: dict[BreakerState, frozenset[BreakerState]] = {
    BreakerState.CLOSED: frozenset({BreakerState.OPEN}),
    BreakerState.OPEN: frozenset({BreakerState.HALF_OPEN}),
    BreakerState.HALF_OPEN: frozenset({BreakerState.OPEN, BreakerState.CLOSED}),
}


@dataclass(frozen=True)
class BreakerPolicy:
    trip_windows: int = 3
    cooldown_s: float = 15.0
    # Shares admitted while HALF_OPEN, one step per healthy probe window; after
    # the last one the breaker closes (100%).
    recovery_shares: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75)
    capacity_factor: float = 0.8
    latency_factor: float = 2.5

    def __post_init__(self) -> None:
        if self.trip_windows < 1:
            raise ValueError(f"trip_windows must be >= 1, got {self.trip_windows}")
        if not self.cooldown_s > 0:
            raise ValueError(f"cooldown_s must be > 0, got {self.cooldown_s}")
        shares = self.recovery_shares
        if not shares or any(not 0 < s < 1 for s in shares) or list(shares) != sorted(set(shares)):
            raise ValueError(f"recovery_shares must be strictly increasing values in (0, 1), got {shares}")
        if not (self.capacity_factor > 0 and self.latency_factor > 0):
            raise ValueError("capacity_factor and latency_factor must be > 0")


class Pressure(enum.Enum):
    UNKNOWN = "unknown"  # no latency figure, or no knee/baseline measured yet
    NORMAL = "normal"
    OVER_CAPACITY = "over_capacity"  # rate past the threshold, latency fine: throttle
    DAMAGED = "damaged"  # latency past the threshold, rate fine
    OVERLOADED = "overloaded"  # both: counts towards tripping


@dataclass(frozen=True)
class UpstreamWindow:
    """One upstream's figures over one window."""

    request_rate: float  # requests/s
    p99_ttft_s: float | None  # None when no request completed its first token
    knee_capacity_rps: float | None  # None until a knee has been found
    baseline_p99_s: float | None
    # The p99 TTFT of the requests that arrived in the window (and have ended): what probes are judged by.
    arrived_p99_ttft_s: float | None = None
    stalled: bool = False  # requests in flight stopped making progress (the inflight_stall indicator, crit)

    def capacity_threshold(self, policy: BreakerPolicy) -> float | None:
        if self.knee_capacity_rps is None or not self.knee_capacity_rps > 0:
            return None
        return policy.capacity_factor * self.knee_capacity_rps

    def latency_threshold(self, policy: BreakerPolicy) -> float | None:
        if self.baseline_p99_s is None or not self.baseline_p99_s > 0:
            return None
        return policy.latency_factor * self.baseline_p99_s

    def latency_damaged(self, policy: BreakerPolicy) -> bool | None:
        return self._over_latency_threshold(self.p99_ttft_s, policy)

    def probe_damaged(self, policy: BreakerPolicy) -> bool | None:
        return self._over_latency_threshold(self.arrived_p99_ttft_s, policy)

    def _over_latency_threshold(self, p99_s: float | None, policy: BreakerPolicy) -> bool | None:
        threshold = self.latency_threshold(policy)
        if threshold is None or p99_s is None or math.isnan(p99_s):
            return None
        return p99_s > threshold

    def pressure(self, policy: BreakerPolicy) -> Pressure:
        capacity = self.capacity_threshold(policy)
        damaged = self.latency_damaged(policy)
        if capacity is None or damaged is None:
            return Pressure.UNKNOWN
        over = self.request_rate > capacity
        if over and damaged:
            return Pressure.OVERLOADED
        if over:
            return Pressure.OVER_CAPACITY
        return Pressure.DAMAGED if damaged else Pressure.NORMAL


@dataclass(frozen=True)
class BreakerStatus:
    state: BreakerState
    admitted_share: float
    opened_at: float | None  # when the current OPEN episode began


class Breaker:
    def __init__(self, policy: BreakerPolicy = BreakerPolicy()):
        self.policy = policy
        self.state = BreakerState.CLOSED
        self._overloaded_streak = 0
        self._recovery_step = 0
        self._opened_at: float | None = None
        self._last_window_at = -math.inf

    @property
    def admitted_share(self) -> float:
        if self.state == BreakerState.OPEN:
            return 0.0
        if self.state == BreakerState.HALF_OPEN:
            return self.policy.recovery_shares[self._recovery_step]
        return 1.0

    @property
    def status(self) -> BreakerStatus:
        return BreakerStatus(self.state, self.admitted_share, self._opened_at)

    def observe(self, window: UpstreamWindow, now: float) -> BreakerStatus:
        """Step the machine with the window that ended at `now`."""
        if now < self._last_window_at:
            raise ValueError(f"windows must arrive in time order ({now} after {self._last_window_at})")
        self._last_window_at = now
        if self.state == BreakerState.CLOSED:
            self._observe_closed(window, now)
        elif self.state == BreakerState.OPEN:
            # The window ending now saw (almost) no traffic: it proves nothing.
            if now >= self._opened_at + self.policy.cooldown_s:  # type: ignore[operator]
                self._move(BreakerState.HALF_OPEN)
                self._recovery_step = 0
        else:
            self._observe_probe(window, now)
        return self.status

    def _observe_closed(self, window: UpstreamWindow, now: float) -> None:
        if window.stalled:
            self._open(now)
            return
        if window.pressure(self.policy) != Pressure.OVERLOADED:
            self._overloaded_streak = 0
            return
        self._overloaded_streak += 1
        if self._overloaded_streak >= self.policy.trip_windows:
            self._open(now)

    def _observe_probe(self, window: UpstreamWindow, now: float) -> None:
        # While probing, the rate is held down on purpose: only latency (and a stall) counts.
        damaged = True if window.stalled else window.probe_damaged(self.policy)
        if damaged is None:
            return  # no evidence either way: hold the current share
        if damaged:
            self._open(now)
        elif self._recovery_step + 1 < len(self.policy.recovery_shares):
            self._recovery_step += 1
        else:
            self._move(BreakerState.CLOSED)
            self._opened_at = None

    def _open(self, now: float) -> None:
        self._move(BreakerState.OPEN)
        self._opened_at = now
        self._overloaded_streak = 0

    def _move(self, new_state: BreakerState) -> None:
        if new_state not in LEGAL_TRANSITIONS[self.state]:
            raise AssertionError(f"illegal breaker transition {self.state.name} -> {new_state.name}")
        self.state = new_state
