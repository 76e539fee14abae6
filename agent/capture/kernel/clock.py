"""Kernel time to wall-clock time.

The probes stamp events with bpf_ktime_get_ns(), which is CLOCK_MONOTONIC:
steady, but counted from boot. Rows are stored in wall-clock time, so the
agent keeps an offset, wall − monotonic, measured by reading the wall clock
between two monotonic readings and keeping the tightest bracket. NTP slews
the wall clock slowly, so the offset is re-measured periodically; a step of
the wall clock shows up at the next re-measure.
"""

from __future__ import annotations

import time


def measure_offset(samples: int = 7) -> int:
    """wall − monotonic in ns, from the tightest of several brackets."""
    best_gap, best_offset = None, 0
    for _ in range(samples):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        gap = after - before
        if best_gap is None or gap < best_gap:
            best_gap, best_offset = gap, wall - (before + after) // 2
    return best_offset


class MonotonicWallClock:
    """Maps CLOCK_MONOTONIC ns (the probes' clock) to Unix-epoch ns."""

    def __init__(self, refresh_s: float = 60.0) -> None:
        self.refresh_ns = int(refresh_s * 1e9)
        self.offset_ns = measure_offset()
        self._measured_at = time.monotonic_ns()

    def to_wall_ns(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns

    def now_wall_ns(self) -> int:
        return self.to_wall_ns(time.monotonic_ns())

    def maybe_refresh(self) -> None:
        """Re-measures the offset if it is older than refresh_s."""
        now = time.monotonic_ns()
        if now - self._measured_at >= self.refresh_ns:
            self.offset_ns = measure_offset()
            self._measured_at = now
