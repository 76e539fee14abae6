"""What the agent's store writer costs, in steady state, side by side with a previous implementation.

The real request sink (``store/sink.py``) writes rows of 200-token streamed
requests at a given rate into a fresh embedded store for a while, and the
benchmark reads the CPU its writer thread took (``SinkStats.cpu_s``: the
rows' Arrow conversion and the inserts, the embedded store's work on them,
its materialized views included) after a warm-up, so neither the store's
first inserts nor its start count. Each run is a process of its own; this
checkout and the previous implementation (``--baseline REF``, installed apart)
alternate, round after round, so that the machine's drift lands on both.

``--samplers`` measures the GPU and engine samplers' writer the same way
instead: a dcgm-exporter page (two H100s) and a vLLM ``/metrics`` page, both
captures from ``tests/data``, served on loopback and scraped every second as
the agent does, their rows inserted every 5 s (this checkout's default)
against every 2 s (the previous one), alternating.

bench_hot_path shows the same cost inside the whole agent as the capture's
"store part", but its 3 s runs catch the once-every-few-seconds work of the
store by chance; this one runs long enough to hold many.

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_hot_path import previous_implementation

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
# What the samplers read: the pages a node's dcgm-exporter and vLLM serve.
SAMPLED_PAGES = {"/dcgm": DATA / "dcgm_h100x2_k8s.txt", "/engine": DATA / "fixtures" / "vllm_metrics_busy.txt"}
SAMPLER_FLUSHES_S = (5.0, 2.0)  # this checkout's default, the previous one

# The commit before the writers fed the embedded store's views themselves (its agent inserted through a view that
# passed no row on, and fed the views every 5 s).
DEFAULT_BASELINE = "f096ca5"
TOKENS = 200


def request_row(number: int, now_ns: int) -> dict:
    """A complete row of a streamed chat completion of TOKENS tokens that ended 3 s ago."""
    offsets = sorted(random.randint(0, 2_000_000) for _ in range(TOKENS))
    offsets[0] = 0
    start = now_ns - 3_000_000_000
    first = start + 60_000_000
    return {
        "node": "bench", "conn_id": 1000 + number % 64, "req_seq": number, "role": "server", "pid": 1,
        "comm": "vllm", "server_port": 8000, "client_addr": "127.0.0.1", "client_port": 40000, "tenant": "",
        "tls": False, "accept_ts": None, "tls_done_ts": None, "req_start": start, "req_end": start + 10_000,
        "resp_start": start + 50_000_000, "first_token": first, "last_token": first + offsets[-1] * 1000,
        "resp_end": first + offsets[-1] * 1000 + 100_000, "method": "POST", "path": "/v1/chat/completions",
        "status": 200, "model": "bench-model", "response_id": f"chatcmpl-{number}", "streamed": True,
        "token_events": TOKENS, "sse_events": TOKENS + 2, "token_offsets_us": offsets, "prompt_tokens": None,
        "completion_tokens": None, "inflight_at_arrival": random.randint(0, 64), "bytes_in": 300,
        "bytes_out": 50_000, "body_fp": random.getrandbits(63), "outcome": "complete", "error": "",
        "api": "openai.chat", "first_content_token": first, "choices": 1, "choice_events": TOKENS,
        "engine_prompt_ms": None, "engine_decode_ms": None, "capture": "exact", "bytes_unseen": 0,
        "protocol": "http/1.1", "stream_id": 0, "grpc_status": None, "unreadable_reason": "",
        "request_messages": 0, "request_message_bytes": 0, "response_message_bytes": 0,
        "largest_response_message_bytes": 0, "error_type": "", "engine_queue_ms": None,
        "namespace": "", "pod": "", "container": "", "pod_uid": "", "container_id": "",
    }


def write(rows_per_s: int, warm_up_s: float, seconds: float) -> None:
    """One run (in the process of the implementation measured): prints the writer's CPU seconds."""
    from tokenprobe.store.embedded import open_store
    from tokenprobe.store.sink import RequestSink

    with tempfile.TemporaryDirectory(prefix="tokenprobe-bench-writes-") as directory:
        store = open_store(f"chdb://{directory}/store", serve=False)
        store.ensure_schema()
        sink = RequestSink(store, spool_dir=f"{directory}/spool")
        started = time.monotonic()
        put = 0
        measured_from = None
        while (elapsed := time.monotonic() - started) < warm_up_s + seconds:
            if measured_from is None and elapsed >= warm_up_s:
                measured_from = sink.stats().cpu_s
            now_ns = time.time_ns()
            for _ in range(max(1, rows_per_s // 10)):  # a tenth of a second's rows at a time
                sink.put(request_row(put, now_ns))
                put += 1
            time.sleep(max(0.0, started + put / rows_per_s - time.monotonic()))
        stats = sink.close()
        store.close()
    print(stats.cpu_s - (measured_from or 0.0))


def sample(flush_s: float, warm_up_s: float, seconds: float) -> None:
    """One run of the samplers flushing every ``flush_s``: prints the CPU their inserts took."""
    from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
    from tokenprobe.agent.sampling.dcgm import DcgmScraper
    from tokenprobe.agent.sampling.engine_metrics import EngineScraper
    from tokenprobe.agent.sampling.samplers import SamplerSet
    from tokenprobe.refserver.harness import served_pages
    from tokenprobe.store.embedded import open_store

    pages = {path: file.read_bytes() for path, file in SAMPLED_PAGES.items()}
    with tempfile.TemporaryDirectory(prefix="tokenprobe-bench-samplers-") as directory, served_pages(pages) as url:
        store = open_store(f"chdb://{directory}/store", serve=False)
        store.ensure_schema()
        samplers = SamplerSet(store, "bench", MonotonicWallClock(), dcgm=[DcgmScraper(f"{url}/dcgm")],
                              engines=[EngineScraper(f"{url}/engine")], flush_interval_s=flush_s)
        samplers.start()
        time.sleep(warm_up_s)
        measured_from = samplers.stats()["write_cpu_s"]
        time.sleep(seconds)
        cpu_s = samplers.stats()["write_cpu_s"] - measured_from
        samplers.stop()
        store.close()
    print(cpu_s)


def measure(pythonpath: str | None, run: list[str], seconds: float) -> float:
    """The writer's CPU per second of one run (``--run`` or ``--run-samplers`` and its figures) of the
    implementation at ``pythonpath`` (None: this checkout)."""
    environment = dict(os.environ)
    if pythonpath:
        environment["PYTHONPATH"] = os.pathsep.join([pythonpath, str(Path(__file__).resolve().parents[1])])
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_store_writes", *run],
                          env=environment, cwd=Path(__file__).resolve().parents[1], check=True, capture_output=True,
                          text=True)
    return float(done.stdout.split()[-1]) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=int, nargs="+", default=[100, 600],
                        help="requests/s of 200 tokens each (default 100 and 600: 20k and 120k token events/s)")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds of a run (default 40)")
    parser.add_argument("--warm-up", type=float, default=10.0, help="seconds before the measurement (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each implementation once a rate (default 2)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help=f"git ref of the previous implementation (default {DEFAULT_BASELINE}, the commit before"
                             " the embedded store's views were fed apart; '' to leave it out)")
    parser.add_argument("--samplers", action="store_true",
                        help="measure the GPU and engine samplers' inserts, every 5 s against every 2 s, instead")
    parser.add_argument("--run", nargs=3, type=float, metavar=("RATE", "WARM_UP", "SECONDS"), help=argparse.SUPPRESS)
    parser.add_argument("--run-samplers", nargs=3, type=float, metavar=("FLUSH_S", "WARM_UP", "SECONDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        write(int(args.run[0]), args.run[1], args.run[2])
        return 0
    if args.run_samplers:
        sample(*args.run_samplers)
        return 0
    if min(args.rates) < 1 or args.seconds <= 0 or args.warm_up < 0 or args.rounds < 1:
        parser.error("--rates and --rounds must be positive, --seconds too, --warm-up not negative")
    if args.samplers:
        return compare_sampler_flushes(args.warm_up, args.seconds, args.rounds)
    with tempfile.TemporaryDirectory(prefix="tokenprobe-bench-baseline-") as tmp:
        implementations = {"this checkout": None}
        if args.baseline:
            implementations[f"previous ({args.baseline})"] = previous_implementation(args.baseline, Path(tmp)).pythonpath
        runs = len(args.rates) * args.rounds * len(implementations)
        print(f"the store writer at {', '.join(map(str, args.rates))} requests/s of {TOKENS} tokens, embedded store;"
              f" {args.warm_up:.0f} s warm-up, {args.seconds:.0f} s measured, {runs} runs"
              f" (about {runs * (args.warm_up + args.seconds + 3) / 60:.0f} min)", flush=True)
        cpu: dict[tuple[str, int], list[float]] = {}
        for round_number in range(args.rounds):
            for rate in args.rates:
                order = list(implementations.items())
                for name, pythonpath in order if round_number % 2 == 0 else reversed(order):
                    per_s = measure(pythonpath, ["--run", str(rate), str(args.warm_up), str(args.seconds)],
                                    args.seconds)
                    cpu.setdefault((name, rate), []).append(per_s)
                    print(f"  round {round_number + 1}, {rate} requests/s, {name}: {per_s * 1000:.0f} ms a second",
                          flush=True)
    print(f"\n{'':36}{'requests/s':>11}{'events/s':>10}{'writer CPU ms/s':>17}{'ms/1k events':>14}{'÷ this':>8}")
    for rate in args.rates:
        this = statistics.median(cpu[("this checkout", rate)])
        for name in implementations:
            per_s = statistics.median(cpu[(name, rate)])
            print(f"{name:36}{rate:11}{rate * TOKENS:10}{per_s * 1000:17.0f}{per_s * 1e6 / (rate * TOKENS):14.2f}"
                  f"{per_s / this:8.2f}")
    return 0


def compare_sampler_flushes(warm_up_s: float, seconds: float, rounds: int) -> int:
    print(f"the samplers' writer: a dcgm-exporter page (2 GPUs) and a vLLM page scraped every second, embedded store;"
          f" {warm_up_s:.0f} s warm-up, {seconds:.0f} s measured, {rounds * len(SAMPLER_FLUSHES_S)} runs", flush=True)
    cpu: dict[float, list[float]] = {}
    for round_number in range(rounds):
        for flush_s in SAMPLER_FLUSHES_S if round_number % 2 == 0 else reversed(SAMPLER_FLUSHES_S):
            per_s = measure(None, ["--run-samplers", str(flush_s), str(warm_up_s), str(seconds)], seconds)
            cpu.setdefault(flush_s, []).append(per_s)
            print(f"  round {round_number + 1}, inserts every {flush_s:.0f} s: {per_s * 1000:.1f} ms a second", flush=True)
    this = statistics.median(cpu[SAMPLER_FLUSHES_S[0]])
    print(f"\n{'inserts every':>14}{'writer CPU ms/s':>17}{'÷ every 5 s':>13}")
    for flush_s in SAMPLER_FLUSHES_S:
        per_s = statistics.median(cpu[flush_s])
        print(f"{flush_s:13.0f}s{per_s * 1000:17.1f}{per_s / this:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
