"""`tokenprobe agent --tenant-header`: the command line, and the header's value
travelling from a real request through the kernel probes into the store."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenprobe.store.embedded import open_store

from tests.kernel_harness import agent, reference_server, require_kernel


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # A wide terminal: argparse then wraps help text only between options, never inside a phrase.
    return subprocess.run([sys.executable, "-m", "tokenprobe", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="1000"))


def test_cli_agent_help_explains_the_tenant_header():
    result = run_cli("agent", "--help")
    assert result.returncode == 0, result.stderr
    assert "--tenant-header NAME" in result.stdout
    for words in ("an identifier, not content", "gateway hook reads the same header", "default x-tenant-id",
                  "'' turns it off"):
        assert words in result.stdout


@pytest.mark.parametrize("name, message", [
    ("x tenant", "'x tenant' is not an HTTP header name"),
    ("Transfer-Encoding", "frames the message"),
])
def test_cli_refuses_a_bad_tenant_header_in_plain_words(name, message):
    result = run_cli("agent", "--port", "8000", "--tenant-header", name)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


CHAT = json.dumps({"model": "small", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                   "max_tokens": 3}).encode()


@pytest.mark.kernel
def test_tenant_header_value_reaches_the_store_through_the_kernel(tmp_path: Path):
    require_kernel()
    # One keep-alive connection: each request is attributed to its own header, not the connection's.
    requests = [("GET", "/v1/models", b"", {"X-Org": "org-7", "X-Tenant-Id": "not-the-configured-one"}),
                ("POST", "/v1/chat/completions", CHAT, {"Content-Type": "application/json"}),
                ("POST", "/v1/chat/completions", CHAT, {"Content-Type": "application/json", "x-org": "org-9"})]
    with reference_server(tmp_path) as (port, _truth):
        with agent(tmp_path, "--tenant-header", "X-Org", ports=[port]) as handle:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            for method, path, body, headers in requests:
                connection.request(method, path, body=body or None, headers=headers)
                response = connection.getresponse()
                response.read()
                assert response.status == 200
            connection.close()
            assert handle.stop() == 0, handle.log()
    with open_store(handle.store_url, serve=False) as store:
        rows = store.query_rows("SELECT req_seq, path, tenant FROM tokenprobe.requests ORDER BY req_seq")
    assert rows == [(0, "/v1/models", "org-7"), (1, "/v1/chat/completions", ""),
                    (2, "/v1/chat/completions", "org-9")]
