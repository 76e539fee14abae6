"""The real agent (real BPF) against what an unprivileged process on the node can do to it, then killed and
restarted: it stays up and traces through the attacks, counts the files it skipped, and the window a
SIGKILL and restart left untraced is a row of agent_gaps and a metric (issue 35, items 4 and 5)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.kernel_harness import (
    agent,
    free_port,
    read_rows,
    reference_server,
    require_kernel,
    wait_for_port,
)
from tests.support import wait_until
from tests.support.stream_client import OPENAI, stream
from tests.test_elf_fuzz import HAND_MADE

pytestmark = pytest.mark.kernel

# As nobody: write the crafted ELF (.dynsym linked to section 999) and map it executable; map a
# second file, unlink it and put a FIFO where /proc/PID/maps names it; then listen on a target port, so
# that the agent reads this process's maps at start and at every rescan.
HOSTILE = r"""
import mmap, os, socket, sys, time
folder, port, evil = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
held = []
for name in ("libevil.so", "libgone.so"):
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(evil)
    with open(path, "rb") as f:
        held.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC))
gone = os.path.join(folder, "libgone.so")
os.unlink(gone)
os.mkfifo(gone + " (deleted)")
listener = socket.create_server(("127.0.0.1", port))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


def metric(metrics_port: int, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
    found = re.search(rf"^{name}{{{selector}}} (\S+)$" if labels else rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def nobodys_folder() -> Iterator[Path]:
    """A folder nobody can write, where nobody can reach it (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="tokenprobe-nobody-"))
    os.chown(folder, 65534, 65534)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_hostile_process_stops_nothing_and_a_sigkill_leaves_a_recorded_window(tmp_path: Path, nobodys_folder):
    folder = nobodys_folder
    hostile_port, metrics_port = free_port(), free_port()
    crafted = HAND_MADE["symtab_linked_to_itself"].ljust(8192, b"\0")  # an 8 KiB ELF that lies
    hostile = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                sys.executable, "-c", HOSTILE, str(folder), str(hostile_port), crafted.hex()],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert hostile.stdout.readline().strip() == "ready"
        wait_for_port(hostile_port)
        with reference_server(tmp_path) as (port, _truth), httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                                        timeout=30) as client:
            with agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port, hostile_port]) as first:
                # Read at start and again at the rescans (every 5 s): counted once, the agent up and tracing.
                assert metric(metrics_port, "tokenprobe_agent_skipped_files_total", reason="malformed_elf") >= 1
                assert metric(metrics_port, "tokenprobe_agent_skipped_files_total", reason="unreadable") >= 1
                time.sleep(6)
                assert first.proc.poll() is None
                assert stream(client, OPENAI, 5).status == 200
                wait_until(lambda: metric(metrics_port, "tokenprobe_agent_events_total") > 0)
                assert metric(metrics_port, "tokenprobe_agent_blind_windows_total") == 0  # a first start
                time.sleep(2.5)  # the sink's flush: what follows is the restart's window alone
                first.proc.kill()
                first.proc.wait()
                killed_at = time.time()
                # What the killed run could vouch for: its last beat, and what its sink had made durable (on a
                # loaded machine the sink's writer may lag its 2 s flush: those rows died with the process).
                (heartbeat,) = tmp_path.rglob("agent-heartbeat.json")
                last = json.loads(heartbeat.read_text())
                vouched_until = min(last["beat_s"], last["durable_until_s"])
                assert killed_at - 15 < vouched_until <= killed_at, (last, killed_at)
                assert stream(client, OPENAI, 5).status == 200  # served while no agent traces
            with agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port, hostile_port]) as second:
                ready_at = time.time()
                assert metric(metrics_port, "tokenprobe_agent_blind_windows_total") == 1
                blind_s = metric(metrics_port, "tokenprobe_agent_blind_seconds_total")
                # The window runs from there to when the new run's probes attached (before it said it traces).
                assert killed_at - vouched_until <= blind_s <= ready_at - vouched_until + 1, \
                    (blind_s, vouched_until, killed_at, ready_at)
                assert stream(client, OPENAI, 5).status == 200
                wait_until(lambda: metric(metrics_port, "tokenprobe_agent_events_total") > 0)
                assert second.stop() == 0, second.log()
        assert hostile.poll() is None  # the attack ran throughout
    finally:
        hostile.kill()
        hostile.wait()
    rows = [row for row in read_rows(second.store_url) if row["server_port"] == port]
    assert len(rows) == 2, rows  # before the kill and after the restart; the one between is in the window
    from tokenprobe.store.embedded import open_store

    store = open_store(second.store_url, serve=False)
    try:
        (gap,) = store.query_df("SELECT reason, seconds, toUnixTimestamp64Nano(gap_start) / 1e9 AS start_s, "
                                "toUnixTimestamp64Nano(gap_end) / 1e9 AS end_s FROM tokenprobe.agent_gaps"
                                ).to_dict("records")
    finally:
        store.close()
    assert gap["reason"] == "crashed"
    assert gap["start_s"] == pytest.approx(vouched_until, abs=1e-3) and killed_at < gap["end_s"] <= ready_at, gap
