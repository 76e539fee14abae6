"""The tokenprobe command as a person uses it: help, bad input, doctor."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

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
    (["agent", "--port", "8000", "--idle-timeout", "0"], "--idle-timeout must be a positive"),
    (["agent", *(f"--port={port}" for port in range(1, 258))], "at most 256 --port"),
])
def test_agent_refuses_bad_options_in_plain_words(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_agent_refuses_an_analysis_config_it_cannot_use_naming_the_key(tmp_path):
    config = tmp_path / "analysis.toml"
    config.write_text("[analysis]\nlive_refit_every = 60\n")
    result = run("agent", "--port", "8000", "--analysis-config", str(config))
    assert result.returncode == 2
    assert "--analysis-config" in result.stderr and "live_refit_every" in result.stderr
    assert "live_refit_every_s" in result.stderr, "the key it meant is named"
    result = run("agent", "--port", "8000", "--analysis-config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "cannot read" in result.stderr


@pytest.mark.kernel
def test_doctor_reports_this_node():
    require_kernel()
    result = run("doctor")
    assert "BPF load" in result.stdout and "libssl" in result.stdout and "NVML" in result.stdout
    assert result.returncode == 0, result.stdout
    assert "tokenprobe can run here" in result.stdout
    # The kernel maps' sizes, and where a running agent reports their overflows.
    assert re.search(r"kernel maps .*conns 65536, .*listeners 16384", result.stdout)
    assert "tokenprobe_agent_map_overflows_total" in result.stdout


@pytest.mark.parametrize("option", [["--port", "70000"], ["--rate", "0"], ["--duration", "-1"], ["--slots", "0"]])
def test_demo_refuses_bad_options_in_plain_words(tmp_path, option):
    result = run("demo", "--store", f"chdb://{tmp_path / 'store'}", *option)
    assert result.returncode == 2 and result.stderr.startswith("tokenprobe demo: --port must be"), result.stderr
    assert not (tmp_path / "store").exists()


def test_version():
    from importlib.metadata import version

    result = run("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"tokenprobe {version('tokenprobe')}")


@pytest.mark.parametrize("command", [["query", "SELECT 1"], ["analyze"], ["dashboard"],
                                     ["agent", "--port", "8000"], ["demo"]])
def test_a_store_url_that_cannot_be_right_is_a_usage_error(command):
    result = run(*command, "--store", "ftp://host/")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"tokenprobe {command[0]}: error: --store: unsupported store URL scheme 'ftp' in 'ftp://host/': use "
        "chdb:///DIR, a directory path, http://host:8123/ or https://host:8443/")


def test_an_unreachable_store_is_one_line_naming_the_reason():
    from tests.support import free_port

    url = f"http://127.0.0.1:{free_port()}/"
    result = run("query", "--store", url, "SELECT 1")
    assert result.returncode == 1
    assert result.stderr == f"tokenprobe query: cannot reach ClickHouse at http://default@{url[7:]}: " \
                            "Connection refused\n"
    verbose = run("query", "-v", "--store", url, "SELECT 1")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr, "-v after the command shows the traceback"


def test_a_mistyped_store_path_is_said_to_hold_nothing_and_stays_empty(tmp_path):
    typo = tmp_path / "typo"
    result = run("query", "--store", f"chdb://{typo}", "SELECT count() FROM tokenprobe.requests")
    assert result.returncode == 1
    assert result.stderr == (f"tokenprobe query: no store at {typo}: no such directory (check the path; an agent "
                             f"started with --store chdb://{typo} creates one)\n")
    assert not typo.exists()


def test_a_metrics_port_in_use_is_refused_before_the_compile(tmp_path):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        result = run("agent", "--port", "8000", "--metrics-port", str(busy), "--store", f"chdb://{tmp_path / 's'}")
    assert result.returncode == 1
    assert result.stderr == (f"tokenprobe agent: --metrics-port {busy}: 127.0.0.1:{busy} is in use by another "
                             "process; choose another port, or stop what listens there\n")
    assert not (tmp_path / "s").exists(), "refused before anything was opened"


def test_targets_that_select_nothing_yet_are_said_at_start():
    import socket

    from tokenprobe.agent.capture.kernel.loader import Targets
    from tokenprobe.cli.preflight import warn_about_targets

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        listening = server.getsockname()[1]
        from tests.support import free_port

        idle = free_port()
        warnings = warn_about_targets(Targets(ports=[listening, idle], exes=["/nonexistent/vllm", sys.executable]))
    assert warnings == [
        f"nothing listens on port {idle} yet: its connections are traced once a server listens there (check the "
        "port if none is about to)",
        "--exe /nonexistent/vllm: no such file on this host and no process runs it: its processes are traced if "
        "one starts (inside a container, give the path the container sees)"]


@pytest.mark.kernel
def test_the_agent_says_what_it_does_and_ends_with_its_summary_on_stdout(tmp_path):
    """`agent … | tee log` keeps the summary; the compile is announced; an idle target port is named."""
    require_kernel()
    from tests.support import free_port

    idle = free_port()
    result = run("agent", "--port", str(idle), "--duration", "1", "--analyze-every", "0", "--quiet",
                 "--store", f"chdb://{tmp_path / 'store'}")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"done: 0 requests from \d+ kernel events .* in [\d.]+s; 0 rows stored; 0 events dropped "
                        r"by the kernel\n", result.stdout), result.stdout
    assert f"WARNING tokenprobe.agent: nothing listens on port {idle} yet" in result.stderr
    assert "compiling and loading the BPF probes (11-60 s)…" in result.stderr
    assert re.search(r"compiling and loading the BPF probes: done in \d+ s", result.stderr), result.stderr
    assert "Traceback" not in result.stderr


def test_an_agent_whose_store_does_not_answer_says_so_once_not_at_every_retry(caplog):
    from tokenprobe.agent.capture.kernel.loader import Targets
    from tokenprobe.cli.agent import Agent, AgentConfig

    from tests.support import free_port

    agent = Agent(AgentConfig(targets=Targets(ports=[8000]), store_url=f"http://127.0.0.1:{free_port()}/"))
    with caplog.at_level("DEBUG"):
        assert agent._open_store() is None and agent._open_store() is None
    said = [(record.levelname, record.name) for record in caplog.records if "cannot reach" in record.getMessage()]
    assert said == [("WARNING", "tokenprobe.agent"), ("DEBUG", "tokenprobe.agent")], said


def test_query_reads_a_store(tmp_path):
    from tokenprobe.store.embedded import open_store

    url = f"chdb://{tmp_path / 'store'}"
    with open_store(url, serve=False) as store:
        store.ensure_schema()
    result = run("query", "--store", url, "SELECT count() AS n FROM tokenprobe.requests")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["n", "0"]


@pytest.mark.parametrize("extra, message", [
    ([], "needs credentials"),
    (["--token-file", "/nonexistent/token"], "No such file"),
    (["--cert", "c.pem"], "--cert and --key go together"),
    (["--token-file", __file__, "--upstream", "8000"], "PORT=NAME"),
])
def test_control_refuses_bad_options_in_plain_words(tmp_path, extra, message):
    result = run("control", "--store", f"chdb://{tmp_path / 'store'}", "--actuator", "127.0.0.1:1", *extra)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_control_runs_until_sigterm_and_says_what_it_did(tmp_path):
    from tokenprobe.actuator.auth import ServerAuth
    from tokenprobe.actuator.server import ActuatorServer

    from tests.actuator_support import TOKEN

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN}))) as actuator:
        control = subprocess.Popen(
            [sys.executable, "-m", "tokenprobe", "control", "--store", f"chdb://{tmp_path / 'store'}",
             "--actuator", f"127.0.0.1:{actuator.port}", "--token-file", str(token_file), "--window", "0.5",
             "--settle", "0"], stderr=subprocess.PIPE, text=True)
        try:
            # The loop has started once it says so; a few windows pass (an empty store: nothing to decide).
            for line in iter(control.stderr.readline, ""):
                if "deciding every 0.5 s" in line:
                    break
            else:
                pytest.fail("control exited before starting its loop")
            time.sleep(2.0)
        finally:
            control.send_signal(signal.SIGTERM)
            _, rest = control.communicate(timeout=60)
    assert control.returncode == 0, rest
    assert "stopped after" in rest and "0 decisions; failures: none" in rest, rest
