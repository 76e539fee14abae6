"""Capture fidelity in the kernel: what real servers do to accepts and
writes, checked per row against what the client saw and the server sent."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from tokenprobe.refserver.tls import make_self_signed_cert

from tests.kernel_harness import (
    agent,
    free_port,
    read_rows,
    read_truth,
    reference_server,
    require_kernel,
    wait_for_port,
)
from tests.support import wait_until

pytestmark = pytest.mark.kernel

SHAPES_SERVER = Path(__file__).parent / "servers" / "shapes_sse.py"


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


@contextmanager
def shapes_server(*args: str, host: str = "127.0.0.1") -> Iterator[tuple[int, int]]:
    """tests/servers/shapes_sse.py started with `args`; yields (port, pid)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SHAPES_SERVER), str(port), "--host", host, *args])
    try:
        wait_for_port(port, host=host)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def stream(conn: http.client.HTTPConnection, tokens: int, delay_ms: float = 0) -> str:
    """One streamed request; returns the response id the server used."""
    rid = f"cmpl-{uuid.uuid4().hex}"
    conn.request("POST", "/v1/completions",
                 body=json.dumps({"id": rid, "max_tokens": tokens, "delay_ms": delay_ms}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
    return rid


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_peer_read_from_the_socket_when_accept_gives_no_address(tmp_path: Path, host: str):
    """accept4(fd, NULL, NULL, 0) (libuv, cpp-httplib): every row still names
    the client's own address and port, and the listening port."""
    with shapes_server("--null-accept", host=host) as (port, _), agent(tmp_path, ports=[port]) as handle:
        clients: dict[str, tuple[str, int]] = {}
        for _ in range(4):
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.connect()
            me = conn.sock.getsockname()[:2]
            for _ in range(2):
                clients[stream(conn, 3)] = me
            conn.close()
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(clients)
    for row in rows:
        assert (row["client_addr"], row["client_port"]) == clients[row["response_id"]], row
        assert row["server_port"] == port and row["outcome"] == "complete", row


def test_rows_that_lost_kernel_events_say_dropped(tmp_path: Path):
    """A ring buffer far too small for a burst makes the kernel drop events:
    every row that lost some says `dropped`, and every row that says `exact`
    matches what the server sent. Paced streams before and after the burst
    lose nothing and stay exact."""
    with shapes_server() as (port, _), agent(tmp_path, "--ringbuf-kb", "16", ports=[port]) as handle:
        sent: dict[str, int] = {}  # response id → token events sent
        client_ports: set[int] = set()  # so that a row of a client this test did not open says so

        def client() -> http.client.HTTPConnection:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.connect()
            client_ports.add(conn.sock.getsockname()[1])
            return conn

        def paced() -> None:
            conn = client()
            for _ in range(3):
                sent[stream(conn, 10, delay_ms=3)] = 10
            conn.close()

        def burst() -> None:
            conn = client()
            for _ in range(3):
                sent[stream(conn, 150)] = 150
            conn.close()

        paced()
        threads = [threading.Thread(target=burst) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        paced()
        assert handle.stop() == 0, handle.log()
    drops = int(re.search(r"; (\d+) events dropped by the kernel", handle.log()).group(1))
    assert drops > 0, handle.log()
    rows = read_rows(handle.store_url)
    strays = [row for row in rows if row["client_port"] not in client_ports]
    assert not strays, f"rows of clients this test did not open: {strays}"
    by_capture = {c: [r for r in rows if r["capture"] == c] for c in ("exact", "gaps", "dropped")}
    assert len(rows) == sum(map(len, by_capture.values())), {r["capture"] for r in rows}
    assert by_capture["dropped"], f"{drops} events dropped and no row says so"
    assert sum(r["bytes_unseen"] for r in by_capture["dropped"]) > 0
    assert by_capture["exact"], "the paced streams lost nothing"
    for row in by_capture["exact"]:
        expected = sent.get(row["response_id"])
        assert (row["token_events"], row["completion_tokens"], row["outcome"], row["bytes_unseen"]) == (
            expected, expected, "complete", 0), row


def connection_sockets(pid: int, listening: set[str]) -> dict[int, str]:
    """The server's connected sockets: fd → its socket inode ('socket:[…]')."""
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:") and target not in listening:
            fds[int(fd)] = target
    return fds


def test_a_close_the_ring_buffer_refused_is_read_from_the_kernels_kept_end(tmp_path: Path):
    """The agent is stopped (SIGSTOP) while a stream goes on and short connections fill its
    16 KiB ring buffer: the stream's last writes and its connection's close are refused. A later connection of the
    server's reuses the fd. Resumed, the agent finds the first connection gone and takes
    its end from the kernel: the row says `dropped` with the bytes it never saw, where
    without it the row read `exact`, a stream cut short."""
    with shapes_server() as (port, server_pid), agent(tmp_path, "--ringbuf-kb", "16", ports=[port]) as handle:
        # Its listener alone (wait_for_port's probe connection is gone), so the fd is reused.
        wait_until(lambda: len(connection_sockets(server_pid, set())) == 1)
        listening = set(connection_sockets(server_pid, set()).values())
        first = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        first.connect()
        first_port = first.sock.getsockname()[1]
        wait_until(lambda: len(connection_sockets(server_pid, listening)) == 1)
        ((fd, first_socket),) = connection_sockets(server_pid, listening).items()
        os.kill(handle.proc.pid, signal.SIGSTOP)
        try:
            cut = f"cmpl-{uuid.uuid4().hex}"
            first.request("POST", "/v1/completions", body=json.dumps({"id": cut, "max_tokens": 60, "delay_ms": 50}),
                          headers={"Content-Type": "application/json"})
            response = first.getresponse()  # the request and header are in the ring buffer; 3 s of tokens to come
            # Records of a header alone (accept, an EOF read, close), more than the ring buffer holds: no room
            # is left for any record, the stream's own small last writes and its close's included.
            for _ in range(100):
                socket.create_connection(("127.0.0.1", port)).close()
            wait_until(lambda: len(connection_sockets(server_pid, listening)) == 1)
            assert response.read().endswith(b"data: [DONE]\n\n")
            first.close()
            wait_until(lambda: not connection_sockets(server_pid, listening))
            # Connections until the server gives one the first one's fd (a lower one may be free).
            idle: list[http.client.HTTPConnection] = []
            while connection_sockets(server_pid, listening).get(fd, first_socket) == first_socket:
                assert len(idle) < 8, connection_sockets(server_pid, listening)
                idle.append(http.client.HTTPConnection("127.0.0.1", port, timeout=30))
                idle[-1].connect()
                wait_until(lambda: len(connection_sockets(server_pid, listening)) == len(idle))
            second = idle.pop()
            second_port = second.sock.getsockname()[1]
        finally:
            os.kill(handle.proc.pid, signal.SIGCONT)
        time.sleep(2)  # the agent reads the ring buffer at least every 250 ms: room for the next stream
        whole = stream(second, 3)  # its events find the first connection gone
        for conn in (second, *idle):
            conn.close()
        assert handle.stop() == 0, handle.log()
    drops = int(re.search(r"; (\d+) events dropped by the kernel", handle.log()).group(1))
    assert drops > 0, handle.log()
    rows = {row["client_port"]: row for row in read_rows(handle.store_url)}
    assert set(rows) == {first_port, second_port}, rows
    assert (rows[second_port]["response_id"], rows[second_port]["capture"], rows[second_port]["outcome"],
            rows[second_port]["token_events"]) == (whole, "exact", "complete", 3)
    cut_row = rows[first_port]  # its id may be unseen: the ring buffer may have been full by the first token
    assert cut_row["response_id"] in ("", cut) and cut_row["token_events"] < 60, cut_row
    assert cut_row["capture"] == "dropped" and cut_row["bytes_unseen"] > 0, cut_row


def connect(port: int, tls: bool) -> http.client.HTTPConnection:
    if tls:
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=ssl_client_context())
    return http.client.HTTPConnection("127.0.0.1", port, timeout=30)


@pytest.mark.parametrize("shape, pad, tokens, tls, per_writev", [
    ("writev", 200, 40, False, 16),     # 16 events (48 iovecs, ~5 KiB) per writev()
    ("writev", 200, 40, False, 64),     # all 42 events in one writev() of 126 iovecs (~13 KiB)
    ("flat", 2000, 10, False, 0),       # one send() of ~22 KiB
    ("flat", 2000, 18, False, 0),       # one send() of ~38 KiB
    ("flat", 2000, 18, True, 0),        # one SSL_write of ~38 KiB: three TLS records, 16 KiB each at most
], ids=["writev-48-iovecs", "writev-126-iovecs", "flat-22KiB", "flat-38KiB", "tls-16KiB-records"])
def test_write_shapes_keep_every_token_event(tmp_path: Path, shape: str, pad: int, tokens: int, tls: bool,
                                             per_writev: int):
    """Coalesced writes (hyper and libuv's writev of many iovecs, more than
    64 too, a buffered server's one large send, the same over TLS in
    full-size records) are captured whole: every row's token events and usage
    match what the server sent, and the row says `exact`."""
    cert_args = [str(p) for p in make_self_signed_cert(tmp_path)] if tls else []
    server_args = ["--shape", shape, "--pad", str(pad)] + (["--tls", *cert_args] if tls else [])
    server_args += ["--events-per-writev", str(per_writev)] if per_writev else []
    with shapes_server(*server_args) as (port, _), agent(tmp_path, ports=[port]) as handle:
        sent = []
        for _ in range(3):
            conn = connect(port, tls)
            sent += [stream(conn, tokens) for _ in range(3)]
            conn.close()
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(sent)
    for row in rows:
        assert (row["token_events"], row["completion_tokens"], row["sse_events"], row["outcome"], row["tls"]) == (
            tokens, tokens, tokens + 2, "complete", tls), row
        assert (row["capture"], row["bytes_unseen"]) == ("exact", 0), row


@pytest.mark.parametrize("server_args, big", [
    (("--shape", "flat", "--pad", "8000"), 18),                                 # one send() of ~150 KiB
    (("--shape", "writev", "--pad", "2000", "--events-per-writev", "64"), 40),  # one writev(): 126 iovecs, ~88 KiB
], ids=["flat-150KiB", "writev-88KiB"])
def test_writes_beyond_the_capture_resynchronise_and_say_gaps(tmp_path: Path, server_args: tuple[str, ...],
                                                               big: int):
    """A write larger than the capture (over 64 KiB, flat or vectored) loses
    its middle: the assembler picks the chunked framing up again where the
    bytes after the hole prove a chain of chunks, so the stream's end, its
    usage and the next request on the connection are still read. The row
    says `gaps` with the bytes it did not see, and counts only the events it
    saw; the small responses between stay exact."""
    small = 1
    with shapes_server(*server_args) as (port, _), agent(tmp_path, ports=[port]) as handle:
        sent = {}
        for _ in range(2):
            conn = connect(port, tls=False)
            for tokens in (big, small, big, small):
                sent[stream(conn, tokens)] = tokens
            conn.close()
        assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(sent)
    for row in rows:
        tokens = sent[row["response_id"]]
        assert (row["completion_tokens"], row["prompt_tokens"], row["outcome"], row["status"]) == (
            tokens, 3, "complete", 200), row
        if tokens == small:
            assert (row["capture"], row["bytes_unseen"], row["token_events"], row["error"]) == (
                "exact", 0, small, ""), row
        else:
            assert (row["capture"], row["bytes_unseen"] > 0) == ("gaps", True), row
            assert 0 < row["token_events"] < big and row["sse_events"] < big + 2, row
            assert "not captured" in row["error"], row


def worker_pids(master: int) -> set[int]:
    return {int(pid) for pid in Path(f"/proc/{master}/task/{master}/children").read_text().split()}


def test_forked_workers_are_tracked_from_their_first_accept(tmp_path: Path):
    """A pre-fork server (gunicorn's shape): workers accept on the listener
    they inherited, and each is replaced after two connections. Workers
    forked after the agent started are tracked from their very first accept:
    every connection is a row with its accept time, under the worker that
    served it (the server names itself in each response's model)."""
    with shapes_server("--workers", "2", "--connections-per-worker", "2") as (port, master):
        wait_until(lambda: len(worker_pids(master)) == 2, timeout=10)
        forked_before = worker_pids(master)
        with agent(tmp_path, ports=[port]) as handle:
            sent = []
            for _ in range(8):  # four generations of workers
                conn = connect(port, tls=False)
                sent += [stream(conn, 3) for _ in range(2)]
                conn.close()
            assert handle.stop() == 0, handle.log()
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(sent)
    for row in rows:
        assert row["model"] == f"pid-{row['pid']}" and row["pid"] != master, row
        assert row["accept_ns"] and row["accept_ns"] <= row["req_start_ns"], row
        assert (row["token_events"], row["outcome"], row["capture"]) == (3, "complete", "exact"), row
    forked_after = {r["pid"] for r in rows} - forked_before
    assert len(forked_after) >= 2, {r["pid"] for r in rows}


SLOW_READ_BYTES, SLOW_READ_PAUSE_S = 2048, 0.002
BRACKET_SLACK_NS = 200_000  # the server stamps a few instructions away from its syscalls


def slow_stream(sock: socket.socket, tokens: int) -> str:
    """One streamed completion on a keep-alive connection whose client drains it
    slowly (1 KiB reads with pauses); returns the response id."""
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(SLOW_READ_BYTES)
        assert chunk, data[-200:]
        data += chunk
        time.sleep(SLOW_READ_PAUSE_S)
    return json.loads(data.split(b"data: ", 2)[1].split(b"\n", 1)[0])["id"]


def test_slow_reader_back_pressure_keeps_rows_exact(tmp_path: Path):
    """A client with a 4 KiB receive buffer that reads slowly, against the
    reference server with a small send buffer: its sends block on the client,
    so its writes are paced by the reader, not by decoding, and the client's
    reads gather many events. Every row still holds the server's token events
    and usage, exactly, and its timestamps agree with the server's own stamps
    of those writes."""
    tokens, decode_ms = 400, 0.05
    with reference_server(tmp_path, decode_ms=decode_ms, send_buffer=4096) as (port, truth_log), \
            agent(tmp_path, ports=[port]) as handle:
        sent = []
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sent += [slow_stream(sock, tokens) for _ in range(2)]
            sock.close()
        assert handle.stop() == 0, handle.log()
    truth = {t["id"]: t for t in read_truth(truth_log) if t["id"] in sent}
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(sent) == sorted(truth)
    for row in rows:
        t = truth[row["response_id"]]
        # Back-pressure happened: the server's writes took far longer than its decoding.
        assert t["done_ns"] - t["token_ns"][0] > 5 * tokens * decode_ms * 1e6, t
        assert (row["token_events"], row["completion_tokens"], row["prompt_tokens"]) == (
            len(t["token_ns"]), t["completion_tokens"], t["prompt_tokens"]), (row, t)
        assert (row["outcome"], row["capture"], row["bytes_unseen"], row["error"]) == ("complete", "exact", 0, ""), row
        # The server stamps each event just before its sendall, in the order it writes: the first
        # token's write starts after its stamp, and each write before the next stamp.
        ttft, decode = row["first_token_ns"] - row["req_end_ns"], row["last_token_ns"] - row["first_token_ns"]
        assert ttft >= t["token_ns"][0] - t["arrival_ns"] - BRACKET_SLACK_NS, (ttft, row, t)
        assert (t["token_ns"][-1] - t["token_ns"][1] - BRACKET_SLACK_NS <= decode
                <= t["done_ns"] - t["token_ns"][0] + BRACKET_SLACK_NS), (decode, row, t)


def read_until(sock, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


@pytest.mark.parametrize("tls, server", [
    (False, "refserver"), (True, "refserver"), (False, "asyncio"), (True, "asyncio"),
], ids=["plain-threads", "tls-socket-bio", "plain-asyncio", "tls-memory-bio"])
def test_client_gone_mid_stream_is_an_outcome_over_tls_too(tmp_path: Path, tls: bool, server: str):
    """A client that disconnects mid-stream shows as client_closed or reset,
    over TLS as over plain sockets: the socket's EOF and errors are seen under
    libssl (socket BIOs: the threaded reference server) and beside it (memory
    BIOs: asyncio), never left to read as the server cutting the stream."""
    cert, key = make_self_signed_cert(tmp_path)
    port = free_port()
    if server == "refserver":
        cmd = [sys.executable, "-m", "tokenprobe.refserver", "serve", "--port", str(port), "--decode-ms", "20",
               "--log-level", "WARNING"] + (["--tls-self-signed"] if tls else [])
    else:
        cmd = [sys.executable, str(Path(__file__).parent / "servers" / "asyncio_sse.py"), str(port)]
        cmd += [str(cert), str(key)] if tls else []
    proc = subprocess.Popen(cmd, cwd=tmp_path)
    try:
        wait_for_port(port)
        with agent(tmp_path, ports=[port]) as handle:
            for _ in range(3):
                raw = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock = ssl_client_context().wrap_socket(raw) if tls else raw
                body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 200, "stream": True}).encode()
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                read_until(sock, b"data: ")
                sock.close()
            time.sleep(1.0)  # the server notices when it next reads or writes
            assert handle.stop() == 0, handle.log()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    rows = read_rows(handle.store_url)
    assert len(rows) == 3 and all(r["tls"] == tls for r in rows), rows
    assert all(r["outcome"] in ("client_closed", "reset") for r in rows), [r["outcome"] for r in rows]


def ssl_client_context():
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def agent_gauge(metrics_port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return float(re.search(rf"^tokenprobe_agent_{name} (\S+)$", text, re.M).group(1))


def test_a_server_that_dies_ends_its_connections(tmp_path: Path):
    """A killed server closes its sockets without close(): its streams end as
    truncated rows while the agent runs, and stop counting as in flight."""
    metrics_port = free_port()
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SHAPES_SERVER), str(port)])
    try:
        wait_for_port(port)
        with agent(tmp_path, "--metrics-port", str(metrics_port), ports=[port]) as handle:
            conns = []
            for _ in range(2):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("POST", "/v1/completions", body=json.dumps(
                    {"id": f"cmpl-{uuid.uuid4().hex}", "max_tokens": 1000, "delay_ms": 20}))
                conn.getresponse().read1(100)
                conns.append(conn)
            wait_until(lambda: agent_gauge(metrics_port, "inflight_requests") == 2, timeout=10)
            proc.kill()
            proc.wait(timeout=20)
            wait_until(lambda: agent_gauge(metrics_port, "open_connections") == 0
                       and agent_gauge(metrics_port, "inflight_requests") == 0, timeout=10)
            assert handle.stop() == 0, handle.log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)
    rows = read_rows(handle.store_url)
    assert [r["outcome"] for r in rows] == ["truncated", "truncated"], rows
    assert all(r["token_events"] > 0 for r in rows)


def test_listeners_map_follows_what_listens_now():
    """The kernel's listener map is pruned to the sockets that listen now:
    entries of dead processes (and stale ones) go at the next rescan."""
    from tokenprobe.agent.capture.kernel.loader import Probes, Targets

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SHAPES_SERVER), str(port)])
    probes = None
    try:
        wait_for_port(port)
        probes = Probes(Targets(ports=[port]))
        listeners = probes.bpf["listeners"]

        def owners() -> set[int]:
            return {key.tgid for key in listeners.keys()}

        assert proc.pid in owners()
        stale = listeners.Key()
        stale.tgid, stale.fd = proc.pid, 999
        listeners[stale] = listeners.Leaf(port)
        probes.rescan_processes()
        assert 999 not in {key.fd for key in listeners.keys()}
        proc.kill()
        proc.wait(timeout=20)
        probes.rescan_processes()
        assert proc.pid not in owners()
    finally:
        if probes is not None:
            probes.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)


def test_memory_bio_tls_is_bound_to_its_own_socket(tmp_path: Path):
    """A server that reads every ready socket before it runs any SSL object
    (memory BIOs): each SSL object is still tied to its own connection, by the
    bytes' path from socket to BIO, so every stream is whole on its own row."""
    cert, key = make_self_signed_cert(tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "servers" / "memory_bio_interleaved.py"),
                             str(port), str(cert), str(key)])
    try:
        wait_for_port(port)
        with agent(tmp_path, ports=[port]) as handle:
            sent: dict[str, tuple[str, int]] = {}
            start = threading.Barrier(3)

            def client() -> None:
                conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=ssl_client_context())
                start.wait()
                conn.connect()
                me = conn.sock.getsockname()[:2]
                for _ in range(3):
                    sent[stream(conn, 5)] = me
                conn.close()

            threads = [threading.Thread(target=client) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert handle.stop() == 0, handle.log()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    rows = read_rows(handle.store_url)
    assert sorted(r["response_id"] for r in rows) == sorted(sent), rows
    for row in rows:
        assert (row["client_addr"], row["client_port"]) == sent[row["response_id"]], row
        assert (row["tls"], row["token_events"], row["outcome"], row["capture"]) == (True, 5, "complete", "exact"), row
