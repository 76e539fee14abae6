"""A minimal asyncio SSE server, as uvicorn-based engines (vLLM, SGLang) do
it: asyncio streams, optional TLS through asyncio's ssl transport (OpenSSL
with memory BIOs: no socket call happens inside SSL_read/SSL_write), and
writes gathered with writelines (sendmsg on newer Pythons).

Run: python asyncio_sse.py PORT [CERT KEY]; answers POST with 5 SSE tokens."""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import uuid


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(5):
                event = b"data: " + json.dumps({"id": rid, "model": "m", "choices": [
                    {"index": 0, "delta": {"content": f"t{i}"}}]}).encode() + b"\n\n"
                writer.writelines([b"%x\r\n" % len(event), event, b"\r\n"])
                await writer.drain()
                await asyncio.sleep(0.005)
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main() -> None:
    port = int(sys.argv[1])
    context = None
    if len(sys.argv) > 3:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(sys.argv[2], sys.argv[3])
    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=context)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
