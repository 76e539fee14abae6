"""The HTTP/2 assembler against real servers and clients: hypercorn serving an ASGI
SSE app over h2c (prior knowledge) to httpx, and a grpcio server-streaming call
(gRPC's C core on both ends), over loopback.

Between them a TCP relay records every recv() of each direction with its
monotonic time: the segments the probes would report for the server's socket
(a relay sees the same bytes, in chunks cut by the same kernel). The
assembler's rows must match what the client saw, stream by stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from hypercorn.asyncio import serve
from tokenprobe.agent.capture.wire.http2 import Http2ConnectionAssembler
from tokenprobe.refserver.h2_sse import config, sse_app

from tests.servers.grpc_generator import (
    METHOD,
    call_generate,
    start_generator,
)
from tests.support import free_port, wait_for_port
from tests.support.h2_wire import assemble


class Relay:
    """Forwards one TCP connection and records each recv(): (monotonic ns, is_request, bytes)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.segments: list[tuple[int, bool, bytes]] = []
        self._lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        pumps = [threading.Thread(target=self._pump, args=(client, server, True), daemon=True),
                 threading.Thread(target=self._pump, args=(server, client, False), daemon=True)]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        client.close()
        server.close()
        self.done.set()

    def _pump(self, source: socket.socket, sink: socket.socket, is_request: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                try:
                    sink.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            with self._lock:  # one lock: the list is in time order across both directions
                self.segments.append((time.monotonic_ns(), is_request, data))
            sink.sendall(data)


@pytest.fixture
def hypercorn_h2c():
    port = free_port()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(sse_app, config(port), shutdown_trigger=stop.wait))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for_port(port)
    yield port
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


async def stream_chats(port: int, count: int, *, tls: bool = False) -> dict[str, dict]:
    """Concurrent streamed requests on one HTTP/2 connection (h2c with prior knowledge, or
    TLS with ALPN h2, the server's certificate not checked); what the client saw of each."""
    seen: dict[str, dict] = {}
    scheme = "https" if tls else "http"
    async with httpx.AsyncClient(http1=False, http2=True, timeout=30, verify=not tls) as client:
        async def one(n: int) -> None:
            body = {"model": "llama-3-8b", "stream": True, "n": n, "messages": [{"role": "user", "content": "hi"}]}
            sent_ns = time.monotonic_ns()
            async with client.stream("POST", f"{scheme}://127.0.0.1:{port}/v1/chat/completions?x=1",
                                     json=body, headers={"x-tenant-id": f"tenant-{n}"}) as response:
                assert response.http_version == "HTTP/2"
                texts, events = [], 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events += 1
                    payload = line[6:]
                    if payload != "[DONE]":
                        choices = json.loads(payload)["choices"]
                        if choices and choices[0]["delta"].get("content"):
                            texts.append(time.monotonic_ns())
            seen[f"tenant-{n}"] = {"sent_ns": sent_ns, "token_seen_ns": texts, "events": events,
                                   "done_ns": time.monotonic_ns(), "id": f"chatcmpl-{n}"}

        await asyncio.gather(*(one(n) for n in range(count)))
    return seen


def test_hypercorn_h2c_sse_streams_match_what_the_client_saw(hypercorn_h2c):
    relay = Relay(hypercorn_h2c)
    seen = asyncio.run(stream_chats(relay.port, 3))
    assert relay.done.wait(30), "the client's connection did not close"

    assembler = Http2ConnectionAssembler(fingerprint_key=b"k")
    rows = assemble(relay.segments, assembler, "client_closed")

    assert assembler.unreadable is None, assembler.error
    assert sorted(row.tenant for row in rows) == sorted(seen)
    assert len({row.stream_id for row in rows}) == 3
    for row in rows:
        client = seen[row.tenant]
        assert (row.outcome, row.error, row.method, row.path, row.status, row.streamed) == \
            ("complete", None, "POST", "/v1/chat/completions", 200, True)
        assert (row.response_id, row.resp_model, row.req_model, row.req_stream) == \
            (client["id"], "llama-3-8b", "llama-3-8b", True)
        assert row.sse_events == client["events"] and row.done_seen
        assert len(row.token_event_ns) == len(client["token_seen_ns"]) == row.completion_tokens
        # Each event left the server before the client read it, and after the request was sent.
        assert client["sent_ns"] <= row.req_start_ns <= row.req_end_ns <= row.resp_start_ns
        assert all(relayed <= read for relayed, read in zip(row.token_event_ns, client["token_seen_ns"]))
        assert row.token_event_ns == sorted(row.token_event_ns)
        assert row.token_event_ns[0] >= row.resp_start_ns and row.resp_end_ns <= client["done_ns"]


@pytest.fixture
def grpc_server():
    server, port = start_generator("127.0.0.1:0")
    yield port
    server.stop(None)


def test_grpc_server_streaming_calls_match_what_the_client_saw(grpc_server):
    relay = Relay(grpc_server)
    seen = call_generate(relay.port, ((5, 0), (3, 1)))
    assert relay.done.wait(30), "the client's connection did not close"

    assembler = Http2ConnectionAssembler(fingerprint_key=b"k")
    rows = assemble(relay.segments, assembler, "client_closed")

    assert assembler.unreadable is None, assembler.error
    assert [(row.grpc_status, row.grpc_message) for row in rows] == \
        [(call.code, call.details) for call in seen] == [(0, None), (8, "KV cache full: 100%")]
    for row, call in zip(rows, seen):
        times = call.arrived_ns
        assert (row.api, row.method, row.path, row.status, row.outcome, row.error) == \
            ("grpc", "POST", METHOD, 200, "complete", None)
        assert (row.request_messages, row.request_message_bytes) == (1, call.request_bytes)
        assert (row.response_messages, row.response_message_bytes, row.largest_response_message_bytes) == \
            (len(times), sum(call.message_sizes), max(call.message_sizes))
        assert len(row.token_event_ns) == len(times)
        assert all(sent <= read for sent, read in zip(row.token_event_ns, times))
        assert row.req_start_ns <= row.req_end_ns <= row.resp_start_ns <= row.token_event_ns[0]
        assert row.token_event_ns[-1] <= row.resp_end_ns
