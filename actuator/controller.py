"""From per-window figures to actuator decisions, and their record in ClickHouse.

``Controller`` is pure: the analytics side hands it one ``WindowFigures`` per
upstream per window (rate, p99 TTFT, the knee, the baseline, the tokens each
tenant really used as the agent saw them) and gets back the decisions to push
— at most one per target per window, each with its reason and evidence:

- Overloaded (rate past capacity × 0.8 AND p99 past baseline × 2.5) for 3
  windows: the upstream's breaker opens, then recovers step by step (see
  ``breaker``). A CLOSED decision is pushed once when it recovers.
- Over capacity with healthy latency: throttle, not break. The upstream's
  token capacity is shared max-min fairly: every tenant using more than the
  fair level L gets a token budget of L tokens/s, so light tenants are not
  touched and heavy ones share what is left equally.
- Over capacity AND latency damaged, with budgets already in force: those
  budgets are cut by ``budget_decrease_factor`` each window (never below
  ``min_budget_share`` of the fair level) until latency recovers; over
  capacity with latency fine, they stay where they are. Holding a server at
  0.8 × capacity is not always enough: the demand of tenants not yet
  budgeted is measured by what the server finished for them, which a queue
  understates, and with few slots bursty arrivals queue even there. So the
  level is found by feedback: cut while damaged, held while healthy at
  capacity, raised (below) once under capacity.
- Back under capacity: budgets are raised by ``budget_recovery_factor`` each
  window (no slamming) and left to lapse once they have not bound for
  ``release_after_windows`` windows in a row; a window in which one did not
  bind holds it. One window is not enough: the window after a raise, or
  after the breaker closes, still shows the tokens admitted before it (what
  ends or streams in it), so a tenant the budget still turns away can look
  as if it no longer needed it, and would be let in whole until the next
  overload. While the breaker is open or probing, budgets are held as they
  are.
- No figures (no knee or baseline yet, no traffic): nothing new is pushed and
  whatever is in force lapses at its expiry.

With ``signals="matrix"`` (the default) the controller also acts on the
indicator matrix that live analysis stores and on the in-flight queue the
agent samples (both read by the loop into ``WindowFigures``), which move
before TTFT does: a request's TTFT is known only once it ends, while the
engine's KV cache, GPU memory and the queue of requests waiting for a first
token are seen as they fill. ``signals="ttft"`` is the policy above alone.

- Demand signals: ``kv_cache_usage`` or ``gpu_memory_pressure`` crit (the
  engine is about to evict and recompute, or to stop admitting), a growing
  queue (between the agent's last two in-flight samples, more requests
  waiting for their first token: over ``queue_growth_min`` more and over
  ``queue_growth_share`` of the requests that ended meanwhile),
  ``retry_storm`` crit (retries are load). Any of them lit: the upstream's
  token demand is cut to ``budget_decrease_factor`` of what it used in the
  window (or to the knee's capacity, if lower), shared max-min fairly, and
  budgets already in force are cut by the same factor each window while a
  signal stays lit.
- Hold signals: those indicators at warn, ``queue_wait_p95`` at warn or
  crit, ``inflight_stall`` at warn: budgets in force are held, never
  loosened. (A long queue wait that is not growing is a steady state, its
  thresholds are absolute milliseconds: a small server's normal queueing
  passes them. It holds; the queue's growth is what cuts. And it holds only
  on a server over capacity or with damaged latency: under capacity and
  healthy, a small server's usual queue would hold budgets cut in an
  overload for good, as ``bench_control_loop``'s ramp showed.)
- ``retry_storm`` warn or crit: every budget rejects rather than delays
  (a held request times out at its client and comes back as a retry), and
  its Retry-After is spread over ``retry_jitter_s`` so the rejected clients
  back off apart instead of returning in step. On a server under capacity
  with healthy latency (``Pressure.NORMAL``) a retry storm neither cuts nor
  holds: the server absorbs the retries, and the indicator looks back a
  minute; holding budgets there would keep rejecting clients that retry on
  a 429 at once, and their retries, admitted, would keep the storm lit long
  after the overload that caused it.
- ``inflight_stall`` crit (requests in flight silent for its crit time):
  the breaker opens at once, closed or probing (see ``breaker``): a jammed
  server ends nothing, so no TTFT ever shows it, and every request admitted
  only joins the jam; after the cool-down it is probed with a small share
  (half-open, the rest shed) as after an overload. At warn, budgets held.

Every decision carries the lit signals it was taken on as evidence (value
and the threshold it crossed) beside the rate and TTFT figures.

Pure: no I/O here. ``publisher`` pushes the decisions over gRPC and records
them in ``tokenprobe.decisions``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..contract.decisions import (
    BreakerAction,
    BreakerState,
    Decision,
    Evidence,
    IndicatorReading,
    Target,
    TokenBudgetAction,
    WindowFigures,
)
from ..contract.indicators import CRIT, INDICATORS_BY_NAME, WARN
from ..contract.indicators import INFLIGHT_STALL as STALL
from .breaker import Breaker, BreakerPolicy, BreakerStatus, Pressure, UpstreamWindow

TTFT_SIGNALS, MATRIX_SIGNALS = "ttft", "matrix"
RETRY_STORM = "retry_storm"
# Indicators that say demand is more than the server will take, before its TTFT shows it: crit cuts.
DEMAND_INDICATORS = ("kv_cache_usage", "gpu_memory_pressure", RETRY_STORM)
QUEUE_WAIT = "queue_wait_p95"  # warn or crit holds budgets (see the module docstring)
QUEUE_GROWTH = "inflight_queue_growth"


@dataclass(frozen=True)
class ControllerPolicy:
    window_s: float = 5.0
    # Decisions live this many windows unless renewed: a controller that
    # stops leaves the gateways at normal within that time.
    decision_ttl_windows: int = 3
    breaker: BreakerPolicy = BreakerPolicy()
    burst_seconds: float = 2.0  # a budget's bucket holds this many seconds of its rate
    max_delay_s: float = 0.5
    budget_recovery_factor: float = 1.5
    release_after_windows: int = 2  # under capacity, a budget that bound in none of this many windows lapses
    budget_decrease_factor: float = 0.7
    min_budget_share: float = 0.1  # of the fair level: a budget is never cut below this
    issuer: str = "tokenprobe-controller"
    signals: str = MATRIX_SIGNALS  # "ttft": rate and TTFT only; "matrix": also the indicator matrix
    retry_jitter_s: float = 10.0  # during a retry storm, Retry-After is spread over this many seconds
    # The in-flight queue grows: more than this many more requests waiting at the newest sample...
    queue_growth_min: int = 3
    queue_growth_share: float = 0.25  # ... and more than this share of the requests that ended meanwhile

    def __post_init__(self) -> None:
        if self.signals not in (TTFT_SIGNALS, MATRIX_SIGNALS):
            raise ValueError(f"signals must be {TTFT_SIGNALS!r} or {MATRIX_SIGNALS!r}, got {self.signals!r}")
        if self.retry_jitter_s < 0 or self.queue_growth_min < 0 or self.queue_growth_share < 0:
            raise ValueError("retry_jitter_s, queue_growth_min and queue_growth_share must be >= 0")
        if not self.window_s > 0 or self.decision_ttl_windows < 2:
            raise ValueError("window_s must be > 0 and decision_ttl_windows >= 2 (renewal needs a window of slack)")
        if not self.burst_seconds > 0 or self.max_delay_s < 0 or not self.budget_recovery_factor > 1:
            raise ValueError("burst_seconds must be > 0, max_delay_s >= 0, budget_recovery_factor > 1")
        if self.release_after_windows < 1:
            raise ValueError("release_after_windows must be >= 1")
        if not 0 < self.budget_decrease_factor < 1 or not 0 < self.min_budget_share <= 1:
            raise ValueError("budget_decrease_factor must be in (0, 1) and min_budget_share in (0, 1]")

    @property
    def ttl_s(self) -> float:
        return self.window_s * self.decision_ttl_windows


def _health(window: WindowFigures, stalled: bool = False) -> UpstreamWindow:
    """The breaker's view of one window's figures."""
    return UpstreamWindow(window.request_rate, window.p99_ttft_s, window.knee_capacity_rps, window.baseline_p99_s,
                          window.arrived_p99_ttft_s, stalled)


@dataclass(frozen=True)
class MatrixSignals:
    """What the matrix policy read in one window's figures, each as the evidence it is recorded with."""

    demand: tuple[Evidence, ...] = ()  # lit: cut the demand now
    hold: tuple[Evidence, ...] = ()  # at warn: loosen nothing
    retry_storm: Evidence | None = None  # warn or crit (and so in demand or hold): reject, jitter Retry-After
    stall: Evidence | None = None  # crit: open the breaker

    @property
    def evidence(self) -> tuple[Evidence, ...]:
        stall = () if self.stall is None else (self.stall,)
        return (*self.demand, *self.hold, *stall)


def _reading_evidence(reading: IndicatorReading) -> Evidence:
    return Evidence(reading.name, reading.value, reading.threshold, INDICATORS_BY_NAME[reading.name].unit)


def matrix_signals(window: WindowFigures, policy: ControllerPolicy) -> MatrixSignals:
    """The matrix policy's reading of ``window`` (nothing under the TTFT-only policy)."""
    if policy.signals == TTFT_SIGNALS:
        return MatrixSignals()
    readings = window.indicators
    # Under capacity with healthy latency, retries and queueing are absorbed (see the module docstring).
    absorbed = _health(window).pressure(policy.breaker) == Pressure.NORMAL
    budgeting = [name for name in DEMAND_INDICATORS if not (name == RETRY_STORM and absorbed)]
    demand = [_reading_evidence(readings[name]) for name in budgeting
              if name in readings and readings[name].state == CRIT]
    hold = [_reading_evidence(readings[name]) for name in (*budgeting, STALL)
            if name in readings and readings[name].state == WARN]
    if QUEUE_WAIT in readings and not absorbed:
        hold.append(_reading_evidence(readings[QUEUE_WAIT]))
    if window.queue is not None:
        growth = window.queue.after - window.queue.before
        threshold = max(policy.queue_growth_min, policy.queue_growth_share * window.request_rate * window.queue.span_s)
        if growth > threshold:
            demand.append(Evidence(QUEUE_GROWTH, growth, threshold, "requests"))
    storm = readings.get(RETRY_STORM)
    stall = readings.get(STALL)
    return MatrixSignals(
        tuple(demand), tuple(hold),
        retry_storm=_reading_evidence(storm) if storm is not None else None,
        stall=_reading_evidence(stall) if stall is not None and stall.state == CRIT else None)


def fair_share_level(demands: Sequence[float], capacity: float) -> float:
    """The per-tenant cap L with sum(min(d, L)) == capacity (max-min fairness); inf when all fit."""
    if sum(demands) <= capacity:
        return math.inf
    remaining = capacity
    ordered = sorted(demands)
    for served, demand in enumerate(ordered):
        level = remaining / (len(ordered) - served)
        if demand >= level:
            return level
        remaining -= demand
    raise AssertionError("unreachable: total demand exceeds capacity")


class _UpstreamState:
    def __init__(self, breaker_policy: BreakerPolicy):
        self.breaker = Breaker(breaker_policy)
        self.last_window_end = -math.inf
        self.breaker_decision: Decision | None = None
        self.budgets: dict[str, Decision] = {}  # tenant -> budget in force
        self.unbound_windows: dict[str, int] = {}  # tenant -> windows in a row under capacity its budget did not bind


class Controller:
    def __init__(self, policy: ControllerPolicy = ControllerPolicy()):
        self.policy = policy
        self._upstreams: dict[str, _UpstreamState] = {}

    def decide(self, window: WindowFigures) -> list[Decision]:
        """The decisions to push for this window: at most one per target."""
        state = self._upstreams.setdefault(window.upstream, _UpstreamState(self.policy.breaker))
        if window.window_end <= state.last_window_end:
            raise ValueError(f"window ending {window.window_end} for {window.upstream!r} was already decided")
        state.last_window_end = window.window_end
        self._forget_lapsed(state, window.window_end)
        decisions = []
        # The window's traffic was shaped by the breaker in force during it, not by the state it moves to now.
        breaker_was_closed = state.breaker.state == BreakerState.CLOSED
        signals = matrix_signals(window, self.policy)
        breaker_decision = self._decide_breaker(state, window, signals)
        if breaker_decision is not None:
            decisions.append(breaker_decision)
        decisions.extend(self._decide_budgets(state, window, breaker_was_closed, signals))
        return decisions

    def _forget_lapsed(self, state: _UpstreamState, now: float) -> None:
        """Decisions that expired (windows without traffic renew nothing) no longer bind the
        gateways: the controller forgets them too, or it would resume a stale episode later."""
        if state.breaker_decision is not None and state.breaker_decision.expires_at <= now:
            state.breaker = Breaker(self.policy.breaker)
            state.breaker_decision = None
        for tenant in [t for t, d in state.budgets.items() if d.expires_at <= now]:
            del state.budgets[tenant]

    # -- breaker -----------------------------------------------------------

    def _decide_breaker(self, state: _UpstreamState, window: WindowFigures,
                        signals: MatrixSignals) -> Decision | None:
        before = state.breaker.status
        status = state.breaker.observe(_health(window, stalled=signals.stall is not None), window.window_end)
        previous = state.breaker_decision
        if status.state == BreakerState.CLOSED:
            if previous is None or previous.action.state == BreakerState.CLOSED:
                return None  # normal and already known to be: nothing to say
            action = BreakerAction(BreakerState.CLOSED)
            # Pushed once: the closed state needs no renewal, lapsing is the same as closed.
        elif status.state == BreakerState.OPEN:
            action = BreakerAction(BreakerState.OPEN, cooldown_s=self.policy.breaker.cooldown_s,
                                   probe_share=self.policy.breaker.recovery_shares[0])
        else:
            action = BreakerAction(BreakerState.HALF_OPEN, admitted_share=status.admitted_share)
        if previous is not None and previous.action == action and not self._due_for_renewal(previous, window):
            return None
        # An OPEN decision's cool-down runs from its issued_at: renewals keep it.
        issued_at = status.opened_at if status.state == BreakerState.OPEN else window.window_end
        expires_at = window.window_end + self.policy.ttl_s
        if status.state == BreakerState.OPEN:
            expires_at = max(expires_at, issued_at + self.policy.breaker.cooldown_s + self.policy.ttl_s)
        decision = Decision(
            target=Target(upstream=window.upstream, model=window.model),
            action=action,
            issued_at=issued_at,
            expires_at=expires_at,
            reason=_breaker_reason(before, status, window, self.policy.breaker, signals),
            evidence=(*_health_evidence(window, self.policy.breaker), *signals.evidence),
            issuer=self.policy.issuer,
            id=uuid.uuid4().hex,
        )
        state.breaker_decision = decision
        return decision

    def _due_for_renewal(self, decision: Decision, window: WindowFigures) -> bool:
        # Renew while at least one window of life is left, so the next window's
        # push (if any) never comes after the lapse.
        return decision.expires_at - window.window_end < 2 * self.policy.window_s

    # -- token budgets -------------------------------------------------------

    def _decide_budgets(self, state: _UpstreamState, window: WindowFigures, breaker_was_closed: bool,
                        signals: MatrixSignals) -> list[Decision]:
        pressure = _health(window).pressure(self.policy.breaker)
        # Only windows in a row that relax count towards a release: any other verdict starts the count again.
        unbound_windows, state.unbound_windows = state.unbound_windows, {}
        if not (breaker_was_closed and state.breaker.state == BreakerState.CLOSED) and state.budgets:
            # What the breaker turns away is not missing demand: relaxing on it would slam the
            # tenants back in the moment the breaker closes.
            wanted = {tenant: d.action for tenant, d in state.budgets.items()}
            reason = "the breaker was open or probing in this window: budgets held"
        elif signals.demand:
            wanted = self._step_towards_fair(state, window, self.policy.budget_decrease_factor,
                                             self._demand_cut_capacity(window))
            reason = (f"{_named(signals.demand)} lit before TTFT degraded: demand cut to "
                      f"{self.policy.budget_decrease_factor:g} x what was used, budgets tightened")
        elif pressure == Pressure.OVERLOADED and state.budgets:
            wanted = self._step_towards_fair(state, window, self.policy.budget_decrease_factor,
                                             self._knee_capacity_tokens(window))
            reason = "overloaded with budgets in force: budgets cut until latency recovers"
        elif pressure in (Pressure.OVER_CAPACITY, Pressure.OVERLOADED):
            # At capacity with latency fine is where the server should run: budgets in force stay put.
            wanted = self._step_towards_fair(state, window, 1.0, self._knee_capacity_tokens(window))
            reason = "over capacity: tenants above the fair share are held to it"
        elif signals.hold and state.budgets:
            wanted = {tenant: d.action for tenant, d in state.budgets.items()}
            reason = f"{_named(signals.hold)} lit: budgets held, not loosened"
        elif pressure == Pressure.NORMAL:
            wanted = self._relax(state, window, unbound_windows)
            reason = "under capacity again: budget raised step by step where it bound, held a window where it did not"
        elif pressure == Pressure.DAMAGED:
            wanted = {tenant: d.action for tenant, d in state.budgets.items()}  # hold, do not loosen
            reason = "latency damaged under capacity: budget held"
        else:
            return []  # no evidence: let what is in force lapse
        wanted = {tenant: self._backoff(action, signals) for tenant, action in wanted.items()}
        if signals.retry_storm is not None and wanted:
            reason += (f"; retry storm: rejected rather than delayed, Retry-After spread over "
                       f"{self.policy.retry_jitter_s:g} s")
        decisions = []
        for tenant, action in sorted(wanted.items()):
            previous = state.budgets.get(tenant)
            if previous is not None and previous.action == action and not self._due_for_renewal(previous, window):
                continue
            decision = Decision(
                target=Target(upstream=window.upstream, tenant=tenant),
                action=action,
                issued_at=window.window_end,
                expires_at=window.window_end + self.policy.ttl_s,
                reason=reason,
                evidence=(*_health_evidence(window, self.policy.breaker), *signals.evidence,
                          Evidence("tenant_tokens_per_s", window.tenant_tokens.get(tenant, 0) / self.policy.window_s,
                                   action.tokens_per_second, "tokens/s")),
                issuer=self.policy.issuer,
                id=uuid.uuid4().hex,
            )
            state.budgets[tenant] = decision
            decisions.append(decision)
        for tenant in set(state.budgets) - set(wanted):
            del state.budgets[tenant]  # released: it lapses at its expiry
        return decisions

    def _backoff(self, action: TokenBudgetAction, signals: MatrixSignals) -> TokenBudgetAction:
        """A budget as the retry storm (or its absence) wants it: during one, reject at once and spread
        the Retry-After; otherwise delay up to max_delay_s, unspread."""
        if signals.retry_storm is not None:
            return replace(action, max_delay_s=0.0, retry_jitter_s=self.policy.retry_jitter_s)
        return replace(action, max_delay_s=self.policy.max_delay_s, retry_jitter_s=0.0)

    def _knee_capacity_tokens(self, window: WindowFigures) -> float | None:
        """The tokens/s the upstream takes at capacity × capacity_factor, or None when unknown."""
        capacity_rps = _health(window).capacity_threshold(self.policy.breaker)
        per_request = window.tokens_per_request
        if per_request is None:
            requests = window.request_rate * self.policy.window_s
            per_request = sum(window.tenant_tokens.values()) / requests if requests > 0 else None
        return capacity_rps * per_request if capacity_rps is not None and per_request else None

    def _demand_cut_capacity(self, window: WindowFigures) -> float | None:
        """What a demand signal leaves the upstream: the decrease factor × the tokens/s used in the
        window, never more than the knee's capacity."""
        used = sum(tokens for tenant, tokens in window.tenant_tokens.items() if tenant) / self.policy.window_s
        if used <= 0:
            return None
        knee = self._knee_capacity_tokens(window)
        cut = self.policy.budget_decrease_factor * used
        return cut if knee is None else min(cut, knee)

    def _throttle(self, state: _UpstreamState, window: WindowFigures,
                  capacity_tokens: float | None) -> dict[str, TokenBudgetAction]:
        # Anonymous traffic ('' tenant) cannot be budgeted apart from the rest.
        demand = {t: tokens / self.policy.window_s for t, tokens in window.tenant_tokens.items() if t and tokens > 0}
        if not demand or capacity_tokens is None:
            return {tenant: d.action for tenant, d in state.budgets.items()}
        level = fair_share_level(list(demand.values()), capacity_tokens)
        throttled = {t for t, d in demand.items() if d > level} | set(state.budgets)
        return {tenant: self._budget(level) for tenant in throttled} if math.isfinite(level) else {}

    def _step_towards_fair(self, state: _UpstreamState, window: WindowFigures, factor: float,
                           capacity_tokens: float | None) -> dict[str, TokenBudgetAction]:
        """Tenants newly over the fair level of `capacity_tokens` get it; budgets in force move by
        `factor` (a cut below 1, a hold at 1), never above the fair level nor below min_budget_share of it."""
        fair = self._throttle(state, window, capacity_tokens)
        wanted = dict(fair)
        for tenant, previous in state.budgets.items():
            level = (fair[tenant] if tenant in fair else previous.action).tokens_per_second
            stepped = min(level, previous.action.tokens_per_second * factor)
            wanted[tenant] = self._budget(max(stepped, level * self.policy.min_budget_share))
        return wanted

    def _relax(self, state: _UpstreamState, window: WindowFigures,
               unbound_before: dict[str, int]) -> dict[str, TokenBudgetAction]:
        """Under capacity: each budget that bound in the window raised, one that did not held, and one that
        has not bound for ``release_after_windows`` windows in a row (``unbound_before``: the windows before
        this one) left out: released."""
        relaxed = {}
        for tenant, decision in state.budgets.items():
            used = window.tenant_tokens.get(tenant, 0) / self.policy.window_s
            if used * self.policy.budget_recovery_factor >= decision.action.tokens_per_second:
                relaxed[tenant] = self._budget(decision.action.tokens_per_second * self.policy.budget_recovery_factor)
                continue
            state.unbound_windows[tenant] = unbound_before.get(tenant, 0) + 1
            if state.unbound_windows[tenant] < self.policy.release_after_windows:
                relaxed[tenant] = decision.action
        return relaxed

    def _budget(self, tokens_per_second: float) -> TokenBudgetAction:
        rate = round(tokens_per_second, 3)  # stable values: equal budgets compare equal across windows
        return TokenBudgetAction(tokens_per_second=rate, burst_tokens=round(rate * self.policy.burst_seconds, 3),
                                 max_delay_s=self.policy.max_delay_s)


def _health_evidence(window: WindowFigures, policy: BreakerPolicy) -> tuple[Evidence, ...]:
    health = _health(window)
    evidence = [Evidence("request_rate", window.request_rate, health.capacity_threshold(policy) or 0.0, "req/s")]
    if window.p99_ttft_s is not None:
        evidence.append(Evidence("p99_ttft", window.p99_ttft_s, health.latency_threshold(policy) or 0.0, "s"))
    if window.knee_capacity_rps is not None:
        evidence.append(Evidence("knee_capacity", window.knee_capacity_rps, 0.0, "req/s"))
    if window.baseline_p99_s is not None:
        evidence.append(Evidence("baseline_p99_ttft", window.baseline_p99_s, 0.0, "s"))
    return tuple(evidence)


def _named(evidence: Sequence[Evidence]) -> str:
    return ", ".join(item.name for item in evidence)


def _breaker_reason(before: BreakerStatus, after: BreakerStatus, window: WindowFigures,
                    policy: BreakerPolicy, signals: MatrixSignals) -> str:
    if after.state == BreakerState.OPEN and before.state != BreakerState.OPEN:
        if signals.stall is not None:
            return (f"requests in flight silent for {signals.stall.value:.0f} s (inflight_stall crit): breaker "
                    "opened, a jammed server ends nothing for latency to show")
        if before.state == BreakerState.HALF_OPEN:
            return "probe window damaged: breaker re-opened"
        return (f"overloaded for {policy.trip_windows} windows: rate {window.request_rate:.2f} req/s over "
                f"{policy.capacity_factor:g} x knee and p99 TTFT over {policy.latency_factor:g} x baseline")
    if after.state == BreakerState.HALF_OPEN:
        return f"probing recovery: admitting {after.admitted_share:.0%}"
    if after.state == BreakerState.CLOSED:
        return "recovered: breaker closed"
    return "breaker open: cooling down"
