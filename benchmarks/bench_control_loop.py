"""Before and after: the same overload, uncontained and through the closed loop.

Two reference servers with the same small capacity (2 slots, 20 ms a token)
are driven through the same schedule in one run: a baseline below the knee,
an overload at several times capacity from one heavy tenant while a light
tenant keeps its pace, then the load drops. The first server takes the load
directly; the second sits behind the gateway, with the agent tracing it and
the control loop deciding (``actuator.stack.closed_loop``). It prints, per
phase and side by side: requests, how they were answered, the client-side
TTFT p50/p99 of those served, and goodput (requests served within the TTFT
objective per second).

Prints figures; asserts nothing. Needs root (real BPF).

    python -m benchmarks.bench_control_loop --overload-rate 12 --overload-s 45
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tokenprobe.cli.stack import closed_loop
from tokenprobe.refserver.harness import agent, free_port, reference_server
from tokenprobe.refserver.overload import (
    DECODE_MS,
    OVERLOAD_POLICY,
    SLOTS,
    TTFT_OBJECTIVE_S,
    load_together,
    percentile,
)


def phase_figures(results: dict, seconds: float) -> dict:
    records = [r for result in results.values() for r in result.records]
    served = [r.ttft_ns / 1e9 for r in records if r.status == 200 and r.ttft_ns is not None]
    statuses: dict[int, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "requests": len(records),
        "answers": ", ".join(f"{n}×{status or 'none'}" for status, n in sorted(statuses.items())),
        "TTFT p50 s": percentile(served, 0.5),
        "TTFT p99 s": percentile(served, 0.99),
        "goodput/s": sum(1 for t in served if t <= TTFT_OBJECTIVE_S) / seconds,
    }


def schedule(port: int, overload_rate: float, overload_s: float) -> list[tuple[str, dict]]:
    phases = [("baseline", 15.0, {"light": 1.0, "heavy": 1.0}),
              ("overload", overload_s, {"light": 1.0, "heavy": overload_rate}),
              ("after", 15.0, {"light": 1.0, "heavy": 1.0})]
    return [(name, phase_figures(load_together(port, seconds, rates, seed=10 * i), seconds))
            for i, (name, seconds, rates) in enumerate(phases)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overload-rate", type=float, default=12.0, help="heavy tenant's requests/s in overload")
    parser.add_argument("--overload-s", type=float, default=45.0, help="seconds of overload")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tokenprobe-bench-loop-"))
    print(f"== {SLOTS} slots, {DECODE_MS:g} ms a token; overload {args.overload_rate:g} requests/s "
          f"for {args.overload_s:g} s; TTFT objective {TTFT_OBJECTIVE_S:g} s")
    with reference_server(tmp, slots=SLOTS, decode_ms=DECODE_MS) as (port, _):
        uncontained = schedule(port, args.overload_rate, args.overload_s)
    with reference_server(tmp, slots=SLOTS, decode_ms=DECODE_MS, simulated_metrics=True) as (port, _), \
            agent(tmp, "--engine", f"http://127.0.0.1:{port}/metrics", "--nvml-hz", "0", ports=[port]) as traced, \
            closed_loop(traced.store_url, server_port=port, gateway_port=free_port(), workdir=tmp,
                        policy=OVERLOAD_POLICY, settle_s=1.5) as stack:
        contained = schedule(stack.gateway_port, args.overload_rate, args.overload_s)
        decisions = len(stack.loop.decisions)
    print(f"{'phase':<9} {'figure':<11} {'uncontained':>28} {'closed loop':>28}")
    for (name, before), (_, after) in zip(uncontained, contained):
        for key in before:
            print(f"{name:<9} {key:<11} {_show(before[key]):>28} {_show(after[key]):>28}")
    print(f"decisions pushed by the control loop: {decisions}")
    overload_before, overload_after = uncontained[1][1], contained[1][1]
    if overload_before["TTFT p99 s"] and overload_after["TTFT p99 s"]:
        print(f"overload TTFT p99 ratio, closed loop / uncontained: "
              f"{overload_after['TTFT p99 s'] / overload_before['TTFT p99 s']:.2f}")


def _show(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
