"""`tokenprobe analyze` against a real benchmark client: NVIDIA AIPerf (PyPI) drives the reference server,
the real agent traces it, and the agent's figures, as ``analyze --json`` prints them labelled with the
tool whose definition they follow, are held to the ones AIPerf printed for the same requests.

- TPOT (AIPerf ``inter_token_latency``) and ITL (``inter_chunk_latency``): within 5%. Both span the
  decode, which the client and the server's socket see alike.
- TTFT and end to end: the client's figure holds what the server side cannot see (its connect, the
  request's and the first chunk's trips, its own event loop), so ours may only be lower, by at most
  ``NETWORK_SHARE_MS`` on loopback.

Each is compared at its mean and median, not its p90: AIPerf's worker processes, scheduled late now and
then on a busy machine, add tens of ms to a request or two (measured: 54 ms to one TTFT; 1.5 ms to one
request's TPOT, 8%), and read two chunks at once (a 0 ms gap beside a doubled one), which moves the p90
of 16 requests but not those.
Needs AIPerf in an environment of its own (``refserver.bench_client``); skipped where it is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenprobe.refserver.bench_client import find_aiperf, run_aiperf

from tests.kernel_harness import REQUIRE_KERNEL, agent, reference_server, require_kernel

pytestmark = pytest.mark.kernel

REQUESTS, CONCURRENCY, SLOTS = 16, 4, 2
DECODE_MS, OUTPUT_TOKENS = 20.0, 16  # few: TPOT over n − 1 tokens and over n differ by 6.7%
DECODE_TOLERANCE = 0.05
# What a loopback client's TTFT holds beyond the server side's: connect, two trips, its event loop (measured
# per request: 0.4-21 ms here at a load of 5-10 on 2 cores).
NETWORK_SHARE_MS = 25.0


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


def analyze_json(store_url: str, port: int, since_ns: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "tokenprobe", "analyze", "--store", store_url, "--json",
                           "--server", str(port), "--since", str(since_ns // 1_000_000_000 - 1), "--until", "now"],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout)


def test_analyze_prints_the_figures_aiperf_printed(tmp_path: Path):
    aiperf = find_aiperf()
    if aiperf is None:  # as a kernel test's: a skip where CI requires the kernel tests is a failure
        (pytest.fail if REQUIRE_KERNEL else pytest.skip)(
            "AIPerf is not installed (scripts/install.sh --test installs it in .venv-aiperf; TOKENPROBE_AIPERF names "
            "another)")
    started_ns = time.time_ns()
    with reference_server(tmp_path, slots=SLOTS, decode_ms=DECODE_MS, prefill_base_ms=20.0) as (port, _log), \
            agent(tmp_path, ports=[port]) as handle:
        client = run_aiperf(aiperf, f"http://127.0.0.1:{port}", tmp_path, model="ref-model", requests=REQUESTS,
                            concurrency=CONCURRENCY, input_tokens=64, output_tokens=OUTPUT_TOKENS)
        time.sleep(2)  # the agent's rows of the last responses
        assert handle.stop() == 0
    assert client.stat("request_count", "avg") == REQUESTS
    [ours] = analyze_json(handle.store_url, port, started_ns)["benchmark_figures"]
    assert ours["requests"] == REQUESTS
    figures = ours["figures"]
    assert "AIPerf inter_token_latency" in figures["tpot_ms"]["follows"]
    assert "AIPerf inter_chunk_latency" in figures["itl_ms"]["follows"]

    for statistic in ("avg", "p50"):
        mine = figures["tpot_ms"]["mean" if statistic == "avg" else statistic]
        assert mine == pytest.approx(client.stat("inter_token_latency", statistic), rel=DECODE_TOLERANCE), statistic
    for statistic in ("avg", "p50"):
        mine = figures["itl_ms"]["mean" if statistic == "avg" else statistic]
        assert mine == pytest.approx(client.stat("inter_chunk_latency", statistic), rel=DECODE_TOLERANCE), statistic
    for figure, metric in (("ttft_ms", "time_to_first_token"), ("e2e_ms", "request_latency")):
        for statistic in ("avg", "p50"):
            mine = figures[figure]["mean" if statistic == "avg" else statistic]
            theirs = client.stat(metric, statistic)
            assert 0 <= theirs - mine <= NETWORK_SHARE_MS, (figure, statistic, mine, theirs)
    print(f"\nAIPerf vs analyze on {REQUESTS} requests at concurrency {CONCURRENCY}, {SLOTS} slots:")
    for figure, metric in (("ttft_ms", "time_to_first_token"), ("tpot_ms", "inter_token_latency"),
                           ("itl_ms", "inter_chunk_latency"), ("e2e_ms", "request_latency")):
        print(f"  {metric:<22}" + "".join(f" {s} {client.stat(metric, s):7.1f} / {figures[figure][k]:7.1f}"
                                          for s, k in (("avg", "mean"), ("p50", "p50"), ("p90", "p90"))))
