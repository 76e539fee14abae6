"""The requests the agent produced, held in memory for its live pass (``live.LiveAnalysis``).

The agent's request sink hands every row it takes to ``HeldRequests.add``
(``RequestSink.watch``), on the capture thread: an inference request of this
node keeps the few columns a pass splits and places in time (``HELD``), as one
tuple, until the pass whose window it ended in takes it (``take``). So a pass
knows the requests that ended in its window, their keys, sizes and times
without asking the store.

Memory: a tuple of ``len(HELD)`` values a request, about 0.5 KiB in CPython
(``bench_analytics`` prints it); at 1k requests/s and passes every 30 s, about
33k requests are held between passes (the window and its settle time), some
16 MiB. At most ``max_rows`` are held: past that a request is not kept, the
pass that should have taken it reads the store instead (``complete_from``).
"""

from __future__ import annotations

import threading

import numpy as np
import pandas as pd

from ..contract import measures
from .split import NO_TIME

# What a pass needs of each request: its key, model, times (Unix ns) and prompt size.
TIMES = ("req_start", "req_end", "first_token", "last_token", "resp_start", "resp_end")
# The engine's stated figures, where it stated them (NaN where not).
ENGINE_FIGURES = ("engine_queue_ms", "engine_prompt_ms")
HELD = ("server_port", "model", "conn_id", "req_seq", *TIMES, "prompt_tokens", "bytes_in", *ENGINE_FIGURES)
# When a request's row is complete (measures.ENDED_AT), in the order of its columns there.
ENDED_AT = ("resp_end", "last_token", "first_token", "resp_start", "req_end", "req_start")
DEFAULT_MAX_ROWS = 500_000  # 8 minutes at 1k requests/s


class HeldRequests:
    """This node's inference requests, held from ``since_ns`` (Unix ns, the time the agent's rows are
    stamped with) until a pass takes them (see the module docstring)."""

    def __init__(self, node: str, since_ns: int, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.node, self.since_ns, self.max_rows = node, since_ns, max_rows
        self._rows: list[tuple] = []  # each (when it ended, *its HELD values)
        self._lock = threading.Lock()
        self._missed_until_ns = 0  # requests were dropped (too many held) until this moment
        self._taken_until_ns = 0  # what ended before this was taken (by a pass that may have failed)

    def add(self, row: dict) -> None:
        """Hold ``row`` if it is one of this node's inference requests (called for every row the sink takes)."""
        if not measures.is_inference(row) or row.get("node") != self.node:
            return
        ended_ns = _ended_ns(row)
        held = (ended_ns, *[row.get(name) for name in HELD])
        with self._lock:
            if len(self._rows) < self.max_rows:
                self._rows.append(held)
                return
            self._missed_until_ns = max(self._missed_until_ns, ended_ns)

    def complete_from(self, start_ns: int) -> bool:
        """Whether every request of this node that ended at or after ``start_ns`` is held (none dropped, none
        taken yet: a pass that took them and failed leaves the next to read the store)."""
        return start_ns >= max(self.since_ns, self._missed_until_ns, self._taken_until_ns)

    def take(self, until_ns: int) -> pd.DataFrame:
        """The requests held that ended before ``until_ns``, no longer held: the columns ``HELD``, ``node``
        and ``ended_ns``; times -1 where a row has none, prompt tokens NaN."""
        with self._lock:
            self._taken_until_ns = max(self._taken_until_ns, until_ns)
            rows = self._rows
            self._rows = [row for row in rows if row[0] >= until_ns]
        chosen = [row for row in rows if row[0] < until_ns]
        ended, *values = zip(*chosen, strict=True) if chosen else [()] * (1 + len(HELD))
        columns = dict(zip(HELD, values, strict=True))
        frame = pd.DataFrame({
            "node": self.node, "model": np.array(columns["model"], dtype=object),
            **{name: np.array(columns[name], dtype=np.int64)
               for name in ("server_port", "conn_id", "req_seq", "bytes_in")},
            **{name: np.array([NO_TIME if time is None else time for time in columns[name]], dtype=np.int64)
               for name in TIMES},
            **{name: np.array([np.nan if value is None else value for value in columns[name]], dtype=np.float64)
               for name in ("prompt_tokens", *ENGINE_FIGURES)},
            "ended_ns": np.array(ended, dtype=np.int64)})
        return frame[["node", *HELD, "ended_ns"]]


def _ended_ns(row: dict) -> int:
    for name in ENDED_AT:  # a loop, not next() over a generator: the capture thread calls this for every row
        value = row.get(name)
        if value is not None:
            return value
    return NO_TIME
