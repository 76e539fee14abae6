"""Hypercorn serving an ASGI app that streams a chat completion as SSE: HTTP/2
with prior knowledge (h2c) or HTTP/1.1 in the clear, or over TLS with ALPN h2
(Python's ssl module, so the libssl probes read it in plaintext). The kernel
tests and the overhead benchmark's HTTP/2 workload run it.

Run: python -m tokenprobe.refserver.h2_sse PORT [CERT KEY]; the tests
in-process import `sse_app`. Request body: {"model": ..., "n": extra tokens}, both optional."""

from __future__ import annotations

import asyncio
import json
import sys

from hypercorn.asyncio import serve
from hypercorn.config import Config

from .harness import asgi_body

TOKENS = 12


async def sse_app(scope, receive, send):
    """A streamed chat completion: role chunk, TOKENS + n text chunks, usage, [DONE]."""
    if scope["type"] != "http":
        return
    # Both fields optional: a GET, the request an `Upgrade: h2c` carries (it has no body), streams the defaults.
    request = {"model": "h2-sse", "n": 0} | json.loads(await asgi_body(receive) or b"{}")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})

    async def event(obj) -> None:
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(obj).encode() + b"\n\n",
                    "more_body": True})
        await asyncio.sleep(0.002)

    chunk = {"id": f"chatcmpl-{request['n']}", "object": "chat.completion.chunk", "model": request["model"]}
    await event(chunk | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(TOKENS + request["n"]):
        await event(chunk | {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
    await event(chunk | {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": TOKENS + request["n"]}})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def config(port: int, cert: str | None = None, key: str | None = None) -> Config:
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = cfg.errorlog = None
    cfg.keep_alive_timeout = 0.2  # it closes a half-closed idle connection only then
    if cert:
        cfg.certfile, cfg.keyfile = cert, key  # ALPN offers h2 first
    return cfg


if __name__ == "__main__":
    asyncio.run(serve(sse_app, config(int(sys.argv[1]), *sys.argv[2:4])))
