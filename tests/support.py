"""Small helpers every kind of test uses: free ports and patient waiting.

Waits are generous: the suite runs on a 2-core machine next to real servers."""

from __future__ import annotations

import socket
import time
from typing import Callable

WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.05)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    wait_until(lambda: port_open(port, host), timeout)
