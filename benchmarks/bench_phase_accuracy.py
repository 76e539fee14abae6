"""How well tokenprobe splits TTFT into queue and prefill, and finds the capacity knee, on real traffic.

The real agent (BPF, needs root) traces reference servers while this drives
them; their ground-truth logs say what really happened. Printed:

1. Per load level, from idle to twice the capacity of a reference server
   (open-loop Poisson load): the median and p90 of |estimated − true| queue
   and prefill time, as a share of each request's TTFT. The target is a
   median of at most 10% at every level.
2. Per slot count N of a reference server swept through closed-loop
   concurrency 1 .. 2N + 3: the knee found, from the TTFT p50 and p99
   curves, and its confidence. The target is N ± 1.

    python -m benchmarks.bench_phase_accuracy                 # from the repository root
    python -m benchmarks.bench_phase_accuracy --seconds 20 --knee-slots 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pandas as pd
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.timerange import TimeRange
from tokenprobe.refserver.groundtruth import (
    LoadLevel,
    errors_by_level,
    phase_errors,
    run_levels,
    sweep_concurrency,
)
from tokenprobe.refserver.harness import (
    agent,
    kernel_unavailable,
    read_truth,
    reference_server,
)
from tokenprobe.store.embedded import open_store

TARGET = 0.10
PROMPT_TOKENS = (16, 512)
MAX_TOKENS = (4, 16)
LOAD_OPTIONS = dict(prompt_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS, include_usage_fraction=0.5)
KNEE_LOAD_OPTIONS = dict(prompt_tokens=(16, 128), max_tokens=(8, 12), include_usage_fraction=0.5)


def capacity_rps(slots: int, prefill_base_ms: float, prefill_ms_per_token: float, decode_ms: float) -> float:
    """Requests/s the server completes when always busy: slots over the mean time a request holds one."""
    prefill_ms = prefill_base_ms + prefill_ms_per_token * sum(PROMPT_TOKENS) / 2
    decode = decode_ms * (sum(MAX_TOKENS) / 2 - 1)
    return slots / ((prefill_ms + decode) / 1000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.3, 0.5, 0.7, 0.9, 1.1, 1.4, 2.0],
                        help="load levels as shares of the server's capacity (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per load level (default %(default)s)")
    parser.add_argument("--slots", type=int, default=4, help="slots of the load-level server (default %(default)s)")
    parser.add_argument("--prefill-base-ms", type=float, default=20.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    parser.add_argument("--decode-ms", type=float, default=10.0)
    parser.add_argument("--overhead-ms", type=float, default=0.0,
                        help="the load-level server's own time per request outside its engine, at idle")
    parser.add_argument("--overhead-ms-per-request", type=float, default=0.0,
                        help="and more for every other request it holds (grows with load)")
    parser.add_argument("--knee-slots", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8],
                        help="slot counts to find the knee of (default %(default)s)")
    parser.add_argument("--requests-per-worker", type=int, default=8)
    args = parser.parse_args()
    why_not = kernel_unavailable()
    if why_not:
        parser.exit(1, f"cannot trace: {why_not}\n")

    timing = dict(prefill_base_ms=args.prefill_base_ms, prefill_ms_per_token=args.prefill_ms_per_token,
                  decode_ms=args.decode_ms)
    capacity = capacity_rps(args.slots, **timing)
    levels = [LoadLevel(f"{share:.0%} of capacity", share * capacity, args.seconds) for share in args.shares]
    tmp = Path(tempfile.mkdtemp(prefix="tokenprobe-bench-accuracy-"))
    started_ns = time.time_ns()
    print(f"reference server: {args.slots} slots, about {capacity:.1f} requests/s at capacity; "
          f"knee servers: {args.knee_slots} slots; workdir {tmp}", flush=True)
    with ExitStack() as servers:
        port, truth_log = servers.enter_context(reference_server(
            tmp, slots=args.slots, overhead_ms=args.overhead_ms, overhead_ms_per_request=args.overhead_ms_per_request,
            **timing))
        knee_ports = {slots: servers.enter_context(reference_server(tmp, slots=slots, **timing))[0]
                      for slots in args.knee_slots}
        with agent(tmp, ports=[port, *knee_ports.values()]) as handle:
            run = run_levels(port, levels, **LOAD_OPTIONS)
            for slots, knee_port in knee_ports.items():
                sweep_concurrency(knee_port, 2 * slots + 3, args.requests_per_worker, **KNEE_LOAD_OPTIONS)
            if handle.stop() != 0:
                raise SystemExit(f"the agent failed:\n{handle.log()}")
    store = open_store(handle.store_url, serve=False)
    try:
        report = analyze(store, TimeRange(started_ns, time.time_ns()))
        summary = errors_by_level(phase_errors(store, read_truth(truth_log)), run.level_of)
    finally:
        store.close()

    summary["meets 10%"] = (summary["queue_error_median"] <= TARGET) & (summary["prefill_error_median"] <= TARGET)
    with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
        print("\nqueue and prefill |estimate - truth| as a share of TTFT, per load level (aggregate: of the sums)")
        print(summary.to_string())
    knees = {port: knee for (_, port, _), knee in report.knees.items()}
    print("\nknee per slot count (target: slots +- 1)")
    print(f"{'slots':>5}  {'knee p50':>8}  {'knee p99':>8}  {'confidence':>10}  within")
    for slots, knee_port in knee_ports.items():
        knee = knees.get(knee_port)
        if knee is None:
            print(f"{slots:>5}  {'none':>8}")
            continue
        p99 = "-" if knee.knee_concurrency_p99 is None else f"{knee.knee_concurrency_p99:.1f}"
        within = "yes" if abs(knee.knee_concurrency - slots) <= 1 else "NO"
        print(f"{slots:>5}  {knee.knee_concurrency:>8.1f}  {p99:>8}  {knee.confidence:>10.2f}  {within}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
