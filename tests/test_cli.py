"""The tokenprobe command as a person uses it: help, bad input, doctor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.kernel_harness import require_kernel


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenprobe", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_names_every_command():
    out = run("--help").stdout
    for command in ("agent", "demo", "doctor", "query"):
        assert command in out


@pytest.mark.parametrize("args, message", [
    (["agent"], "no targets"),
    (["agent", "--port", "70000"], "not a TCP port"),
    (["agent", "--pid", "999999999"], "no process with pid"),
    (["agent", "--port", "8000", "--gpu", "8000"], "expected PORT=GPU"),
    (["agent", "--port", "8000", "--dcgm", "ftp://x"], "must be http"),
    (["agent", "--port", "8000", "--ringbuf-mb", "3"], "power of two"),
])
def test_agent_refuses_bad_options_in_plain_words(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.kernel
def test_doctor_reports_this_node():
    require_kernel()
    result = run("doctor")
    assert "BPF load" in result.stdout and "libssl" in result.stdout and "NVML" in result.stdout
    assert result.returncode == 0, result.stdout
    assert "tokenprobe can run here" in result.stdout


def test_query_reads_a_store(tmp_path):
    from tokenprobe.agent.store import open_store

    url = f"chdb://{tmp_path / 'store'}"
    with open_store(url, serve=False) as store:
        store.ensure_schema()
    result = run("query", "--store", url, "SELECT count() AS n FROM tokenprobe.requests")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["n", "0"]
