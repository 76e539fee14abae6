"""An OpenAI-compatible gateway in the style of LiteLLM: a Starlette app that
relays each request to a TLS upstream with httpx on the same event loop and
streams the upstream's bytes back unchanged. Its inbound reads and its
outbound TLS (CPython ssl over memory BIOs) interleave on one thread, which is
what could mislead the agent into tying one connection's plaintext to another.

Run from this folder: uvicorn gateway:app, with UPSTREAM=https://127.0.0.1:PORT."""

from __future__ import annotations

import os

import httpx
import llm_script
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

# verify=False: the upstream's certificate is the test's self-signed one. No pooled upstream
# connections: each request's TLS handshake upstream follows its own inbound read on this thread.
upstream = httpx.AsyncClient(base_url=os.environ["UPSTREAM"], verify=False, timeout=60,
                             limits=httpx.Limits(max_keepalive_connections=0))


async def relay(request: Request) -> StreamingResponse:
    outbound = upstream.build_request("POST", request.url.path, content=await request.body(),
                                      headers={"content-type": "application/json"})
    response = await upstream.send(outbound, stream=True)

    async def body():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    return StreamingResponse(body(), status_code=response.status_code,
                             media_type=response.headers.get("content-type"))


app = Starlette(routes=[Route(path, relay, methods=["POST"]) for path in llm_script.ROUTES])
