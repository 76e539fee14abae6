"""Protocols and blind spots with real BPF: HTTP/2 from hypercorn (h2c with prior
knowledge, and TLS with ALPN h2 read at libssl) read stream by stream; a Go
`crypto/tls` server read at its own Read/Write; and TLS the agent cannot probe
(a Go binary without symbols, OpenSSL linked into node) named at start-up,
counted on /metrics and stored as `unsupported` rows with the reason, never as
missing data."""

from __future__ import annotations

import asyncio
import re
import ssl
import sys
import time
import urllib.request
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
from tests.servers.grpc_generator import MESSAGE_BYTES, METHOD, call_generate
from tests.support.stream_client import OPENAI, stream
from tests.test_http2_real_server import stream_chats
from tests.test_kernel_matrix import build_go_server, check_read

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


def test_grpc_server_streaming_calls_are_rows_matching_the_client(tmp_path: Path):
    """grpcio (gRPC's C core) over h2c: one row per call, its status from the trailers,
    each streamed message one token event."""
    port = free_port()
    with listening_process([sys.executable, "-m", "tests.servers.grpc_generator", str(port)], port, cwd=REPO), \
            agent(tmp_path, ports=[port]) as handle:
        seen = call_generate(port, ((5, 0), (12, 0), (3, 1)))
        assert handle.stop() == 0, handle.log()
    rows = sorted(read_rows(handle.store_url), key=lambda row: row["stream_id"])
    assert [code for _, code, _ in seen] == [0, 0, 8]
    assert [(r["protocol"], r["api"], r["path"], r["status"], r["outcome"], r["error"], r["capture"],
             r["grpc_status"], r["token_events"], r["tls"], r["unreadable_reason"]) for r in rows] == [
        ("h2c", "grpc", METHOD, 200, "complete", "", "exact", code, len(times), False, "")
        for times, code, _ in seen], rows
    for row, (times, _, _) in zip(rows, seen):
        assert row["req_end_ns"] <= row["first_token_ns"] <= row["last_token_ns"], row
        assert row["bytes_out"] >= MESSAGE_BYTES * len(times)  # the messages, inside DATA frames


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


NODE_SSE_SERVER = r'''
const https = require("https"), fs = require("fs");
const [port, cert, key] = process.argv.slice(1);
https.createServer({cert: fs.readFileSync(cert), key: fs.readFileSync(key)}, (req, res) => {
  res.writeHead(200, {"content-type": "text/event-stream", "connection": "close"});
  for (let i = 0; i < 5; i++) res.write(`data: {"choices":[{"index":0,"delta":{"content":"t${i}"}}]}\n\n`);
  res.end("data: [DONE]\n\n");
}).listen(Number(port), "127.0.0.1");
'''


def test_node_with_openssl_linked_in_is_named_and_counted_as_tls_unprobed(tmp_path: Path):
    """The image's Node.js 20 carries OpenSSL inside `node`: not probed yet, so named and counted."""
    port = free_port()
    cert, key = make_self_signed_cert(tmp_path)
    with listening_process(["/usr/bin/node", "-e", NODE_SSE_SERVER, str(port), str(cert), str(key)], port) as server, \
            agent(tmp_path, ports=[port]) as handle:
        post_twice_over_tls(port)
        time.sleep(0.5)  # the server's close
        assert handle.stop() == 0, handle.log()
    assert f"TLS of pid {server.pid} (/usr/bin/node) cannot be read: static OpenSSL" in handle.log()
    rows = read_rows(handle.store_url)
    assert [(r["outcome"], r["unreadable_reason"], r["status"]) for r in rows] == [
        ("unsupported", "tls_unprobed", 0)] * 2, rows
