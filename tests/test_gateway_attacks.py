"""Attacks on the gateway (`python -m tokenprobe.actuator.proxy`), each over real sockets on loopback, bounded
in count and time: a hung upstream, clients that leave or stall, oversized heads, cut bodies, and budgets
that must not lock a tenant out nor let a new key escape. docs/reliability.md lists them."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import grpc
import pytest
from tokenprobe.actuator.auth import ServerAuth
from tokenprobe.actuator.engine import DEFAULT_CONTEXT_TOKENS, Enforcer
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.actuator.tenant import DEFAULT_TENANT, tenant_of_key
from tokenprobe.actuator.v1 import actuator_pb2_grpc as pb_grpc

from tests.actuator_support import (
    TOKEN,
    apply,
    budget,
    tokens_available,
    unique_upstream,
)
from tests.gateway_support import (
    RecordingUpstream,
    ScriptedUpstream,
    gateway,
    gateway_process,
    hang,
    raw_request,
    read_message,
    read_response,
)
from tests.support import wait_until

CHAT = b'{"model": "m", "max_tokens": 4, "prompt": "hi"}'
MiB = 1 << 20


@pytest.fixture(scope="module")
def actuator():
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})), enforcer=Enforcer(min_dwell_s=0.0)) as running, \
            grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield f"127.0.0.1:{running.port}", pb_grpc.ActuatorStub(channel)


def open_request(port: int, target: str = "/v1/chat/completions", body: bytes = CHAT) -> socket.socket:
    """A client connection with one whole request sent, its answer not read yet."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=20)
    connection.sendall(f"POST {target} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return connection


# --------------------------------------------------------------------------- a hung upstream


def test_a_hung_upstream_holds_at_most_the_in_flight_limit_and_clients_that_leave_free_it(tmp_path, actuator):
    address, _ = actuator
    upstream = ScriptedUpstream(hang)
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address,
                     "--max-in-flight", "8", "--first-byte-timeout", "60") as port:
            waiting = [open_request(port) for _ in range(8)]
            wait_until(lambda: upstream.open == 8, timeout=20)
            started = time.monotonic()
            refused = [open_request(port) for _ in range(4)]
            answers = [read_message(connection) for connection in refused]
            refused_in = time.monotonic() - started
            for connection in waiting + refused:
                connection.close()
            # The clients left: their upstream requests are cancelled and those connections closed.
            wait_until(lambda: upstream.open == 0, timeout=10)
            freed_in = time.monotonic() - started
            # And the gateway takes new requests to the upstream again.
            again = open_request(port)
            wait_until(lambda: upstream.accepted == 9 and upstream.open == 1, timeout=10)
            again.close()
    finally:
        upstream.close()
    print(f"\nhung upstream: 4 over the limit answered in {refused_in:.2f} s; 8 upstream connections closed "
          f"{freed_in:.2f} s after their clients left")
    # Refused by the limit at once, not left to wait for a connection of the pool.
    assert all(answer.startswith(b"HTTP/1.1 503 ") and b"in flight" in answer for answer in answers), answers


def test_an_upstream_that_never_answers_is_a_504_after_the_first_byte_timeout(tmp_path, actuator):
    address, _ = actuator
    upstream = ScriptedUpstream(hang)
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address,
                     "--first-byte-timeout", "1") as port:
            started = time.monotonic()
            status, _ = raw_request(port, "/v1/chat/completions")
            waited = time.monotonic() - started
            wait_until(lambda: upstream.open == 0, timeout=10)  # and the gateway let go of that connection
    finally:
        upstream.close()
    assert status == 504, status
    assert 1.0 <= waited < 15.0, waited


def test_an_upstream_that_goes_quiet_mid_stream_is_cut_after_the_idle_timeout(tmp_path, actuator):
    address, _ = actuator

    def quiet_after_one_event(connection: socket.socket) -> None:
        event = b'data: {"a":1}\n\n'
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"%x\r\n%s\r\n" % (len(event), event))
        hang(connection)
    upstream = ScriptedUpstream(quiet_after_one_event)
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address,
                     "--idle-timeout", "1") as port, \
                socket.create_connection(("127.0.0.1", port), timeout=20) as connection:
            connection.sendall(b"GET /stream HTTP/1.1\r\nHost: gw\r\n\r\n")
            received = b""
            while chunk := connection.recv(65536):  # until the gateway drops the connection
                received += chunk
            wait_until(lambda: upstream.open == 0, timeout=10)  # and its own to the upstream
    finally:
        upstream.close()
    assert received.startswith(b"HTTP/1.1 200 ") and b'data: {"a":1}' in received
    assert not received.endswith(b"0\r\n\r\n")  # cut, not ended as if the stream were whole


# --------------------------------------------------------------------------- clients that leave or stall


FLOOD_BYTES = 64 * MiB


def flood(connection: socket.socket, total: int = FLOOD_BYTES, piece: int = 64 * 1024) -> int:
    """Answer 64 MiB as fast as the gateway takes it; returns the bytes sent before it let go."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                       b"Content-Length: %d\r\n\r\n" % total)
    sent = 0
    try:
        while sent < total:
            sent += connection.send(b"x" * min(piece, total - sent))
    except OSError:
        pass
    return sent


def test_a_client_that_leaves_or_stops_reading_stops_the_upstream(tmp_path, actuator):
    address, _ = actuator
    sent: list[int] = []
    upstream = ScriptedUpstream(lambda connection: sent.append(flood(connection)))
    try:
        with gateway_process(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address,
                             "--client-timeout", "2") as running:
            idle_files = running.open_files()
            leaving = small_window_connection(running.port)
            leaving.sendall(b"GET /big HTTP/1.1\r\nHost: gw\r\n\r\n")
            received = 0
            while received < MiB:
                received += len(leaving.recv(65536))
            leaving.close()
            wait_until(lambda: len(sent) == 1, timeout=20)
            # A client that stays but reads nothing is cut off after --client-timeout: the upstream request
            # ends, and the gateway drops the client's connection with what it had buffered for it.
            stalled = small_window_connection(running.port)
            stalled.sendall(b"GET /big HTTP/1.1\r\nHost: gw\r\n\r\n")
            wait_until(lambda: len(sent) == 2, timeout=30)
            wait_until(lambda: running.open_files() <= idle_files, timeout=10)
            stalled.close()
    finally:
        upstream.close()
    print(f"\nupstream sent {sent[0] / MiB:.1f} MiB of 64 to a client that left after 1 MiB, "
          f"{sent[1] / MiB:.1f} MiB to one that read nothing")
    # The gateway closed both upstream connections: what the socket buffers on the way held was sent, not the
    # 64 MiB the upstream would have streamed (loopback buffers here may grow to 32 MiB, so no tighter bound).
    assert max(sent) < FLOOD_BYTES, f"the upstream sent {[f'{n / MiB:.1f} MiB' for n in sent]} of 64"


def small_window_connection(port: int) -> socket.socket:
    """A client connection whose receive buffer stays at 64 KiB (no autotuning)."""
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    connection.settimeout(20)
    connection.connect(("127.0.0.1", port))
    return connection


def test_slow_clients_are_answered_408_and_closed(tmp_path, actuator):
    address, _ = actuator
    upstream = RecordingUpstream()
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address,
                     "--head-timeout", "1", "--client-timeout", "1") as port:
            silent = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(50)]
            slow_heads = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(150)]
            for connection in slow_heads:
                connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow")
            slow_body = socket.create_connection(("127.0.0.1", port), timeout=20)
            slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{")
            started = time.monotonic()
            head_statuses = {read_response(connection)[0] for connection in silent + slow_heads}
            body_status = read_response(slow_body)[0]
            closed_in = time.monotonic() - started
            for connection in silent + slow_heads + [slow_body]:
                connection.close()
    finally:
        upstream.close()
    print(f"\n200 slow heads and a slow body answered 408 and closed within {closed_in:.1f} s")
    assert head_statuses == {408} and body_status == 408
    assert upstream.requests == []


def test_bodies_held_at_once_are_bounded_over_all_clients(tmp_path, actuator):
    address, _ = actuator
    upstream = RecordingUpstream()
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address,
                     "--max-buffered-body-bytes", str(MiB)) as port:
            # Three clients each send 400 KiB of an 800 KiB body, and wait: 1.2 MiB would be held.
            clients = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(3)]
            for connection in clients:
                connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                                   b"Content-Length: %d\r\n\r\n" % (800 * 1024) + b" " * (400 * 1024))
            answered = {}
            deadline = time.monotonic() + 10
            while not answered and time.monotonic() < deadline:
                for index, connection in enumerate(clients):
                    connection.settimeout(0.1)
                    with contextlib.suppress(TimeoutError):
                        answered[index] = connection.recv(65536)
            time.sleep(0.5)  # a second answer, were there one, has come by now
            for index, connection in enumerate(clients):
                with contextlib.suppress(TimeoutError):
                    answered.setdefault(index, connection.recv(65536))
                connection.close()
            # Once they are gone, what they held is free again.
            after = raw_request(port, "/v1/chat/completions")[0]
    finally:
        upstream.close()
    assert len(answered) == 1, answered  # the one that would have passed the limit; the others wait
    assert next(iter(answered.values())).startswith(b"HTTP/1.1 503 "), answered
    assert after == 200 and len(upstream.requests) == 1


# --------------------------------------------------------------------------- oversized or broken requests


def test_a_huge_request_head_is_refused_unread_and_never_forwarded(tmp_path, actuator):
    address, _ = actuator
    upstream = RecordingUpstream()
    try:
        with gateway_process(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address) as running:
            before = running.peak_rss_kib()
            with socket.create_connection(("127.0.0.1", running.port), timeout=20) as connection:
                connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Big: ")
                offered = 0
                try:
                    while offered < 64 * MiB:  # the gateway stops reading long before
                        connection.sendall(b"a" * MiB)
                        offered += MiB
                except OSError:
                    pass
                big_status = read_response(connection)[0]
            after = running.peak_rss_kib()
            many_fields = tuple(f"X-Field-{i}: {i}" for i in range(200)) + (f"Content-Length: {len(CHAT)}",)
            fields_status = raw_request(running.port, "/v1/chat/completions", headers=many_fields)[0]
    finally:
        upstream.close()
    print(f"\n64 MiB header: {offered / MiB:.0f} MiB sent before the gateway closed; its peak RSS "
          f"{before / 1024:.1f} -> {after / 1024:.1f} MiB")
    assert (big_status, fields_status) == (431, 431)
    assert upstream.requests == []
    assert after - before < 16 * 1024, f"peak RSS {before / 1024:.1f} -> {after / 1024:.1f} MiB"


def test_a_broken_chunk_after_a_complete_json_chunk_is_never_forwarded(tmp_path, actuator):
    address, _ = actuator
    upstream = RecordingUpstream()
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", unique_upstream(), address) as port, \
                socket.create_connection(("127.0.0.1", port), timeout=20) as connection:
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"%x\r\n%s\r\n" % (len(CHAT), CHAT))
            time.sleep(0.5)  # the gateway holds a whole JSON document by now
            connection.sendall(b"zz\r\nbroken\r\n")
            status = read_response(connection)[0]
            time.sleep(0.5)  # what the gateway would have forwarded has reached the upstream by now
    finally:
        upstream.close()
    assert status == 400
    assert upstream.requests == []


# --------------------------------------------------------------------------- budgets


def chat_with_key(port: int, key: str, body: bytes) -> int:
    return raw_request(port, "/v1/chat/completions", body=body,
                       headers=(f"Content-Length: {len(body)}", f"Authorization: Bearer {key}"))[0]


def test_a_request_the_upstream_refuses_refunds_its_charge(tmp_path, actuator):
    address, stub = actuator
    name = unique_upstream()
    upstream = RecordingUpstream(status=400)
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", name, address) as port:
            apply(stub, budget(name, DEFAULT_TENANT, rate=0.001, burst=10_000.0, ttl=120.0))
            # 128 choices of a whole context each: 16.8M tokens estimated, which no bucket holds.
            huge = json.dumps({"model": "m", "prompt": "hi", "n": 128, "max_tokens": DEFAULT_CONTEXT_TOKENS}).encode()
            statuses = []
            for _ in range(3):
                statuses.append(raw_request(port, "/v1/chat/completions", body=huge)[0])
                # Settlement is a call of its own, after the answer: wait for it rather than race it.
                wait_until(lambda: tokens_available(stub, name, DEFAULT_TENANT) > 9_999)
    finally:
        upstream.close()
    # Each was charged one bucket and refunded when the upstream answered 400: none was refused with 429.
    assert statuses == [400, 400, 400]
    assert len(upstream.requests) == 3


def test_a_new_key_shares_the_bucket_of_unknown_keys_until_the_upstream_accepts_it(tmp_path, actuator):
    address, stub = actuator
    name = unique_upstream()
    upstream = RecordingUpstream(usage_tokens=900)
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 899}'
    try:
        with gateway(tmp_path, f"http://127.0.0.1:{upstream.port}", name, address) as port:
            apply(stub, budget(name, DEFAULT_TENANT, rate=0.001, burst=1000.0, ttl=120.0))
            first = chat_with_key(port, "sk-first-0123456789", body)  # new: charged to the unknown keys' bucket
            assert tokens_available(stub, name, DEFAULT_TENANT) < 200  # charged 900, and settled at 900
            fresh = [chat_with_key(port, f"sk-random-{i}", body) for i in range(3)]
            again = chat_with_key(port, "sk-first-0123456789", body)  # accepted once: its own tenant now
    finally:
        upstream.close()
    assert (first, fresh, again) == (200, [429] * 3, 200)
    assert [headers["x-tenant-id"] for _, _, headers in upstream.requests] == [
        DEFAULT_TENANT, tenant_of_key("sk-first-0123456789")]
