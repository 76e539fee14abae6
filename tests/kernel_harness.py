"""Real processes for the kernel tests: the reference server, the agent (the
real `tokenprobe agent` command) and nginx, each in its own process so the
agent sees them only through the kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

# The processes themselves are started by refserver.harness, which the benchmarks share.
from tokenprobe.refserver.harness import (
    AgentProcess,
    agent,
    kernel_unavailable,
    listening_process,
    read_truth,
    reference_server,
)

from tests.support import free_port, wait_for_port

__all__ = ["REQUIRE_KERNEL", "AgentProcess", "agent", "free_port", "kernel_unavailable", "listening_process",
           "nginx_tls_proxy", "read_rows", "read_truth", "reference_server", "require_kernel", "wait_for_port"]

REQUIRE_KERNEL = os.environ.get("TOKENPROBE_REQUIRE_KERNEL") == "1"


def require_kernel() -> None:
    """Skips where BPF truly cannot run; fails instead when CI requires it."""
    reason = kernel_unavailable()
    if reason:
        if REQUIRE_KERNEL:
            pytest.fail(f"kernel tests are required (TOKENPROBE_REQUIRE_KERNEL=1) but {reason}")
        pytest.skip(reason)


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


def read_rows(store_url: str) -> list[dict]:
    from tokenprobe.store.embedded import open_store

    store = open_store(store_url, serve=False)
    try:
        df = store.query_df("""
            SELECT response_id, path, status, outcome, error, tls, req_seq, conn_id, token_events, role, server_port,
                   client_addr, client_port, sse_events, capture, bytes_unseen, tenant, protocol, stream_id,
                   unreadable_reason, grpc_status, token_offsets_us, request_messages, request_message_bytes,
                   response_message_bytes, largest_response_message_bytes, namespace, pod, container, pod_uid,
                   container_id,
                   completion_tokens, prompt_tokens, model, inflight_at_arrival, bytes_in, bytes_out, api, pid,
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
