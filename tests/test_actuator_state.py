"""The actuator's state machines, pure: breaker, token buckets, enforcement, controller.

Properties are checked with hypothesis over random sequences of windows,
decisions, clock steps and requests; time is a manual clock so every
expiry and cool-down is exact.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenprobe.actuator.breaker import (
    LEGAL_TRANSITIONS,
    Breaker,
    BreakerPolicy,
    Pressure,
    UpstreamWindow,
)
from tokenprobe.actuator.buckets import TokenBucket
from tokenprobe.actuator.controller import (
    QUEUE_GROWTH,
    TTFT_SIGNALS,
    Controller,
    ControllerPolicy,
    fair_share_level,
)
from tokenprobe.actuator.engine import (
    DEFAULT_CONTEXT_TOKENS,
    MAX_CHOICES,
    DwellViolation,
    Enforcer,
    SubscriptionOverflow,
    VerdictKind,
)
from tokenprobe.actuator.tenant import DEFAULT_TENANT
from tokenprobe.contract.decisions import (
    BreakerAction,
    BreakerState,
    Decision,
    IndicatorReading,
    InvalidDecision,
    QueueSample,
    Target,
    TokenBudgetAction,
    WindowFigures,
)

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T0 = 1_800_000_000.0  # a fixed wall-clock epoch for the manual clock


class ManualClock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


KNEE_RPS, BASELINE_S = 10.0, 0.4  # thresholds: 8 req/s and 1.0 s
OVERLOADED = UpstreamWindow(12.0, 2.0, KNEE_RPS, BASELINE_S, 2.0)
OVER_CAPACITY = UpstreamWindow(12.0, 0.5, KNEE_RPS, BASELINE_S, 0.5)
HEALTHY = UpstreamWindow(3.0, 0.5, KNEE_RPS, BASELINE_S, 0.5)
DAMAGED_PROBE = UpstreamWindow(1.0, 2.0, KNEE_RPS, BASELINE_S, 2.0)

# Mostly typical windows, overload-heavy so that trips and recoveries happen, plus arbitrary ones.
windows = st.one_of(
    st.sampled_from([OVERLOADED, OVERLOADED, OVERLOADED, OVER_CAPACITY, HEALTHY, HEALTHY, DAMAGED_PROBE]),
    st.builds(
        UpstreamWindow,
        request_rate=st.floats(0, 30),
        p99_ttft_s=st.one_of(st.none(), st.floats(0, 5)),
        knee_capacity_rps=st.one_of(st.none(), st.just(KNEE_RPS)),
        baseline_p99_s=st.one_of(st.none(), st.just(BASELINE_S)),
        arrived_p99_ttft_s=st.one_of(st.none(), st.floats(0, 5)),
    ),
)


def breaker_decision(state: BreakerState, now: float, ttl: float = 60.0, **fields) -> Decision:
    return Decision(target=Target(upstream="vllm-a"), action=BreakerAction(state, **fields),
                    issued_at=now, expires_at=now + ttl)


def budget_decision(now: float, rate: float, burst: float, tenant: str = "acme", max_delay_s: float = 0.0,
                    ttl: float = 60.0) -> Decision:
    return Decision(target=Target(upstream="vllm-a", tenant=tenant),
                    action=TokenBudgetAction(rate, burst, max_delay_s), issued_at=now, expires_at=now + ttl)


# --------------------------------------------------------------------------- breaker


def test_pressure_needs_both_dimensions_to_count_as_overload():
    policy = BreakerPolicy()
    assert OVERLOADED.pressure(policy) == Pressure.OVERLOADED
    assert OVER_CAPACITY.pressure(policy) == Pressure.OVER_CAPACITY
    assert UpstreamWindow(3.0, 2.0, KNEE_RPS, BASELINE_S).pressure(policy) == Pressure.DAMAGED
    assert HEALTHY.pressure(policy) == Pressure.NORMAL
    assert UpstreamWindow(12.0, 2.0, None, BASELINE_S).pressure(policy) == Pressure.UNKNOWN
    assert UpstreamWindow(12.0, None, KNEE_RPS, BASELINE_S).pressure(policy) == Pressure.UNKNOWN


def test_breaker_full_cycle_trip_cooldown_ramp_close():
    breaker = Breaker(BreakerPolicy(cooldown_s=15.0))
    now = T0
    states = []
    for window in [OVERLOADED, OVERLOADED, OVERLOADED]:
        now += 5
        states.append(breaker.observe(window, now).state)
    assert states == [BreakerState.CLOSED, BreakerState.CLOSED, BreakerState.OPEN]
    opened = now
    now += 5
    assert breaker.observe(HEALTHY, now).state == BreakerState.OPEN  # cool-down not over
    now = opened + 15
    assert (breaker.observe(HEALTHY, now).state, breaker.admitted_share) == (BreakerState.HALF_OPEN, 0.1)
    shares = []
    for _ in range(3):
        now += 5
        shares.append(breaker.observe(HEALTHY, now).admitted_share)
    assert shares == [0.25, 0.5, 0.75]
    now += 5
    assert breaker.observe(HEALTHY, now).state == BreakerState.CLOSED


def test_over_capacity_without_latency_damage_never_trips():
    breaker = Breaker()
    for step in range(20):
        assert breaker.observe(OVER_CAPACITY, T0 + 5 * step).state == BreakerState.CLOSED


def test_a_gap_breaks_the_streak():
    breaker = Breaker()
    for step, window in enumerate([OVERLOADED, OVERLOADED, HEALTHY, OVERLOADED, OVERLOADED]):
        assert breaker.observe(window, T0 + 5 * step).state == BreakerState.CLOSED


def test_damaged_probe_reopens():
    breaker = Breaker(BreakerPolicy(trip_windows=1, cooldown_s=10.0))
    breaker.observe(OVERLOADED, T0)
    breaker.observe(HEALTHY, T0 + 10)
    assert breaker.state == BreakerState.HALF_OPEN
    status = breaker.observe(DAMAGED_PROBE, T0 + 15)
    assert (status.state, status.opened_at) == (BreakerState.OPEN, T0 + 15)


def test_probes_are_judged_by_what_arrived_in_the_window():
    breaker = Breaker(BreakerPolicy(trip_windows=1, cooldown_s=10.0))
    breaker.observe(OVERLOADED, T0)
    breaker.observe(HEALTHY, T0 + 10)
    assert breaker.admitted_share == 0.1
    # The backlog queued before the trip drains with long waits; what was admitted since fares well.
    draining = UpstreamWindow(4.0, 6.0, KNEE_RPS, BASELINE_S, 0.3)
    assert breaker.observe(draining, T0 + 15).admitted_share == 0.25
    # The probes themselves still wait behind the backlog: no evidence, the share is held.
    assert breaker.observe(UpstreamWindow(4.0, 6.0, KNEE_RPS, BASELINE_S, None), T0 + 20).admitted_share == 0.25
    assert breaker.state == BreakerState.HALF_OPEN


def test_windows_out_of_order_are_refused():
    breaker = Breaker()
    breaker.observe(HEALTHY, T0 + 10)
    with pytest.raises(ValueError, match="time order"):
        breaker.observe(HEALTHY, T0)


@pytest.mark.parametrize("bad", [dict(trip_windows=0), dict(cooldown_s=0), dict(recovery_shares=()),
                                 dict(recovery_shares=(0.5, 0.25)), dict(recovery_shares=(0.1, 1.0))])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        BreakerPolicy(**bad)


@PROPERTY_SETTINGS
@given(steps=st.lists(st.tuples(windows, st.floats(0.5, 20)), min_size=1, max_size=60))
def test_breaker_properties(steps):
    """No illegal transition; OPEN lasts the cool-down; the ramp only rises; trips need the streak."""
    policy = BreakerPolicy()
    breaker = Breaker(policy)
    now, previous = T0, breaker.status
    streak = 0
    for window, elapsed in steps:
        now += elapsed
        streak = streak + 1 if window.pressure(policy) == Pressure.OVERLOADED else 0
        status = breaker.observe(window, now)
        if status.state != previous.state:
            assert status.state in LEGAL_TRANSITIONS[previous.state]
        if previous.state == BreakerState.OPEN and status.state == BreakerState.HALF_OPEN:
            assert now >= previous.opened_at + policy.cooldown_s
            assert status.admitted_share == policy.recovery_shares[0]
        if previous.state == status.state == BreakerState.HALF_OPEN:
            assert status.admitted_share >= previous.admitted_share
        if previous.state == BreakerState.CLOSED and status.state == BreakerState.OPEN:
            assert streak >= policy.trip_windows
            streak = 0
        assert 0.0 <= status.admitted_share <= 1.0
        previous = status


# --------------------------------------------------------------------------- token buckets


def test_bucket_starts_full_refills_and_caps():
    bucket = TokenBucket(tokens_per_second=100.0, burst_tokens=500.0, now=T0)
    assert bucket.wait_for(500, T0) == 0.0
    bucket.take(500, T0)
    assert bucket.wait_for(100, T0) == pytest.approx(1.0)
    assert bucket.level(T0 + 2.0) == pytest.approx(200.0)
    assert bucket.level(T0 + 100.0) == 500.0  # never beyond the burst


def test_bucket_request_larger_than_burst_waits_for_full_pays_a_full_bucket_and_owes_at_most_one():
    bucket = TokenBucket(100.0, 500.0, T0)
    bucket.take(300, T0)
    assert bucket.wait_for(5000, T0) == pytest.approx(3.0)  # until full, not forever
    assert bucket.take(5000, T0 + 3.0) == 500  # charged what the bucket can hold, not the estimate
    assert bucket.level(T0 + 3.0) == pytest.approx(0.0)
    bucket.adjust(4500, T0 + 3.0)  # settled at the real count: the debt stops at one bucket
    assert bucket.level(T0 + 3.0) == pytest.approx(-500.0)


def test_bucket_reconfigure_keeps_spent_tokens_spent():
    bucket = TokenBucket(100.0, 1000.0, T0)
    bucket.take(900, T0)
    bucket.reconfigure(50.0, 2000.0, T0)
    assert bucket.level(T0) == pytest.approx(100.0)


# --------------------------------------------------------------------------- enforcement


def test_open_breaker_rejects_until_cooldown_then_probes_at_exact_share():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock)
    decision = enforcer.apply(breaker_decision(BreakerState.OPEN, T0, cooldown_s=15.0, probe_share=0.1))
    verdict = enforcer.check("vllm-a", "small", "acme", 10)
    assert (verdict.kind, verdict.http_status, verdict.decision_id) == (VerdictKind.REJECT, 503, decision.id)
    assert verdict.retry_after_s == pytest.approx(15.0)
    assert enforcer.check("vllm-b", "small", "acme", 10).kind == VerdictKind.ALLOW  # other upstream
    clock.now = T0 + 15.0
    admitted = sum(enforcer.check("vllm-a", "small", "acme", 10).allowed for _ in range(100))
    assert admitted == 10


def test_breaker_for_one_model_leaves_other_models_alone():
    enforcer = Enforcer(clock=ManualClock())
    decision = breaker_decision(BreakerState.OPEN, T0, cooldown_s=15.0, probe_share=0.1)
    enforcer.apply(Decision(target=Target(upstream="vllm-a", model="big"), action=decision.action,
                            issued_at=T0, expires_at=T0 + 60))
    assert not enforcer.check("vllm-a", "big", "acme", 1).allowed
    assert enforcer.check("vllm-a", "small", "acme", 1).allowed


def test_budget_rejects_early_delays_within_max_delay_and_settles():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock)
    enforcer.apply(budget_decision(T0, rate=100.0, burst=1000.0, max_delay_s=0.5))
    first = enforcer.check("vllm-a", "small", "acme", 900)
    assert first.kind == VerdictKind.ALLOW and first.reservation_id
    delayed = enforcer.check("vllm-a", "small", "acme", 140)  # 100 left, 40 more within 0.4 s
    assert delayed.kind == VerdictKind.DELAY and delayed.delay_s == pytest.approx(0.4)
    rejected = enforcer.check("vllm-a", "small", "acme", 500)  # bucket at -40: 5.4 s away
    assert (rejected.kind, rejected.http_status) == (VerdictKind.REJECT, 429)
    assert rejected.retry_after_s == pytest.approx(5.4)
    assert enforcer.check("vllm-a", "small", "other-tenant", 500).kind == VerdictKind.ALLOW
    # The first request really cost 300 tokens: 600 come back.
    assert enforcer.settle(first.reservation_id, 300) == -600
    assert enforcer.settle(first.reservation_id, 300) is None  # settled once only
    assert enforcer.check("vllm-a", "small", "acme", 500).kind == VerdictKind.ALLOW


def test_under_estimate_is_charged_at_settlement():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock)
    enforcer.apply(budget_decision(T0, rate=10.0, burst=1000.0))
    verdict = enforcer.check("vllm-a", "", "acme", 100)
    assert enforcer.settle(verdict.reservation_id, 1000) == 900
    assert not enforcer.check("vllm-a", "", "acme", 1).allowed


def test_requests_without_a_tenant_pay_into_the_default_tenants_budget():
    enforcer = Enforcer(clock=ManualClock())
    enforcer.apply(budget_decision(T0, rate=1.0, burst=100.0, tenant=DEFAULT_TENANT))
    assert enforcer.check("vllm-a", "", "", 100).kind == VerdictKind.ALLOW
    assert not enforcer.check("vllm-a", "", "", 100).allowed  # leaving the tenant out escapes nothing
    assert not enforcer.check("vllm-a", "", DEFAULT_TENANT, 100).allowed
    assert enforcer.check("vllm-a", "", "acme", 100).allowed


def test_a_huge_estimate_is_charged_one_bucket_and_an_upstream_error_refunds_it_all():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock)
    enforcer.apply(budget_decision(T0, rate=1.0, burst=1000.0, tenant=DEFAULT_TENANT))
    verdict = enforcer.check("vllm-a", "", "", DEFAULT_CONTEXT_TOKENS * MAX_CHOICES)  # n=128 at full context
    assert verdict.kind == VerdictKind.ALLOW
    [status] = enforcer.status()
    # Charged what the bucket holds (16.8M tokens of debt would have refused the tenant for 194 days).
    assert status.tokens_available == pytest.approx(0.0)
    assert enforcer.check("vllm-a", "", "", 1).kind == VerdictKind.REJECT
    enforcer.settle(verdict.reservation_id, 0)  # the upstream answered 400: nothing was generated
    [status] = enforcer.status()
    assert status.tokens_available == pytest.approx(1000.0)


def test_debt_and_retry_after_are_bounded_whatever_the_counts():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock)
    enforcer.apply(budget_decision(T0, rate=0.001, burst=1000.0, ttl=60.0))
    verdict = enforcer.check("vllm-a", "", "acme", 2 ** 64 - 1)  # what the wire can carry
    assert verdict.kind == VerdictKind.ALLOW
    enforcer.settle(verdict.reservation_id, 2 ** 64 - 1)
    [status] = enforcer.status()
    assert status.tokens_available == pytest.approx(-1000.0)  # one bucket of debt, not 2**64
    rejected = enforcer.check("vllm-a", "", "acme", 1)
    # Refilling at 0.001 token/s would take half a year; the decision lapses in a minute.
    assert (rejected.http_status, rejected.retry_after_s) == (429, pytest.approx(60.0))
    enforcer.apply(breaker_decision(BreakerState.OPEN, T0, ttl=10.0, cooldown_s=300.0, probe_share=0.1))
    assert enforcer.check("vllm-a", "", "acme", 1).retry_after_s == pytest.approx(10.0)


def test_reservations_are_bounded_and_age_out():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock, max_reservations=3, reservation_ttl_s=10.0)
    enforcer.apply(budget_decision(T0, rate=1e6, burst=1e9))
    ids = [enforcer.check("vllm-a", "", "acme", 1).reservation_id for _ in range(4)]
    assert enforcer.settle(ids[0], 1) is None  # evicted: the 4th pushed it out
    assert enforcer.settle(ids[1], 1) == 0
    clock.now += 11
    enforcer.check("vllm-a", "", "acme", 1)
    assert enforcer.settle(ids[2], 1) is None  # too old


def test_dwell_refuses_early_loosening_but_never_tightening():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock, min_dwell_s=3.0)
    enforcer.apply(breaker_decision(BreakerState.HALF_OPEN, T0, admitted_share=0.5))
    clock.now += 1
    with pytest.raises(DwellViolation, match="loosening"):
        enforcer.apply(breaker_decision(BreakerState.CLOSED, clock.now))
    enforcer.apply(breaker_decision(BreakerState.HALF_OPEN, clock.now, admitted_share=0.25))  # tighter: fine
    enforcer.apply(breaker_decision(BreakerState.HALF_OPEN, clock.now, admitted_share=0.25, ttl=90))  # renewal
    clock.now += 3
    enforcer.apply(breaker_decision(BreakerState.CLOSED, clock.now))


def test_budget_loosening_is_paced_too():
    clock = ManualClock()
    enforcer = Enforcer(clock=clock, min_dwell_s=3.0)
    enforcer.apply(budget_decision(T0, rate=100.0, burst=200.0))
    with pytest.raises(DwellViolation):
        enforcer.apply(budget_decision(T0, rate=150.0, burst=300.0))
    enforcer.apply(budget_decision(T0, rate=50.0, burst=100.0))


@pytest.mark.parametrize("decision, message", [
    (Decision(Target(), BreakerAction(BreakerState.CLOSED), T0 + 60, T0), "needs an upstream"),
    (Decision(Target("u", tenant="t"), BreakerAction(BreakerState.CLOSED), T0 + 60, T0), "not a tenant"),
    (Decision(Target("u"), BreakerAction(BreakerState.HALF_OPEN, admitted_share=0.0), T0 + 60, T0), "admitted_share"),
    (Decision(Target("u"), BreakerAction(BreakerState.OPEN, cooldown_s=10, probe_share=1.5), T0 + 60, T0),
     "probe_share"),
    (Decision(Target("u"), BreakerAction(BreakerState.OPEN, cooldown_s=0, probe_share=0.1), T0 + 60, T0),
     "cooldown"),
    (Decision(Target(model="m"), TokenBudgetAction(10, 10), T0 + 60, T0), "tenant or an upstream"),
    (Decision(Target(tenant="t"), TokenBudgetAction(math.nan, 10), T0 + 60, T0), "tokens_per_second"),
    (Decision(Target(tenant="t"), TokenBudgetAction(10, 10, max_delay_s=-1), T0 + 60, T0), "max_delay"),
    (Decision(Target(tenant="t"), TokenBudgetAction(10, 10), T0 - 1, T0 - 5), "expired"),
    (Decision(Target(tenant="t"), TokenBudgetAction(10, 10), T0 + 600, T0 + 300), "future"),
    (Decision(Target(tenant="t" * 300), TokenBudgetAction(10, 10), T0 + 60, T0), "longer than"),
])
def test_invalid_decisions_are_refused_with_a_reason(decision, message):
    with pytest.raises(InvalidDecision, match=message):
        Enforcer(clock=ManualClock()).apply(decision)


def test_lifetime_is_capped():
    enforcer = Enforcer(clock=ManualClock(), max_lifetime_s=600.0)
    stored = enforcer.apply(budget_decision(T0, 10, 10, ttl=86_400))
    assert stored.expires_at == T0 + 600.0


def test_watchers_get_snapshot_then_updates_and_overflow_is_reported():
    enforcer = Enforcer(clock=ManualClock(), min_dwell_s=0)
    first = enforcer.apply(budget_decision(T0, 10, 10))
    subscription = enforcer.subscribe(max_pending=2)
    assert subscription.snapshot == [first]
    second = enforcer.apply(budget_decision(T0, 20, 20))
    assert subscription.next(timeout=0) == second
    assert subscription.next(timeout=0) is None
    for rate in (30, 40, 50):
        enforcer.apply(budget_decision(T0, rate, rate))
    with pytest.raises(SubscriptionOverflow):
        for _ in range(3):
            subscription.next(timeout=0)


def test_replace_all_keeps_bucket_levels_and_drops_the_rest():
    clock = ManualClock()
    cache = Enforcer(clock=clock, min_dwell_s=0)
    budget = budget_decision(T0, rate=1.0, burst=100.0)
    breaker = breaker_decision(BreakerState.OPEN, T0, cooldown_s=30, probe_share=0.1)
    cache.replace_all([budget, breaker])
    cache.check("vllm-a", "", "acme", 0)  # the breaker rejects before the budget is touched
    cache.replace_all([budget])
    assert cache.check("vllm-a", "", "acme", 100).allowed
    cache.replace_all([budget])  # resync: the bucket stays spent
    assert not cache.check("vllm-a", "", "acme", 100).allowed


decision_ops = st.one_of(
    st.tuples(st.just("breaker"), st.sampled_from(list(BreakerState)), st.floats(0.05, 1.0), st.floats(0.5, 20),
              st.floats(0.5, 40)),
    st.tuples(st.just("budget"), st.sampled_from(["acme", "globex"]), st.floats(1, 500), st.floats(1, 2000),
              st.floats(0.5, 40)),
    st.tuples(st.just("tick"), st.floats(0.01, 15)),
    st.tuples(st.just("check"), st.sampled_from(["acme", "globex", ""]), st.integers(0, 800)),
)


@PROPERTY_SETTINGS
@given(ops=st.lists(decision_ops, min_size=1, max_size=80))
def test_enforcement_properties(ops):
    """Expiry is always honoured; loosening respects the dwell; rejections name a live decision."""
    clock = ManualClock()
    enforcer = Enforcer(clock=clock, min_dwell_s=3.0)
    applied: dict[str, Decision] = {}
    for op in ops:
        if op[0] == "tick":
            clock.now += op[1]
        elif op[0] == "check":
            verdict = enforcer.check("vllm-a", "small", op[1], op[2])
            if not verdict.allowed:
                assert applied[verdict.decision_id].expires_at > clock.now
        else:
            if op[0] == "breaker":
                _, state, share, cooldown, ttl = op
                decision = breaker_decision(state, clock.now, ttl=ttl, admitted_share=share,
                                            cooldown_s=cooldown, probe_share=share)
            else:
                _, tenant, rate, burst, ttl = op
                decision = budget_decision(clock.now, rate, burst, tenant=tenant, ttl=ttl)
            before = {s.decision.key: s for s in enforcer.status()}.get(decision.key)
            try:
                stored = enforcer.apply(decision)
            except DwellViolation:
                assert before is not None and clock.now - before.changed_at < 3.0
                continue
            applied[stored.id] = stored
            after = {s.decision.key: s for s in enforcer.status()}[decision.key]
            if before is not None and _looser(before, after):
                assert clock.now - before.changed_at >= 3.0
    # Once every decision has lapsed, nothing is enforced any more: fail-open.
    clock.now += 1000
    assert enforcer.status() == []
    assert all(enforcer.check("vllm-a", "small", t, 10_000).kind == VerdictKind.ALLOW
               for t in ("acme", "globex", ""))


def _looser(before, after) -> bool:
    if after.effective_state is not None:
        return after.admitted_share > before.admitted_share
    old, new = before.decision.action, after.decision.action
    return new.tokens_per_second > old.tokens_per_second or new.burst_tokens > old.burst_tokens


@PROPERTY_SETTINGS
@given(rate=st.floats(1, 1000), burst=st.floats(1, 5000), max_delay=st.floats(0, 2),
       requests=st.lists(st.tuples(st.floats(0, 2), st.integers(0, 3000)), min_size=1, max_size=60))
def test_budget_never_admits_more_than_it_refills(rate, burst, max_delay, requests):
    """Tokens charged by time t never exceed burst + rate × (t + max_delay).

    A request larger than the bucket is charged a full bucket at admission (its real count, at
    settlement, may add at most one bucket of debt), so it waits for a full bucket each time."""
    clock = ManualClock()
    enforcer = Enforcer(clock=clock)
    enforcer.apply(budget_decision(T0, rate, burst, max_delay_s=max_delay, ttl=600))
    charged_tokens = 0
    for gap, tokens in requests:
        clock.now += gap
        if enforcer.check("vllm-a", "", "acme", tokens).allowed:
            charged_tokens += min(tokens, burst)
        elapsed = clock.now - T0
        assert charged_tokens <= burst + rate * (elapsed + max_delay) + 1e-6


# --------------------------------------------------------------------------- controller


def figures(end: float, window: UpstreamWindow, tenant_tokens=None, upstream: str = "vllm-a", *,
            lit: tuple[IndicatorReading, ...] = (), queue: QueueSample | None = None) -> WindowFigures:
    return WindowFigures(upstream, end, window.request_rate, window.p99_ttft_s, window.knee_capacity_rps,
                         window.baseline_p99_s, tenant_tokens or {}, arrived_p99_ttft_s=window.arrived_p99_ttft_s,
                         indicators={reading.name: reading for reading in lit}, queue=queue)


def test_fair_share_level_is_max_min_fair():
    assert fair_share_level([10, 20], 100) == math.inf
    level = fair_share_level([10, 50, 100], 90)
    assert level == 40
    assert sum(min(d, level) for d in [10, 50, 100]) == pytest.approx(90)


def test_controller_trips_recovers_and_closes_once():
    controller = Controller(ControllerPolicy(window_s=5.0))
    now = T0
    kinds = []
    for window in [OVERLOADED] * 3 + [HEALTHY] * 2 + [HEALTHY] * 6:
        now += 5
        decisions = [d for d in controller.decide(figures(now, window)) if d.kind == "breaker"]
        assert len(decisions) <= 1  # at most one per target per window
        kinds.append((decisions[0].action.state.name, decisions[0].action.admitted_share) if decisions else None)
    assert kinds[:3] == [None, None, ("OPEN", 1.0)]
    assert kinds[3:5] == [None, None]  # cooling down; the OPEN decision outlives the cool-down
    assert kinds[5:] == [("HALF_OPEN", 0.1), ("HALF_OPEN", 0.25), ("HALF_OPEN", 0.5), ("HALF_OPEN", 0.75),
                         ("CLOSED", 1.0), None]


def test_controller_forgets_a_breaker_whose_decision_lapsed():
    policy = ControllerPolicy(window_s=5.0, decision_ttl_windows=3, breaker=BreakerPolicy(trip_windows=1))
    controller = Controller(policy)
    [opened] = controller.decide(figures(T0, OVERLOADED))
    assert opened.action.state == BreakerState.OPEN
    # Traffic stops (no windows), the decision lapses at the gateways: fail-open.
    later = opened.expires_at + 1
    assert controller.decide(figures(later, HEALTHY)) == []  # closed, as the gateways already are
    [reopened] = controller.decide(figures(later + 5, OVERLOADED))
    assert reopened.action.state == BreakerState.OPEN and reopened.issued_at == later + 5


def test_controller_evidence_and_expiry():
    controller = Controller(ControllerPolicy(window_s=5.0))
    for step in range(1, 4):
        decisions = controller.decide(figures(T0 + 5 * step, OVERLOADED))
    opened = next(d for d in decisions if d.kind == "breaker")
    evidence = {e.name: e for e in opened.evidence}
    assert evidence["request_rate"].value == 12.0 and evidence["request_rate"].threshold == pytest.approx(8.0)
    assert evidence["p99_ttft"].value == 2.0 and evidence["p99_ttft"].threshold == pytest.approx(1.0)
    assert "overloaded for 3 windows" in opened.reason
    assert opened.expires_at >= opened.issued_at + 15.0 + 15.0  # cool-down plus a lifetime to probe


def test_controller_throttles_heavy_tenants_only_when_latency_is_fine():
    controller = Controller(ControllerPolicy(window_s=5.0))
    # 12 req/s for 5 s = 60 requests, 6000 tokens: 100 tokens per request.
    usage = {"light": 500, "heavy": 3500, "medium": 2000}
    decisions = controller.decide(figures(T0 + 5, OVER_CAPACITY, usage))
    assert all(d.kind == "token_budget" for d in decisions)
    budgets = {d.target.tenant: d.action.tokens_per_second for d in decisions}
    assert set(budgets) == {"heavy", "medium"}
    capacity = 8.0 * 100  # 0.8 × knee × tokens per request, tokens/s
    demand = {t: v / 5.0 for t, v in usage.items()}
    level = budgets["heavy"]
    assert budgets["medium"] == level
    assert sum(min(d, level) for d in demand.values()) == pytest.approx(capacity, rel=1e-3)


def test_controller_cuts_budgets_while_overload_persists_then_floors_them():
    # (a breaker slow to trip: while it is open, budgets are only held)
    controller = Controller(ControllerPolicy(window_s=5.0, budget_decrease_factor=0.5, min_budget_share=0.2,
                                             breaker=BreakerPolicy(trip_windows=10)))
    usage = {"light": 500, "heavy": 5500}
    [first] = [d for d in controller.decide(figures(T0 + 5, OVER_CAPACITY, usage)) if d.kind == "token_budget"]
    level = first.action.tokens_per_second
    rates = []
    for step in range(2, 6):
        budgets = [d for d in controller.decide(figures(T0 + 5 * step, OVERLOADED, usage)) if d.kind == "token_budget"]
        rates.append(budgets[0].action.tokens_per_second if budgets else rates[-1])
    assert rates == pytest.approx([level * 0.5, level * 0.25, level * 0.2, level * 0.2], rel=1e-3)
    # Latency fine again while still at capacity: the budget stays where the cuts left it.
    held = controller.decide(figures(T0 + 30, OVER_CAPACITY, usage))
    assert all(d.action.tokens_per_second == pytest.approx(level * 0.2, rel=1e-3) for d in held)  # renewals
    # Under capacity, with the tenant using all it may: raised step by step.
    [raised] = controller.decide(figures(T0 + 35, HEALTHY, {"heavy": int(level * 0.2 * 5)}))
    assert raised.action.tokens_per_second == pytest.approx(level * 0.2 * 1.5, rel=1e-3)


def test_controller_holds_budgets_while_the_breaker_is_open():
    controller = Controller(ControllerPolicy(window_s=5.0, decision_ttl_windows=3,
                                             breaker=BreakerPolicy(trip_windows=1, cooldown_s=30.0)))
    [budget] = controller.decide(figures(T0 + 5, OVER_CAPACITY, {"light": 500, "heavy": 5500}))
    assert {d.kind for d in controller.decide(figures(T0 + 10, OVERLOADED, {"heavy": 5500}))} >= {"breaker"}
    # The breaker turns the heavy tenant away, so its usage looks small: that is no reason to release it.
    [renewed] = controller.decide(figures(T0 + 15, HEALTHY, {"heavy": 10}))
    assert renewed.kind == "token_budget" and renewed.target.tenant == "heavy"
    assert renewed.action == budget.action and "held" in renewed.reason


def test_controller_relaxes_budgets_gradually_then_releases():
    controller = Controller(ControllerPolicy(window_s=5.0))
    first = controller.decide(figures(T0 + 5, OVER_CAPACITY, {"light": 500, "heavy": 5500}))
    level = first[0].action.tokens_per_second
    # Under capacity, the heavy tenant still uses all it is allowed: raise by 1.5 each window.
    used = int(level * 5)
    raised = controller.decide(figures(T0 + 10, HEALTHY, {"heavy": used}))
    assert raised[0].action.tokens_per_second == pytest.approx(level * 1.5, rel=1e-3)
    # It no longer needs the room: the budget is released (left to lapse, not renewed).
    assert controller.decide(figures(T0 + 15, HEALTHY, {"heavy": 10})) == []
    assert controller.decide(figures(T0 + 20, HEALTHY, {"heavy": 10})) == []


def test_controller_holds_a_budget_through_one_window_it_did_not_bind():
    # The window after a raise, or after the breaker closed, still shows the tokens admitted before it: a
    # tenant still turned away looks as if it no longer needed its budget. Released there, it came back
    # whole, and the server was overloaded again before the next window.
    controller = Controller(ControllerPolicy(window_s=5.0))
    [first] = [d for d in controller.decide(figures(T0 + 5, OVER_CAPACITY, {"light": 500, "heavy": 5500}))
               if d.target.tenant == "heavy"]
    level = first.action.tokens_per_second
    [raised] = controller.decide(figures(T0 + 10, HEALTHY, {"heavy": int(level * 5)}))
    assert controller.decide(figures(T0 + 15, HEALTHY, {"heavy": 10})) == []  # held; not yet due for renewal
    # Bound again: raised once more from where it was, not let go.
    [again] = controller.decide(figures(T0 + 20, HEALTHY, {"heavy": int(raised.action.tokens_per_second * 5)}))
    assert again.target.tenant == "heavy"
    assert again.action.tokens_per_second == pytest.approx(level * 1.5 * 1.5, rel=1e-3)
    # Two windows in a row without binding: released. (Held, it would be renewed at T0 + 30, one window
    # before it lapses.)
    assert controller.decide(figures(T0 + 25, HEALTHY, {"heavy": 10})) == []
    assert controller.decide(figures(T0 + 30, HEALTHY, {"heavy": 10})) == []
    # Any other verdict between two such windows starts the count again.
    controller = Controller(ControllerPolicy(window_s=5.0))
    controller.decide(figures(T0 + 5, OVER_CAPACITY, {"light": 500, "heavy": 5500}))
    assert controller.decide(figures(T0 + 10, HEALTHY, {"heavy": 10})) == []  # held: one window unbound
    [held] = controller.decide(figures(T0 + 15, OVER_CAPACITY, {"light": 500, "heavy": 5500}))  # held there, renewed
    assert controller.decide(figures(T0 + 20, HEALTHY, {"heavy": 10})) == []  # held again: the count restarted
    [renewed] = controller.decide(figures(T0 + 25, HEALTHY, {"heavy": int(held.action.tokens_per_second * 5)}))
    assert renewed.action.tokens_per_second == pytest.approx(held.action.tokens_per_second * 1.5, rel=1e-3)


def test_controller_says_nothing_without_evidence_and_refuses_a_window_twice():
    controller = Controller()
    assert controller.decide(figures(T0 + 5, UpstreamWindow(50.0, None, None, None), {"a": 100})) == []
    with pytest.raises(ValueError, match="already decided"):
        controller.decide(figures(T0 + 5, HEALTHY))


@PROPERTY_SETTINGS
@given(steps=st.lists(st.tuples(st.sampled_from([OVERLOADED, OVER_CAPACITY, HEALTHY, DAMAGED_PROBE]),
                                st.integers(0, 8000), st.integers(0, 8000)), min_size=1, max_size=40))
def test_controller_decisions_are_unique_per_target_and_always_accepted(steps):
    """At most one decision per target per window, and the enforcer (with its dwell time) takes every one."""
    policy = ControllerPolicy(window_s=5.0)
    controller = Controller(policy)
    clock = ManualClock()
    enforcer = Enforcer(clock=clock, min_dwell_s=3.0)
    for index, (window, acme, globex) in enumerate(steps, start=1):
        clock.now = T0 + policy.window_s * index
        decisions = controller.decide(figures(clock.now, window, {"acme": acme, "globex": globex}))
        keys = [d.key for d in decisions]
        assert len(keys) == len(set(keys))
        for decision in decisions:
            enforcer.apply(decision)
            assert decision.expires_at > clock.now


# --------------------------------------------------------------------------- the controller on the matrix

KV_CRIT = IndicatorReading("kv_cache_usage", "crit", 0.97, 0.95)
KV_WARN = IndicatorReading("kv_cache_usage", "warn", 0.85, 0.80)
GPU_MEMORY_CRIT = IndicatorReading("gpu_memory_pressure", "crit", 0.96, 0.92)
RETRIES_CRIT = IndicatorReading("retry_storm", "crit", 0.3, 0.2)
RETRIES_WARN = IndicatorReading("retry_storm", "warn", 0.1, 0.05)
STALLED = IndicatorReading("inflight_stall", "crit", 45.0, 30.0)
# Healthy by rate and TTFT (3 req/s against a threshold of 8): the TTFT-only policy does nothing.
USAGE = {"light": 500, "heavy": 2500}  # tokens in a 5 s window: 600 tokens/s used


def budgets_of(decisions) -> dict[str, TokenBudgetAction]:
    return {d.target.tenant: d.action for d in decisions if d.kind == "token_budget"}


def evidence_of(decision) -> dict[str, tuple[float, float]]:
    return {e.name: (e.value, e.threshold) for e in decision.evidence}


@pytest.mark.parametrize("reading", [KV_CRIT, GPU_MEMORY_CRIT], ids=lambda r: r.name)
def test_a_demand_signal_tightens_budgets_while_ttft_is_still_healthy(reading):
    matrix, ttft_only = Controller(ControllerPolicy(window_s=5.0)), Controller(
        ControllerPolicy(window_s=5.0, signals=TTFT_SIGNALS))
    assert ttft_only.decide(figures(T0 + 5, HEALTHY, USAGE, lit=(reading,))) == []
    [first] = matrix.decide(figures(T0 + 5, HEALTHY, USAGE, lit=(reading,)))
    # The demand is cut to 0.7 × the 600 tokens/s used, max-min fairly: light's 100 fit, heavy gets the rest.
    assert first.target.tenant == "heavy" and first.action.tokens_per_second == pytest.approx(0.7 * 600 - 100)
    assert evidence_of(first)[reading.name] == (reading.value, reading.threshold)
    assert reading.name in first.reason and "before TTFT degraded" in first.reason
    # Still lit a window later, heavy using all it may: cut again, to 0.7 × the budget or to the fair
    # level of 0.7 × what was used (420 tokens/s), whichever is lower.
    [second] = matrix.decide(figures(T0 + 10, HEALTHY, {"light": 500, "heavy": 1600}, lit=(reading,)))
    assert second.action.tokens_per_second == pytest.approx(min(0.7 * 420 - 100, 320 * 0.7), rel=1e-3)


def test_a_signal_at_warn_holds_budgets_instead_of_relaxing_them():
    controller = Controller(ControllerPolicy(window_s=5.0))
    [tightened] = controller.decide(figures(T0 + 5, HEALTHY, USAGE, lit=(KV_CRIT,)))
    used = {"heavy": int(tightened.action.tokens_per_second * 5)}  # all it may: it would be raised if healthy
    assert controller.decide(figures(T0 + 10, HEALTHY, used, lit=(KV_WARN,))) == []  # held: nothing new
    [renewed] = controller.decide(figures(T0 + 15, HEALTHY, used, lit=(KV_WARN,)))
    assert renewed.action == tightened.action and "kv_cache_usage lit: budgets held" in renewed.reason
    [raised] = controller.decide(figures(T0 + 20, HEALTHY, used))  # nothing lit: relaxed step by step
    assert raised.action.tokens_per_second == pytest.approx(tightened.action.tokens_per_second * 1.5, rel=1e-3)


def test_a_growing_in_flight_queue_is_a_demand_signal_a_steady_one_is_not():
    controller = Controller(ControllerPolicy(window_s=5.0))
    # A long queue wait (absolute thresholds) that is not growing cuts nothing.
    long_waits = IndicatorReading("queue_wait_p95", "crit", 800.0, 450.0)
    assert controller.decide(figures(T0, HEALTHY, USAGE, lit=(long_waits,))) == []
    # 3 req/s ended over the 5 s between samples: growth must pass max(3, 0.25 × 15) = 3.75 requests.
    assert controller.decide(figures(T0 + 5, HEALTHY, USAGE, queue=QueueSample(2, 5, 5.0))) == []
    [budget] = controller.decide(figures(T0 + 10, HEALTHY, USAGE, queue=QueueSample(5, 14, 5.0)))
    assert budget.target.tenant == "heavy"
    assert evidence_of(budget)[QUEUE_GROWTH] == (9, pytest.approx(3.75))


def test_a_long_queue_wait_holds_budgets_only_where_the_server_is_not_healthy():
    """queue_wait_p95's thresholds are absolute: a small server queues past them at healthy load, and
    holding there would keep an overload's budgets in force for good."""
    controller = Controller(ControllerPolicy(window_s=5.0))
    long_waits = IndicatorReading("queue_wait_p95", "warn", 300.0, 120.0)
    [tightened] = controller.decide(figures(T0 + 5, HEALTHY, USAGE, lit=(KV_CRIT,)))
    used = {"heavy": int(tightened.action.tokens_per_second * 5)}
    unknown = UpstreamWindow(3.0, 0.5, None, None, 0.5)  # no knee or baseline: only the matrix to go by
    assert controller.decide(figures(T0 + 10, unknown, used, lit=(long_waits,))) == []  # held: nothing new
    [renewed] = controller.decide(figures(T0 + 15, unknown, used, lit=(long_waits,)))
    assert renewed.action == tightened.action and "queue_wait_p95 lit: budgets held" in renewed.reason
    [raised] = controller.decide(figures(T0 + 20, HEALTHY, used, lit=(long_waits,)))
    assert raised.action.tokens_per_second == pytest.approx(tightened.action.tokens_per_second * 1.5, rel=1e-3)


def test_a_retry_storm_makes_budgets_reject_at_once_with_a_spread_retry_after():
    controller = Controller(ControllerPolicy(window_s=5.0, retry_jitter_s=8.0))
    [stormy] = controller.decide(figures(T0 + 5, OVER_CAPACITY, {"light": 500, "heavy": 5500}, lit=(RETRIES_WARN,)))
    assert (stormy.action.max_delay_s, stormy.action.retry_jitter_s) == (0.0, 8.0)
    assert "retry storm" in stormy.reason and "retry_storm" in evidence_of(stormy)
    [calm] = controller.decide(figures(T0 + 10, OVER_CAPACITY, {"light": 500, "heavy": 5500}))
    assert (calm.action.max_delay_s, calm.action.retry_jitter_s) == (0.5, 0.0)


def test_a_retry_storm_cuts_demand_over_capacity_and_lets_go_once_the_server_absorbs_it():
    controller = Controller(ControllerPolicy(window_s=5.0))
    tokens = {"light": 500, "heavy": 5500}  # 1200 tokens/s used
    [over] = controller.decide(figures(T0 + 5, OVER_CAPACITY, tokens, lit=(RETRIES_CRIT,)))
    # Cut to 0.7 x what was used (not only to the fair share of the knee's capacity), rejecting at once.
    assert over.target.tenant == "heavy" and over.action.tokens_per_second <= 0.7 * 1200 - 100
    assert "retry_storm" in over.reason and over.action.max_delay_s == 0.0
    # Back under capacity, healthy, the storm still lit (the indicator looks back a minute): the budget
    # is raised, not held, and still rejects with a spread Retry-After while the storm shows.
    used = {"heavy": int(over.action.tokens_per_second * 5)}
    [absorbed] = controller.decide(figures(T0 + 10, HEALTHY, used, lit=(RETRIES_CRIT,)))
    assert absorbed.action.tokens_per_second == pytest.approx(over.action.tokens_per_second * 1.5, rel=1e-3)
    assert (absorbed.action.max_delay_s, absorbed.action.retry_jitter_s) == (0.0, 10.0)
    assert "under capacity again" in absorbed.reason


def test_the_enforcer_spreads_retry_after_over_the_jitter():
    import random
    enforcer = Enforcer(clock=ManualClock(), rng=random.Random(7))
    enforcer.apply(Decision(target=Target(upstream="vllm-a", tenant="acme"),
                            action=TokenBudgetAction(100.0, 100.0, retry_jitter_s=10.0), issued_at=T0,
                            expires_at=T0 + 60))
    assert enforcer.check("vllm-a", "m", "acme", 100).allowed
    waits = [enforcer.check("vllm-a", "m", "acme", 100).retry_after_s for _ in range(50)]  # 1 s to refill
    assert all(1.0 <= wait <= 11.0 for wait in waits)
    assert max(waits) - min(waits) > 5.0, "rejected clients are told to come back at spread-out times"


def test_a_budget_crosses_the_wire_with_its_delay_and_jitter():
    from tokenprobe.actuator import wire
    decision = budget_decision(T0, rate=10.0, burst=20.0, max_delay_s=0.5)
    decision = replace(decision, action=replace(decision.action, retry_jitter_s=7.5))
    assert wire.decision_from_proto(wire.decision_to_proto(decision)) == decision


def test_a_stall_opens_the_breaker_of_a_server_that_ends_nothing():
    jammed = UpstreamWindow(0.0, None, KNEE_RPS, BASELINE_S)  # nothing ended: no latency to judge
    policy = ControllerPolicy(window_s=5.0, breaker=BreakerPolicy(cooldown_s=10.0, recovery_shares=(0.25,)))
    assert Controller(replace(policy, signals=TTFT_SIGNALS)).decide(figures(T0 + 5, jammed, lit=(STALLED,))) == []
    controller = Controller(policy)
    [opened] = controller.decide(figures(T0 + 5, jammed, lit=(STALLED,)))
    assert opened.action.state == BreakerState.OPEN and "inflight_stall crit" in opened.reason
    assert evidence_of(opened)["inflight_stall"] == (45.0, 30.0)
    controller.decide(figures(T0 + 10, jammed, lit=(STALLED,)))
    [probing] = controller.decide(figures(T0 + 15, jammed, lit=(STALLED,)))  # cool-down over: probes
    assert probing.action.state == BreakerState.HALF_OPEN and probing.action.admitted_share == 0.25
    # Still stalled while probing: re-opened, with no latency figure needed.
    [reopened] = controller.decide(figures(T0 + 20, jammed, lit=(STALLED,)))
    assert reopened.action.state == BreakerState.OPEN


def test_bad_signal_policies_are_refused():
    with pytest.raises(ValueError, match="signals"):
        ControllerPolicy(signals="everything")
    with pytest.raises(ValueError, match="retry_jitter_s"):
        ControllerPolicy(retry_jitter_s=-1)
