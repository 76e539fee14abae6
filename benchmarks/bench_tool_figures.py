"""The figures `tokenprobe analyze` prints as the benchmark tools define them, beside the tool's own.

NVIDIA AIPerf (PyPI, in a venv of its own: ``TOKENPROBE_AIPERF`` names its ``aiperf``) drives a reference
server that the real agent (BPF, needs root) traces; printed per figure, AIPerf's mean, p50 and p90 and the
agent's, and their difference. The client's TTFT and end to end hold what the server side cannot see (its
connect, the trips, its own scheduling), so ours read lower by that; TPOT and ITL span the decode alike.

    python -m benchmarks.bench_tool_figures                   # from the repository root
    python -m benchmarks.bench_tool_figures --requests 64 --concurrency 8 --slots 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tokenprobe.analytics.config import DEFAULT_OBJECTIVES
from tokenprobe.analytics.scope import Scope, Server
from tokenprobe.analytics.timerange import TimeRange
from tokenprobe.analytics.tool_figures import tool_figures
from tokenprobe.refserver.bench_client import find_aiperf, run_aiperf
from tokenprobe.refserver.harness import agent, kernel_unavailable, reference_server
from tokenprobe.store.embedded import open_store

# our figure -> AIPerf's metric of the same definition
PAIRS = (("ttft_ms", "time_to_first_token"), ("tpot_ms", "inter_token_latency"),
         ("itl_ms", "inter_chunk_latency"), ("e2e_ms", "request_latency"))
STATISTICS = (("mean", "avg"), ("p50", "p50"), ("p90", "p90"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--decode-ms", type=float, default=20.0)
    args = parser.parse_args()
    aiperf, unavailable = find_aiperf(), kernel_unavailable()
    if aiperf is None or unavailable:
        raise SystemExit(unavailable or "AIPerf is not installed: pip install aiperf into a venv, TOKENPROBE_AIPERF")
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        started_ns = time.time_ns()
        with reference_server(tmp, slots=args.slots, decode_ms=args.decode_ms, prefill_base_ms=20.0) as (port, _), \
                agent(tmp, ports=[port]) as handle:
            client = run_aiperf(aiperf, f"http://127.0.0.1:{port}", tmp, model="ref-model", requests=args.requests,
                                concurrency=args.concurrency, input_tokens=64, output_tokens=args.output_tokens)
            time.sleep(2)  # the agent's rows of the last responses
            handle.stop()
        store = open_store(handle.store_url, serve=False)
        try:
            [ours] = tool_figures(store, TimeRange(started_ns, time.time_ns()), Scope((Server(port),)),
                                  DEFAULT_OBJECTIVES)
        finally:
            store.close()
    print(f"{args.requests} requests at concurrency {args.concurrency} on {args.slots} slots, "
          f"{args.output_tokens} output tokens; ms, AIPerf / tokenprobe analyze (difference)")
    for figure, metric in PAIRS:
        cells = []
        for ours_name, theirs_name in STATISTICS:
            theirs, mine = client.stat(metric, theirs_name), ours[f"{figure}_{ours_name}"]
            cells.append(f"{ours_name} {theirs:7.1f} / {mine:7.1f} ({(mine - theirs) / theirs:+.1%})")
        print(f"  {metric:<21} " + "   ".join(cells))


if __name__ == "__main__":
    main()
