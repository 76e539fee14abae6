"""Helpers for whoever runs the reference server and the agent as processes: the tests, the
benchmarks and the demo. Ports, and waiting for them."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    """Wait until something listens on ``host:port``; TimeoutError past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not port_open(port, host):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")
        time.sleep(0.05)
