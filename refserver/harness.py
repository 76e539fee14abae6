"""The reference server and the real `tokenprobe agent` as processes, for the tests and the
benchmarks: each in its own process, so the agent sees the server only through the kernel.
Ports, and waiting for them; an ASGI request's whole body; static pages (a dcgm-exporter's, an
engine's /metrics) served on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served_pages(pages: Mapping[str, bytes]) -> Iterator[str]:
    """Serves each body at its path (404 elsewhere) from a real HTTP server on 127.0.0.1 while open;
    yields its base URL (``http://127.0.0.1:PORT``)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Pages(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            body = pages.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    """Wait until something listens on ``host:port``; TimeoutError past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not port_open(port, host):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")
        time.sleep(0.05)


async def asgi_body(receive) -> bytes:
    """The whole request body an ASGI app receives, however many messages carry it."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def kernel_unavailable() -> str | None:
    """Why real BPF cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "not root"
    try:
        import bcc  # noqa: F401  (importable is what is checked)
    except ImportError:
        return "BCC's python module is missing (apt-get install python3-bpfcc)"
    if not Path("/sys/kernel/btf").exists() and not Path("/sys/kernel/tracing").exists():
        return "no tracefs"
    return None


@contextmanager
def reference_server(tmp: Path, *, port: int | None = None, tls: bool = False, slots: int = 4,
                     decode_ms: float = 8.0, prefill_base_ms: float = 4.0,
                     prefill_ms_per_token: float = 0.02,
                     simulated_metrics: bool = False,
                     send_buffer: int | None = None,
                     kv_cache_blocks: int | None = None,
                     engine_kv_blocks: int | None = None, per_request_metrics: bool = False,
                     fail_streams_every: int = 0, overhead_ms: float = 0.0,
                     overhead_ms_per_request: float = 0.0) -> Iterator[tuple[int, Path]]:
    """The reference server in a child process; yields (port, truth log).

    ``simulated_metrics``: it also serves simulated vLLM /metrics (the slot
    count the controller reads) and dcgm-exporter text, with a KV-cache gauge
    of ``kv_cache_blocks`` (the server's default when None). ``engine_kv_blocks``:
    the engine is bounded by a KV cache of that many blocks, admitting and
    preempting as vLLM's (see ``refserver.engine``). ``send_buffer``: the
    accepted sockets' SO_SNDBUF (small: a slow client pushes back on its writes). ``per_request_metrics``,
    ``fail_streams_every``, ``overhead_ms`` and ``overhead_ms_per_request``: see ``ServerConfig``."""
    port = port or free_port()
    truth = tmp / f"truth-{port}.jsonl"
    cmd = [sys.executable, "-m", "tokenprobe.refserver", "serve", "--port", str(port),
           "--slots", str(slots), "--decode-ms", str(decode_ms), "--prefill-base-ms", str(prefill_base_ms),
           "--prefill-ms-per-token", str(prefill_ms_per_token), "--truth-log", str(truth),
           "--log-level", "WARNING",
           # A keep-alive connection opened before the agent must outlive its BPF compile on a busy machine.
           "--idle-timeout", "300"]
    if tls:
        cmd.append("--tls-self-signed")
    if simulated_metrics:
        cmd.append("--simulated-metrics")
    if send_buffer is not None:
        cmd += ["--send-buffer", str(send_buffer)]
    if kv_cache_blocks is not None:
        cmd += ["--kv-cache-blocks", str(kv_cache_blocks)]
    if engine_kv_blocks is not None:
        cmd += ["--engine-kv-blocks", str(engine_kv_blocks)]
    if per_request_metrics:
        cmd.append("--enable-per-request-metrics")
    if fail_streams_every:
        cmd += ["--fail-streams-every", str(fail_streams_every)]
    if overhead_ms or overhead_ms_per_request:
        cmd += ["--overhead-ms", str(overhead_ms), "--overhead-ms-per-request", str(overhead_ms_per_request)]
    # The ground truth is stamped in Python just after a read and just before a write: at a raised
    # priority, the load generator's threads on the same few cores cannot delay those stamps.
    with listening_process(cmd, port, cwd=tmp, preexec_fn=_raise_priority):
        yield port, truth


@contextmanager
def listening_process(cmd: list[str], port: int, **popen) -> Iterator[subprocess.Popen]:
    """`cmd` as a child process, handed over once it listens on `port`, terminated after."""
    proc = subprocess.Popen(cmd, **popen)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _raise_priority() -> None:
    try:
        os.nice(-10)
    except PermissionError:
        pass  # not root: the kernel tests skip anyway


class AgentProcess:
    def __init__(self, proc: subprocess.Popen, log_path: Path, store_url: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.store_url = store_url

    def stop(self) -> int:
        """SIGTERM, as an orchestrator would; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def agent(tmp: Path, *extra: str, ports: list[int], quiet: bool = True,
          ready: str = "tracing ports") -> Iterator[AgentProcess]:
    """`tokenprobe agent` on the given ports, into a fresh embedded store,
    yielded once its log shows `ready`; quiet=False keeps its status line on,
    as an operator runs it."""
    store_url = f"chdb://{tmp / 'store'}"
    log_path = tmp / "agent.log"
    cmd = [sys.executable, "-m", "tokenprobe", "agent", "--store", store_url, *extra]
    if quiet:
        cmd.append("--quiet")
    for port in ports:
        cmd += ["--port", str(port)]
    # HOME: a spool for server stores (~/.cache) stays inside the test.
    env = dict(os.environ, TOKENPROBE_FINGERPRINT_KEY="kernel-test-key", HOME=str(tmp))
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    handle = AgentProcess(proc, log_path, store_url)
    try:
        deadline = time.monotonic() + 180  # first compile of the BPF program takes a while
        while ready not in handle.log():
            if proc.poll() is not None:
                raise RuntimeError(f"agent exited with {proc.returncode}:\n{handle.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent not ready:\n{handle.log()}")
            time.sleep(0.1)
        yield handle
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_truth(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
