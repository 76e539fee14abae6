"""The scripted LLM (llm_script.py) on aiohttp's own web server: a
StreamResponse written frame by frame. Run: python aiohttp_sse.py PORT"""

from __future__ import annotations

import asyncio
import sys

import llm_script
from aiohttp import web


async def generate(request: web.Request) -> web.StreamResponse:
    script = llm_script.reply(request.path, await request.read())
    if script is None:
        raise web.HTTPNotFound()
    content_type, frames, gap = script
    response = web.StreamResponse(headers={"Content-Type": content_type})
    await response.prepare(request)
    for frame in frames:
        await response.write(frame)
        await asyncio.sleep(gap)
    await response.write_eof()
    return response


def main() -> None:
    app = web.Application()
    for path in llm_script.ROUTES:
        app.router.add_post(path, generate)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
