"""The agent's footprint: what it imports with its store elsewhere, how much of another process's file its
scans hold at once, and the progress it shows while a long step of its start runs
(benchmarks/bench_footprint.py prints the figures)."""

from __future__ import annotations

import json
import logging
import mmap
import re
import subprocess
import sys
import time

import pytest
from tokenprobe.agent.capture.kernel.elf import SEARCH_WINDOW, find_in_file
from tokenprobe.agent.runner import Progress
from tokenprobe.store.embedded import SERVE_FILE, open_store

# In a fresh interpreter: the agent's command module, then the store at argv[1] used once; prints the
# answer and the engine's modules it imported.
OPEN_AS_THE_AGENT = """
import sys
import tokenprobe.cli.agent
from tokenprobe.store.embedded import open_store
with open_store(sys.argv[1]) as store:
    print(store.mode, store.command("SELECT 40 + 2"))
print(sorted(name for name in sys.modules if name.split(".")[0] == "chdb"))
"""


@pytest.mark.parametrize("shape, engine_expected", [
    ("http", False),        # the DaemonSet's: a ClickHouse server's URL
    ("via-owner", False),   # an embedded store another process owns
    ("owner", True),        # the store embedded in this process: the engine is needed, and seen
])
def test_the_engine_is_imported_only_where_the_store_is_embedded(store_dir, shape, engine_expected):
    directory = store_dir
    if shape == "owner":
        url = f"chdb://{directory}"
        answer = _run_as_agent(url)
    else:
        with open_store(f"chdb://{directory}"):  # this test's process owns it and serves it over HTTP
            if shape == "http":
                token, port = _advert(directory)
                url = f"http://default:{token}@127.0.0.1:{port}/"
            else:
                url = f"chdb://{directory}"
            answer = _run_as_agent(url)
    mode, engine = answer
    assert mode == {"http": "server 42", "via-owner": "embedded-via-owner 42", "owner": "embedded-owner 42"}[shape]
    assert (engine != "[]") == engine_expected, engine


def _advert(directory) -> tuple[str, int]:
    advert = json.loads((directory / SERVE_FILE).read_text())
    return advert["token"], advert["port"]


def _run_as_agent(url: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", OPEN_AS_THE_AGENT, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def test_progress_is_said_while_the_step_runs_and_not_after(caplog):
    caplog.set_level(logging.INFO, logger="tokenprobe.agent")

    def ticks() -> list[str]:
        return [r.getMessage() for r in caplog.records if re.fullmatch(r"compiling the probes… \d+ s", r.getMessage())]

    with Progress("compiling the probes", "5-60 s", live=False, every_s=0.05):
        time.sleep(0.4)
    said = len(ticks())
    time.sleep(0.2)
    assert said >= 3 and len(ticks()) == said, ticks()
    assert caplog.records[-1].getMessage().startswith("compiling the probes: done in")


def _rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", open("/proc/self/status").read())[1]) * 1024


def _mapped(path) -> mmap.mmap:
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def test_a_whole_file_search_finds_what_straddles_its_windows(tmp_path):
    path = tmp_path / "lib.so"
    with open(path, "wb") as file:
        file.truncate(SEARCH_WINDOW * 2 + 100)
        file.seek(SEARCH_WINDOW - 3)
        file.write(b"/rustls-")  # across the first window's end
        file.seek(SEARCH_WINDOW * 2 + 92)
        file.write(b"go1.22.3")  # the file's last bytes
    elf = _mapped(path)
    with elf:
        assert find_in_file(elf, b"/rustls-") == SEARCH_WINDOW - 3
        assert find_in_file(elf, b"go1.22.3") == SEARCH_WINDOW * 2 + 92
        assert find_in_file(elf, b"absent") == -1


def test_a_whole_file_search_holds_a_window_of_the_file_not_the_file(tmp_path):
    """The scans read every library the node's processes map; a GPU server's run to gigabytes."""
    path = tmp_path / "large.so"
    with open(path, "wb") as file:
        file.truncate(SEARCH_WINDOW * 8)  # 128 MiB, read as zeros
    elf = _mapped(path)
    with elf:
        before = _rss_bytes()
        assert find_in_file(elf, b"/rustls-") == -1
        held = _rss_bytes() - before
    assert held < 2 * SEARCH_WINDOW, f"{held >> 20} MiB of a {len(elf) >> 20} MiB file held after the search"
