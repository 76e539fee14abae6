"""Capture fidelity in the kernel: what real servers do to accepts and
writes, checked per row against what the client saw and the server sent."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.kernel_harness import agent, free_port, read_rows, require_kernel, wait_for_port

pytestmark = pytest.mark.kernel

SHAPES_SERVER = Path(__file__).parent / "servers" / "shapes_sse.py"


@pytest.fixture(autouse=True)
def _kernel():
    require_kernel()


@contextmanager
def shapes_server(*args: str, host: str = "127.0.0.1") -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SHAPES_SERVER), str(port), "--host", host, *args])
    try:
        wait_for_port(port, host=host)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def stream(conn: http.client.HTTPConnection, tokens: int) -> str:
    """One streamed request; returns the response id the server used."""
    rid = f"cmpl-{uuid.uuid4().hex}"
    conn.request("POST", "/v1/completions", body=json.dumps({"id": rid, "max_tokens": tokens}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
    return rid


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_peer_read_from_the_socket_when_accept_gives_no_address(tmp_path: Path, host: str):
    """accept4(fd, NULL, NULL, 0) (libuv, cpp-httplib): every row still names
    the client's own address and port, and the listening port."""
    with shapes_server("--null-accept", host=host) as port, agent(tmp_path, ports=[port]) as handle:
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
