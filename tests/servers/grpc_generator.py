"""A grpcio server-streaming service (gRPC's C core, no stubs: bytes in and
out), the shape of a streaming inference API: each streamed message is one
generated token; a request can end in an error status from the trailers.

Run: python -m tests.servers.grpc_generator PORT (from the repository root);
the tests in-process import `start_generator` and `call_generate`."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc

METHOD = "/inference.Generator/Generate"


class GenerateCall(NamedTuple):
    """What the client sent and saw of one call."""

    request_bytes: int  # the one request message's payload
    arrived_ns: list[int]  # the monotonic time each response message arrived
    message_sizes: list[int]  # each response message's payload bytes
    code: int  # the status code
    details: str | None


def generate(request: bytes, context):
    """Server-streaming: request[0] messages of 3 to 12 bytes, then OK, or an error status when request[1] is set."""
    for i in range(request[0]):
        time.sleep(0.002)
        yield b"tok" * (1 + i % 4)  # sizes vary so that totals and the largest tell messages apart
    if request[1]:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full: 100%")


def start_generator(address: str) -> tuple[grpc.Server, int]:
    """The service started on `address` ("127.0.0.1:0" for any port) and its port."""
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.Generator", {"Generate": grpc.unary_stream_rpc_method_handler(generate)}),))
    port = server.add_insecure_port(address)
    server.start()
    return server, port


def call_generate(port: int, plan: tuple[tuple[int, int], ...]) -> list[GenerateCall]:
    """One call per (messages, fail) on one channel: what the client sent and saw of each."""
    seen = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD)
        for count, fail in plan:
            request = bytes([count, fail])
            times, sizes, code, details = [], [], grpc.StatusCode.OK, None
            try:
                for message in call(request):
                    times.append(time.monotonic_ns())
                    sizes.append(len(message))
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            seen.append(GenerateCall(len(request), times, sizes, code.value[0], details))
    return seen


if __name__ == "__main__":
    start_generator(f"127.0.0.1:{int(sys.argv[1])}")[0].wait_for_termination()
