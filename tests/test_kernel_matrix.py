"""Real server stacks traced by the real agent, every stored row held against
what the client itself received (tests/server_matrix.py says, per stack, what
the agent is expected to make of it; docs/servers.md's table is rendered from it).

One agent traces every stack at once (its BPF compile is the slow part);
each stack gets a short keep-alive burst over a few connections, its three
API dialects interleaved, before the agent is stopped and the store read.
For a stack that is read, every request has exactly one row, and the row says
what the client saw: the text chunks as token events, the usage, the id, a
complete outcome, and a server TTFT inside the client's.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pandas as pd
import pytest
from tokenprobe.refserver.tls import make_self_signed_cert

from tests.kernel_harness import agent, read_rows, require_kernel
from tests.server_matrix import (
    MISREAD,
    READ,
    SILENT,
    STACKS,
    TLS_UNPROBED_ERROR,
    UNREADABLE,
    Outcome,
    Stack,
)
from tests.support import free_port, wait_for_port
from tests.support.stream_client import ClientView, stream

pytestmark = pytest.mark.kernel

SERVERS = Path(__file__).parent / "servers"
REQUESTS_PER_STACK = 12
CLIENTS_PER_STACK = 3          # concurrent connections, each carrying 4 requests (keep-alive)
BRACKET_SLACK_NS = 100_000     # timestamps are taken a few instructions away from the syscall they mark


@dataclass
class Launch:
    """How a stack is started and reached."""
    argv: Callable[[int, "Paths"], list[str]]  # (port, paths) -> command line, run in tests/servers
    scheme: str = "http"
    http2: bool = False        # the client speaks only HTTP/2 (ALPN h2, or prior knowledge over http)


@dataclass
class Paths:
    cert: Path
    key: Path
    go_binary: Path
    upstream: int              # the gateway's TLS upstream's port


PY = sys.executable
Argv = Callable[[int, Paths], list[str]]


def _argv(*template: str) -> Argv:
    """A command line with {port}, {cert}, {key} and {go} filled in at launch."""
    return lambda port, p: [a.format(port=port, cert=p.cert, key=p.key, go=p.go_binary) for a in template]


def _uvicorn(app: str, *extra: str) -> Argv:
    return _argv(PY, "-m", "uvicorn", app, "--port", "{port}", "--loop", "uvloop", "--http", "httptools",
                 "--log-level", "warning", "--no-access-log", *extra)


def _granian(*extra: str) -> Argv:
    return _argv(PY, "-m", "granian", "--interface", "asgi", "--port", "{port}", "--no-ws", "--log-level", "warning",
                 *extra, "asgi_sse:app")


GO_TLS = ("-cert", "{cert}", "-key", "{key}")

LAUNCHES = {
    "uvicorn": Launch(_uvicorn("asgi_sse:app")),
    "uvicorn-tls": Launch(_uvicorn("asgi_sse:app", "--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}"), "https"),
    "granian": Launch(_granian()),
    "granian-burst": Launch(_granian()),
    "granian-tls": Launch(_granian("--ssl-certificate", "{cert}", "--ssl-keyfile", "{key}"), "https"),
    "aiohttp": Launch(_argv(PY, "aiohttp_sse.py", "{port}")),
    "gateway": Launch(_uvicorn("gateway:app")),
    "go": Launch(_argv("{go}", "-port", "{port}")),
    "go-tls": Launch(_argv("{go}", "-port", "{port}", *GO_TLS), "https"),
    "go-tls-h2": Launch(_argv("{go}", "-port", "{port}", *GO_TLS), "https", http2=True),
    "node-tls": Launch(_argv("/usr/bin/node", "node_sse.js", "{port}", "{cert}", "{key}"), "https"),
    "hypercorn-h2": Launch(_argv(PY, "-m", "hypercorn", "--bind", "127.0.0.1:{port}", "--certfile", "{cert}",
                                 "--keyfile", "{key}", "asgi_sse:app"), "https", http2=True),
    "hypercorn-h2c": Launch(_argv(PY, "-m", "hypercorn", "--bind", "127.0.0.1:{port}", "asgi_sse:app"), http2=True),
}


@dataclass
class StackRun:
    stack: Stack
    port: int
    pid: int
    views: list[ClientView] = field(default_factory=list)


@dataclass
class MatrixRun:
    runs: dict[str, StackRun]
    rows: list[dict]
    log: str
    upstream_port: int


def _client(launch: Launch, port: int) -> httpx.Client:
    # verify=False: the servers' certificate is the test's self-signed one.
    return httpx.Client(base_url=f"{launch.scheme}://127.0.0.1:{port}", verify=False, timeout=60,
                        http1=not launch.http2, http2=launch.http2)


def drive(run: StackRun, launch: Launch) -> None:
    """REQUESTS_PER_STACK streamed requests over CLIENTS_PER_STACK keep-alive connections;
    dialects, lengths, usage and pacing vary from request to request."""
    bursts = [i % run.stack.burst_every == run.stack.burst_every - 1 if run.stack.burst_every else False
              for i in range(REQUESTS_PER_STACK)]
    plan = list(zip(itertools.cycle(run.stack.apis), itertools.cycle((3, 7, 5, 30, 4)),
                    itertools.cycle((True, False, True)), bursts))

    def one_client(share: list) -> list[ClientView]:
        with _client(launch, run.port) as client:
            return [stream(client, api, tokens, include_usage=usage, burst=burst) for api, tokens, usage, burst in share]

    with ThreadPoolExecutor(CLIENTS_PER_STACK) as pool:
        # Consecutive requests per connection: each connection carries every dialect the stack serves.
        per_client = len(plan) // CLIENTS_PER_STACK
        shares = [plan[i * per_client:(i + 1) * per_client] for i in range(CLIENTS_PER_STACK)]
        for views in pool.map(one_client, shares):
            run.views += views
    expected_version = "HTTP/2" if launch.http2 else "HTTP/1.1"
    assert all(v.status == 200 and v.http_version == expected_version and v.text_chunks for v in run.views), run.views


@contextmanager
def serving(argv: list[str], port: int, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """A server process, its output in `log` (a pipe nobody reads could stall it)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=SERVERS, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_for_port(port, timeout=60)
        except AssertionError:
            raise AssertionError(f"{argv} did not listen on {port}:\n{log.read_text(errors='replace')}") from None
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def build_go_server(tmp: Path, *, stripped: bool = False) -> Path:
    """tests/servers/go_sse.go built with Debian's Go; `stripped`: without symbol table and DWARF."""
    go = shutil.which("go")
    if go is None:
        pytest.fail("go is not installed (apt-get install golang-go; scripts/install.sh does)")
    binary = tmp / ("go_sse_stripped" if stripped else "go_sse")
    env = dict(os.environ, GOCACHE=str(tmp / "gocache"), GOPATH=str(tmp / "gopath"), GO111MODULE="off")
    flags = ["-ldflags=-s -w"] if stripped else []
    subprocess.run([go, "build", *flags, "-o", str(binary), str(SERVERS / "go_sse.go")], check=True, env=env)
    return binary


def warm_up(launch: Launch, port: int, apis: tuple[str, ...]) -> None:
    """One request per dialect before tracing: imports and first connections cost
    the servers once, and a first request must not be what the matrix measures."""
    with _client(launch, port) as client:
        for api in apis:
            assert stream(client, api, 2).status == 200


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> MatrixRun:
    require_kernel()
    tmp = tmp_path_factory.mktemp("matrix")
    cert, key = make_self_signed_cert(tmp)
    paths = Paths(cert, key, build_go_server(tmp), upstream=free_port())
    env = dict(os.environ, PYTHONPATH=str(SERVERS), UPSTREAM=f"https://127.0.0.1:{paths.upstream}")
    with ExitStack() as servers:
        # The gateway's upstream: the same TLS stack, traced only through the gateway's outbound side.
        servers.enter_context(serving(LAUNCHES["uvicorn-tls"].argv(paths.upstream, paths), paths.upstream, env,
                                      tmp / "upstream.log"))
        runs = {}
        for stack in STACKS:
            port = free_port()
            proc = servers.enter_context(serving(LAUNCHES[stack.key].argv(port, paths), port, env,
                                                 tmp / f"{stack.key}.log"))
            runs[stack.key] = StackRun(stack, port, proc.pid)
        for run in runs.values():
            warm_up(LAUNCHES[run.stack.key], run.port, run.stack.apis)
        ports = [run.port for run in runs.values() if run.stack.key != "gateway"]
        gateway = runs["gateway"]
        with agent(tmp, "--pid", str(gateway.pid), "--outbound", ports=ports) as handle:
            for run in runs.values():
                drive(run, LAUNCHES[run.stack.key])
            assert handle.stop() == 0, handle.log()
    return MatrixRun(runs, read_rows(handle.store_url), handle.log(), paths.upstream)


def _plain(value):
    """A store value as the client's: NULL as None, numpy scalars as Python ones."""
    if pd.isna(value):
        return None
    return value.item() if hasattr(value, "item") else value


def check_read(rows: list[dict], views: list[ClientView], *, tls: bool) -> None:
    """One row per request, each saying what its client saw."""
    by_model: dict[str, list[dict]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row)
    assert sorted(by_model) == sorted(v.model for v in views), "rows and requests differ"
    for view in views:
        (row,) = by_model[view.model]
        seen = {k: _plain(row[k]) for k in ("status", "outcome", "error", "tls", "api", "response_id", "token_events",
                                    "prompt_tokens", "completion_tokens")}
        client = {"status": view.status, "outcome": "complete", "error": "", "tls": tls, "api": view.api,
                  "response_id": view.response_id, "token_events": view.text_chunks,
                  "prompt_tokens": view.prompt_tokens, "completion_tokens": view.completion_tokens}
        if view.prompt_tokens is None:  # no usage asked for: the row may hold none, nothing else
            seen["prompt_tokens"], seen["completion_tokens"] = None, None
        assert seen == client, f"row vs client for {view}"
        server_ttft = row["first_token_ns"] - row["req_end_ns"]
        assert 0 < server_ttft <= view.ttft_ns + BRACKET_SLACK_NS, (server_ttft, view)


def observed(rows: list[dict], views: list[ClientView], stack: Stack) -> Outcome:
    """What the agent made of a stack that is not read: its rows name why, or there are none."""
    if not rows:
        return Outcome(SILENT, stack.outcome.reason)
    errors = {row["error"] for row in rows}
    named = stack.outcome.error and all(stack.outcome.error in e for e in errors)
    if named and not any(row["token_events"] for row in rows):
        return Outcome(UNREADABLE, stack.outcome.reason, stack.outcome.error)
    return Outcome(MISREAD, f"{len(rows)} rows for {len(views)} requests, errors {sorted(errors)}")


def _bug_marks(bug: str) -> list:
    """A stack misread because of a capture bug fails strictly: loudly once the bug is fixed."""
    return [pytest.mark.xfail(strict=True, reason=bug)] if bug else []


@pytest.mark.parametrize("stack", [pytest.param(s, id=s.key, marks=_bug_marks(s.bug)) for s in STACKS])
def test_stack(matrix: MatrixRun, stack: Stack):
    run = matrix.runs[stack.key]
    rows = [r for r in matrix.rows if r["server_port"] == run.port and r["role"] == "server"]
    if stack.outcome.kind == READ:
        check_read(rows, run.views, tls=LAUNCHES[stack.key].scheme == "https")
    else:
        assert observed(rows, run.views, stack) == stack.outcome


@pytest.mark.parametrize("gateway", [pytest.param(s, id=s.key, marks=_bug_marks(s.outbound_bug))
                                     for s in STACKS if s.key == "gateway"])
def test_gateway_outbound(matrix: MatrixRun, gateway: Stack):
    """The gateway's own TLS calls upstream, on the thread that reads its inbound
    connections, are rows of their own: each the upstream's answer to one request."""
    run = matrix.runs[gateway.key]
    outbound = [r for r in matrix.rows if r["server_port"] == matrix.upstream_port]
    assert all(r["role"] == "client" for r in outbound)
    check_read(outbound, run.views, tls=True)


@pytest.mark.parametrize("stack", [pytest.param(s, id=s.key) for s in STACKS if s.outcome.error == TLS_UNPROBED_ERROR])
def test_unreadable_tls_is_named_at_start_up(matrix: MatrixRun, stack: Stack):
    """The agent's start-up log names the TLS library of each stack whose TLS it cannot read."""
    named = [line for line in matrix.log.splitlines() if " cannot be read: " in line]
    assert any(f"cannot be read: {stack.tls}" in line for line in named), named


def test_no_row_outside_the_matrix(matrix: MatrixRun):
    """Every row belongs to a traced stack's port or to the gateway's upstream: no
    connection's bytes were credited to a port nobody asked about."""
    ports = {run.port for run in matrix.runs.values()} | {matrix.upstream_port}
    stray = [r for r in matrix.rows if r["server_port"] not in ports]
    assert not stray, stray


def test_nothing_dropped(matrix: MatrixRun):
    """The matrix's misreads are the agent's, not ring-buffer overflow: the kernel dropped nothing."""
    assert "; 0 events dropped by the kernel" in matrix.log, matrix.log
