"""What /proc says about processes and their TCP sockets.

The kernel side cannot always name a connection's ports (see accept_exit in
bpf/tokenprobe.c) and never sees sockets opened before it attached; /proc
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


def proc_net_sockets(pid: str) -> Iterable[tuple[str, str, str, str]]:
    """(state, local, remote, inode) of the TCP sockets in a process's netns."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9:
                        yield cols[3], cols[1], cols[2], cols[9]
        except (OSError, StopIteration):
            continue


TCP_ESTABLISHED_HEX, TCP_LISTEN_HEX = "01", "0A"


def target_port_sockets(ports: set[int]) -> tuple[list[SocketOwner], list[SocketOwner]]:
    """(listening, established) sockets on target ports, with the processes
    holding them, in every network namespace (each process's /proc/PID/net
    shows its own)."""
    if not ports:
        return [], []
    wanted: dict[str, tuple[str, int, str, int]] = {}  # "socket:[inode]" → state, port, peer
    seen_netns: set[str] = set()
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if netns in seen_netns:
            continue
        seen_netns.add(netns)
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
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                found = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if found is not None:
                state, port, peer_addr, peer_port = found
                owner = SocketOwner(int(pid), int(fd), port, peer_addr, peer_port)
                (listening if state == TCP_LISTEN_HEX else established).append(owner)
    return listening, established


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
