"""A grpcio server-streaming service (gRPC's C core, no stubs: bytes in and
out), the shape of a streaming inference API: each streamed message is one
generated token; a request can end in an error status from the trailers.

Run: python -m tests.servers.grpc_generator PORT (from the repository root);
the tests in-process import `start_generator` and `call_generate`."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

METHOD = "/inference.Generator/Generate"
MESSAGE_BYTES = 6  # each streamed message: b"\x0a\x04tok" + one digit


def generate(request: bytes, context):
    """Server-streaming: request[0] messages, then OK, or an error status when request[1] is set."""
    for i in range(request[0]):
        time.sleep(0.002)
        yield b"\x0a\x04tok%d" % (i % 10)
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


def call_generate(port: int, plan: tuple[tuple[int, int], ...]) -> list[tuple[list[int], int, str | None]]:
    """One call per (messages, fail) on one channel: what the client saw of each, as
    (the monotonic time each message arrived, the status code, its details)."""
    seen = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD)
        for count, fail in plan:
            times, code, details = [], grpc.StatusCode.OK, None
            try:
                for _ in call(bytes([count, fail])):
                    times.append(time.monotonic_ns())
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            seen.append((times, code.value[0], details))
    return seen


if __name__ == "__main__":
    start_generator(f"127.0.0.1:{int(sys.argv[1])}")[0].wait_for_termination()
