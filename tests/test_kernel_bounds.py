"""Bounded kernel state: every map of the program is an LRU or a hash whose
overflows are counted, and a map made small at load time shows its counter."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenprobe.agent.capture.kernel.loader import (
    KERNEL_MAPS,
    MAP_OVERFLOW_SLOTS,
    MapSizes,
    Probes,
    Targets,
    program_source,
)
from tokenprobe.agent.capture.kernel.records import (
    DIR_READ,
    DIR_WRITE,
    EV_DATA,
    KernelEvent,
)
from tokenprobe.agent.capture.wire.sse import SteadyTemplate

from tests.kernel_harness import (
    agent,
    free_port,
    read_rows,
    require_kernel,
    wait_for_port,
)
from tests.support import wait_until

# A server with a thread per connection, each blocked in recv() between messages: threads
# inside a traced call at once. A connection is closed after its first message.
THREADED = """
import socket, sys, threading
def serve(conn, once):
    while data := conn.recv(4096):
        conn.sendall(data)
        if once:
            break
    conn.close()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(16)
for n in range(3):
    threading.Thread(target=serve, args=(listener.accept()[0], n == 1)).start()
"""
SHAPES_SERVER = Path(__file__).parent / "servers" / "shapes_sse.py"
SOURCE = program_source()
# A server that keeps every connection it accepts, closing none, and echoes what each sends.
KEEPER = """
import selectors, socket, sys
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(1024)
selector = selectors.DefaultSelector()
selector.register(listener, selectors.EVENT_READ)
while True:
    for key, _ in selector.select():
        if key.fileobj is listener:
            selector.register(listener.accept()[0], selectors.EVENT_READ)
        elif data := key.fileobj.recv(4096):
            key.fileobj.sendall(data)
"""


def test_every_map_of_the_program_is_listed_and_every_overflow_slot_named():
    declared = re.findall(r"^BPF_(?:(?:F_)?TABLE\(\"\w+\", [^,]+, [^,]+, (\w+)|[A-Z_]+\((\w+))", SOURCE, re.MULTILINE)
    assert {table or other for table, other in declared} == set(KERNEL_MAPS)
    enum = re.search(r"enum map_slot \{(.*?)\};", SOURCE, re.DOTALL).group(1)
    slots = [name.split("=")[0].strip().removeprefix("MAP_").lower() for name in enum.split(",")]
    assert slots == [*MAP_OVERFLOW_SLOTS, "slots"]


@pytest.mark.kernel
def test_small_maps_count_what_they_could_not_hold():
    """conns sized 64 against 100 open connections: 36 evictions counted; a
    listeners map of 2 against 4 listening sockets: 2 refusals counted."""
    require_kernel()
    port, spare = free_port(), [free_port() for _ in range(3)]
    server = subprocess.Popen([sys.executable, "-c", KEEPER, str(port)])
    probes, clients, bound = None, [], []
    try:
        wait_for_port(port)
        probes = Probes(Targets(ports=[port, *spare]), map_sizes=MapSizes(conns=64, listeners=2))
        assert probes.map_sizes()["conns"] == 64 and probes.map_sizes()["listeners"] == 2
        assert probes.map_overflows() == dict.fromkeys(MAP_OVERFLOW_SLOTS, 0)
        for _ in range(100):
            clients.append(socket.create_connection(("127.0.0.1", port)))
        wait_until(lambda: probes.map_overflows()["conns"] == 100 - 64)
        assert sum(1 for _ in probes.bpf["conns"]) <= 64
        for spare_port in spare:  # the server's listener holds one of the two entries
            sock = socket.socket()
            sock.bind(("127.0.0.1", spare_port))
            bound.append(sock)
        assert probes.map_overflows() == {**dict.fromkeys(MAP_OVERFLOW_SLOTS, 0), "conns": 36, "listeners": 2}
    finally:
        for sock in clients + bound:
            sock.close()
        if probes is not None:
            probes.close()
        server.kill()
        server.wait(timeout=20)


@contextlib.contextmanager
def kept_connection() -> Iterator[tuple[Probes, Callable[[], KernelEvent]]]:
    """Probes on a server that keeps its connections open, and one connection to it: ``exchange()``
    makes one echo on it and returns the server's read of it."""
    require_kernel()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", KEEPER, str(port)])
    probes, events = None, []
    try:
        wait_for_port(port)
        probes = Probes(Targets(ports=[port]))
        probes.open(events.append)
        with socket.create_connection(("127.0.0.1", port)) as client:

            def exchange() -> KernelEvent:
                events.clear()
                client.sendall(b"ping")
                assert client.recv(16) == b"ping"

                def server_read() -> list[KernelEvent]:
                    probes.poll(50)
                    return [e for e in events if e.kind == EV_DATA and e.dir == DIR_READ and e.tgid == server.pid]

                wait_until(server_read)
                return server_read()[0]

            yield probes, exchange
    finally:
        if probes is not None:
            probes.close()
        server.kill()
        server.wait(timeout=20)


@pytest.mark.kernel
def test_a_restarted_connection_speaks_again_as_one_adopted_afresh():
    """What idle eviction does to the kernel's entry: the connection's next
    events carry no accept time and counters from zero. Asked for another
    generation (a newer connection on the fd, its accept not read yet), the
    entry is left as it is."""
    with kept_connection() as (probes, exchange):
        exchange()
        before = exchange()
        assert before.conn_ns and before.events_before == (1, 1) and before.bytes_before == (4, 4)
        probes.restart_connection(before.tgid, before.fd, before.conn_ns + 1)
        kept = exchange()
        assert (kept.conn_ns, kept.events_before, kept.bytes_before) == (before.conn_ns, (2, 2), (8, 8))
        probes.restart_connection(before.tgid, before.fd, before.conn_ns)
        after = exchange()
        assert (after.conn_ns, after.events_before, after.bytes_before) == (0, (0, 0), (0, 0))
        assert (after.fd, after.head) == (before.fd, b"ping")


@pytest.mark.kernel
def test_forgetting_a_connection_spares_a_newer_one_and_clears_what_an_evicted_one_left():
    """Asked for another generation, forgetting leaves the entry and its steady template; asked for a
    connection the conns LRU evicted, it still clears the template (a plain hash keeps it otherwise)."""
    with kept_connection() as (probes, exchange):
        first = exchange()
        conns, templates = probes.bpf["conns"], probes.bpf["steady_templates"]
        key = conns.Key(first.tgid, first.fd)
        assert probes.arm_steady(first.tgid, first.fd, SteadyTemplate(b'data: {"text":"', b'"},"index":0}\n\n'))
        probes.forget_connection(first.tgid, first.fd, first.conn_ns + 1)
        assert conns[key].accept_ns == first.conn_ns
        assert templates[templates.Key(first.tgid, first.fd)].prefix_len == len(b'data: {"text":"')
        del conns[key]  # as the LRU evicts it
        probes.forget_connection(first.tgid, first.fd, first.conn_ns)
        assert templates.Key(first.tgid, first.fd) not in templates


@pytest.mark.kernel
def test_the_agent_evicts_an_idle_connection_and_follows_it_afresh_when_it_speaks(tmp_path: Path):
    """A stream silent past --idle-timeout is written truncated while it waits;
    the rest of it reads as nothing, and the connection's next request is one
    exact row of its own."""
    require_kernel()
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SHAPES_SERVER), str(port)])
    try:
        wait_for_port(port)
        with agent(tmp_path, "--idle-timeout", "1", ports=[port]) as handle:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            # Silent 6 s before each event: longer than the timeout and the agent's 5 s sweep.
            for rid, tokens, delay_ms in (("cmpl-silent", 1, 6000), ("cmpl-after", 3, 0)):
                conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                             body=json.dumps({"id": rid, "max_tokens": tokens, "delay_ms": delay_ms}))
                assert conn.getresponse().read().count(b"data: ") == tokens + 2
            conn.close()
            assert handle.stop() == 0, handle.log()
    finally:
        server.terminate()
        server.wait(timeout=20)
    rows = sorted(read_rows(handle.store_url), key=lambda r: r["req_start_ns"])
    assert [(r["outcome"], r["response_id"], r["token_events"], r["req_seq"]) for r in rows] == [
        ("truncated", "", 0, 0), ("complete", "cmpl-after", 3, 0)], rows
    silent, after = rows
    assert "no I/O for 1 s" in silent["error"] and silent["status"] == 200
    assert after["capture"] == "exact" and after["completion_tokens"] == 3
    assert after["conn_id"] != silent["conn_id"]


@pytest.mark.kernel
def test_a_full_pending_map_is_counted_and_the_calls_it_missed_read_as_lost():
    """io_pending sized 1: while one thread waits in recv(), another's calls
    find no room. They are counted, and the connection's next event owns up to
    them, so the exchange they belong to would say 'dropped'."""
    require_kernel()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", THREADED, str(port)])
    probes, events = None, []
    try:
        wait_for_port(port)  # the first connection, closed at once
        probes = Probes(Targets(ports=[port]), map_sizes=MapSizes(pending=1))
        probes.open(events.append)
        holder = socket.create_connection(("127.0.0.1", port))  # its thread takes the one entry
        wait_until(lambda: probes.poll(50) or any(e.tgid == server.pid for e in events))
        time.sleep(0.5)  # and is inside recv()
        starved = socket.create_connection(("127.0.0.1", port))
        starved.sendall(b"lost")
        assert starved.recv(16) == b"lost"  # read and echoed unseen
        wait_until(lambda: probes.map_overflows()["io_pending"] >= 2)
        holder.sendall(b"free")  # its thread answers, closes and ends: the entry is free
        assert holder.recv(16) == b"free" and holder.recv(16) == b""
        time.sleep(0.5)
        starved.sendall(b"seen")
        assert starved.recv(16) == b"seen"

        def starved_write() -> list[KernelEvent]:
            probes.poll(50)
            return [e for e in events if e.kind == EV_DATA and e.dir == DIR_WRITE and e.head == b"seen"]

        wait_until(starved_write)
        reads_lost, writes_lost = starved_write()[0].events_before
        assert reads_lost >= 1 and writes_lost >= 1, "the calls the full map missed are numbered"
        holder.close()
        starved.close()
    finally:
        if probes is not None:
            probes.close()
        server.kill()
        server.wait(timeout=20)
