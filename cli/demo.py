"""`tokenprobe demo`: the whole pipeline on one machine.

The reference server and the load generator run as child processes, so the
agent in this process observes them from the kernel exactly as it would a
real inference server: no hooks, no shared state.

Unless ``--no-actuator``, the load goes through a gateway enforcing the
actuator's decisions, and a control loop turns what the agent stores into
those decisions (``actuator.stack``): the overload phase is detected and
contained with nobody touching anything, and the decisions are listed at the
end from ``tokenprobe.decisions``.

The agent analyses the traffic as it runs (``DEMO_ANALYZE_EVERY_S`` windows),
and the demo analyses the whole run once more when the load is over, so the
store it leaves has every table the dashboard shows filled: phases split into
queue and prefill, the indicator matrix, the knee.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from ..actuator.breaker import BreakerPolicy
from ..actuator.controller import ControllerPolicy
from ..agent.capture.kernel.loader import ProbeError, Targets
from ..analytics.pipeline import analyze, default_range
from ..analytics.scope import EVERYTHING
from ..contract.measures import is_inference
from ..store.client import StoreUnavailable
from ..store.embedded import open_store
from .agent import Agent, AgentConfig, SamplerConfig
from .stack import closed_loop

# Of --rate, an equal part of --duration each: idle enough to calibrate on,
# busy, past the server's capacity, and back down to show the recovery.
LOAD_SHARES = (0.2, 0.6, 1.3, 0.3)
DEMO_TENANT = "demo"
# The demo lasts a minute, so the loop decides on short windows; a real
# deployment keeps ControllerPolicy's defaults.
DEMO_POLICY = ControllerPolicy(window_s=2.0, breaker=BreakerPolicy(trip_windows=2, cooldown_s=5.0,
                                                                   recovery_shares=(0.25, 0.5, 0.75)))
# Likewise the live analysis: windows of a few seconds, so a minute of load lights the matrix.
DEMO_ANALYZE_EVERY_S = 5


def _ms(later: int | None, earlier: int | None) -> str:
    if later is None or earlier is None:
        return "     -"
    return f"{(later - earlier) / 1e6:6.1f}"


def request_line(row: dict) -> str:
    """One request as a person reads it."""
    return (f"{row['method']:<4} {row['path']:<22} {row['status']:>3}  "
            f"ttft {_ms(row['first_token'], row['req_end'])} ms  "
            f"total {_ms(row['resp_end'], row['req_start'])} ms  "
            f"{row['token_events']:>3} tok  in flight {row['inflight_at_arrival']:>2}  "
            f"{'tls ' if row['tls'] else ''}{row['outcome']}")


class Totals:
    """The inference requests traced, each printed as it ends; the rest (health checks, other clients'
    scrapes: the agent's own are no rows) only counted, by method and path."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[dict] = []
        self.other = Counter()

    def add(self, row: dict) -> None:
        with self.lock:
            if not is_inference(row):
                self.other[f"{row['method']} {row['path']}"] += 1
                return
            self.rows.append(row)
        print(request_line(row), flush=True)

    def traced(self) -> str:
        """Every request traced, inference apart from the rest."""
        others = ", ".join(f"{count} {what}" for what, count in self.other.most_common())
        return (f"{len(self.rows)} inference requests"
                + (f" and {sum(self.other.values())} other requests ({others})" if self.other else "") + " traced")

    def summary(self) -> str:
        rows = self.rows
        ttfts = sorted((r["first_token"] - r["req_end"]) / 1e6 for r in rows
                       if r["first_token"] is not None and r["req_end"] is not None)
        outcomes: dict[str, int] = {}
        for r in rows:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1

        def pct(q: float) -> str:
            return f"{ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]:.1f}" if ttfts else "-"

        return (f"{len(rows)} completions traced ({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))}); "
                f"server TTFT p50 {pct(0.5)} ms, p99 {pct(0.99)} ms; "
                f"{sum(r['token_events'] for r in rows)} token events")


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def decisions_summary(store_url: str, upstream: str) -> list[str]:
    """The control loop's decisions for `upstream`, one line each, from tokenprobe.decisions."""
    with open_store(store_url, serve=False) as store:
        rows = store.query_rows(
            """SELECT toUnixTimestamp64Nano(issued_at), kind, tenant, breaker_state, tokens_per_second,
                      reason, outcome
               FROM tokenprobe.decisions WHERE upstream = {u:String} ORDER BY issued_at, recorded_at""",
            {"u": upstream})
    lines = []
    for issued_ns, kind, tenant, state, tokens_per_s, reason, outcome in rows:
        at = datetime.fromtimestamp(issued_ns / 1e9, timezone.utc).strftime("%H:%M:%S")
        if kind == "breaker":
            action = f"breaker {state}"  # the reason gives a probing breaker's share
        else:
            action = f"tenant {tenant!r} held to {tokens_per_s:.0f} tokens/s"
        lines.append(f"{at}  {action}: {reason} [{outcome}]")
    return lines


def analyse_the_run(store_url: str) -> str:
    """Analyse the whole run once more, now that every row is stored (the live passes leave the last
    seconds, still settling, to a pass that never comes), in the live windows; say what it found."""
    with open_store(store_url, serve=False) as store:
        traffic = default_range(store, EVERYTHING)
        if traffic is None:
            return "no inference requests to analyse"
        report = analyze(store, traffic, window_s=DEMO_ANALYZE_EVERY_S)
    phases = report.phases
    requests, unsplit = int(phases["requests"].sum()), int(phases["unsplit"].sum())
    states = Counter(cell.state for cell in report.cells)
    return (f"{requests} requests split into phases ({requests - unsplit} with queue and prefill apart); "
            f"{len(report.cells)} indicator cells in {DEMO_ANALYZE_EVERY_S} s windows ("
            + ", ".join(f"{count} {state}" for state, count in sorted(states.items())) + ")")


def shell_command() -> str:
    """How a shell runs this same tokenprobe: its name where PATH finds this installation's script, else that
    script's path (relative when under the working directory, e.g. .venv/bin/tokenprobe), else python -m."""
    script = Path(sys.executable).parent / "tokenprobe"  # the virtual environment's, not its resolved Python's
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m tokenprobe"
    on_path = shutil.which("tokenprobe")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "tokenprobe"
    relative = os.path.relpath(script)
    return shlex.quote(relative if not relative.startswith("..") else str(script))


def next_commands(store_url: str) -> str:
    """The commands that show the store the demo leaves, ready to paste (no process owns it any more)."""
    tokenprobe, store = shell_command(), shlex.quote(store_url)
    # In double quotes, as a person types it: it holds single quotes and nothing a shell expands.
    sql = ("\"SELECT path, count(), quantile(0.5)(dateDiff('millisecond', req_end, first_token)) AS ttft_p50_ms "
           "FROM tokenprobe.requests GROUP BY path\"")
    return (f"  {tokenprobe} dashboard --store {store} --own-store\n"
            f"and, beside it or alone, query it:\n"
            f"  {tokenprobe} query --store {store} {sql}")


def gateway_answers(workdir: Path) -> str:
    """How the gateway answered the load, from the load generator's records."""
    statuses: dict[int, int] = {}
    for path in sorted(workdir.glob("load-*.json")):
        for record in json.loads(path.read_text())["requests"]:
            statuses[record["status"]] = statuses.get(record["status"], 0) + 1
    return ", ".join(f"{count} × {status or 'no answer'}" for status, count in sorted(statuses.items()))


def run_demo(args: argparse.Namespace) -> int:
    if not (0 < args.port < 65535 and args.duration > 0 and args.rate > 0 and args.slots > 0):
        print("tokenprobe demo: --port must be within 1-65534 (the gateway takes the next), and --duration, --rate "
              "and --slots positive", file=sys.stderr)
        return 2
    with_actuator = not args.no_actuator and not args.tls
    gateway_port = args.port + 1
    for port, option in ((args.port, "--port"), *(((gateway_port, "--port"),) if with_actuator else ())):
        if port_in_use(port):
            print(f"demo: port {port} is in use; choose another with {option}", file=sys.stderr)
            return 2
    if args.tls and not args.no_actuator:
        print("demo: over TLS the load goes straight to the server: the gateway proxies plain HTTP only",
              file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="tokenprobe-demo-"))
    server_cmd = [sys.executable, "-m", "tokenprobe.refserver", "serve", "--port", str(args.port),
                  "--slots", str(args.slots), "--truth-log", str(workdir / "truth.jsonl"),
                  "--simulated-metrics", "--log-level", "WARNING"]
    if args.tls:
        server_cmd.append("--tls-self-signed")
    # The load sweeps from light to past the server's capacity, so that the
    # analytics have an idle regime to calibrate on and a knee to find.
    phases = [(args.duration / len(LOAD_SHARES), args.rate * share) for share in LOAD_SHARES]

    load_port = gateway_port if with_actuator else args.port

    def load_cmd(seconds: float, rate: float, seed: int) -> list[str]:
        cmd = [sys.executable, "-m", "tokenprobe.refserver", "load", "--port", str(load_port),
               "--rate", f"{rate:.3f}", "--duration", f"{seconds:.3f}", "--seed", str(seed), "--quiet",
               "--tenant", DEMO_TENANT, "--json", str(workdir / f"load-{seed}.json")]
        return cmd + (["--tls"] if args.tls else [])

    print(f"demo: reference server on port {args.port} with {args.slots} slots; load "
          + ", then ".join(f"{rate:.1f} requests/s for {seconds:.0f}s" for seconds, rate in phases)
          + f"; store {args.store}"
          + (f"; through the gateway on port {gateway_port}, control window {DEMO_POLICY.window_s:g}s"
             if with_actuator else ""), file=sys.stderr)
    server = subprocess.Popen(server_cmd)
    totals = Totals()
    load: subprocess.Popen | None = None
    upstream = None

    def start_load() -> None:
        nonlocal load, upstream
        try:
            with ExitStack() as loop_running:
                if with_actuator:
                    upstream = loop_running.enter_context(closed_loop(
                        args.store, server_port=args.port, gateway_port=gateway_port, workdir=workdir,
                        policy=DEMO_POLICY)).upstream
                for seed, (seconds, rate) in enumerate(phases):
                    load = subprocess.Popen(load_cmd(seconds, rate, seed))
                    load.wait()
                time.sleep(0.5)  # let the last responses' closing bytes reach the agent
        except (OSError, StoreUnavailable) as error:
            print(f"demo: cannot run the control loop: {error}", file=sys.stderr)
        finally:
            agent.stop()

    driver = threading.Thread(target=start_load, daemon=True)
    # No GPU here: the reference server's simulated dcgm and vLLM pages stand
    # in, every row from them marked simulated, mapped to "GPU 0" by port.
    # (Over TLS its certificate is self-signed, which the scrapers refuse.)
    samplers = SamplerConfig() if args.tls else SamplerConfig(
        dcgm_urls=[f"http://127.0.0.1:{args.port}/sim/dcgm"],
        engine_urls={f"http://127.0.0.1:{args.port}/metrics": args.port},
        gpus_by_port={args.port: ["0"]})
    agent = Agent(AgentConfig(targets=Targets(ports=[args.port]), store_url=args.store, status=False,
                              on_row=totals.add, on_ready=driver.start, samplers=samplers,
                              analyze_every_s=DEMO_ANALYZE_EVERY_S))
    try:
        summary = agent.run()
    except ProbeError as exc:
        print(f"demo: {exc}\nRun 'tokenprobe doctor' for what works on this node.", file=sys.stderr)
        return 1
    finally:
        if load is not None and load.poll() is None:
            load.send_signal(signal.SIGINT)
            load.wait(timeout=10)
        server.terminate()
        server.wait(timeout=10)

    # The outcome goes to stdout, after the request lines: `tokenprobe demo | tee log` keeps it.
    print(f"\ndemo: {totals.summary()}")
    if upstream is not None:
        print(f"demo: the gateway answered {gateway_answers(workdir)}")
        lines = decisions_summary(args.store, upstream)
        print(f"demo: {len(lines)} decisions by the control loop (tokenprobe.decisions):")
        for line in lines:
            print(f"  {line}")
    print(f"demo: analysis: {analyse_the_run(args.store)}")
    print(f"demo: {totals.traced()}; {summary.rows_written} rows in {args.store} ({summary.drops} kernel events "
          f"dropped). See it with:\n{next_commands(args.store)}")
    return 0
