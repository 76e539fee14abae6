"""The gateway process and the upstreams the gateway tests put behind it, all over real sockets on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.actuator_support import TOKEN
from tests.support import free_port, wait_for_port


@dataclass
class GatewayProcess:
    port: int
    process: subprocess.Popen

    def open_files(self) -> int:
        """How many file descriptors the gateway holds (its sockets among them)."""
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def peak_rss_kib(self) -> int:
        """The gateway's peak resident memory so far (VmHWM), in KiB."""
        with open(f"/proc/{self.process.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@contextmanager
def gateway_process(tmp: Path, upstream_url: str, upstream: str, actuator: str, *options: str, token: str = TOKEN,
                    log=None) -> Iterator[GatewayProcess]:
    """`python -m tokenprobe.actuator.proxy` in front of `upstream_url`, asking the actuator at `actuator`."""
    token_file = tmp / "token"
    token_file.write_text(token)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenprobe.actuator.proxy", "--upstream-url", upstream_url,
                                "--upstream", upstream, "--actuator", actuator, "--token-file", str(token_file),
                                "--port", str(port), "--deadline", "5.0", *options], stderr=log)
    try:
        wait_for_port(port)
        yield GatewayProcess(port, process)
    finally:
        process.terminate()
        process.wait(timeout=20)


@contextmanager
def gateway(*args, **kwargs) -> Iterator[int]:
    """gateway_process, yielding its port."""
    with gateway_process(*args, **kwargs) as running:
        yield running.port


class RecordingUpstream:
    """An upstream that records each request target and header set it receives, over real HTTP.

    It answers `status` with a usage of `usage_tokens` (200, 2 by default), or, for an error status,
    an error without usage, as servers do."""

    def __init__(self, status: int = 200, usage_tokens: int = 2):
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        recorded = self.requests

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                recorded.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                if status < 400:
                    answer = {"usage": {"prompt_tokens": 1, "completion_tokens": usage_tokens - 1,
                                        "total_tokens": usage_tokens}}
                else:
                    answer = {"error": {"message": "refused by the upstream", "code": status}}
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "x-upstream-hop")
                self.send_header("X-Upstream-Hop", "secret")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()


class ScriptedUpstream:
    """A raw TCP upstream: reads each request's head and body, then runs `answer(connection)` on it.

    Counts connections accepted and those still open (until the gateway closes its end), so a test
    sees whether the gateway let go of a request it no longer needs."""

    def __init__(self, answer: Callable[[socket.socket], None]):
        self._answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self.accepted = 0
        self.open = 0
        self.bytes_sent: list[int] = []  # per finished answer, for answers that report it
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self.open += 1
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        try:
            with connection:
                read_message(connection)
                self._answer(connection)
        except OSError:
            pass
        finally:
            with self._lock:
                self.open -= 1

    def close(self) -> None:
        self._listener.close()


def read_message(connection: socket.socket) -> bytes:
    """One HTTP/1.1 request or response with a Content-Length body (or none), read whole; the connection
    stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def hang(connection: socket.socket) -> None:
    """Never answer: wait until the gateway closes its end."""
    while connection.recv(65536):
        pass


def raw_request(port: int, target: str, *, method: str = "POST", headers: tuple[str, ...] = (),
                body: bytes = b'{"model": "m", "max_tokens": 4, "prompt": "hi"}') -> tuple[int, bytes]:
    """Send one request byte for byte as written (no client library normalises it); status and raw head."""
    fields = headers or (f"Content-Length: {len(body)}",)
    head = f"{method} {target} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nConnection: close\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(head.encode("latin-1") + "".join(f + "\r\n" for f in fields).encode() + b"\r\n" + body)
        return read_response(connection)


def read_response(connection: socket.socket) -> tuple[int, bytes]:
    """The status and raw head of the response on `connection`, read until the server closes it."""
    response = b""
    while chunk := connection.recv(65536):
        response += chunk
    return int(response.split(b" ", 2)[1]), response.split(b"\r\n\r\n", 1)[0]
