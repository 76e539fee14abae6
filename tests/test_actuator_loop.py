"""The closed loop, end to end: reference server ← gateway (actuator hook) ← load,
the real agent capturing the server's traffic from the kernel, and the control
loop turning what it stored into decisions.

Driven past its knee, the server's overload must be detected and contained
with nobody touching anything: decisions recorded in tokenprobe.decisions,
requests rejected while overloaded, the requests still admitted served under
the TTFT objective, and admission back to normal once the load drops.
Directions of effects are asserted with wide margins, never exact timings:
uncontained, a request sent late in the overload waits about 100 s for a slot.
A failed assertion prints the overload's timeline (admissions, rejections and
TTFT per 5 s, and the decisions) so a failure in CI can be read afterwards.
"""

from __future__ import annotations

import time

import pytest
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.cli.stack import closed_loop
from tokenprobe.contract.decisions import BreakerState
from tokenprobe.refserver.overload import (
    DECODE_MS,
    OVERLOAD_POLICY,
    SLOTS,
    TTFT_OBJECTIVE_S,
    load_together,
    percentile,
)
from tokenprobe.store.embedded import open_store

from tests.kernel_harness import agent, reference_server, require_kernel
from tests.support import free_port

pytestmark = pytest.mark.kernel

OVERLOAD_S = 60.0
CONTAINED_TAIL_S = 15.0
TIMELINE_STEP_S = 5


def anything_in_force(server: ActuatorServer) -> bool:
    """A breaker not CLOSED, or a token budget, still live at the actuator."""
    return any(s.effective_state != BreakerState.CLOSED for s in server.enforcer.status())


def overload_timeline(overload, decided, started_wall_s: float) -> str:
    """Per TIMELINE_STEP_S of the overload's sending: statuses and the slowest admitted TTFT; then the decisions."""
    started_ns = min(result.started_ns for result in overload.values())
    steps: dict[int, list] = {}
    for result in overload.values():
        for r in result.records:
            if r.send_ns is not None:
                steps.setdefault(int((r.send_ns - started_ns) / 1e9 // TIMELINE_STEP_S), []).append(r)
    lines = []
    for step, records in sorted(steps.items()):
        statuses = sorted({r.status for r in records}, key=str)
        counts = ", ".join(f"{status}: {sum(r.status == status for r in records)}" for status in statuses)
        ttfts = [r.ttft_ns / 1e9 for r in records if r.status == 200 and r.ttft_ns is not None]
        slowest = f"{max(ttfts):.2f} s" if ttfts else "-"
        lines.append(f"  sent at {step * TIMELINE_STEP_S:3d} s: {counts}; slowest admitted TTFT {slowest}")
    lines += [f"  {issued_at - started_wall_s:6.1f} s {kind} {tenant or breaker_state}: {reason}"
              for issued_at, kind, tenant, breaker_state, _, _, reason in decided]
    return "\n".join(lines)


def test_overload_is_detected_contained_and_released(tmp_path):
    require_kernel()
    with reference_server(tmp_path, slots=SLOTS, decode_ms=DECODE_MS, simulated_metrics=True) as (port, _), \
            agent(tmp_path, "--engine", f"http://127.0.0.1:{port}/metrics", "--scrape-interval", "0.5",
                  "--nvml-hz", "0", "--nice", "0", ports=[port]) as running_agent, \
            closed_loop(running_agent.store_url, server_port=port, gateway_port=free_port(), workdir=tmp_path,
                        policy=OVERLOAD_POLICY, settle_s=1.5, gateway_deadline_s=1.0) as stack:
        gateway_port, loop, actuator = stack.gateway_port, stack.loop, stack.actuator
        # below the knee: the baseline
        load_together(gateway_port, 15, {"light": 1.0, "heavy": 1.0}, seed=10)
        overload_started_wall_s = time.time()
        overload = load_together(gateway_port, OVERLOAD_S, {"light": 1.0, "heavy": 12.0}, seed=20)
        load_together(gateway_port, 10, {"light": 1.0, "heavy": 1.0}, seed=30)
        deadline = time.monotonic() + 90
        while anything_in_force(actuator) and time.monotonic() < deadline:
            time.sleep(1.0)
        released = not anything_in_force(actuator)
        after = load_together(gateway_port, 5, {"light": 1.0, "heavy": 1.0}, seed=40)
        with open_store(running_agent.store_url, serve=False) as store:
            decided = store.query_rows(
                """SELECT toUnixTimestamp64Nano(issued_at) / 1e9, kind, tenant, breaker_state, outcome,
                          length(evidence_name), reason
                   FROM tokenprobe.decisions WHERE upstream = {u:String} ORDER BY issued_at""",
                {"u": stack.upstream})

    timeline = overload_timeline(overload, decided, overload_started_wall_s)
    assert not loop.errors, f"the loop met failures: {dict(loop.errors)}\n{timeline}"
    assert decided, "no decision was recorded"
    assert all(row[4] == "applied" and row[5] > 0 for row in decided), decided
    budgets = [row[2] for row in decided if row[1] == "token_budget"]
    opened = [row for row in decided if row[1] == "breaker" and row[3] == "OPEN"]
    assert budgets and opened, decided
    # Max-min fairness: the tenant that overloads the server is the one throttled first...
    assert budgets[0] == "heavy", decided
    # ... and pays for it: the light tenant, at its usual pace, is throttled (429) far less often.
    # (An open breaker turns everyone away alike, with 503.)
    throttled = {tenant: sum(r.status == 429 for r in result.records) / len(result.records)
                 for tenant, result in overload.items()}
    rejected = sum(r.status in (429, 503) for r in overload["heavy"].records) / len(overload["heavy"].records)
    assert rejected > 0.1, f"too few rejections while overloaded: {rejected:.0%}\n{timeline}"
    assert throttled["light"] < throttled["heavy"] / 2, throttled
    # What the gateway still admitted late in the overload, once the backlog built before containment
    # had drained, was served under the objective: its p95 (of some 60 requests: p99 would be the single
    # slowest), with none near the 100 s an uncontained server makes them wait.
    late_from_ns = min(result.started_ns for result in overload.values()) + int((OVERLOAD_S - CONTAINED_TAIL_S) * 1e9)
    admitted = [r.ttft_ns / 1e9 for result in overload.values() for r in result.records
                if r.status == 200 and r.ttft_ns is not None and r.send_ns >= late_from_ns]
    assert admitted, f"nothing admitted late in the overload\n{timeline}"
    late_p95 = percentile(admitted, 0.95)
    assert late_p95 < TTFT_OBJECTIVE_S, f"admitted p95 TTFT {late_p95:.2f} s late in the overload\n{timeline}"
    assert max(admitted) < 3 * TTFT_OBJECTIVE_S, f"an admitted TTFT of {max(admitted):.2f} s late\n{timeline}"

    assert released, "decisions were still in force long after the load dropped"
    statuses = [r.status for result in after.values() for r in result.records]
    assert all(status == 200 for status in statuses), statuses
