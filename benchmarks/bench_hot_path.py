"""The agent's hot path as a busy node sees it: token events per second on one core, side by side.

A C server (benchmarks/firehose.c, built here with cc) streams OpenAI chat
chunks (vLLM's, or another server's: --shape), one write per event, over keep-alive connections held by its own
clients (in the same C loop, so that neither is the bottleneck; connected once per
stream count and warmed up, as a node's keep-alive pool is), on CPU 0. The
real `tokenprobe agent` runs pinned to CPU 1 and reports through its own
/metrics what it handled and what the kernel dropped. Per implementation — this
checkout with kernel batching (the default), this checkout with
--no-kernel-batching, and a previous one given as a git ref (default: the
commit before kernel batching kept templates across responses) — it prints:

- for 1, 64 and 512 concurrent streams: per offered rate, the token events the
  clients read per second, the kernel records the agent handled per second and
  the writes that came batched in them, the records per response, the share of
  records the kernel dropped, the agent's CPU per 1k token events (its capture's:
  the passes of its live analysis are counted apart, from the agent's own
  counter, and spread over the token events of the requests they analysed),
  the part of it its store writer took (the rows' inserts, from the agent's own
  counter: with the embedded store, the store's work on them), the part its main
  thread took (reading the kernel's records: tracking, parsing, making rows; the
  rest is the store's own threads, its merges, and the agent's others) and its
  RSS; and
  the highest rate it kept up with, no drops;
- the watched server at a fixed offered rate: events delivered per second, the
  firehose's own CPU per 1k events (where the probes' work in its calls shows)
  and client-side p50/p99 TTFT without an agent and with each implementation,
  in rounds that alternate them (A B A B ...): per implementation the median
  of its per-round ratio and p99 TTFT added, and their spread;
- then all of it side by side, one line per implementation and stream count.

``--steady`` measures instead what a node pays in steady state, which the
short runs above cannot show (they take the agent's idle cost off, and a
live analysis pass, every 30 s, costs about the same whatever a window
holds): 64 streams at each offered rate (default 10k and 100k events/s)
held for ``--seconds`` (default 90: three of the live analysis' windows)
after STEADY_WARM_UP_S (the agent's first pass, which counts its whole past,
falls there), one agent for all the rates; per implementation and rate, the
whole agent's CPU (every thread: capture, store writer, live analysis, the
store's merges, idle work), its parts, per second and per 10k events/s as a
share of one core, beside the events delivered and dropped. This checkout runs
in two shapes, one after the other: with its embedded store (the demo's and a
single node's: the store's engine, its inserts, merges and the analysis'
queries, runs inside the agent) and with the store in a process of its own
(the DaemonSet's: the agent writes to a ClickHouse server off the node; here
the embedded store's owner, served over HTTP, pinned to the load's CPU), whose
CPU is printed beside the agent's.

Prints figures; asserts nothing. Needs root (real BPF), cc and git. `--quick`
takes fewer rates for less time each, and the server's figures in three rounds
for this checkout alone (about 8 minutes in all).

    .venv/bin/python -m benchmarks.bench_hot_path [--quick] [--baseline REF] [--rates ...] [--seconds S]
        [--rounds N] [--shape vllm|bare|openai|starlette|anthropic|ollama] [--streams N ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Iterator

from tokenprobe.refserver.harness import free_port, wait_for_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AGENT_CPU, LOAD_CPU = "1", "0"
WARM_UP_S = 2.0
TICKS = os.sysconf("SC_CLK_TCK")
# How long to wait for the agent's live analysis (a pass every 30 s, 3 s behind the clock) to reach the
# requests of the last run: its passes' CPU is then spread over all the requests it analysed.
ANALYSIS_WAIT_S = 45.0
# --steady: how long a rate runs before it is measured (the live analysis' first pass, the agent's past,
# falls here at the first rate; at the next ones, a pass over the change of rate).
STEADY_WARM_UP_S = 40.0



@dataclass
class Implementation:
    name: str
    pythonpath: str | None  # None: this checkout as installed
    agent_args: tuple[str, ...] = ()


# The stream shapes benchmarks/firehose.c serves (its SHAPES), and the API path each answers: vLLM's chunks;
# chunks without `created` and `model`; OpenAI's own (a system_fingerprint, logprobs null); sse-starlette's
# CRLF framing; Anthropic's named events; Ollama's NDJSON lines.
SHAPES = {"vllm": "/v1/chat/completions", "bare": "/v1/chat/completions", "openai": "/v1/chat/completions",
          "starlette": "/v1/chat/completions", "anthropic": "/v1/messages", "ollama": "/api/chat"}


@dataclass(frozen=True)
class FirehoseBinary:
    """benchmarks/firehose.c built, and the shape of the streams it is to serve (SHAPES)."""

    path: Path
    shape: str


def build_firehose(tmp: Path) -> Path:
    binary = tmp / "firehose"
    subprocess.run(["cc", "-O2", "-o", str(binary), str(HERE / "firehose.c")], check=True)
    return binary


def previous_implementation(ref: str, tmp: Path) -> Implementation:
    """The agent as of ``ref``, installed apart (no dependencies: they are this venv's)."""
    source, site = tmp / "baseline-src", tmp / "baseline-site"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(source), ref],
                   check=True, capture_output=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "--target", str(site), str(source)],
                       check=True, capture_output=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(source)], capture_output=True)
    return Implementation(f"previous ({ref})", str(site))


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """The user and system CPU a process (or one of its threads) has spent so far."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    stat = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / TICKS


@dataclass(frozen=True)
class AgentFigures:
    """What an agent has done and spent so far: kernel records handled and dropped, writes that came
    batched, CPU seconds (the process's, its main thread's, its live analysis passes' and its store
    writer's inserts', from its own counters: 0 where it has none), RSS bytes, and the request rows it
    stored and the live analysis passes that completed and failed (so a cheap figure is not a silent one)."""

    records: float
    drops: float
    batched: float
    cpu_s: float
    rss: int
    analysis_cpu_s: float
    store_cpu_s: float
    main_cpu_s: float
    rows_written: float = 0.0
    passes: float = 0.0
    pass_failures: float = 0.0

    def minus(self, earlier: AgentFigures) -> AgentFigures:
        """What was done and spent since ``earlier`` (the RSS: now)."""
        return AgentFigures(*(now - then if name != "rss" else now for name, now, then in zip(
            self.__dataclass_fields__, astuple(self), astuple(earlier), strict=True)))


def metric(page: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", page, re.MULTILINE)
    return float(match[1]) if match else 0.0


# A process that owns an embedded store and serves it, as a ClickHouse server would, until its stdin closes.
STORE_OWNER = """
import sys
from tokenprobe.store.embedded import open_store
store = open_store(sys.argv[1])
print("serving", flush=True)
sys.stdin.read()
store.close()
"""


class StoreOwner:
    """The agent's store in a process of its own (``--steady``'s DaemonSet shape), pinned to the load's CPU:
    the agent, opening the same directory, finds it owned and writes and reads through it over HTTP."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen(["taskset", "-c", LOAD_CPU, sys.executable, "-c", STORE_OWNER, url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "serving":
            self.proc.kill()
            raise RuntimeError(f"the store owner of {url} did not start (exit {self.proc.wait()})")

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class AgentProcess:
    """`tokenprobe agent` pinned to one CPU, read through its /metrics and /proc; with ``store_apart``, its
    store owned by a ``StoreOwner`` started before it (``owner``), else embedded in the agent."""

    def __init__(self, impl: Implementation, port: int, tmp: Path, store_apart: bool = False):
        self.log_path = tmp / f"agent-{port}.log"
        self.store_url = f"chdb://{tmp / f'store-{port}'}"
        self.owner = StoreOwner(self.store_url) if store_apart else None
        try:
            # A free port may be taken before the agent binds it (its store's own server binds an
            # ephemeral one first): then the agent exits, and starts again on another.
            for _ in range(3):
                if self._start(impl, port, tmp):
                    return
            raise self._did_not_start()
        except BaseException:  # an agent that did not start leaves no store owner behind
            if self.owner is not None:
                self.owner.stop()
            raise

    def _start(self, impl: Implementation, port: int, tmp: Path) -> bool:
        """True once the agent traces; False when it exited because its metrics port was taken."""
        self.metrics_port = free_port()
        env = dict(os.environ, TOKENPROBE_FINGERPRINT_KEY="bench-key", HOME=str(tmp))
        if impl.pythonpath:
            env["PYTHONPATH"] = impl.pythonpath
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                ["taskset", "-c", AGENT_CPU, sys.executable, "-m", "tokenprobe", "agent", "--port", str(port),
                 "--store", self.store_url, "--quiet", "--metrics-port", str(self.metrics_port),
                 *impl.agent_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        deadline = time.monotonic() + 240  # the first compile of the BPF program takes a while
        while "tracing ports" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                if "Address already in use" in self.log_path.read_text(errors="replace"):
                    return False
                raise self._did_not_start()
            if time.monotonic() > deadline:
                raise self._did_not_start()
            time.sleep(0.2)
        wait_for_port(self.metrics_port)
        return True

    def _did_not_start(self) -> RuntimeError:
        return RuntimeError(f"agent did not start:\n{self.log_path.read_text(errors='replace')[-2000:]}")

    def settled_figures(self) -> tuple[AgentFigures, float, float]:
        """The figures once the agent has handled what the kernel holds (they stop moving; the agent
        publishes them every second, so two publications apart), the CPU seconds a second it spent
        between those two (its live analysis' passes apart), and when they were read."""
        time.sleep(2.5)
        previous, previous_at = self.figures(), time.monotonic()
        for _ in range(20):
            time.sleep(2.5)
            current, now = self.figures(), time.monotonic()
            if (current.records, current.drops) == (previous.records, previous.drops):
                since = current.minus(previous)
                spent = since.cpu_s - since.analysis_cpu_s
                return current, spent / (now - previous_at), now
            previous, previous_at = current, now
        return previous, 0.0, previous_at  # never settled: nothing to take off

    def figures(self) -> AgentFigures:
        """What the agent has done and spent so far (``AgentFigures``)."""
        page = self.page()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{self.proc.pid}/status").read_text())[1]) * 1024
        return AgentFigures(
            records=metric(page, "tokenprobe_agent_events_total"), drops=metric(page, "tokenprobe_agent_drops_total"),
            batched=metric(page, "tokenprobe_agent_batched_writes_total"), cpu_s=cpu_seconds(self.proc.pid),
            rss=rss, analysis_cpu_s=metric(page, "tokenprobe_agent_analysis_cpu_seconds_total"),
            store_cpu_s=metric(page, "tokenprobe_agent_store_write_cpu_seconds_total"),
            main_cpu_s=cpu_seconds(self.proc.pid, thread=self.proc.pid),
            rows_written=metric(page, "tokenprobe_agent_rows_written_total"),
            passes=metric(page, "tokenprobe_agent_analysis_passes_total"),
            pass_failures=metric(page, "tokenprobe_agent_analysis_failures_total"))

    def page(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()

    def analysis(self, until: float) -> tuple[float, float] | None:
        """(CPU seconds its passes took, Unix time up to which they analysed the requests that ended) once
        a pass has analysed those that ended by ``until`` (Unix s), or a window and a half went by; None
        from an agent that does not count the passes' CPU (an implementation before it did)."""
        deadline = time.monotonic() + ANALYSIS_WAIT_S
        while True:
            page = self.page()
            if "tokenprobe_agent_analysis_cpu_seconds_total" not in page:
                return None
            analysed_until = metric(page, "tokenprobe_agent_analysed_until_seconds")
            if analysed_until >= until or time.monotonic() > deadline:
                return metric(page, "tokenprobe_agent_analysis_cpu_seconds_total"), analysed_until
            time.sleep(1.0)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.owner is not None:
            self.owner.stop()


@dataclass
class LoadFigures:
    """What the firehose's clients read in one run."""

    events_per_s: float
    responses: int  # that ended
    ttft_p50_ms: float
    ttft_p99_ms: float
    # The firehose's own CPU (server and clients, the probes' work in its calls included) per 1k events.
    load_cpu_per_1k_ms: float = 0.0


@dataclass
class Capacity:
    """What one implementation did for one stream count."""

    streams: int
    kept_up: float = 0.0  # the highest rate with no drops, events/s
    cpu_per_1k_ms: float = 0.0  # at that rate: the capture's, the live analysis' passes apart
    records_per_response: float = 0.0  # at that rate
    rss_mib: float = 0.0
    # The live analysis' passes over the agent's run, per 1k token events of the requests they analysed
    # (None: not counted by that implementation, its passes are in cpu_per_1k_ms where they fell).
    analysis_per_1k_ms: float | None = None

    @property
    def total_per_1k_ms(self) -> float:
        return self.cpu_per_1k_ms + (self.analysis_per_1k_ms or 0.0)


class ResponseLog:
    """When the firehose's responses ended, report by report: how many a moment had seen end."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float, int]] = []  # (from, to: Unix s; responses that ended in it)
        self._since = time.time()

    def add(self, responses: int) -> None:
        now = time.time()
        self._spans.append((self._since, now, responses))
        self._since = now

    @property
    def last_report(self) -> float:
        """When the last report was taken (Unix s): no response it counted ended later."""
        return self._since

    def ended_by(self, moment: float) -> float:
        """Responses that ended by ``moment``, those of a span it cuts prorated."""
        return sum(n if to <= moment else n * max(0.0, moment - start) / max(to - start, 1e-9)
                   for start, to, n in self._spans)


class Firehose:
    """benchmarks/firehose.c on CPU 0, listening before the agent starts; its rate set on stdin."""

    def __init__(self, binary: FirehoseBinary, port: int, tokens: int):
        self.proc = subprocess.Popen(["taskset", "-c", LOAD_CPU, str(binary.path), str(port), str(tokens),
                                      binary.shape],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "listening":
            raise RuntimeError("the firehose did not start")

    def rate(self, events_per_s: float) -> None:
        self._command(f"{events_per_s}")

    def clients(self, streams: int) -> None:
        """That many keep-alive clients from now on, each asking again when a response ends."""
        self._command(f"clients {streams}")

    def report(self, seconds: float) -> LoadFigures:
        """What the clients read since the last report, over the `seconds` it took."""
        self._command("report")
        fields = self.proc.stdout.readline().split()
        if len(fields) != 5 or fields[0] != "received":
            raise RuntimeError(f"the firehose said {' '.join(fields)!r} to a report")
        events, responses, p50_us, p99_us = map(float, fields[1:])
        return LoadFigures(events / seconds, int(responses), p50_us / 1000, p99_us / 1000)

    def _command(self, line: str) -> None:
        self.proc.stdin.write(f"{line}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@contextmanager
def streaming_server(binary: FirehoseBinary, port: int, tokens: int) -> Iterator[Firehose]:
    hose = Firehose(binary, port, tokens)
    try:
        yield hose
    finally:
        if hose.proc.poll() is None:
            hose.proc.kill()
            hose.proc.wait()


def drive(hose: Firehose, rate: float, seconds: float, responses: ResponseLog | None = None) -> LoadFigures:
    """The firehose's clients at ``rate`` for ``seconds``, and what they read meanwhile (with ``responses``,
    the responses that ended since the last report, and those of this run, logged)."""
    hose.rate(rate)
    before = hose.report(seconds)  # from here on
    cpu = cpu_seconds(hose.proc.pid)
    time.sleep(seconds)
    load = hose.report(seconds)
    if responses is not None:
        responses.add(before.responses)
        responses.add(load.responses)
    cpu = cpu_seconds(hose.proc.pid) - cpu
    hose.rate(0)
    return replace(load, load_cpu_per_1k_ms=cpu * 1e6 / max(1.0, load.events_per_s * seconds))


def connect_clients(hose: Firehose, streams: int, rate: float) -> None:
    """``streams`` keep-alive clients, each sending its next request when a response ends, first run
    at ``rate`` for WARM_UP_S: measured, a node's pool of keep-alive connections is past its first
    responses (those whose templates the agent is still naming)."""
    hose.clients(streams)
    hose.rate(rate)
    time.sleep(WARM_UP_S)
    hose.rate(0)


def capacity(impl: Implementation, binary: FirehoseBinary, tmp: Path, rates: list[float], seconds: float,
             stream_counts: tuple[int, ...]) -> list[Capacity]:
    print(f"\n== {impl.name}: agent on CPU {AGENT_CPU}, server and clients on CPU {LOAD_CPU}, {seconds:.0f} s a rate")
    print("   CPU ms/1k ev: the capture's (the agent's, less its live analysis' passes); store part: what of it"
          " the store writer's inserts took; main thread: what of it the thread reading the kernel's records"
          " (tracking, parsing, rows) took, the rest being the store's own threads (merges) and the agent's"
          " others; the passes' own, per 1k events of the requests they analysed over the run, follow each"
          " stream count")
    print(f"{'streams':>8}{'offered ev/s':>14}{'served ev/s':>13}{'records/s':>11}{'batched/s':>11}"
          f"{'rec/resp':>10}{'dropped':>9}{'CPU ms/1k ev':>14}{'store part':>12}{'main thread':>13}{'RSS MiB':>9}")
    found = []
    for streams in stream_counts:
        port = free_port()
        result = Capacity(streams)
        tokens = 4000 if streams == 1 else 200
        responses = ResponseLog()
        with streaming_server(binary, port, tokens=tokens) as hose:
            agent = AgentProcess(impl, port, tmp)
            try:
                # What the agent spends with no traffic (its poll loop, store, timers), taken off each run
                # for the time it lasted; read before any traffic, as after it the store merges the parts
                # the traffic made, which is the traffic's cost.
                _, idle_cpu, _ = agent.settled_figures()
                connect_clients(hose, streams, rates[0])
                for rate in rates:
                    before, _, started = agent.settled_figures()
                    load = drive(hose, rate, seconds, responses)
                    after, _, settled = agent.settled_figures()
                    run = after.minus(before)
                    records = run.records
                    # a pass of the live analysis that fell here is counted apart
                    cpu = run.cpu_s - run.analysis_cpu_s
                    cpu = max(0.0, cpu - idle_cpu * (settled - started))  # what the events cost, not the waits
                    share = run.drops / max(1.0, records + run.drops)
                    # Per token event the server wrote: with batching, a record holds many.
                    events = max(1.0, load.events_per_s * seconds)
                    per_1k = cpu * 1e6 / events
                    # '-': an implementation without the counter
                    store = f"{run.store_cpu_s * 1e6 / events:12.2f}" if after.store_cpu_s else f"{'-':>12}"
                    per_response = records / max(1, load.responses)
                    print(f"{streams:8}{rate:14.0f}{load.events_per_s:13.0f}{records / seconds:11.0f}"
                          f"{run.batched / seconds:11.0f}{per_response:10.1f}{share:9.1%}{per_1k:14.2f}{store}"
                          f"{run.main_cpu_s * 1e6 / events:13.2f}{after.rss / 2**20:9.0f}")
                    if run.drops == 0 and load.events_per_s > result.kept_up:
                        result = Capacity(streams, load.events_per_s, per_1k, per_response, after.rss / 2**20)
                analysis = agent.analysis(until=responses.last_report)
            finally:
                agent.stop()
        print(f"{'':8}highest rate with no drops: {result.kept_up:.0f} events/s; the agent with no traffic:"
              f" {idle_cpu * 1000:.1f} ms of CPU a second (taken off the runs)")
        analysed = responses.ended_by(analysis[1]) * tokens if analysis is not None else 0.0
        if analysed:
            analysis_cpu = analysis[0]
            result.analysis_per_1k_ms = analysis_cpu * 1e6 / analysed
            print(f"{'':8}live analysis: {analysis_cpu:.2f} CPU s for the requests of {analysed:.0f} token events"
                  f" (those that ended by its last pass): {result.analysis_per_1k_ms:.2f} ms per 1k events;"
                  f" with the capture's at that rate {result.total_per_1k_ms:.2f} ms")
        found.append(result)
    return found


def server_cost(impls: list[Implementation], binary: FirehoseBinary, tmp: Path, rate: float, seconds: float,
                rounds: int) -> dict[str, tuple[float, float]]:
    """The server's delivered rate and TTFT without an agent and with each implementation, in
    `rounds` rounds, each one run without an agent and one with each implementation, in turn (the
    order reversed every other round, so that a drift of the machine's other load favours none).
    Each implementation's figures are per round, against that round's run without an agent: their
    median, and the spread of its p99 TTFT added, beside the spread of the no-agent p99 itself
    (what the machine moves between rounds), so noise can be told from cost."""
    print(f"\n== the watched server at {rate:.0f} tokens/s offered, 64 streams of 200 tokens, {seconds:.0f} s a run,"
          f" {rounds} round(s), each against its own run without an agent")
    names = ["no agent", *(impl.name for impl in impls)]
    runs: dict[str, list[LoadFigures]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = [None, *impls]
        for impl in order if round_index % 2 == 0 else reversed(order):
            port = free_port()
            with streaming_server(binary, port, tokens=200) as hose:
                agent = AgentProcess(impl, port, tmp) if impl else None
                try:
                    connect_clients(hose, 64, rate)
                    load = drive(hose, rate, seconds)
                finally:
                    if agent:
                        agent.stop()
            runs[impl.name if impl else "no agent"].append(load)
    base = runs["no agent"]
    print(f"{'':40}{'events/s':>10}{'ratio':>7}{'load CPU ms/1k':>16}{'TTFT p50 ms':>13}{'p99 ms':>9}"
          f"{'p99 Δ µs':>10}{'Δ spread µs':>16}  p99 Δ per round, µs")
    costs = {}
    for name in names:
        loads = runs[name]
        ratios = [load.events_per_s / without.events_per_s for load, without in zip(loads, base)]
        if name == "no agent":  # its own p99 against its median: how far rounds move with no agent at all
            deltas = [(load.ttft_p99_ms - statistics.median(w.ttft_p99_ms for w in base)) * 1000 for load in loads]
        else:
            deltas = [(load.ttft_p99_ms - without.ttft_p99_ms) * 1000 for load, without in zip(loads, base)]
        ratio, delta = statistics.median(ratios), statistics.median(deltas)
        print(f"{name:40}{statistics.median(load.events_per_s for load in loads):10.0f}{ratio:7.3f}"
              f"{statistics.median(load.load_cpu_per_1k_ms for load in loads):16.3f}"
              f"{statistics.median(load.ttft_p50_ms for load in loads):13.3f}"
              f"{statistics.median(load.ttft_p99_ms for load in loads):9.3f}{delta:10.0f}"
              f"{f'{min(deltas):+.0f}..{max(deltas):+.0f}':>16}  {' '.join(f'{d:+.0f}' for d in deltas)}")
        if name != "no agent":
            costs[name] = (ratio, delta)
    return costs


def steady(impl: Implementation, binary: FirehoseBinary, tmp: Path, rates: list[float], seconds: float,
           store_apart: bool = False) -> None:
    """The whole agent's CPU at each rate held steady (see ``--steady`` in the module docstring)."""
    shape = ("the store in a process of its own (the DaemonSet's shape), its CPU apart" if store_apart
             else "the store embedded in the agent")
    print(f"\n== {impl.name}, {shape}; steady state: 64 streams of 200 tokens, {STEADY_WARM_UP_S:.0f} s at a"
          f" rate, then {seconds:.0f} s measured; the agent's CPU is all of its threads'")
    print(f"{'offered ev/s':>13}{'served ev/s':>13}{'dropped':>9}{'agent CPU ms/s':>16}{'main thread':>13}"
          f"{'store writer':>14}{'live analysis':>15}{'other':>7}{'ms/1k ev':>10}"
          + (f"{'store process ms/s':>20}" if store_apart else ""))
    print("   ms/1k ev: also the share of one core (%) a rate of 10k events/s costs; the target is 2")
    port = free_port()
    with streaming_server(binary, port, tokens=200) as hose:
        agent = AgentProcess(impl, port, tmp, store_apart)
        try:
            connect_clients(hose, 64, rates[0])
            for rate in rates:
                hose.rate(rate)
                time.sleep(STEADY_WARM_UP_S)
                hose.report(STEADY_WARM_UP_S)  # the clients' count starts here
                before, started = agent.figures(), time.monotonic()
                store_before = agent.owner.cpu_s() if agent.owner else 0.0
                time.sleep(seconds)
                after, elapsed = agent.figures(), time.monotonic() - started
                store_per_s = (agent.owner.cpu_s() - store_before) * 1000 / elapsed if agent.owner else None
                load = hose.report(elapsed)
                run = after.minus(before)
                parts = [run.cpu_s, run.main_cpu_s, run.store_cpu_s, run.analysis_cpu_s]
                parts.append(parts[0] - sum(parts[1:]))
                per_s = [part * 1000 / elapsed for part in parts]
                share = run.drops / max(1.0, run.records + run.drops)
                per_1k = parts[0] * 1e6 / max(1.0, load.events_per_s * elapsed)
                print(f"{rate:13.0f}{load.events_per_s:13.0f}{share:9.1%}{per_s[0]:16.1f}{per_s[1]:13.1f}"
                      f"{per_s[2]:14.1f}{per_s[3]:15.1f}{per_s[4]:7.1f}{per_1k:10.2f}"
                      + (f"{store_per_s:20.1f}" if store_per_s is not None else ""))
                print(f"{'':13}(it stored {run.rows_written:.0f} request rows; live analysis passes:"
                      f" {run.passes:.0f} completed, {run.pass_failures:.0f} failed)")
            hose.rate(0)
        finally:
            agent.stop()


def summary(results: dict[str, list[Capacity]], costs: dict[str, tuple[float, float]]) -> None:
    """The issue's figures side by side (targets: >= 300k events/s with no drops, <= 2 ms of agent
    CPU per 1k events, the server's throughput within 1% and its p99 TTFT within 50 µs)."""
    print("\n== side by side: at the highest rate each kept up with (no drops); the server's figures are medians"
          " over the rounds")
    print("   CPU ms/1k ev: capture + the live analysis' passes (amortized over the requests they analysed) ="
          " the agent's; '-': an implementation that does not count its passes apart (they are in its capture"
          " figure where they fell)")
    print(f"{'':40}{'streams':>8}{'no-drop ev/s':>14}{'CPU ms/1k ev':>24}{'rec/resp':>10}{'RSS MiB':>9}"
          f"{'server ratio':>14}{'p99 Δ µs':>10}")
    for name, found in results.items():
        server = f"{costs[name][0]:14.3f}{costs[name][1]:10.0f}" if name in costs else f"{'-':>14}{'-':>10}"
        for c in found:
            cpu = (f"{c.cpu_per_1k_ms:.2f} + {c.analysis_per_1k_ms:.2f} = {c.total_per_1k_ms:.2f}"
                   if c.analysis_per_1k_ms is not None else f"{c.cpu_per_1k_ms:.2f} + - = -")
            print(f"{name:40}{c.streams:8}{c.kept_up:14.0f}{cpu:>24}{c.records_per_response:10.1f}"
                  f"{c.rss_mib:9.0f}{server}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="61b821e", help="git ref of the previous implementation "
                        "(default %(default)s, kernel batching before templates outlived a response; "
                        "'' to leave it out)")
    parser.add_argument("--rates", type=float, nargs="+", help="offered events/s "
                        "(default 50k, 100k, 200k, 300k; --quick: 100k, 300k)")
    parser.add_argument("--seconds", type=float, help="a rate's time (default 5 s; --quick: 3 s)")
    parser.add_argument("--server-rate", type=float, default=100_000)
    parser.add_argument("--rounds", type=int, help="rounds of the server's figures (default 5; --quick: 3)")
    parser.add_argument("--quick", action="store_true", help="two rates, 3 s each; the server's figures in three "
                        "rounds, for this checkout alone")
    parser.add_argument("--shape", choices=SHAPES, default="vllm", help="the chunks the server streams "
                        "(default %(default)s; bare: without created and model; openai: with system_fingerprint and"
                        " logprobs; starlette: sse-starlette's CRLF framing; anthropic: Anthropic's Messages API; ollama: Ollama's"
                        " /api/chat)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 512],
                        help="concurrent stream counts (default %(default)s)")
    parser.add_argument("--steady", action="store_true", help="instead, the whole agent's CPU with 64 streams held"
                        " at each rate (default 10k, 100k) for --seconds (default 90) after"
                        f" {STEADY_WARM_UP_S:.0f} s, for this checkout (its store apart, then embedded) and the"
                        " baseline (about 5 min each)")
    args = parser.parse_args()
    if args.steady:
        rates, seconds = args.rates or [10_000, 100_000], args.seconds or 90.0
    else:
        rates = args.rates or ([100_000, 300_000] if args.quick else [50_000, 100_000, 200_000, 300_000])
        seconds = args.seconds or (3.0 if args.quick else 5.0)
    if os.geteuid() != 0 or not shutil.which("cc") or os.cpu_count() < 2:
        print("needs root, cc and two CPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tokenprobe-hot-path-") as scratch:
        tmp = Path(scratch)
        binary = FirehoseBinary(build_firehose(tmp), args.shape)
        print(f"streams of shape {args.shape}")
        impls = [Implementation("this checkout", None),
                 Implementation("this checkout, no kernel batching", None, ("--no-kernel-batching",))]
        if args.baseline:
            impls.append(previous_implementation(args.baseline, tmp))
        if args.steady:
            steady(impls[0], binary, tmp, rates, seconds, store_apart=True)
            for impl in (impl for impl in impls if not impl.agent_args):
                steady(impl, binary, tmp, rates, seconds)
            return 0
        results = {impl.name: capacity(impl, binary, tmp, rates, seconds, tuple(args.streams)) for impl in impls}
        rounds = args.rounds or (3 if args.quick else 5)
        # --quick: this checkout's cost to the server alone (an agent's start, its BPF compile, is the
        # most of a run's time).
        summary(results, server_cost(impls[:1] if args.quick else impls, binary, tmp, args.server_rate, seconds,
                                     rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
