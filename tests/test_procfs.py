"""/proc readers the agent rescans with: the listening sockets of target ports and their
owners (procfs.ListenerScan), checked against real sockets and processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

from tokenprobe.agent.capture.kernel.procfs import (
    ListenerScan,
    proc_net_sockets,
    target_port_sockets,
)

# A process that keeps what it is given: it receives a socket over a unix socket, then waits.
KEEPER = """
import socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
print("ready", flush=True)
msg, fds, _, _ = socket.recv_fds(channel, 16, 4)
print(fds[0] if fds else -1, flush=True)
sys.stdin.read()
"""


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def owners(scan: ListenerScan) -> set[tuple[int, int, int]]:
    return {(owner.pid, owner.fd, owner.local_port) for owner in scan.scan()}


@contextmanager
def keeper() -> Iterator[tuple[subprocess.Popen, socket.socket]]:
    """A child process started now (so a scan knows it), waiting for a socket over a unix socket."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", KEEPER, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs.close()
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc, ours
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        ours.close()


def test_listeners_of_target_ports_are_found_with_their_owners_and_nothing_else():
    target, other = listener(), listener()
    port = target.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))  # established on the target port: not a listener
    served, _ = target.accept()
    try:
        scan = ListenerScan({port})
        assert owners(scan) == {(os.getpid(), target.fileno(), port)}
        assert owners(scan) == {(os.getpid(), target.fileno(), port)}, "the next, narrower scan finds the same"
        assert target_port_sockets({port})[0] == scan.scan()
    finally:
        for sock in (client, served, target, other):
            sock.close()


def test_the_listening_only_read_stops_at_the_established_sockets_and_misses_no_listener():
    sockets = [listener() for _ in range(3)]
    clients = [socket.create_connection(sock.getsockname()) for sock in sockets]
    try:
        every = list(proc_net_sockets("self"))
        listening = list(proc_net_sockets("self", listening_only=True))
        assert listening == [row for row in every if row[0] == "0A"]
        assert any(row[0] != "0A" for row in every)
    finally:
        for sock in (*sockets, *clients):
            sock.close()


def test_a_listener_that_appears_or_a_process_that_starts_is_read_again_and_a_closed_copy_is_dropped():
    first = listener()
    port = first.getsockname()[1]
    scan = ListenerScan({port})
    try:
        assert owners(scan) == {(os.getpid(), first.fileno(), port)}
        copy = os.dup(first.fileno())  # the same socket on a second fd of a known process: not looked for yet
        with keeper() as (proc, channel):  # a process started since the last scan is read
            socket.send_fds(channel, [b"x"], [first.fileno()])
            theirs = int(proc.stdout.readline())
            assert owners(scan) == {(os.getpid(), first.fileno(), port), (proc.pid, theirs, port)}
            os.close(copy)
            second = listener()  # a listening socket that appeared: every process is read again
            second_port = second.getsockname()[1]
            scan.ports.add(second_port)
            assert owners(scan) == {(os.getpid(), first.fileno(), port), (proc.pid, theirs, port),
                                    (os.getpid(), second.fileno(), second_port)}
            first.close()  # our copy closed, theirs kept: only theirs remains
            assert owners(scan) == {(proc.pid, theirs, port), (os.getpid(), second.fileno(), second_port)}
            second.close()
        assert owners(scan) == set()
    finally:
        first.close()


def test_a_listener_passed_to_a_process_already_read_is_found_at_the_next_full_scan():
    """What the narrower scans cannot see (a listener sent over a unix socket to a process they
    already read) comes at the next full scan, every `full_every`."""
    sock = listener()
    port = sock.getsockname()[1]
    try:
        with keeper() as (proc, channel):
            scan = ListenerScan({port}, full_every=3)
            mine = (os.getpid(), sock.fileno(), port)
            assert owners(scan) == {mine}  # scan 0: full
            socket.send_fds(channel, [b"x"], [sock.fileno()])
            theirs = (proc.pid, int(proc.stdout.readline()), port)
            assert owners(scan) == {mine} and owners(scan) == {mine}  # scans 1 and 2: the keeper is known
            assert owners(scan) == {mine, theirs}  # scan 3: full
    finally:
        sock.close()
