"""How fast the analytics run: a full re-analysis of a day, and the agent's incremental live windows.

Generates the requests inside ClickHouse itself (INSERT ... SELECT FROM
numbers()) in a fresh embedded store: four servers over a day, load rising
and falling so that some requests arrive to an idle server (the prefill
calibration needs them) and some queue; streams of 8 to 32 token events.
The store computes every request's calibration-independent figures as it
stores it (``request_figures``): their cost is the generate step's.
Then times each analysis step on the whole day (``tokenprobe analyze`` over
it) and prints seconds, CPU seconds (the process's, the store's threads
included) and rows/s, so a figure taken on fewer rows
extrapolates to the 10 million of a busy day (the target: 5 s for those).
``--queries`` prints every store call's elapsed time (the store's DEBUG log)
before the line of the step that made it. With ``--baseline REF`` the whole
analysis then runs again as of that git ref, and as this checkout once more,
over the same requests (the baseline's tables added beside this checkout's).

Then the live analysis (``analytics/live.py``): another node's four servers
serve ``--live-rate`` requests/s (1000 by default) for ``--live-history``
seconds and then ``--live-windows`` windows of ``--live-every`` seconds, and
``LiveAnalysis.run_once`` analyses
each window as the agent would when it ends, publishing to the agent's /metrics as
with ``--metrics-port`` (the target: 100 ms a window at
1000 requests/s), this checkout's holding the agent's requests as its sink hands them over (each window's
rows are read from the store before its passes, untimed; the watcher's CPU and, once, the memory of a
window's held requests are printed). The clock is the benchmark's, so no window waits for time
to pass. With ``--baseline REF`` the analytics as of that git ref (loaded
apart, as package ``tokenprobe_baseline``) analyse the same windows of the
same store, each window by both in turn (alternating which goes first), so
the two medians are taken under the same load. Each prints median, p95 and
max wall time, median CPU time, and the mean of both (a pass that refits the
calibration and the knee, every ``live_refit_every_s``, weighs in it) per
window (its first pass, which builds what the later ones keep, apart); ``--live-queries`` lists the store calls of
the last window with their times. With ``--store-apart`` the passes reach the store as the DaemonSet's agent
does, over ClickHouse's HTTP protocol (here the benchmark's own store, served by this process: its wall times
then hold that server's Python too); each implementation also prints the median CPU of the thread that ran
its passes, which is then the agent's own cost of a window, the store's work on it being the server's.

    python benchmarks/bench_analytics.py                       # 1 million requests: CI's size
    python benchmarks/bench_analytics.py --rows 10000000       # a busy day
    python benchmarks/bench_analytics.py --live-windows 0 --queries   # the full pass only, query by query
    python benchmarks/bench_analytics.py --live-history 21600 --baseline 884fb47   # SLO windows full, A/B
    python benchmarks/bench_analytics.py --rows 20000 --store-apart   # the agent's own CPU a live window

Not a test: nothing is asserted. On a 2-core machine 10 million rows take
a few minutes, most of it generating the data.
"""

from __future__ import annotations

import argparse
import importlib
import io
import logging
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from tokenprobe.analytics import pipeline
from tokenprobe.analytics.calibration import calibrate
from tokenprobe.analytics.config import DEFAULT_CONFIG
from tokenprobe.analytics.held import TIMES
from tokenprobe.analytics.indicators import (
    OCCUPANCY_LOOKBACK_S,
    Windows,
    compute_matrix,
    matrix_lead_s,
)
from tokenprobe.analytics.knee import fit_knees
from tokenprobe.analytics.phases import compute_phases, phase_requests, phase_summary
from tokenprobe.analytics.pipeline import auto_window_s, server_capacities
from tokenprobe.analytics.scope import EVERYTHING
from tokenprobe.analytics.slo import evaluate_slos
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange, range_condition
from tokenprobe.contract import measures
from tokenprobe.contract.requests import REQUESTS_TABLE
from tokenprobe.refserver.overload import percentile
from tokenprobe.store.client import Store
from tokenprobe.store.embedded import open_store

SERVERS = 4
DAY_S = 86_400
DEFAULT_ROWS = 1_000_000
FULL_NODE, LIVE_NODE = "bench-node", "live-node"
CALL_COST_SAMPLES = 21
ROOT = Path(__file__).resolve().parent.parent
BASELINE_PACKAGE = "tokenprobe_baseline"

# One request per number n; 'load' swings between 0 and 1 six times over the span.
GENERATE = """
SELECT
    '{node}' AS node, n AS conn_id, 0 AS req_seq, 'server' AS role, 4242 AS pid, 'engine' AS comm,
    8000 + n % {servers} AS server_port,
    concat('10.0.', toString(intDiv(n % 200, 50)), '.', toString(n % 50)) AS client_addr,
    toUInt16(30000 + n % 30000) AS client_port, '' AS tenant, false AS tls,
    fromUnixTimestamp64Nano(toInt64(start_ns - 1000000)) AS accept_ts, NULL AS tls_done_ts,
    fromUnixTimestamp64Nano(toInt64(start_ns)) AS req_start,
    fromUnixTimestamp64Nano(toInt64(start_ns + 200000)) AS req_end,
    fromUnixTimestamp64Nano(toInt64(start_ns + 250000)) AS resp_start,
    fromUnixTimestamp64Nano(toInt64(first_ns)) AS first_token,
    fromUnixTimestamp64Nano(toInt64(first_ns + offsets[-1] * 1000)) AS last_token,
    fromUnixTimestamp64Nano(toInt64(first_ns + offsets[-1] * 1000 + 300000)) AS resp_end,
    'POST' AS method, '/v1/chat/completions' AS path, 200 AS status, 'bench-model' AS model,
    concat('chatcmpl-bench-', toString(n)) AS response_id, true AS streamed,
    length(offsets) AS token_events, length(offsets) + 3 AS sse_events, offsets AS token_offsets_us,
    if(n % 2 = 0, prompt, NULL) AS prompt_tokens, if(n % 2 = 0, length(offsets), NULL) AS completion_tokens,
    inflight AS inflight_at_arrival, 300 + prompt * 4 AS bytes_in, 200 + 60 * length(offsets) AS bytes_out,
    cityHash64(n) AS body_fp, 'complete' AS outcome, '' AS error, 'openai.chat' AS api,
    first_token AS first_content_token, 1 AS choices, token_events AS choice_events,
    NULL AS engine_prompt_ms, NULL AS engine_decode_ms,
    'exact' AS capture, toUInt64(0) AS bytes_unseen, 'http/1.1' AS protocol, toUInt32(0) AS stream_id,
    NULL AS grpc_status, '' AS unreadable_reason, toUInt32(0) AS request_messages,
    toUInt64(0) AS request_message_bytes, toUInt64(0) AS response_message_bytes,
    toUInt32(0) AS largest_response_message_bytes,
    '' AS error_type, NULL AS engine_queue_ms,
    '' AS namespace, '' AS pod, '' AS container, '' AS pod_uid, '' AS container_id
FROM (
    SELECT number AS n,
        {start_ns} + toInt64(n * ({span_ns} / {requests})) AS start_ns,
        (1 + sin(2 * pi() * 6 * n / {requests})) / 2 AS load,
        toUInt32(floor(load * 10 * (cityHash64(n, 1) % 100) / 100)) AS inflight,
        toUInt32(16 + cityHash64(n, 2) % 500) AS prompt,
        arrayMap(k -> toUInt32(k * 10000 + cityHash64(n, k) % 800), range(8 + cityHash64(n, 3) % 25)) AS offsets,
        start_ns + 200000 + if(inflight >= 4, (inflight - 3) * 60000000, 0) + (20 + prompt / 10) * 1000000
            AS first_ns
    FROM numbers({requests})
)
"""


def process_cpu_s() -> float:
    """CPU seconds of this process, the embedded store's threads (its background merges too) included:
    steadier than wall time on a machine shared with other work."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def print_timing(label: str, rows: int, seconds: float, cpu_s: float, note: str = "") -> None:
    print(f"  {label:<34} {seconds:8.2f} s {cpu_s:8.2f} CPU-s {rows / seconds:12,.0f} requests/s{note}", flush=True)


def timed(label: str, rows: int, step) -> object:
    started, cpu_started = time.perf_counter(), process_cpu_s()
    result = step()
    print_timing(label, rows, time.perf_counter() - started, process_cpu_s() - cpu_started)
    return result


def log_store_calls(handler: logging.Handler) -> None:
    """Every store call's elapsed time, as the store logs it at DEBUG, goes to ``handler``."""
    store_log = logging.getLogger(Store.__module__)
    store_log.addHandler(handler)
    store_log.setLevel(logging.DEBUG)


def generate(store, node: str, start_ns: int, span_s: int, requests: int) -> None:
    store.insert_select(REQUESTS_TABLE, GENERATE.format(node=node, servers=SERVERS, start_ns=start_ns,
                                                        span_ns=span_s * NS_PER_S, requests=requests))


def agent_live_analysis(package: str, **options) -> Callable[..., object]:
    """``LiveAnalysis`` of the product installed as ``package``, as an agent with ``--metrics-port`` runs it:
    each pass also published to the agent's /metrics (its ``MetricsOutlet``); ``options`` as the agent gives
    them."""
    live = importlib.import_module(f"{package}.analytics.live").LiveAnalysis
    outlets = importlib.import_module(f"{package}.analytics.outlets")
    metrics = importlib.import_module(f"{package}.agent.export.metrics_endpoint")
    return lambda *args, **kwargs: live(*args, outlets=[outlets.MetricsOutlet(metrics.AgentMetrics())], **options,
                                        **kwargs)


def agents_rows(store, ended: TimeRange) -> list[dict]:
    """The live node's requests that ended in ``ended``, as the agent's sink takes its rows (the columns
    ``HeldRequests`` keeps; timestamps in Unix ns)."""
    # named apart: an alias would stand for the column in the condition too
    times = ", ".join(f"toUnixTimestamp64Nano({name}) AS {name}_ns" for name in TIMES)
    in_range, parameters = range_condition(measures.ENDED_AT, "ended", ended)
    frame = store.query_df(
        f"SELECT node, method, server_port, model, conn_id, req_seq, {times}, prompt_tokens, bytes_in"
        f" FROM {store.table(REQUESTS_TABLE)} WHERE node = '{LIVE_NODE}' AND {in_range}", parameters)
    frame = frame.rename(columns={f"{name}_ns": name for name in TIMES})
    frame["prompt_tokens"] = frame["prompt_tokens"].astype(object).where(frame["prompt_tokens"].notna(), None)
    return frame.to_dict("records")


def load_baseline(ref: str, directory: Path) -> None:
    """Make the product as of git ``ref`` importable as ``BASELINE_PACKAGE`` (it imports itself relatively,
    so it loads under another name); once."""
    if (directory / BASELINE_PACKAGE).exists():
        return
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory / BASELINE_PACKAGE, filter="data")
    sys.path.insert(0, str(directory))


def add_baseline_tables(store) -> None:
    """The tables the baseline writes that this checkout's schema has no more (or not yet)."""
    registry = importlib.import_module(f"{BASELINE_PACKAGE}.contract.registry")
    for statement in registry.create_statements(store.database, embedded=True):
        store.command(statement)


class CollectedCalls(logging.Handler):
    """The store calls a stretch of work made, as the store logs them at DEBUG: (statement, seconds)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.taken: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        seconds, _, statement = record.getMessage().strip().partition(" s  ")
        self.taken.append((statement[:100], float(seconds)))


def call_seconds(store) -> float:
    started = time.perf_counter()
    store.query_rows("SELECT 1")
    return time.perf_counter() - started


def live_windows(store, end_ns: int, rate: int, every_s: int, windows: int, history_s: int,
                 implementations: dict[str, Callable[..., object]], show_queries: bool = False,
                 live_store=None) -> None:
    """Time the live analysis of each of ``windows`` windows of ``rate`` requests/s, ending at ``end_ns``,
    after ``history_s`` of the same traffic (what a pass reads back: occupancy, calibration, SLO windows),
    by each implementation in turn: wall time, and CPU time (the process's, chDB's threads included:
    less moved by other work on a shared machine). The first window of each is its first pass (it builds
    what later passes keep) and is shown apart. ``show_queries``: each statement of the last window.
    ``live_store``: the store the passes use (default ``store``; a client of it over HTTP for --store-apart),
    whose pass-thread CPU is then printed too."""
    span_s = history_s + windows * every_s
    start_ns = end_ns - span_s * NS_PER_S
    timed(f"generate {rate:,} requests/s for {span_s} s", rate * span_s,
          lambda: generate(store, LIVE_NODE, start_ns, span_s, rate * span_s))
    window_ns = every_s * NS_PER_S
    first_end_ns = end_ns - windows * window_ns
    clock = [first_end_ns]
    pass_store = store if live_store is None else live_store
    passes = {name: live(pass_store, LIVE_NODE, every_s=every_s, settle_s=0, clock_ns=lambda: clock[0])
              for name, live in implementations.items()}
    # Those that hold the agent's requests get each window's as the agent's sink hands them over.
    holding = {name: live.held for name, live in passes.items() if getattr(live, "held", None) is not None}
    holding_s: list[float] = []
    held_bytes = None
    queries = CollectedCalls() if show_queries else None
    if queries:
        log_store_calls(queries)
    seconds: dict[str, list[tuple[float, float, float]]] = {name: [] for name in passes}
    last_queries: dict[str, list[tuple[str, float]]] = {}
    for index in range(windows):
        clock[0] = first_end_ns + (index + 1) * window_ns
        if holding:
            rows = agents_rows(store, TimeRange(clock[0] - window_ns, clock[0]))
            for held in holding.values():
                tracing = held_bytes is None and index == 1  # a window of the steady state, once
                if tracing:
                    tracemalloc.start()
                started = time.thread_time()
                for row in rows:
                    held.add(row)
                holding_s.append(time.thread_time() - started)
                if tracing:
                    held_bytes = tracemalloc.get_traced_memory()[0]
                    tracemalloc.stop()
        names = list(passes) if index % 2 == 0 else list(reversed(passes))
        for name in names:
            if queries:
                queries.taken = []
            started, cpu_started, thread_started = time.perf_counter(), time.process_time(), time.thread_time()
            passes[name].run_once()
            seconds[name].append((time.perf_counter() - started, time.process_time() - cpu_started,
                                  time.thread_time() - thread_started))
            if queries:
                last_queries[name] = queries.taken
    per_window = rate * every_s
    print(f"  live windows of {every_s} s at {rate:,} requests/s ({per_window:,} requests each), {windows} windows"
          " (the first, each one's first pass, apart):")
    for name, taken in seconds.items():
        (first_wall, first_cpu, _), later = taken[0], taken[1:] or taken
        wall, cpu = [wall for wall, _, _ in later], [cpu for _, cpu, _ in later]
        own = (f"; the agent's own CPU (its pass thread) median {statistics.median(t for *_, t in later) * 1000:.0f} ms"
               if live_store is not None else "")
        print(f"    {name:<24} median {statistics.median(wall) * 1000:6.0f} ms,"
              f" p95 {percentile(wall, 0.95) * 1000:6.0f} ms, max {max(wall) * 1000:6.0f} ms;"
              f" CPU median {statistics.median(cpu) * 1000:6.0f} ms; mean {statistics.mean(wall) * 1000:6.0f} ms"
              f" (CPU {statistics.mean(cpu) * 1000:6.0f} ms); first pass {first_wall:5.1f} s"
              f" (CPU {first_cpu:5.1f} s); {per_window / statistics.median(wall):10,.0f} requests/s{own}", flush=True)
    if holding_s:
        traced = "" if held_bytes is None else (f"; a window's requests held: {held_bytes / 2**20:.1f} MiB"
                                                f" ({held_bytes / per_window:.0f} B a request, tracemalloc)")
        print(f"    holding a window's requests (the sink's watcher, on the capture thread): CPU median"
              f" {statistics.median(holding_s) * 1000:.0f} ms{traced}")
    if queries:  # what a call costs however little it reads: what merging two calls saves at most
        queries.taken = []  # not the last window's
        print(f"    a store call's own cost (SELECT 1, median of {CALL_COST_SAMPLES}):"
              f" {statistics.median(call_seconds(store) for _ in range(CALL_COST_SAMPLES)) * 1000:.1f} ms")
    for name, taken in last_queries.items():
        print(f"    {name}: {len(taken)} store calls in the last window, {sum(s for _, s in taken) * 1000:.0f} ms:")
        for statement, spent in taken:
            print(f"      {spent * 1000:7.1f} ms  {statement}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", "--requests", type=int, default=DEFAULT_ROWS, dest="rows",
                        help="requests over the day of the full analysis (default %(default)s)")
    parser.add_argument("--live-rate", type=int, default=1000, help="requests/s of the live windows")
    parser.add_argument("--live-every", type=int, default=30, help="seconds per live window (the agent's default)")
    parser.add_argument("--live-windows", type=int, default=5, help="live windows to time (0: none)")
    parser.add_argument("--live-history", type=int, default=int(OCCUPANCY_LOOKBACK_S) + 60, metavar="S",
                        help="seconds of traffic before the first live window (default: the occupancy look-back"
                             " and a minute, as an agent in steady state; the SLO windows reach back 6 h)")
    parser.add_argument("--baseline", metavar="REF", help="also time the live windows of the analytics as of this "
                                                         "git ref, window by window with this checkout's")
    parser.add_argument("--queries", action="store_true", help="print each store call's elapsed time")
    parser.add_argument("--live-queries", action="store_true",
                        help="print each store call of the last live window, with its time")
    parser.add_argument("--store-apart", action="store_true",
                        help="the live passes reach the store over HTTP, as the DaemonSet's agent reaches its"
                             " ClickHouse server; prints their own thread's CPU (the agent's cost of a window)")
    parser.add_argument("--store", metavar="DIR", help="where to build the store (default: a temporary folder, "
                                                      "removed afterwards)")
    args = parser.parse_args()
    if args.rows < 1000:
        parser.error("--rows must be at least 1000")
    if args.live_rate < 1 or args.live_every < 1 or args.live_windows < 0 or args.live_history < 0:
        parser.error("--live-rate and --live-every must be positive, --live-windows and --live-history not negative")
    directory = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="tokenprobe-bench-analytics-"))
    baseline_directory = Path(tempfile.mkdtemp(prefix="tokenprobe-bench-baseline-"))
    config = DEFAULT_CONFIG
    end_ns = time.time_ns() // NS_PER_S * NS_PER_S
    analysed = TimeRange(end_ns - DAY_S * NS_PER_S, end_ns)
    store = open_store(f"chdb://{directory}", serve=args.store_apart)
    live_store = None
    try:
        store.ensure_schema()
        if args.queries:  # printed before the line of the step that made them
            printed = logging.StreamHandler(sys.stdout)
            printed.setFormatter(logging.Formatter("      %(message)s"))
            log_store_calls(printed)
        n = args.rows
        print(f"{n:,} requests from {SERVERS} servers over {DAY_S // 3600} h, embedded store in {directory}")
        timed("generate (INSERT ... SELECT)", n, lambda: generate(store, FULL_NODE, analysed.start_ns, DAY_S, n))
        window_s = auto_window_s(analysed)
        lead_s = matrix_lead_s(window_s, config.thresholds)
        phases_range = TimeRange(Windows(analysed, window_s, lead_s).base_ns,
                                 analysed.end_ns).extended_back(OCCUPANCY_LOOKBACK_S)
        now_ns = time.time_ns()
        print(f"analysis over the day, windows of {window_s} s:")
        analysis_started, analysis_cpu_started = time.perf_counter(), process_cpu_s()
        calibrations = timed("prefill calibration", n, lambda: calibrate(store, phases_range, EVERYTHING,
                                                                         config.spans, now_ns))
        timed("phases (INSERT ... SELECT)", n, lambda: compute_phases(
            store, phase_requests(store, phases_range, EVERYTHING, config.thresholds), calibrations, now_ns))
        timed("phase summary", n, lambda: phase_summary(store, analysed, EVERYTHING, config.thresholds))
        knees = timed("knee", n, lambda: fit_knees(store, analysed, EVERYTHING, config.spans, now_ns))
        cells = timed("indicator matrix", n, lambda: compute_matrix(
            store, analysed, window_s, EVERYTHING, config.thresholds, server_capacities(knees, knees), now_ns))
        timed("SLO burn rates (last 6 h)", n, lambda: evaluate_slos(store, analysed.end_ns, config.objectives,
                                                                   EVERYTHING))
        full_s, full_cpu_s = time.perf_counter() - analysis_started, process_cpu_s() - analysis_cpu_started
        found = ", ".join(f"{port}: {knee.knee_concurrency}" for (_, port, _), knee in sorted(knees.items()))
        print(f"{len(calibrations)} calibrations, knees {{{found}}}, {len(cells)} matrix cells")
        print_timing("full analysis", n, full_s, full_cpu_s, f"  (10M requests: {10_000_000 * full_s / n:.1f} s,"
                     f" {10_000_000 * full_cpu_s / n:.1f} CPU-s at this rate)")
        if args.baseline:  # the whole analysis again, as the baseline runs it, over the same requests
            load_baseline(args.baseline, baseline_directory)
            add_baseline_tables(store)
            baseline = importlib.import_module(f"{BASELINE_PACKAGE}.analytics.pipeline")
            for label, analysis in ((f"full analysis, baseline ({args.baseline})", baseline),
                                    ("full analysis, this checkout, again", pipeline)):
                started, cpu_started = time.perf_counter(), process_cpu_s()
                analysis.analyze(store, analysed, window_s=window_s, now_ns=time.time_ns(), schema_ready=True)
                seconds, cpu_s = time.perf_counter() - started, process_cpu_s() - cpu_started
                print_timing(label, n, seconds, cpu_s, f"  (10M requests: {10_000_000 * seconds / n:.1f} s,"
                             f" {10_000_000 * cpu_s / n:.1f} CPU-s at this rate)")
        if args.live_windows:
            print("live analysis (the agent's incremental windows, another node's servers):")
            implementations = {"this checkout": agent_live_analysis("tokenprobe", hold_requests=True)}
            if args.baseline:
                load_baseline(args.baseline, baseline_directory)
                implementations[f"baseline ({args.baseline})"] = agent_live_analysis(BASELINE_PACKAGE)
                add_baseline_tables(store)  # again: harmless, and needed where the full analysis had none
            if args.store_apart:  # this process owns the store: opened again, it is a client of its server
                live_store = open_store(f"chdb://{directory}")
            live_windows(store, end_ns, args.live_rate, args.live_every, args.live_windows, args.live_history,
                         implementations, args.live_queries, live_store)
    finally:
        if live_store is not None:
            live_store.close()
        store.close()
        shutil.rmtree(baseline_directory, ignore_errors=True)
        if not args.store:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
