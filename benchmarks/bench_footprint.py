"""The agent's footprint with its store elsewhere (the DaemonSet's shape), beside a previous commit.

`tokenprobe agent --store http://…` runs against a store served over HTTP by a process of its own (an
embedded store's owner, as a ClickHouse server would serve it), tracing the port of a small HTTP server
that a client asks a few times a second. For each run the benchmark prints:

- start: seconds from the command's start to its "tracing" line (imports, the BPF compile, attaching);
- peak: the most memory the agent held at once, BPF compile included: the largest of its own VmHWM and
  the sum of VmRSS over it and its child processes, sampled every 50 ms (a compile in a child counts);
- steady: the agent's RSS (children included) once it has traced for ``--steady-s`` seconds, a live
  analysis pass included (one every 30 s); of it, the anonymous part (heap, maps: what the kernel
  cannot reclaim; the rest is files' pages, libraries' code) and the pages of LLVM's and clang's
  libraries (paged out after the compile, except those another process maps too).

This checkout and ``--baseline REF`` (installed apart) alternate, round after round, so that the
machine's drift lands on both. Prints figures; asserts nothing. Needs root (real BPF) and git.

    .venv/bin/python -m benchmarks.bench_footprint [--baseline REF] [--rounds N] [--steady-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_hot_path import Implementation, StoreOwner
from tokenprobe.agent.capture.kernel.loader import COMPILER_LIBRARY
from tokenprobe.refserver.harness import free_port, wait_for_port
from tokenprobe.store.embedded import SERVE_FILE

# The commit before the agent's imports and compile were cut (issue 30, item 4).
DEFAULT_BASELINE = "c2ca6ef"
SAMPLE_EVERY_S = 0.05
MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Footprint:
    start_s: float
    peak: int   # bytes
    steady: int  # bytes
    steady_anon: int  # bytes of it that are no file's pages (the kernel cannot reclaim them without swap)
    steady_compiler: int  # bytes of it in LLVM's and clang's libraries


def checkout(ref: str, tmp: Path) -> Implementation:
    """The project's tree as of ``ref``, importable as ``tokenprobe`` (its dependencies are this venv's). Read
    from git as is, not installed: a package list in an older pyproject may miss a room it has."""
    package = tmp / "baseline-site" / "tokenprobe"
    package.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    return Implementation(f"previous ({ref})", str(package.parent))


def _status_kib(pid: int, field: str) -> int:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    except OSError:  # the process is gone
        return 0
    return int(match[1]) if match else 0


def _tree(pid: int) -> list[int]:
    """The process and its descendants now."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children") if Path(f"/proc/{current}").exists() else ():
            try:
                pending += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return found


def tree_rss(pid: int, field: str = "VmRSS") -> int:
    """Bytes resident in the process and its descendants now (``field``: VmRSS, or its part RssAnon)."""
    return sum(_status_kib(each, field) for each in _tree(pid)) * 1024


def compiler_rss(pid: int) -> int:
    """Bytes of LLVM's and clang's libraries resident in the process. The agent pages them out after its
    compile, but the kernel keeps a page that another process maps too (another BCC tool running)."""
    total, in_compiler = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as smaps:
            for line in smaps:
                if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                    in_compiler = bool(COMPILER_LIBRARY.search(line))
                elif in_compiler and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:  # the process is gone
        return 0
    return total


class PeakWatch:
    """Samples a process tree's RSS on a thread until stopped; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, tree_rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_kib(self.pid, "VmHWM") * 1024)


def http_store_url(directory: Path) -> str:
    """The store's URL over HTTP, with the writer's token its owner published."""
    serve = json.loads((directory / SERVE_FILE).read_text())
    return f"http://default:{serve['token']}@127.0.0.1:{serve['port']}/"


def run_agent(impl: Implementation, store_url: str, tmp: Path, steady_s: float) -> Footprint:
    """One agent run: its start time, peak and steady RSS."""
    server_port, metrics_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(server_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
    log_path = tmp / f"agent-{metrics_port}.log"
    env = dict(os.environ, TOKENPROBE_FINGERPRINT_KEY="bench-key", HOME=str(tmp), TOKENPROBE_STORE=store_url)
    if impl.pythonpath:
        env["PYTHONPATH"] = impl.pythonpath
    try:
        wait_for_port(server_port)
        with open(log_path, "w") as log:
            started = time.monotonic()
            agent = subprocess.Popen([sys.executable, "-m", "tokenprobe", "agent", "--port", str(server_port),
                                      "--quiet", "--metrics-port", str(metrics_port)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        watch = PeakWatch(agent.pid)
        try:
            while "tracing ports" not in log_path.read_text(errors="replace"):
                if agent.poll() is not None or time.monotonic() - started > 300:
                    raise RuntimeError(f"agent did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)
            start_s = time.monotonic() - started
            until = time.monotonic() + steady_s
            while time.monotonic() < until:  # a few requests a second, so that rows flow to the store
                urllib.request.urlopen(f"http://127.0.0.1:{server_port}/", timeout=5).read()
                time.sleep(0.2)
            steady, steady_anon = tree_rss(agent.pid), tree_rss(agent.pid, "RssAnon")
            steady_compiler = compiler_rss(agent.pid)
        finally:
            peak = watch.stop()
            agent.terminate()
            agent.wait(timeout=60)
        return Footprint(start_s, peak, steady, steady_anon, steady_compiler)
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git ref of the previous implementation "
                        f"(default {DEFAULT_BASELINE}: before the footprint was cut)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steady-s", type=float, default=40.0,
                        help="how long the agent traces before its steady RSS is read")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenprobe-footprint-") as tmp_name:
        tmp = Path(tmp_name)
        impls = [checkout(args.baseline, tmp), Implementation("this checkout", None)]
        store_dir = tmp / "store"
        owner = StoreOwner(f"chdb://{store_dir}")
        try:
            store_url = http_store_url(store_dir)
            figures: dict[str, list[Footprint]] = {impl.name: [] for impl in impls}
            for round_no in range(args.rounds):
                for impl in impls:
                    footprint = run_agent(impl, store_url, tmp, args.steady_s)
                    figures[impl.name].append(footprint)
                    print(f"round {round_no + 1} {impl.name:>20}: start {footprint.start_s:5.1f} s  "
                          f"peak {footprint.peak / MIB:6.0f} MiB  steady {footprint.steady / MIB:6.0f} MiB "
                          f"(anonymous {footprint.steady_anon / MIB:.0f}, compiler {footprint.steady_compiler / MIB:.0f})",
                          flush=True)
        finally:
            owner.stop()
    load = os.getloadavg()[0]
    print(f"\nagent with --store http://… ({os.cpu_count()} CPUs, load average {load:.1f}); medians of "
          f"{args.rounds} rounds, steady after {args.steady_s:.0f} s of tracing:")
    print(f"{'':>24} {'start s':>8} {'peak MiB':>9} {'steady MiB':>11} {'of it anonymous':>16} {'compiler':>9}")
    for name, runs in figures.items():
        print(f"{name:>24} {statistics.median(r.start_s for r in runs):8.1f} "
              f"{statistics.median(r.peak for r in runs) / MIB:9.0f} "
              f"{statistics.median(r.steady for r in runs) / MIB:11.0f} "
              f"{statistics.median(r.steady_anon for r in runs) / MIB:16.0f} "
              f"{statistics.median(r.steady_compiler for r in runs) / MIB:9.0f}")


if __name__ == "__main__":
    main()
