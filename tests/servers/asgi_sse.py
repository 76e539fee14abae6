"""The scripted LLM (llm_script.py) as a Starlette app, the way vLLM and SGLang
serve: a StreamingResponse fed by an async generator, one frame per write.
Served by uvicorn, granian and hypercorn alike: `asgi_sse:app`, run from this
folder."""

from __future__ import annotations

import asyncio

import llm_script
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


async def generate(request: Request) -> Response:
    script = llm_script.reply(request.url.path, await request.body())
    if script is None:
        return Response(status_code=404)
    content_type, frames, gap = script

    async def paced():
        for frame in frames:
            yield frame
            await asyncio.sleep(gap)

    return StreamingResponse(paced(), media_type=content_type)


app = Starlette(routes=[Route(path, generate, methods=["POST"]) for path in llm_script.ROUTES])
