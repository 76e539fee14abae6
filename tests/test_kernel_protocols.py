"""Protocols and blind spots with real BPF: HTTP/2 from hypercorn (h2c with prior
knowledge, and TLS with ALPN h2 read at libssl) read stream by stream; gRPC
server-streaming calls as rows; a Go `crypto/tls` server read at its own
Read/Write; OpenSSL found by what it exports (linked into Node.js, a renamed
libssl) read; and TLS the agent cannot probe (a Go binary without symbols) named
at start-up, counted on /metrics and stored as `unsupported` rows with the
reason, never as missing data."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from tokenprobe.refserver.tls import make_self_signed_cert

from tests.kernel_harness import (
    agent,
    free_port,
    listening_process,
    read_rows,
    require_kernel,
)
from tests.servers.grpc_generator import METHOD, call_generate
from tests.support import mapped_libssl, wait_until
from tests.support.stream_client import OPENAI, ClientView, stream
from tests.test_http2_real_server import stream_chats
from tests.test_kernel_matrix import (
    LAUNCHES,
    Paths,
    build_go_server,
    check_read,
    serving,
)

pytestmark = pytest.mark.kernel
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


@pytest.mark.parametrize("tls", [False, True], ids=["h2c", "h2-alpn"])
def test_hypercorn_http2_every_stream_is_a_row_matching_the_client(tmp_path: Path, tls: bool):
    port = free_port()
    cmd = [sys.executable, "-m", "tokenprobe.refserver.h2_sse", str(port)]
    if tls:
        cmd += [str(p) for p in make_self_signed_cert(tmp_path)]
    with listening_process(cmd, port, cwd=REPO), agent(tmp_path, ports=[port]) as handle:
        seen = asyncio.run(stream_chats(port, 3, tls=tls))
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert sorted(r["tenant"] for r in rows) == sorted(seen), rows
    assert sorted(r["stream_id"] for r in rows) == [1, 3, 5]
    for row in rows:
        client = seen[row["tenant"]]
        assert (row["protocol"], row["tls"], row["outcome"], row["error"], row["capture"], row["path"],
                row["status"], row["unreadable_reason"]) == (
            "h2" if tls else "h2c", tls, "complete", "", "exact", "/v1/chat/completions", 200, ""), row
        assert row["response_id"] == client["id"] and row["sse_events"] == client["events"]
        assert row["token_events"] == len(client["token_seen_ns"]) == row["completion_tokens"]


def test_an_h2c_upgrade_by_curl_is_read_on_in_http2(tmp_path: Path):
    """curl --http2 on http:// asks `Upgrade: h2c`; hypercorn answers 101 and streams the response on
    HTTP/2 stream 1: one h2c row matching what curl read, and no blind spot."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenprobe.refserver.h2_sse", str(port)]
    with listening_process(cmd, port, cwd=REPO), agent(tmp_path, ports=[port]) as handle:
        curl = subprocess.run(["curl", "--http2", "-sS", "-N", "--max-time", "30", "-H", "x-tenant-id: upgraded",
                               "-w", "\n%{http_version}", f"http://127.0.0.1:{port}/v1/chat/completions"],
                              capture_output=True, text=True, timeout=60, check=True)
        assert handle.stop() == 0, handle.log()
    *lines, http_version = curl.stdout.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    texts = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert http_version == "2" and "data: [DONE]" in lines, curl.stdout
    [row] = read_rows(handle.store_url)
    assert (row["protocol"], row["stream_id"], row["tenant"], row["path"], row["status"], row["outcome"],
            row["error"], row["capture"], row["unreadable_reason"]) == (
        "h2c", 1, "upgraded", "/v1/chat/completions", 200, "complete", "", "exact", ""), row
    assert (row["response_id"], row["sse_events"], row["token_events"]) == (
        events[0]["id"], len(events) + 1, len(texts)), row  # + 1: [DONE]


def test_grpc_server_streaming_calls_are_rows_matching_the_client(tmp_path: Path):
    """grpcio (gRPC's C core) over h2c: one row per call, its status from the trailers,
    each streamed message one token event."""
    port = free_port()
    with listening_process([sys.executable, "-m", "tests.servers.grpc_generator", str(port)], port, cwd=REPO), \
            agent(tmp_path, ports=[port]) as handle:
        seen = call_generate(port, ((5, 0), (12, 0), (3, 1)))
        assert handle.stop() == 0, handle.log()
    rows = sorted(read_rows(handle.store_url), key=lambda row: row["stream_id"])
    assert [call.code for call in seen] == [0, 0, 8]
    assert [(r["protocol"], r["api"], r["path"], r["status"], r["outcome"], r["error"], r["capture"],
             r["grpc_status"], r["token_events"], r["tls"], r["unreadable_reason"]) for r in rows] == [
        ("h2c", "grpc", METHOD, 200, "complete", "", "exact", call.code, len(call.arrived_ns), False, "")
        for call in seen], rows
    assert [(r["request_messages"], r["request_message_bytes"], r["response_message_bytes"],
             r["largest_response_message_bytes"]) for r in rows] == [
        (1, call.request_bytes, sum(call.message_sizes), max(call.message_sizes)) for call in seen], rows
    for row, call in zip(rows, seen):
        assert row["req_end_ns"] <= row["first_token_ns"] <= row["last_token_ns"], row
        assert row["bytes_out"] >= sum(call.message_sizes)  # the messages, inside DATA frames


def post_twice_over_tls(port: int) -> None:
    """Two streamed chats, one connection each, the server's certificate not checked."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    for _ in range(2):
        request = urllib.request.Request(f"https://127.0.0.1:{port}/v1/chat/completions", data=b"{}")
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            assert b"[DONE]" in response.read()  # the client read it all; the agent cannot


def tls_unprobed_counts(metrics_port: int, port: int) -> list[str]:
    """The agent's tls_unprobed counter for connections to `port`, as exposed on /metrics."""
    counted = rf'^tokenprobe_agent_unreadable_connections_total{{(?=[^}}]*reason="tls_unprobed")' \
              rf'(?=[^}}]*server_port="{port}")[^}}]*}} (\S+)'
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        return re.findall(counted, page.read().decode(), re.MULTILINE)


def go_tls_server(binary: Path, port: int, tmp: Path):
    cert, key = make_self_signed_cert(tmp)
    return listening_process([str(binary), "-port", str(port), "-cert", str(cert), "-key", str(key)], port)


def test_go_crypto_tls_server_rows_match_the_client(tmp_path: Path):
    """Go net/http over crypto/tls, read at crypto/tls.(*Conn).Read/Write: rows like OpenSSL's."""
    binary = build_go_server(tmp_path)
    port, metrics_port = free_port(), free_port()
    with go_tls_server(binary, port, tmp_path), \
            agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port]) as handle:
        views = []
        for plan in (((3, True), (7, False)), ((5, True), (30, True))):  # two keep-alive connections
            with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=60) as client:
                views += [stream(client, OPENAI, tokens, include_usage=usage) for tokens, usage in plan]
        counted = tls_unprobed_counts(metrics_port, port)
        assert handle.stop() == 0, handle.log()
    assert re.search(rf"Go crypto/tls probed: \S*{re.escape(str(binary))} \(go1\.\d+", handle.log()), handle.log()
    assert "cannot be read" not in handle.log() and counted == []
    rows = read_rows(handle.store_url)
    assert all(v.status == 200 and v.http_version == "HTTP/1.1" for v in views), views
    check_read(rows, views, tls=True)
    assert [r["protocol"] for r in rows] == ["http/1.1"] * 4, rows
    assert len({r["conn_id"] for r in rows}) == 2
    assert all(r["accept_ns"] < r["tls_done_ns"] < r["req_start_ns"] for r in rows), rows


def test_go_crypto_tls_without_symbols_is_counted_as_tls_unprobed(tmp_path: Path):
    """`go build -ldflags=-s -w` leaves no symbol table to find crypto/tls by: named, counted, never guessed."""
    binary = build_go_server(tmp_path, stripped=True)
    port, metrics_port = free_port(), free_port()
    with go_tls_server(binary, port, tmp_path) as server, \
            agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port]) as handle:
        post_twice_over_tls(port)
        deadline = time.monotonic() + 20
        while (counted := tls_unprobed_counts(metrics_port, port)) != ["2.0"] and time.monotonic() < deadline:
            time.sleep(0.3)
        assert handle.stop() == 0, handle.log()
    assert f"TLS of pid {server.pid} ({binary}) cannot be read: Go crypto/tls, no symbol table " \
           "(built with -ldflags=-s)" in handle.log()
    rows = read_rows(handle.store_url)
    assert counted == ["2.0"]
    assert [(r["outcome"], r["unreadable_reason"], r["tls"], r["status"]) for r in rows] == [
        ("unsupported", "tls_unprobed", False, 0)] * 2, rows
    assert all(r["bytes_in"] and r["bytes_out"] for r in rows)


def _drive_tls_sse(port: int) -> list[ClientView]:
    """Eight streamed chats over two keep-alive TLS connections: lengths, usage and pacing vary,
    and every other request asks for its chunks at once (burst)."""
    views = []
    for connection in range(2):
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=60) as client:
            for i in range(4):
                views.append(stream(client, OPENAI, (3, 9, 1, 30)[i], include_usage=i % 2 == 0,
                                    burst=(i + connection) % 2 == 1))
    assert all(v.status == 200 and v.text_chunks for v in views), views
    return views


def test_openssl_linked_into_node_and_a_renamed_libssl_are_probed_and_read(tmp_path: Path):
    """Two copies of OpenSSL the agent finds by what they export, not by their file names:
    the one linked into Node.js (driven through node's own BIOs and sent later by libuv:
    each SSL is bound to its socket by the records it writes), and a libssl copied under
    another name that a Python TLS server runs on instead of the system's (LD_PRELOAD: the
    loader takes it for libssl.so.3 by its soname). Every streamed request on either, paced
    or in bursts node gathers into vectored writes, is a row matching its client."""
    cert, key = make_self_signed_cert(tmp_path)
    renamed = tmp_path / "libssl-3f2a9c1d.so.3"  # as a wheel bundles it (auditwheel)
    shutil.copy(mapped_libssl(), renamed)
    paths = Paths(cert, key, go_binary=Path("/nonexistent"), upstream=0)
    node_port, python_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests" / "servers"))
    with ExitStack() as servers:
        node = servers.enter_context(serving(LAUNCHES["node-tls"].argv(node_port, paths), node_port, env,
                                             tmp_path / "node.log"))
        python = servers.enter_context(serving(LAUNCHES["uvicorn-tls"].argv(python_port, paths), python_port,
                                               dict(env, LD_PRELOAD=str(renamed)), tmp_path / "uvicorn.log"))
        mapped = Path(f"/proc/{python.pid}/maps").read_text()
        assert str(renamed) in mapped and "/libssl.so" not in mapped, "the server does not run on the copy"
        with agent(tmp_path, ports=[node_port, python_port]) as handle:
            views = {node_port: _drive_tls_sse(node_port), python_port: _drive_tls_sse(python_port)}
            assert handle.stop() == 0, handle.log()
    log = handle.log()
    probed = next(line for line in log.splitlines() if "OpenSSL probed:" in line)
    assert "/usr/bin/node" in probed and str(renamed) in probed, probed
    assert f"TLS of pid {node.pid}" not in log  # nothing left unread to name
    rows = read_rows(handle.store_url)
    for port, seen in views.items():
        check_read([r for r in rows if r["server_port"] == port], seen, tls=True)


def test_a_renamed_libssl_of_a_server_started_after_the_agent_is_probed_at_a_rescan(tmp_path: Path):
    """After its first look at every process, the agent's rescans read the memory maps only
    of the processes the kernel watches: a server started later on a target port, running on
    its own copy of libssl, is among them from its bind(), and its copy is probed at the next
    rescan; every streamed request after that is a row matching its client."""
    cert, key = make_self_signed_cert(tmp_path)
    renamed = tmp_path / "libssl-7c0e51b4.so.3"
    shutil.copy(mapped_libssl(), renamed)
    paths = Paths(cert, key, go_binary=Path("/nonexistent"), upstream=0)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests" / "servers"), LD_PRELOAD=str(renamed))
    with agent(tmp_path, ports=[port]) as handle:
        assert str(renamed) not in handle.log()
        with serving(LAUNCHES["uvicorn-tls"].argv(port, paths), port, env, tmp_path / "uvicorn.log"):
            wait_until(lambda: "probing OpenSSL in /proc/" in handle.log() and str(renamed) in handle.log(),
                       timeout=30)
            views = _drive_tls_sse(port)
        assert handle.stop() == 0, handle.log()
    check_read(read_rows(handle.store_url), views, tls=True)
