"""What /proc says about processes and their TCP sockets.

The kernel side cannot always name a connection's ports (see accept_exit in
bpf/connections.c) and never sees sockets opened before it attached; /proc
fills those gaps. Each process's /proc/PID/net shows its own network
namespace, so containers are covered.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class SocketOwner:
    pid: int
    fd: int
    local_port: int
    peer_addr: str
    peer_port: int


def proc_net_address(hex_addr: str) -> tuple[str, int]:
    """'0100007F:1F40' (or the 32-digit IPv6 form) → ('127.0.0.1', 8000)."""
    host, port = hex_addr.rsplit(":", 1)
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return str(addr), int(port, 16)


TCP_ESTABLISHED_HEX, TCP_LISTEN_HEX = "01", "0A"


def proc_net_sockets(pid: str, *, listening_only: bool = False) -> Iterable[tuple[str, str, str, str]]:
    """(state, local, remote, inode) of the TCP sockets in a process's netns. With
    `listening_only` the read stops at the first socket that is not listening: the kernel
    prints its listening sockets first (its listening hash, then the established one), so the
    established sockets, tens of thousands on a busy node, are never printed, nor are the empty
    buckets of their hash walked (milliseconds, even with none)."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if len(cols) <= 9:
                        continue
                    if listening_only and cols[3] != TCP_LISTEN_HEX:
                        break
                    yield cols[3], cols[1], cols[2], cols[9]
        except (OSError, StopIteration):
            continue


def _process_ids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def _one_process_per_netns(pids: list[str]) -> Iterable[str]:
    """A process of each network namespace among `pids`: /proc/PID/net shows its namespace's."""
    seen: set[str] = set()
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if netns not in seen:
            seen.add(netns)
            yield pid


def _socket_fds(pid: str) -> Iterable[tuple[str, str]]:
    """(fd, what it links to) of a process's open files; nothing once it is gone."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield fd, os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


class ListenerScan:
    """The listening sockets of target ports and the processes holding them, in every network
    namespace, found again at each of the agent's rescans for a fraction of a full scan's cost.

    A full scan (target_port_sockets) reads every socket of every namespace and every open file
    of every process: 197 ms a rescan with 5,000 connections and 5,000 other files open
    (benchmarks/bench_rescan.py). Here the namespaces' tables are read up to their listening
    sockets, and the processes' files only where something new may hold one: every process when
    a listening socket appeared since the last scan, else only the processes that started since
    (forked workers inherit their parent's listener); the owners found before are checked one
    link each. A full scan of the files still comes every `full_every` scans, for what that
    misses (a process number reused by a new process, a listener passed over a unix socket)."""

    def __init__(self, ports: set[int], full_every: int = 12) -> None:
        self.ports = ports
        self.full_every = full_every
        self._owners: dict[str, list[SocketOwner]] = {}  # "socket:[inode]" → the owners found
        self._pids: set[str] = set()  # the processes whose files were read, or known not to hold one
        self._scans = 0

    def scan(self) -> list[SocketOwner]:
        pids = _process_ids()
        listening = self._listening(pids)
        full = self._scans % self.full_every == 0 or not listening.keys() <= self._owners.keys()
        self._scans += 1
        owners: dict[str, list[SocketOwner]] = {link: [] for link in listening}
        if not full:
            for link in listening:
                owners[link] = [owner for owner in self._owners[link]
                                if _links_to(owner, link)]
        for pid in pids if full else [pid for pid in pids if pid not in self._pids]:
            for fd, link in _socket_fds(pid):
                found = listening.get(link)
                if found is not None:
                    owners[link].append(SocketOwner(int(pid), int(fd), *found))
        self._owners, self._pids = owners, set(pids)
        return [owner for found in owners.values() for owner in found]

    def _listening(self, pids: list[str]) -> dict[str, tuple[int, str, int]]:
        """The target ports' listening sockets ("socket:[inode]" → port, peer address and port as
        /proc prints them), one read per namespace."""
        listening: dict[str, tuple[int, str, int]] = {}
        for pid in _one_process_per_netns(pids):
            for _, local, remote, inode in proc_net_sockets(pid, listening_only=True):
                _, port = proc_net_address(local)
                if port in self.ports:
                    listening[f"socket:[{inode}]"] = (port, *proc_net_address(remote))
        return listening


def _links_to(owner: SocketOwner, link: str) -> bool:
    try:
        return os.readlink(f"/proc/{owner.pid}/fd/{owner.fd}") == link
    except OSError:
        return False


def target_port_sockets(ports: set[int]) -> tuple[list[SocketOwner], list[SocketOwner]]:
    """(listening, established) sockets on target ports, with the processes
    holding them, in every network namespace (each process's /proc/PID/net
    shows its own)."""
    if not ports:
        return [], []
    wanted: dict[str, tuple[str, int, str, int]] = {}  # "socket:[inode]" → state, port, peer
    pids = _process_ids()
    for pid in _one_process_per_netns(pids):
        for state, local, remote, inode in proc_net_sockets(pid):
            if state not in (TCP_LISTEN_HEX, TCP_ESTABLISHED_HEX):
                continue
            _, port = proc_net_address(local)
            if port in ports:
                peer_addr, peer_port = proc_net_address(remote)
                wanted[f"socket:[{inode}]"] = (state, port, peer_addr, peer_port)
    listening: list[SocketOwner] = []
    established: list[SocketOwner] = []
    if not wanted:
        return listening, established
    for pid in pids:
        for fd, link in _socket_fds(pid):
            found = wanted.get(link)
            if found is not None:
                state, port, peer_addr, peer_port = found
                owner = SocketOwner(int(pid), int(fd), port, peer_addr, peer_port)
                (listening if state == TCP_LISTEN_HEX else established).append(owner)
    return listening, established


def own_tcp_ports() -> set[tuple[int, int]]:
    """(local port, remote port) of this process's own TCP connections (in its network namespace)."""
    links = {link for _, link in _socket_fds("self")}
    ports = set()
    for _, local, remote, inode in proc_net_sockets("self"):
        if f"socket:[{inode}]" in links:
            ports.add((proc_net_address(local)[1], proc_net_address(remote)[1]))
    return ports


def comm_of(tgid: int) -> str:
    try:
        with open(f"/proc/{tgid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def socket_endpoints(tgid: int, fd: int) -> tuple[int, str, int] | None:
    """(local port, peer address, peer port) of a process's TCP socket fd,
    from /proc; None if the socket is gone or not TCP."""
    try:
        link = os.readlink(f"/proc/{tgid}/fd/{fd}")
    except OSError:
        return None
    if not link.startswith("socket:["):
        return None
    inode = link[8:-1]
    for _state, local, remote, sock_inode in proc_net_sockets(str(tgid)):
        if sock_inode == inode:
            peer_addr, peer_port = proc_net_address(remote)
            return proc_net_address(local)[1], peer_addr, peer_port
    return None
