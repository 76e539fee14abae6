"""What the agent reads, per real server stack: the one list that the kernel
matrix (tests/test_kernel_matrix.py) asserts stack by stack and that the
README's "What is read" table is rendered from (tests/test_server_matrix.py
checks the README against it). Changing what a stack yields means changing
its entry here, and the README with it: `python -m tests.server_matrix`
prints the table.

Nothing here needs BPF: the README check runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.support.stream_client import ANTHROPIC, OLLAMA, OPENAI

READ, UNREADABLE, SILENT, MISREAD = "read", "counted unreadable", "not read, not counted", "misread"


@dataclass(frozen=True)
class Outcome:
    kind: str           # READ, UNREADABLE (rows that say why), SILENT (no row), MISREAD (rows, wrong)
    reason: str = ""    # in words, for the README
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

OUTBOUND_MEMORY_BIO = ("a memory-BIO TLS client's own requests (the gateway's httpx to its TLS upstream, traced "
                       "with --outbound) give no rows: the SSL* is never bound to its socket on the client side")

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
          Outcome(READ), outbound_bug=OUTBOUND_MEMORY_BIO),
    Stack("go", "Go 1.19 net/http", "—", "HTTP/1.1", (OPENAI,), Outcome(READ)),
    # Read at crypto/tls.(*Conn).Read/Write (the executable keeps its symbols: the default build).
    Stack("go-tls", "Go 1.19 net/http", "Go crypto/tls", "HTTP/1.1", (OPENAI,), Outcome(READ)),
    Stack("go-tls-h2", "Go 1.19 net/http", "Go crypto/tls", "HTTP/2 (ALPN h2)", (OPENAI,), Outcome(READ)),
    Stack("node-tls", "Node.js 20 `https`", "OpenSSL linked into the node binary", "HTTP/1.1", (OPENAI,),
          tls_unprobed("OpenSSL linked into node: its exported SSL_read/SSL_write are not probed yet")),
    Stack("hypercorn-h2", "hypercorn, Starlette", "OpenSSL via CPython ssl (memory BIO)", "HTTP/2 (ALPN h2)",
          (OPENAI,), Outcome(READ)),
    Stack("hypercorn-h2c", "hypercorn, Starlette", "—", "HTTP/2 (h2c prior knowledge)", (OPENAI,),
          Outcome(READ)),
)

API_NAMES = {OPENAI: "OpenAI chat (SSE)", ANTHROPIC: "Anthropic Messages (SSE `event:`)",
             OLLAMA: "Ollama chat (NDJSON)"}
README_BEGIN = "<!-- server-matrix: generated from tests/server_matrix.py, checked by tests/test_server_matrix.py -->"
README_END = "<!-- /server-matrix -->"


def readme_table() -> str:
    lines = ["| server stack | TLS library | HTTP | API dialects | what the agent stores |", "|---|---|---|---|---|"]
    for stack in STACKS:
        outcome = f"{MISREAD} (bug): {stack.bug}" if stack.bug else stack.outcome.describe()
        if stack.outbound_bug:
            outcome += f"; its outbound calls: {MISREAD} (bug): {stack.outbound_bug}"
        apis = ", ".join(API_NAMES[api] for api in stack.apis)
        lines.append(f"| {stack.server} | {stack.tls} | {stack.http} | {apis} | {outcome} |")
    return "\n".join([README_BEGIN, *lines, README_END])


if __name__ == "__main__":
    print(readme_table())
