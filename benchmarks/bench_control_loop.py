"""Before and after: the same overload, uncontained, through the TTFT-only loop, and through the matrix loop.

Three reference servers with the same small capacity (2 slots, 20 ms a
token, a simulated KV cache the size of their batch) are driven through the
same schedule in one run: a baseline below the knee, an overload at several
times capacity from one heavy tenant while a light tenant keeps its pace,
then the load drops. The first server takes the load directly; the other two
sit behind the gateway, with the agent tracing them (live analysis every
``ANALYZE_EVERY_S``) and the control loop deciding
(``cli.stack.closed_loop``): one on rate and TTFT alone
(``ControllerPolicy(signals="ttft")``), one also on the indicator matrix and
the in-flight queue (``signals="matrix"``). It prints, per phase and side by
side: requests, how they were answered, the client-side TTFT p50/p99 of
those served, and goodput (requests served within the TTFT objective per
second); then, per side, the time from the overload's start to containment
(to the last request sent that was admitted and not served within the
objective) and to the first decision.

Prints figures; asserts nothing. Needs root (real BPF).

    python -m benchmarks.bench_control_loop --overload-rate 12 --overload-s 45
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tokenprobe.actuator.controller import MATRIX_SIGNALS, TTFT_SIGNALS
from tokenprobe.actuator.publisher import PushOutcome
from tokenprobe.cli.stack import closed_loop
from tokenprobe.refserver.harness import agent, free_port, reference_server
from tokenprobe.refserver.loadgen import LoadResult
from tokenprobe.refserver.overload import (
    ANALYZE_EVERY_S,
    DECODE_MS,
    KV_CACHE_BLOCKS,
    OVERLOAD_POLICY,
    SLOTS,
    TTFT_OBJECTIVE_S,
    load_together,
    percentile,
)

REJECTED = (429, 503)  # the gateway's answers: turned away on purpose, not failed


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    results: dict[str, LoadResult]

    @property
    def started_ns(self) -> int:
        return min(result.started_ns for result in self.results.values())


def phase_figures(phase: Phase) -> dict:
    records = [r for result in phase.results.values() for r in result.records]
    served = [r.ttft_ns / 1e9 for r in records if r.status == 200 and r.ttft_ns is not None]
    statuses: dict[int, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "requests": len(records),
        "answers": ", ".join(f"{n}×{status or 'none'}" for status, n in sorted(statuses.items())),
        "TTFT p50 s": percentile(served, 0.5),
        "TTFT p99 s": percentile(served, 0.99),
        "goodput/s": sum(1 for t in served if t <= TTFT_OBJECTIVE_S) / phase.seconds,
    }


def schedule(port: int, overload_rate: float, overload_s: float) -> list[Phase]:
    phases = [("baseline", 15.0, {"light": 1.0, "heavy": 1.0}),
              ("overload", overload_s, {"light": 1.0, "heavy": overload_rate}),
              ("after", 15.0, {"light": 1.0, "heavy": 1.0})]
    return [Phase(name, seconds, load_together(port, seconds, rates, seed=10 * i))
            for i, (name, seconds, rates) in enumerate(phases)]


def containment_s(phases: list[Phase]) -> float | None:
    """Seconds from the overload's start to the last request sent then or later that was admitted and not
    served within the objective; None when none was."""
    overload = phases[1]
    broken = [r.send_ns for phase in phases[1:] for result in phase.results.values() for r in result.records
              if r.send_ns is not None and r.status not in REJECTED
              and (r.ttft_ns is None or r.ttft_ns / 1e9 > TTFT_OBJECTIVE_S)]
    return (max(broken) - overload.started_ns) / 1e9 if broken else None


def first_decision_s(phases: list[Phase], decisions: list[PushOutcome]) -> float | None:
    overload = phases[1]
    start_s = (overload.started_ns + next(iter(overload.results.values())).wall_offset_ns) / 1e9
    after = [o.decision.issued_at - start_s for o in decisions if o.decision.issued_at >= start_s]
    return min(after) if after else None


def controlled(workdir: Path, signals: str, args: argparse.Namespace) -> tuple[list[Phase], list[PushOutcome]]:
    workdir.mkdir()
    with reference_server(workdir, slots=SLOTS, decode_ms=DECODE_MS, simulated_metrics=True,
                          kv_cache_blocks=KV_CACHE_BLOCKS) as (port, _), \
            agent(workdir, "--engine", f"http://127.0.0.1:{port}/metrics", "--scrape-interval", "0.5",
                  "--nvml-hz", "0", "--analyze-every", str(ANALYZE_EVERY_S), ports=[port]) as traced, \
            closed_loop(traced.store_url, server_port=port, gateway_port=free_port(), workdir=workdir,
                        policy=replace(OVERLOAD_POLICY, signals=signals), settle_s=1.5) as stack:
        phases = schedule(stack.gateway_port, args.overload_rate, args.overload_s)
        return phases, list(stack.loop.decisions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overload-rate", type=float, default=12.0, help="heavy tenant's requests/s in overload")
    parser.add_argument("--overload-s", type=float, default=45.0, help="seconds of overload")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tokenprobe-bench-loop-"))
    print(f"== {SLOTS} slots, {DECODE_MS:g} ms a token; overload {args.overload_rate:g} requests/s "
          f"for {args.overload_s:g} s; TTFT objective {TTFT_OBJECTIVE_S:g} s")
    with reference_server(tmp, slots=SLOTS, decode_ms=DECODE_MS) as (port, _):
        sides = {"uncontained": (schedule(port, args.overload_rate, args.overload_s), [])}
    for signals in (TTFT_SIGNALS, MATRIX_SIGNALS):
        sides[f"{signals} loop"] = controlled(tmp / signals, signals, args)
    print(f"{'phase':<9} {'figure':<11}" + "".join(f" {name:>26}" for name in sides))
    tables = {name: [phase_figures(phase) for phase in phases] for name, (phases, _) in sides.items()}
    for index, phase in enumerate(sides["uncontained"][0]):
        for key in tables["uncontained"][index]:
            print(f"{phase.name:<9} {key:<11}" + "".join(f" {_show(table[index][key]):>26}"
                                                         for table in tables.values()))
    for name, (phases, decisions) in sides.items():
        contained = containment_s(phases)
        print(f"{name}: overload start to containment "
              f"{'never broken' if contained is None else f'{contained:.1f} s'}"
              + ("" if contained is None or contained < args.overload_s else " (not within the overload)")
              + (f"; first decision {_show(first_decision_s(phases, decisions))} s after it, "
                 f"{len(decisions)} decisions pushed" if name != "uncontained" else ""))


def _show(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
