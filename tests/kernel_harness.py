"""Real processes for the kernel tests: the reference server, the agent (the
real `tokenprobe agent` command) and nginx, each in its own process so the
agent sees them only through the kernel."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.support import free_port, wait_for_port

REQUIRE_KERNEL = os.environ.get("TOKENPROBE_REQUIRE_KERNEL") == "1"


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


def require_kernel() -> None:
    """Skips where BPF truly cannot run; fails instead when CI requires it."""
    reason = kernel_unavailable()
    if reason:
        if REQUIRE_KERNEL:
            pytest.fail(f"kernel tests are required (TOKENPROBE_REQUIRE_KERNEL=1) but {reason}")
        pytest.skip(reason)






@contextmanager
def reference_server(tmp: Path, *, port: int | None = None, tls: bool = False, slots: int = 4,
                     decode_ms: float = 8.0, prefill_base_ms: float = 4.0,
                     prefill_ms_per_token: float = 0.02,
                     simulated_metrics: bool = False) -> Iterator[tuple[int, Path]]:
    """The reference server in a child process; yields (port, truth log).

    ``simulated_metrics``: it also serves simulated vLLM /metrics (the slot
    count the controller reads) and dcgm-exporter text."""
    port = port or free_port()
    truth = tmp / f"truth-{port}.jsonl"
    cmd = [sys.executable, "-m", "tokenprobe.refserver", "serve", "--port", str(port),
           "--slots", str(slots), "--decode-ms", str(decode_ms), "--prefill-base-ms", str(prefill_base_ms),
           "--prefill-ms-per-token", str(prefill_ms_per_token), "--truth-log", str(truth),
           "--log-level", "WARNING"]
    if tls:
        cmd.append("--tls-self-signed")
    if simulated_metrics:
        cmd.append("--simulated-metrics")
    # The ground truth is stamped in Python just after a read and just before a write: at a raised
    # priority, the load generator's threads on the same few cores cannot delay those stamps.
    proc = subprocess.Popen(cmd, cwd=tmp, preexec_fn=_raise_priority)
    try:
        wait_for_port(port)
        yield port, truth
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


@contextmanager
def nginx_tls_proxy(tmp: Path, backend_port: int, cert: Path, key: Path) -> Iterator[int]:
    """Debian's nginx terminating TLS in front of a plain HTTP backend, with
    keep-alive to the backend and proxy_buffering off (SSE passes through)."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.fail("nginx is not installed (apt-get install nginx-light; scripts/install.sh does)")
    port = free_port()
    root = tmp / "nginx"
    root.mkdir()
    conf = root / "nginx.conf"
    conf.write_text(f"""
worker_processes 2;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {root}/body;
  proxy_temp_path {root}/proxy;
  upstream backend {{ server 127.0.0.1:{backend_port}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    keepalive_requests 10000;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 120s;
    }}
  }}
}}
""")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-g", "daemon off;"], stderr=subprocess.PIPE)
    try:
        wait_for_port(port)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def read_truth(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_rows(store_url: str) -> list[dict]:
    from tokenprobe.store.embedded import open_store

    store = open_store(store_url, serve=False)
    try:
        df = store.query_df("""
            SELECT response_id, path, status, outcome, error, tls, req_seq, conn_id, token_events, role, server_port,
                   client_addr, client_port, sse_events, capture, bytes_unseen, tenant, protocol, stream_id,
                   unreadable_reason,
                   completion_tokens, prompt_tokens, model, inflight_at_arrival, bytes_in, bytes_out,
                   toUnixTimestamp64Nano(req_start) AS req_start_ns,
                   toUnixTimestamp64Nano(req_end) AS req_end_ns,
                   toUnixTimestamp64Nano(first_token) AS first_token_ns,
                   toUnixTimestamp64Nano(last_token) AS last_token_ns,
                   toUnixTimestamp64Nano(accept_ts) AS accept_ns,
                   toUnixTimestamp64Nano(tls_done_ts) AS tls_done_ns
            FROM tokenprobe.requests""")
    finally:
        store.close()
    return df.to_dict("records")
