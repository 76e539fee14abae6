"""Requests still in flight: the agent's samples of them, stored, and the ``inflight_stall`` indicator.

The agent samples the exchanges it holds open once per live-analysis window
(``agent/capture/inflight.py``); ``store_samples`` writes them to
``inflight_samples`` and ``stall_cells`` judges each server by the longest
time one of its requests has gone without progress. A server that answers
nothing at all, or a stream that stopped mid-way, lights it while every
figure built on ended requests is silent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..contract.indicators import INDICATORS_BY_NAME, OK
from ..contract.indicators import INFLIGHT_STALL as STALL
from ..contract.inflight import INFLIGHT_SAMPLES
from ..store.client import Store
from .config import Thresholds
from .indicators import Cell, state_of


def store_samples(store: Store, samples: Sequence[dict]) -> None:
    if samples:
        store.insert_arrow(INFLIGHT_SAMPLES.name, INFLIGHT_SAMPLES.arrow(samples))


def stall_cells(samples: Sequence[dict], servers: Iterable[tuple[str, int]], window: tuple[int, int],
                thresholds: Thresholds) -> list[Cell]:
    """One ``inflight_stall`` cell per server in ``servers`` or in ``samples``, for ``window`` (start, end ns).

    Only requests the servers answer (``role = 'server'``) count: an outbound
    connection's wait is its upstream's stall, judged on that upstream.
    """
    silences: dict[tuple[str, int], list[float]] = {server: [] for server in servers}
    for sample in samples:
        if sample["role"] == "server":
            silences.setdefault((sample["node"], sample["server_port"]), []).append(sample["since_progress_ms"] / 1000)
    warn, crit = thresholds.inflight_stall_warn_s, thresholds.inflight_stall_crit_s
    cells = []
    for (node, port), seconds in sorted(silences.items()):
        longest = max(seconds, default=0.0)
        state = state_of(longest, warn, crit, INDICATORS_BY_NAME[STALL].comparison)
        silent = sum(1 for value in seconds if value > warn)
        explanation = (f"{len(seconds)} requests in flight, the longest silent for {longest:.0f} s"
                       if state == OK else
                       f"{silent} of {len(seconds)} requests in flight silent for over {warn:g} s, the longest "
                       f"{longest:.0f} s: streams or a queue stopped moving; nothing has ended to show it")
        cells.append(Cell(window[0], window[1], node, port, "", STALL, longest, state, warn, crit, explanation))
    return cells
