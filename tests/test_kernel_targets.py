"""Target selection in the kernel: by PID, by executable (including processes
started after the agent, and their forked workers), connections opened
before the agent started, and the agent's exit paths."""

from __future__ import annotations

import http.client
import json
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pandas as pd
import pytest
from tokenprobe.refserver.loadgen import LoadConfig, burst
from tokenprobe.refserver.tls import make_self_signed_cert

from tests.kernel_harness import (
    agent,
    free_port,
    nginx_tls_proxy,
    read_rows,
    reference_server,
    require_kernel,
    wait_for_port,
)
from tests.support import wait_until

pytestmark = pytest.mark.kernel


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


def stream_once(conn: http.client.HTTPConnection, max_tokens: int = 4) -> str:
    body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": max_tokens, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    assert response.status == 200
    return json.loads(data.split(b"data: ", 2)[1].split(b"\n", 1)[0])["id"]


def small_load(port: int, tls: bool, n: int = 12) -> set[str]:
    config = LoadConfig(port=port, tls=tls, requests=n, duration_s=None, max_tokens=(2, 6), seed=3)
    result = burst(config, n=n, concurrency=3, per_connection=2)
    assert not result.errors
    return {r.response_id for r in result.records}


def test_pid_target(tmp_path: Path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenprobe.refserver", "serve", "--port", str(port),
                               "--decode-ms", "2", "--log-level", "WARNING"])
    try:
        wait_for_port(port)
        with agent(tmp_path, "--pid", str(server.pid), ports=[]) as handle:
            sent = small_load(port, tls=False)
            assert handle.stop() == 0, handle.log()
    finally:
        server.terminate()
        server.wait(timeout=20)
    rows = read_rows(handle.store_url)
    assert {r["response_id"] for r in rows} == sent


def test_exe_target_started_later_with_forked_workers(tmp_path: Path):
    """nginx is started after the agent: its master is exec'd (matched in the
    kernel by path) and its workers are forked (inherited as targets)."""
    cert, key = make_self_signed_cert(tmp_path)
    with reference_server(tmp_path, decode_ms=2.0) as (backend, _truth), \
            agent(tmp_path, "--exe", "/usr/sbin/nginx", ports=[]) as handle:
        with nginx_tls_proxy(tmp_path, backend, cert, key) as port:
            sent = small_load(port, tls=True)
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert {r["response_id"] for r in rows} == sent
    assert all(r["tls"] for r in rows)


@contextmanager
def asyncio_server(tmp_path: Path, tls: bool) -> Iterator[int]:
    """tests/servers/asyncio_sse.py (5 tokens a stream); over TLS, asyncio's ssl transport: memory BIOs."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).parent / "servers" / "asyncio_sse.py"), str(port)]
    if tls:
        cmd += [str(p) for p in make_self_signed_cert(tmp_path)]
    server = subprocess.Popen(cmd)
    try:
        wait_for_port(port)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=20)


@contextmanager
def adoptable_server(tmp_path: Path, kind: str) -> Iterator[tuple[int, int]]:
    """(port, token events a stream) of the server a kept-alive connection is adopted on."""
    if kind == "tls-memory-bio":
        with asyncio_server(tmp_path, tls=True) as port:
            yield port, 5
    else:
        with reference_server(tmp_path, tls=kind == "tls-socket-bio", decode_ms=2.0) as (port, _truth):
            yield port, 4


@pytest.mark.parametrize("kind", ["plain", "tls-socket-bio", "tls-memory-bio"])
def test_connection_opened_before_the_agent(tmp_path: Path, kind: str):
    """A keep-alive connection from before the agent started is adopted from
    /proc; requests on it afterwards are captured whole (accept time
    unknown). Over TLS its SSL object, created before the agent, is bound at
    its next read: a socket BIO by libssl's own socket call, a memory BIO by
    the ciphertext's path from the socket to BIO_write and libssl's BIO_read."""
    tls = kind != "plain"
    with adoptable_server(tmp_path, kind) as (port, tokens):
        conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=ssl._create_unverified_context())
                if tls else http.client.HTTPConnection("127.0.0.1", port, timeout=30))
        before = stream_once(conn)
        with agent(tmp_path, ports=[port]) as handle:
            after = [stream_once(conn) for _ in range(3)]
            conn.close()
            assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    ids = [r["response_id"] for r in rows]
    assert before not in ids
    assert sorted(ids) == sorted(after)
    for row in rows:
        assert pd.isna(row["accept_ns"]), row
        assert (row["tls"], row["token_events"], row["outcome"], row["capture"], row["error"]) == (
            tls, tokens, "complete", "exact", ""), row


def test_sigint_mid_stream_writes_the_open_request(tmp_path: Path):
    """Stopping the agent (status line on, as an operator runs it) while a
    stream is open loses nothing: the request is stored, marked truncated,
    with the tokens seen so far, and the summary is printed."""
    with reference_server(tmp_path, decode_ms=50.0) as (port, _truth), \
            agent(tmp_path, ports=[port], quiet=False) as handle:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = json.dumps({"prompt": "x", "max_tokens": 200, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read1(4096)
        time.sleep(0.5)
        handle.proc.send_signal(signal.SIGINT)
        assert handle.proc.wait(timeout=120) == 0, handle.log()
        conn.close()
    rows = read_rows(handle.store_url)
    assert len(rows) == 1
    assert rows[0]["outcome"] == "truncated" and rows[0]["token_events"] >= 3
    log = handle.log()
    assert re.search(r"tokenprobe agent +\d+s \| requests 1 \|", log), log
    assert "done: 1 requests" in log and "1 rows stored" in log, log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_while_the_program_loads(tmp_path: Path, sig: int):
    """A stop that arrives while the BPF program compiles ends the run
    cleanly too: summary printed, exit 0."""
    with agent(tmp_path, ports=[free_port()], quiet=False, ready="compiling and loading") as handle:
        handle.proc.send_signal(sig)
        assert handle.proc.wait(timeout=120) == 0, handle.log()
    assert "done: 0 requests" in handle.log(), handle.log()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls-memory-bio"])
def test_asyncio_server(tmp_path: Path, tls: bool):
    """uvicorn-style asyncio serving; over TLS, asyncio's ssl transport uses
    memory BIOs, so the probes tie SSL* to the connection through the
    ciphertext's path from the socket into the BIO, not a socket call inside libssl."""
    with asyncio_server(tmp_path, tls) as port, agent(tmp_path, ports=[port]) as handle:
        config = LoadConfig(port=port, tls=tls, requests=20, duration_s=None, seed=5)
        result = burst(config, n=20, concurrency=4, per_connection=5)
        assert not result.errors, result.errors[0].error
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(r.response_id for r in result.records)
    assert all(r["token_events"] == 5 and r["outcome"] == "complete" and r["tls"] == tls for r in rows), rows
    if tls:
        assert all(r["tls_done_ns"] for r in rows if r["req_seq"] == 0)


def test_outbound_connections_of_a_proxy(tmp_path: Path):
    """--outbound: nginx's own keep-alive connections to its upstream are
    traced from the client side (role 'client'), next to the inbound ones."""
    cert, key = make_self_signed_cert(tmp_path)
    with reference_server(tmp_path, decode_ms=2.0) as (backend, _truth), \
            agent(tmp_path, "--exe", "/usr/sbin/nginx", "--outbound", ports=[]) as handle:
        with nginx_tls_proxy(tmp_path, backend, cert, key) as port:
            sent = small_load(port, tls=True)
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    inbound = {r["response_id"] for r in rows if r["server_port"] == port}
    outbound = [r for r in rows if r["server_port"] == backend]
    assert inbound == sent
    assert {r["response_id"] for r in outbound} == sent
    assert all(not r["tls"] and r["outcome"] == "complete" for r in outbound)


def test_store_down_the_agent_traces_and_spools(tmp_path: Path):
    """An unreachable store costs nothing but a warning: requests are traced,
    spooled to disk, and the agent still exits 0 with the count."""
    dead_store = f"http://127.0.0.1:{free_port()}/"
    with reference_server(tmp_path, decode_ms=2.0) as (port, _truth), \
            agent(tmp_path, "--store", dead_store, ports=[port]) as handle:
        small_load(port, tls=False, n=6)
        assert handle.stop() == 0, handle.log()
    log = handle.log()
    assert "tracing anyway" in log
    assert re.search(r"done: 6 requests .* 6 spooled to disk", log), log


def test_prometheus_endpoint_counts_what_was_traced(tmp_path: Path):
    metrics_port = free_port()
    with reference_server(tmp_path, decode_ms=2.0) as (port, _truth), \
            agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port]) as handle:
        sent = small_load(port, tls=False, n=8)
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
                text = response.read().decode()
            counts = re.findall(rf'tokenprobe_request_ttft_seconds_count{{[^}}]*server_port="{port}"[^}}]*}} (\S+)',
                                text)
            if sum(float(c) for c in counts) >= len(sent) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert handle.stop() == 0, handle.log()
    assert sum(float(c) for c in counts) == len(sent), text
    assert re.search(r"^tokenprobe_agent_events_total \d", text, re.M), text


def test_sampling_and_analysis_start_when_a_store_down_at_start_comes_back(tmp_path: Path):
    """The store is unreachable when the agent starts: requests spool, and the engine samples and the
    live analysis begin once it answers, with no restart."""
    from tokenprobe.store import open_store
    from tokenprobe.store.server import StoreServer

    store_port = free_port()
    url = f"http://default:late-token@127.0.0.1:{store_port}/"
    with reference_server(tmp_path, simulated_metrics=True) as (port, _truth), \
            agent(tmp_path, "--store", url, "--engine", f"http://127.0.0.1:{port}/metrics",
                  "--scrape-interval", "0.5", "--analyze-every", "2", ports=[port]) as handle:
        response_id = stream_once(http.client.HTTPConnection("127.0.0.1", port, timeout=30))
        with open_store(f"chdb://{tmp_path / 'late-store'}", serve=False) as owner:
            server = StoreServer(str(tmp_path / "late-store"), "late-token", port=store_port)
            try:
                wait_until(lambda: owner.command("EXISTS TABLE tokenprobe.engine_samples") == 1
                           and owner.command("SELECT count() FROM tokenprobe.engine_samples") > 0, timeout=90)
                # Spooled while the store was away, replayed once it answers (beside the agent's own scrapes).
                wait_until(lambda: owner.command("SELECT count() FROM tokenprobe.requests WHERE response_id = "
                                                 "{id:String}", {"id": response_id}) == 1, timeout=60)
                assert handle.stop() == 0, handle.log()
            finally:
                server.close()
    assert "sampling and live analysis started" in handle.log()
