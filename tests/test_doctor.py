"""`tokenprobe doctor` names the real cause of what stops tracing, found by trying, under the real conditions:
capabilities dropped (setpriv), a seccomp filter refusing bpf() (libseccomp), a read-only tracefs without
CAP_SYS_ADMIN (a private mount namespace); and `doctor --port` on a real server with a real request."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.kernel_harness import reference_server, require_kernel
from tests.support import free_port

pytestmark = pytest.mark.kernel

DOCTOR = [sys.executable, "-m", "tokenprobe", "doctor"]
# Debian's python3 carries the libseccomp binding (python3-seccomp); the filter it loads survives the exec.
SECCOMP_PYTHON = "/usr/bin/python3"
REFUSE_BPF = """
import errno, os, sys, seccomp
refusing = seccomp.SyscallFilter(seccomp.ALLOW)
refusing.add_rule(seccomp.ERRNO(errno.EPERM), "bpf")
refusing.load()
os.execv(sys.argv[1], sys.argv[1:])
"""


def lines_of(output: str, check: str) -> str:
    """The line of ``check`` in doctor's table and its fix line, if any."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if line[6:].startswith(check + " "):
            fix = lines[index + 1] if index + 1 < len(lines) and "→" in lines[index + 1] else ""
            return f"{line}\n{fix}"
    raise AssertionError(f"no {check!r} line in:\n{output}")


def require_tool(path: str) -> None:
    if not shutil.which(path):
        pytest.fail(f"{path} is needed to run the doctor under these conditions")


def test_without_the_capabilities_it_names_them_not_the_uid():
    require_kernel()
    require_tool("setpriv")
    # Still uid 0, but without CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN in effect.
    result = subprocess.run(["setpriv", "--bounding-set=-bpf,-perfmon,-sys_admin", "--inh-caps=-all", *DOCTOR],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout
    capabilities = lines_of(result.stdout, "capabilities")
    assert capabilities.startswith("FAIL") and "CAP_BPF no" in capabilities and "CAP_SYS_ADMIN no" in capabilities
    assert "needs CAP_BPF and CAP_PERFMON" in capabilities and "→ run as root, or grant CAP_BPF" in capabilities
    bpf = lines_of(result.stdout, "bpf()")
    assert bpf.startswith("FAIL") and "bpf() is refused (EPERM): this process lacks CAP_BPF and CAP_PERFMON" in bpf
    assert "running as root" not in result.stdout and "BPF load" not in result.stdout, "no compile that cannot load"
    assert result.stdout.rstrip().endswith("until these are fixed: capabilities, bpf().")


def refusing_bpf(*command: str, timeout: float) -> subprocess.CompletedProcess:
    if subprocess.run([SECCOMP_PYTHON, "-c", "import seccomp"], capture_output=True).returncode:
        pytest.fail(f"{SECCOMP_PYTHON} cannot import seccomp: apt-get install python3-seccomp")
    return subprocess.run([SECCOMP_PYTHON, "-c", REFUSE_BPF, *command], capture_output=True, text=True,
                          timeout=timeout)


def test_a_seccomp_filter_refusing_bpf_is_named_by_doctor_and_by_the_agent(tmp_path: Path):
    require_kernel()
    result = refusing_bpf(*DOCTOR, timeout=300)
    assert result.returncode == 1, result.stdout
    assert lines_of(result.stdout, "capabilities").startswith("  ok")
    bpf = lines_of(result.stdout, "bpf()")
    assert bpf.startswith("FAIL") and "although this process holds CAP_BPF" in bpf and "seccomp filter" in bpf, bpf
    # The agent says so before compiling, not as a headers problem after it.
    agent = refusing_bpf(*DOCTOR[:-1], "agent", "--port", str(free_port()), "--duration", "1",
                         "--store", f"chdb://{tmp_path / 'store'}", "--analyze-every", "0", timeout=300)
    assert agent.returncode == 1, agent.stderr
    assert "tokenprobe agent: the BPF program cannot load: bpf() is refused (EPERM)" in agent.stderr, agent.stderr
    assert "a seccomp filter forbids it" in agent.stderr and "headers" not in agent.stderr, agent.stderr


def test_openssl_found_but_not_probed_fails_and_says_why():
    """The DaemonSet's case: no CAP_SYS_ADMIN and a read-only tracefs, so the uprobes cannot attach."""
    require_kernel()
    require_tool("unshare")
    require_tool("setpriv")
    read_only = ("mount -o remount,bind,ro /sys/kernel/tracing && "
                 "exec setpriv --bounding-set=-sys_admin --inh-caps=-all \"$@\"")
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", read_only, "sh", *DOCTOR],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert lines_of(result.stdout, "BPF load").startswith("  ok")
    probes = lines_of(result.stdout, "TLS probes")
    assert probes.startswith("FAIL") and "could not be probed" in probes, probes
    assert "tracefs at /sys/kernel/tracing is read-only" in probes and "grant CAP_SYS_ADMIN" in probes, probes
    assert "headers" not in probes


def test_doctor_port_checks_a_server_and_the_api_of_a_request(tmp_path: Path):
    require_kernel()
    with reference_server(tmp_path) as (port, _truth):
        doctor = subprocess.Popen([*DOCTOR, "--port", str(port), "--wait", "120"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        stderr: list[str] = []

        def request_once_waiting() -> None:
            for line in doctor.stderr:
                stderr.append(line)
                if line.startswith(f"waiting up to 120 s for a request to port {port}"):
                    chat(port)

        reader = threading.Thread(target=request_once_waiting)
        reader.start()
        out = doctor.stdout.read()  # the table, once doctor is done
        doctor.wait(timeout=600)
        reader.join()
    assert doctor.returncode == 0, out + "".join(stderr)[-2000:]
    assert lines_of(out, f"port {port}").startswith("  ok") and "listened on by pid" in out
    assert "maps no TLS library" in out or ": probed" in out, out
    sample = lines_of(out, "sample request")
    assert sample.startswith("  ok") and "POST /v1/chat/completions → 200, API openai.chat" in sample, sample
    # Nothing there: said, and a failure, without waiting for a request.
    empty = subprocess.run([*DOCTOR, "--no-load", "--port", str(free_port())], capture_output=True, text=True,
                           timeout=600)
    assert empty.returncode == 1 and "nothing listens on port" in empty.stdout, empty.stdout


def chat(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": True})
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    connection.getresponse().read()
    connection.close()
