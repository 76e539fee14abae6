"""Real HTTP/2 bytes from the h2 library's client and server state machines, in memory.

`H2Wire` connects an h2 client and server back to back and records every
flush as one segment — (ts, is_request, bytes) — the way the probes see one
write(): each side's `data_to_send()` after an action is one call. Both
machines check every frame, so the bytes are what a conforming peer sends.
"""

from __future__ import annotations

import json
import struct

import h2.config
import h2.connection
import h2.events
from tokenprobe.agent.capture.wire.http2 import H2Exchange, Http2ConnectionAssembler

T0 = 1_000_000
STEP_NS = 1_000


def assemble(segments, assembler: Http2ConnectionAssembler,
             close: str | None = "server_closed") -> list[H2Exchange]:
    """Feeds whole (ts, is_request, bytes) segments, then closes one ns after the last
    unless close is None; returns every record."""
    records: list[H2Exchange] = []
    for ts, is_request, data in segments:
        feed = assembler.feed_request_bytes if is_request else assembler.feed_response_bytes
        records += feed(ts, data, len(data))
    if close:
        records += assembler.close(segments[-1][0] + 1, close)
    return records


class H2Wire:
    """With `upgrade_path`, the connection starts in HTTP/1.1 and upgrades (RFC 7540, section 3.2):
    a GET of that path with `Upgrade: h2c`, the server's 101 and SETTINGS in one write, then the
    client's preface; the GET is stream 1, whose response the server sends in HTTP/2."""

    def __init__(self, *, server_settings: dict | None = None, upgrade_path: str | None = None) -> None:
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, validate_inbound_headers=False))
        self.segments: list[tuple[int, bool, bytes]] = []
        self.ts = T0
        if upgrade_path is not None:
            settings = self.client.initiate_upgrade_connection().decode("ascii")
            self._write(True, f"GET {upgrade_path} HTTP/1.1\r\nHost: gpu-node:8000\r\n"
                              "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                              f"HTTP2-Settings: {settings}\r\n\r\n".encode("ascii"))
            self.server.initiate_upgrade_connection(settings)
            self._write(False, b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
                        + self.server.data_to_send())
            self.flush()
            return
        self.server.initiate_connection()
        if server_settings:
            self.server.update_settings(server_settings)
        self.client.initiate_connection()
        self.flush(server_first=True)  # a server may write its SETTINGS before the preface arrives

    def _write(self, is_request: bool, data: bytes) -> None:
        """One write the state machines do not see (the HTTP/1.1 of an upgrade)."""
        self.ts += STEP_NS
        self.segments.append((self.ts, is_request, data))

    def flush(self, server_first: bool = False) -> int:
        """Deliver what both sides wrote, one segment per side and turn, until quiet;
        the client acknowledges DATA (WINDOW_UPDATE) as a real one does. Returns the
        timestamp of the first segment: the write of the side that just acted."""
        sides = [(self.client, self.server, True), (self.server, self.client, False)]
        if server_first:
            sides.reverse()
        first_ts = None
        moved = True
        while moved:
            moved = False
            for sender, receiver, is_request in sides:
                data = sender.data_to_send()
                if data:
                    self.ts += STEP_NS
                    first_ts = first_ts or self.ts
                    self.segments.append((self.ts, is_request, data))
                    for event in receiver.receive_data(data):
                        if isinstance(event, h2.events.DataReceived) and receiver is self.client:
                            self.client.acknowledge_received_data(event.flow_controlled_length,
                                                                  event.stream_id)
                    moved = True
        return first_ts

    def request(self, stream_id: int, headers: list[tuple[str, str]], body: bytes | None) -> int:
        """Headers and body as two writes; returns the body's (the request's last byte)."""
        self.client.send_headers(stream_id, headers, end_stream=body is None)
        last = self.flush()
        if body is not None:
            self.client.send_data(stream_id, body, end_stream=True)
            last = self.flush()
        return last

    def respond(self, stream_id: int, headers: list[tuple[str, str]]) -> int:
        self.server.send_headers(stream_id, headers)
        return self.flush()

    def send(self, stream_id: int, data: bytes, *, end_stream: bool = False,
             pad_length: int | None = None) -> int:
        self.server.send_data(stream_id, data, end_stream=end_stream, pad_length=pad_length)
        return self.flush()

    def trailers(self, stream_id: int, headers: list[tuple[str, str]]) -> int:
        self.server.send_headers(stream_id, headers, end_stream=True)
        return self.flush()


def chat_request(stream_id_headers: list[tuple[str, str]] | None = None,
                 path: str = "/v1/chat/completions") -> tuple[list[tuple[str, str]], bytes]:
    body = json.dumps({"model": "llama-3-8b", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "gpu-node:8000"),
               (":path", path + "?api-version=1"), ("content-type", "application/json"),
               ("content-length", str(len(body))), *(stream_id_headers or [])]
    return headers, body


SSE_RESPONSE = [(":status", "200"), ("content-type", "text/event-stream")]


def sse_chunk(content: str | None = None, *, role: bool = False, usage: tuple | None = None) -> bytes:
    """One OpenAI chat.completion.chunk event, as vLLM writes it."""
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    event = {"id": "chatcmpl-42", "object": "chat.completion.chunk", "model": "llama-3-8b",
             "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": None}]}
    if usage:
        event["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                          "total_tokens": sum(usage)}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BL", int(compressed), len(payload)) + payload


def grpc_request(path: str = "/inference.Generator/Generate") -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":authority", "gpu-node:50051"),
            (":path", path), ("content-type", "application/grpc"), ("te", "trailers")]


GRPC_RESPONSE = [(":status", "200"), ("content-type", "application/grpc+proto")]
