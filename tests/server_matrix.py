"""What the agent reads, per real server stack: the one list that the kernel
matrix (tests/test_kernel_matrix.py) asserts stack by stack and that the
table of docs/servers.md is rendered from (tests/test_server_matrix.py
checks the page against it). Changing what a stack yields means changing
its entry here, then `.venv/bin/python scripts/render_docs.py` rewrites the
page's table (`python -m tests.server_matrix` prints it). The table's other lines (SHOWN_ELSEWHERE) are what other
tests show, each naming its test, which tests/test_server_matrix.py finds.

Nothing here needs BPF: the page check runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.support.stream_client import ANTHROPIC, OLLAMA, OPENAI

READ, UNREADABLE, SILENT, MISREAD = "read", "counted unreadable", "not read, not counted", "misread"


@dataclass(frozen=True)
class Outcome:
    kind: str           # READ, UNREADABLE (rows that say why), SILENT (no row), MISREAD (rows, wrong)
    reason: str = ""    # in words, for docs/servers.md
    error: str = ""     # UNREADABLE: what every stored row's `error` contains

    def describe(self) -> str:
        return self.kind + (f": {self.reason}" if self.reason else "")


@dataclass(frozen=True)
class Stack:
    key: str            # pytest id
    server: str
    tls: str            # the TLS library, "—" for plain TCP
    http: str
    apis: tuple[str, ...]
    outcome: Outcome
    bug: str = ""       # where the outcome is a capture bug, the test is strict-xfail with this reason
    outbound_bug: str = ""  # the same for the stack's own outbound calls (the gateway's upstream)
    burst_every: int = 4  # every Nth request asks for unpaced frames (llm_script.py); 0: none


# A TLS library no probe reads: one `unsupported` row per connection (unreadable_reason tls_unprobed),
# counted in tokenprobe_agent_unreadable_connections_total, and the process named by doctor.
TLS_UNPROBED_ERROR = "TLS records on a connection no libssl probe saw"


def tls_unprobed(library: str) -> Outcome:
    return Outcome(UNREADABLE, f"tls_unprobed ({library}): one `unsupported` row per connection", TLS_UNPROBED_ERROR)


STACKS = (
    Stack("uvicorn", "uvicorn + uvloop + httptools, Starlette", "—", "HTTP/1.1",
          (OPENAI, ANTHROPIC, OLLAMA), Outcome(READ)),
    Stack("uvicorn-tls", "uvicorn + uvloop + httptools, Starlette", "OpenSSL via CPython ssl (memory BIO)",
          "HTTP/1.1", (OPENAI, ANTHROPIC, OLLAMA), Outcome(READ)),
    # Paced frames: hyper writes each as one writev of 3 iovecs (chunk size, data, CRLF).
    Stack("granian", "granian (Rust hyper), Starlette, frames paced", "—", "HTTP/1.1", (OPENAI, ANTHROPIC, OLLAMA),
          Outcome(READ), burst_every=0),
    # Unpaced frames from concurrent streams: hyper coalesces them, writev with 6-12+ iovecs.
    Stack("granian-burst", "granian (Rust hyper), Starlette, frames unpaced", "—", "HTTP/1.1",
          (OPENAI, ANTHROPIC, OLLAMA), Outcome(READ), burst_every=1),
    Stack("granian-tls", "granian (Rust hyper), Starlette", "rustls", "HTTP/1.1", (OPENAI,),
          tls_unprobed("rustls")),
    Stack("aiohttp", "aiohttp web server", "—", "HTTP/1.1", (OPENAI, ANTHROPIC, OLLAMA), Outcome(READ)),
    Stack("gateway", "httpx gateway on uvicorn, both sides (`--outbound`)",
          "— in; OpenSSL via CPython ssl (memory BIO) to its upstream", "HTTP/1.1", (OPENAI, ANTHROPIC),
          Outcome(READ)),
    Stack("go", "Go 1.19 net/http", "—", "HTTP/1.1", (OPENAI,), Outcome(READ)),
    # Read at crypto/tls.(*Conn).Read/Write (the executable keeps its symbols: the default build).
    Stack("go-tls", "Go 1.19 net/http", "Go crypto/tls", "HTTP/1.1", (OPENAI,), Outcome(READ)),
    Stack("go-tls-h2", "Go 1.19 net/http", "Go crypto/tls", "HTTP/2 (ALPN h2)", (OPENAI,), Outcome(READ)),
    # node's own BIOs: each SSL is bound to its socket by the records it writes (libuv sends them later).
    Stack("node-tls", "Node.js 20 `https`", "OpenSSL linked into the node binary, probed there", "HTTP/1.1",
          (OPENAI,), Outcome(READ)),
    Stack("hypercorn-h2", "hypercorn, Starlette", "OpenSSL via CPython ssl (memory BIO)", "HTTP/2 (ALPN h2)",
          (OPENAI,), Outcome(READ)),
    Stack("hypercorn-h2c", "hypercorn, Starlette", "—", "HTTP/2 (h2c prior knowledge)", (OPENAI,),
          Outcome(READ)),
)

@dataclass(frozen=True)
class Shown:
    """A line of the table that a test other than the kernel matrix shows."""
    server: str
    tls: str
    http: str
    apis: str
    stores: str
    test: str           # tests/FILE.py::test_name


SHOWN_ELSEWHERE = (
    Shown("nginx TLS proxy in front of the reference server", "OpenSSL (libssl, socket BIO)", "HTTP/1.1",
          "OpenAI chat (SSE)", READ, "tests/test_kernel_capture.py::test_https_through_nginx"),
    Shown("the reference server (CPython `ssl`, a thread per connection)", "OpenSSL (libssl, socket BIO)", "HTTP/1.1", "OpenAI chat (SSE)", READ,
          "tests/test_kernel_capture.py::test_https_cpython_ssl"),
    Shown("uvicorn on a libssl copied under another file name (as wheels bundle it)",
          "OpenSSL, found by its exports", "HTTP/1.1", "OpenAI chat (SSE)", READ,
          "tests/test_kernel_protocols.py::test_openssl_linked_into_node_and_a_renamed_libssl_are_probed_and_read"),
    Shown("Go 1.19 net/http built with `-ldflags=-s -w`", "Go crypto/tls, no symbol table", "HTTP/1.1",
          "OpenAI chat (SSE)", tls_unprobed("Go crypto/tls, no symbol table").describe(),
          "tests/test_kernel_protocols.py::test_go_crypto_tls_without_symbols_is_counted_as_tls_unprobed"),
    Shown("grpcio (gRPC C core), server-streaming", "—", "HTTP/2 (h2c prior knowledge)", "gRPC",
          f"{READ}: one row per call (`api` grpc, `grpc_status` from the trailers, a token event per message)",
          "tests/test_kernel_protocols.py::test_grpc_server_streaming_calls_are_rows_matching_the_client"),
    Shown("hypercorn, asked by curl --http2 on http://", "—", "HTTP/1.1 upgraded to HTTP/2 (`Upgrade: h2c`)",
          "OpenAI chat (SSE)", f"{READ}: the upgraded request is stream 1's row (`protocol` h2c)",
          "tests/test_kernel_protocols.py::test_an_h2c_upgrade_by_curl_is_read_on_in_http2"),
    Shown("any server, HTTP/2 picked up mid-connection", "—", "HTTP/2", "—",
          f"{UNREADABLE}: h2_midstream (HPACK state unknown): one `unsupported` row per connection",
          "tests/test_tracker.py::test_http2_picked_up_midway_is_one_unsupported_row"),
    Shown("any server, after `101 Switching Protocols`", "—", "WebSocket", "—",
          f"the upgrade request is a row (status 101); then {UNREADABLE}: websocket",
          "tests/test_tracker.py::test_traffic_after_a_websocket_upgrade_is_one_unsupported_row"),
    Shown("anything else", "—", "neither HTTP/1, HTTP/2 nor TLS", "—", f"{UNREADABLE}: unknown_protocol",
          "tests/test_tracker.py::test_connections_that_cannot_be_read_are_one_unsupported_row"),
)

API_NAMES = {OPENAI: "OpenAI chat (SSE)", ANTHROPIC: "Anthropic Messages (SSE `event:`)",
             OLLAMA: "Ollama chat (NDJSON)"}
TABLE_BEGIN = "<!-- server-matrix: generated from tests/server_matrix.py by scripts/render_docs.py, checked by tests/test_server_matrix.py -->"
TABLE_END = "<!-- /server-matrix -->"


def matrix_table() -> str:
    lines = ["| server stack | TLS library | HTTP | API dialects | what the agent stores | shown by |",
             "|---|---|---|---|---|---|"]
    for stack in STACKS:
        outcome = f"{MISREAD} (bug): {stack.bug}" if stack.bug else stack.outcome.describe()
        if stack.outbound_bug:
            outcome += f"; its outbound calls: {MISREAD} (bug): {stack.outbound_bug}"
        apis = ", ".join(API_NAMES[api] for api in stack.apis)
        lines.append(f"| {stack.server} | {stack.tls} | {stack.http} | {apis} | {outcome} | "
                     f"`test_kernel_matrix.py` |")
    for shown in SHOWN_ELSEWHERE:
        lines.append(f"| {shown.server} | {shown.tls} | {shown.http} | {shown.apis} | {shown.stores} | "
                     f"`{shown.test.removeprefix('tests/')}` |")
    return "\n".join([TABLE_BEGIN, *lines, TABLE_END])


if __name__ == "__main__":
    print(matrix_table())
