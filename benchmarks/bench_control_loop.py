"""Before and after: overloads of four kinds, each uncontained, through the TTFT-only loop, and through the matrix loop.

Each scenario drives three reference servers of the same make through the
same schedule (a baseline below the knee, the overload, then normal load
again). The first takes the load directly; the other two sit behind the
gateway, with the agent tracing them (live analysis every
``ANALYZE_EVERY_S``) and the control loop deciding (``cli.stack.closed_loop``):
one on rate and TTFT alone (``ControllerPolicy(signals="ttft")``), one also on
the indicator matrix and the in-flight queue (``signals="matrix"``). The
scenarios are modelled on how a vLLM server collapses:

- ``abrupt``: one tenant jumps to three times the server's capacity at once.
- ``kv-cache``: the heavy tenant's long streams (150-250 tokens) come ever
  faster; they accumulate in the engine's KV cache (``--engine-kv-blocks``,
  see ``refserver.engine``) until it is full, then the engine preempts and
  recomputes, and requests queued behind see TTFT jump. Its slots are many:
  the cache, not the batch, is the limit, as on a real GPU.
- ``retry-storm``: 1.5 times capacity from clients that resend a request at
  once, ignoring Retry-After, on a 429/5xx or when they time out (6 s
  without a byte): the retries add to the overload that caused them.
- ``ramp``: the heavy tenant's rate climbs steadily from 1 to 10 requests/s,
  crossing the knee (about 4) a third of the way in.

It prints, per scenario, per phase and side by side: requests, how they were
answered, the client-side TTFT p50/p99 of those served, and goodput
(requests served within the TTFT objective per second); then, per side and
from the overload's start: the time to containment (to the last request sent
that was admitted and not served within the objective), TTFT p99, goodput,
requests rejected (429/503), requests left without an answer (timed out,
reset), the engine's preemptions, when a request's TTFT first crossed the
objective, and when the loop first acted (a decision is pushed when its
window is decided: at its end + ``SETTLE_S``), also relative to that
crossing, its own and the uncontained side's (negative: before).

Prints figures; asserts nothing. Needs root (real BPF).

    python -m benchmarks.bench_control_loop --scenario kv-cache --scenario ramp
"""

from __future__ import annotations

import argparse
import http.client
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tokenprobe.actuator.controller import MATRIX_SIGNALS, TTFT_SIGNALS
from tokenprobe.actuator.publisher import PushOutcome
from tokenprobe.agent.sampling.prom_text import parse_exposition
from tokenprobe.cli.stack import closed_loop
from tokenprobe.refserver.harness import agent, free_port, reference_server
from tokenprobe.refserver.loadgen import LoadResult, RequestRecord
from tokenprobe.refserver.overload import (
    ANALYZE_EVERY_S,
    DECODE_MS,
    KV_CACHE_BLOCKS,
    OVERLOAD_POLICY,
    SLOTS,
    TTFT_OBJECTIVE_S,
    TenantLoad,
    load_together,
    percentile,
)

REJECTED = (429, 503)  # the gateway's answers: turned away on purpose, not failed
SETTLE_S = 1.5  # the loop decides a window this long after it ends
COLUMN = 30  # characters a side's column takes
NORMAL = {"light": 1.0, "heavy": 1.0}
# The retry storm's clients: the same SDK for every tenant, in every phase.
RETRYING = {"retries": 4, "timeout_s": 6.0}


@dataclass(frozen=True)
class Scenario:
    name: str
    # (phase name, seconds, each tenant's load); the second phase is the overload.
    phases: tuple[tuple[str, float, dict[str, float | TenantLoad]], ...]
    slots: int = SLOTS
    engine_kv_blocks: int | None = None  # the engine's KV cache, when it is the limit
    kv_gauge_blocks: int | None = KV_CACHE_BLOCKS  # the gauge of an unbounded cache: a full batch fills it

    def server(self, workdir: Path):
        return reference_server(workdir, slots=self.slots, decode_ms=DECODE_MS, simulated_metrics=True,
                                engine_kv_blocks=self.engine_kv_blocks,
                                kv_cache_blocks=None if self.engine_kv_blocks else self.kv_gauge_blocks)


SCENARIOS = {scenario.name: scenario for scenario in (
    Scenario("abrupt", (("baseline", 15.0, NORMAL), ("overload", 45.0, {"light": 1.0, "heavy": 12.0}),
                        ("after", 15.0, NORMAL))),
    # 8 slots and 48 blocks of 16 tokens: three finished long streams fill the cache.
    Scenario("kv-cache", (("baseline", 15.0, NORMAL),
                          ("overload", 45.0, {"light": 1.0, "heavy": TenantLoad(0.3, ramp_to_rate=2.0,
                                                                                 max_tokens=(150, 250))}),
                          ("after", 15.0, NORMAL)), slots=8, engine_kv_blocks=48),
    Scenario("retry-storm", (("baseline", 15.0, {t: TenantLoad(1.0, **RETRYING) for t in NORMAL}),
                             ("overload", 45.0, {"light": TenantLoad(1.0, **RETRYING),
                                                 "heavy": TenantLoad(5.0, **RETRYING)}),
                             ("after", 15.0, {t: TenantLoad(1.0, **RETRYING) for t in NORMAL}))),
    Scenario("ramp", (("baseline", 15.0, NORMAL),
                      ("overload", 60.0, {"light": 1.0, "heavy": TenantLoad(1.0, ramp_to_rate=10.0)}),
                      ("after", 15.0, NORMAL))),
)}


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    results: dict[str, LoadResult]

    @property
    def started_ns(self) -> int:
        return min(result.started_ns for result in self.results.values())

    @property
    def records(self) -> list[RequestRecord]:
        return [r for result in self.results.values() for r in result.records]


@dataclass(frozen=True)
class Side:
    phases: list[Phase]
    decisions: list[PushOutcome]
    preemptions: float | None

    @property
    def overload(self) -> Phase:
        return self.phases[1]

    @property
    def from_overload(self) -> list[RequestRecord]:
        return [r for phase in self.phases[1:] for r in phase.records]

    def seconds_after_overload(self, monotonic_ns: int) -> float:
        return (monotonic_ns - self.overload.started_ns) / 1e9


def served_ttfts(records: list[RequestRecord]) -> list[float]:
    return [r.ttft_ns / 1e9 for r in records if r.status == 200 and r.ttft_ns is not None]


def broken(record: RequestRecord) -> bool:
    """Admitted (not turned away) and not served within the objective."""
    return record.send_ns is not None and record.status not in REJECTED \
        and (record.ttft_ns is None or record.ttft_ns / 1e9 > TTFT_OBJECTIVE_S)


def answer(record: RequestRecord) -> str:
    """The status, or how the exchange failed when no whole answer came (a 200 whose stream timed out)."""
    if record.error and record.status in (0, 200):
        return record.error.split(":")[0]
    return str(record.status)


def phase_figures(phase: Phase) -> dict:
    records = phase.records
    served = served_ttfts(records)
    answers: dict[str, int] = {}
    for r in records:
        answers[answer(r)] = answers.get(answer(r), 0) + 1
    return {
        "requests": len(records),
        "answers": ", ".join(f"{n}×{name}" for name, n in sorted(answers.items())),
        "TTFT p50 s": percentile(served, 0.5),
        "TTFT p99 s": percentile(served, 0.99),
        "goodput/s": sum(1 for t in served if t <= TTFT_OBJECTIVE_S) / phase.seconds,
    }


def side_figures(side: Side, uncontained_crossed_s: float | None) -> dict:
    """From the overload's start: the figures each side is compared by."""
    records = side.from_overload
    served = served_ttfts(records)
    broken_sends = [r.send_ns for r in records if broken(r)]
    # The moment a TTFT passed the objective: the send of the first broken request, plus the objective.
    crossed = side.seconds_after_overload(min(broken_sends)) + TTFT_OBJECTIVE_S if broken_sends else None
    acted = first_decision_s(side)
    return {
        "containment s": side.seconds_after_overload(max(broken_sends)) if broken_sends else "never broken",
        "TTFT p99 s": percentile(served, 0.99),
        "goodput/s": sum(1 for t in served if t <= TTFT_OBJECTIVE_S) / sum(p.seconds for p in side.phases[1:]),
        "rejected": sum(1 for r in records if r.status in REJECTED),
        "unanswered": sum(1 for r in records if r.status not in REJECTED and r.first_token_ns is None),
        "preemptions": side.preemptions,
        "TTFT>SLO at s": crossed,
        "first act at s": acted,
        "act-own SLO s": None if acted is None or crossed is None else acted - crossed,
        "act-uncont. s": None if acted is None or uncontained_crossed_s is None else acted - uncontained_crossed_s,
        "decisions": len(side.decisions),
    }


def first_decision(side: Side) -> tuple[PushOutcome | None, float]:
    """The first decision issued from the overload's start on (they are in the order pushed), and that
    start in wall seconds."""
    start_s = (side.overload.started_ns + next(iter(side.overload.results.values())).wall_offset_ns) / 1e9
    return next((o for o in side.decisions if o.decision.issued_at >= start_s), None), start_s


def first_decision_s(side: Side) -> float | None:
    first, start_s = first_decision(side)
    return None if first is None else first.decision.issued_at + SETTLE_S - start_s


def run_phases(port: int, scenario: Scenario) -> list[Phase]:
    return [Phase(name, seconds, load_together(port, seconds, tenants, seed=10 * i))
            for i, (name, seconds, tenants) in enumerate(scenario.phases)]


def engine_preemptions(port: int) -> float | None:
    """The engine's own count (vllm:num_preemptions_total on its simulated page)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        page = parse_exposition(connection.getresponse().read().decode())
    finally:
        connection.close()
    series = page.series_by_name().get("vllm:num_preemptions_total")
    return series[0].value if series else None


def uncontained(workdir: Path, scenario: Scenario) -> Side:
    workdir.mkdir()
    with scenario.server(workdir) as (port, _):
        return Side(run_phases(port, scenario), [], engine_preemptions(port))


def controlled(workdir: Path, scenario: Scenario, signals: str) -> Side:
    workdir.mkdir()
    with scenario.server(workdir) as (port, _), \
            agent(workdir, "--engine", f"http://127.0.0.1:{port}/metrics", "--scrape-interval", "0.5",
                  "--nvml-hz", "0", "--analyze-every", str(ANALYZE_EVERY_S), ports=[port]) as traced, \
            closed_loop(traced.store_url, server_port=port, gateway_port=free_port(), workdir=workdir,
                        policy=replace(OVERLOAD_POLICY, signals=signals), settle_s=SETTLE_S) as stack:
        phases = run_phases(stack.gateway_port, scenario)
        return Side(phases, list(stack.loop.decisions), engine_preemptions(port))


def report(scenario: Scenario, sides: dict[str, Side]) -> None:
    kv = f"a KV cache of {scenario.engine_kv_blocks} blocks" if scenario.engine_kv_blocks else "an unbounded KV cache"
    print(f"\n== {scenario.name}: {scenario.slots} slots, {DECODE_MS:g} ms a token, {kv}; "
          f"TTFT objective {TTFT_OBJECTIVE_S:g} s; phases "
          + ", ".join(f"{name} {seconds:g} s" for name, seconds, _ in scenario.phases))
    header = "".join(f" {name:>{COLUMN}}" for name in sides)
    print(f"{'phase':<9} {'figure':<14}" + header)
    tables = {name: [phase_figures(phase) for phase in side.phases] for name, side in sides.items()}
    for index, (phase_name, _, _) in enumerate(scenario.phases):
        for key in tables["uncontained"][index]:
            print(f"{phase_name:<9} {key:<14}" + "".join(f" {_show(table[index][key]):>{COLUMN}}"
                                                        for table in tables.values()))
    uncontained_crossed = side_figures(sides["uncontained"], None)["TTFT>SLO at s"]
    summaries = {name: side_figures(side, uncontained_crossed) for name, side in sides.items()}
    for key in summaries["uncontained"]:
        print(f"{'overload+':<9} {key:<14}" + "".join(f" {_show(summary[key]):>{COLUMN}}"
                                                     for summary in summaries.values()))
    for name, side in sides.items():
        first, _ = first_decision(side)
        if first is not None:
            print(f"{name} first acted: {first.decision.target.describe()}: {first.decision.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                        help="run only this scenario (repeatable; default: all, in order)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tokenprobe-bench-loop-"))
    for name in args.scenario or list(SCENARIOS):
        scenario = SCENARIOS[name]
        sides = {"uncontained": uncontained(tmp / f"{name}-uncontained", scenario)}
        for signals in (TTFT_SIGNALS, MATRIX_SIGNALS):
            sides[f"{signals} loop"] = controlled(tmp / f"{name}-{signals}", scenario, signals)
        report(scenario, sides)


def _show(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
