"""Small helpers every kind of test uses: free ports and patient waiting.

Waits are generous: the suite runs on a 2-core machine next to real servers."""

from __future__ import annotations

import time
from typing import Callable

from tokenprobe.refserver.harness import asgi_body, free_port, port_open, wait_for_port

__all__ = ["WAIT_S", "asgi_body", "free_port", "mapped_libssl", "port_open", "wait_for_port", "wait_until"]

WAIT_S = 60.0


def mapped_libssl() -> str:
    """The libssl file CPython's ssl module runs on in this process."""
    import _ssl  # noqa: F401  (maps libssl)

    with open("/proc/self/maps") as maps:
        return next(line.split()[-1] for line in maps if "/libssl" in line)


def wait_until(predicate: Callable[[], object], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.05)
