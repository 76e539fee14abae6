"""Continuous analysis: the agent analyses its own node's servers every window, incrementally.

``LiveAnalysis.run_once()`` is one pass; ``start()`` runs passes on a thread
of their own every ``every_s`` seconds, so capture never waits for a query.
A pass:

1. picks the inference requests of this node that *ended* since the last
   pass (a watermark on ``measures.ENDED_AT``, i.e. resp_end, else the last
   moment the row saw) and before ``now − settle_s`` (rows land in the store
   a flush after they end). The agent holds them (``held.HeldRequests``, fed
   by its request sink): the pass takes them from memory, splits their TTFT
   there (``split.py``) and gives the occupancy their intervals as they are.
   Where it does not hold them all (the first pass after the agent starts,
   a pass after a failed one, too many held, no ``held``), it finds them in
   the store: where they lie in ``requests`` (sorted by start) comes from
   ``request_ends`` (sorted by end, ``contract/ends.py``): the seconds they
   started in, as a few ranges, so no pass reads the hour of requests that
   could have been running; the first pass after the agent starts reads
   ``requests`` itself (its rows may predate the view);
2. re-analyses, with ``pipeline.analyze``, the windows of ``every_s``
   seconds (aligned to the epoch) from the one where the earliest of them
   started up to the settle point, for the servers they belong to only;
   the phases of those requests only (the ones before them have theirs from
   earlier passes), so a pass costs what the new rows cost. The prefill
   calibration and the knee are fitted again only every
   ``live_refit_every_s`` (``AnalysisSpans``; ``pipeline.KeptFits``).
   The analytics tables replace what an earlier pass wrote for the same
   request or window (ReplacingMergeTree), so a window analysed again, or a
   pass retried after a failure, leaves one result per request and cell;
3. with ``samples_inflight``, asks the capture thread for a snapshot of the
   requests still in flight (``offer_inflight``), stores it in
   ``inflight_samples`` and judges each server's ``inflight_stall``
   (``analytics/inflight.py``), also when no request ended at all;
4. hands the result (``LivePass``: the matrix cells and the phases of the
   requests that ended) to each outlet (``analytics/outlets.py``: the
   agent's /metrics, OTLP, Alertmanager).

A failed pass leaves the watermark where it was, so the next one covers its
rows too; failures are counted, and logged once until a pass succeeds again.
``tokenprobe analyze`` stays the tool for a chosen range.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd

from ..contract import measures
from ..contract.analysis import INDICATOR_MATRIX_TABLE
from ..contract.ends import REQUEST_ENDS_TABLE
from ..contract.indicators import NO_DATA, OK
from ..contract.requests import REQUESTS_TABLE
from ..store.client import Store
from .calibration import IdleArrivalFloors
from .config import DEFAULT_CONFIG, DEFAULT_LIVE_EVERY_S, AnalyticsConfig
from .held import HeldRequests
from .indicators import Cell, KeptOccupancy
from .inflight import stall_cells, store_samples
from .pipeline import AnalysisReport, KeptFits, analyze
from .scope import Scope, Server
from .slo import SloMinutes
from .timerange import NS_PER_S, TimeRange, range_condition

log = logging.getLogger("tokenprobe.analytics.live")

DEFAULT_SETTLE_S = 3.0  # the request sink flushes every second; leave it two more
# A pass re-analyses at most this far back, however long the requests that ended were.
MAX_SPAN_S = 3600
# How long a pass waits for the capture thread's snapshot (it looks every second).
INFLIGHT_WAIT_S = 3.0
# Starts of new requests closer than this (s) are read as one range of ``requests``; a long request that
# started well before the rest gets a range of its own.
START_GAP_S = 30
# The phase columns outlets get for each request that ended in a pass.
PHASE_COLUMNS = ("node", "server_port", "model", "conn_id", "req_seq", "req_end", "first_token",
                 "queue_ms", "prefill_ms")
# How each is read, beside the occupancy's intervals (which hold node and server_port): timestamps in Unix ns,
# under names of their own (an alias would stand for the column in the intervals' expressions too).
PHASE_READ = {name: f"{name}_ns" if name in ("req_end", "first_token") else name for name in PHASE_COLUMNS}
PHASE_EXPRESSIONS = tuple(f"toUnixTimestamp64Nano({name}) AS {read}" if read != name else name
                          for name, read in PHASE_READ.items() if name not in ("node", "server_port"))


class EndedPhases:
    """The phases of the requests that ended in a pass, as the frame the pass read them in (its columns
    ``PHASE_COLUMNS``; timestamps in Unix ns). Outlets take the columns they need, as lists (``column``) or
    as float arrays (``floats``): at 1k requests/s a window holds 30k requests, which no pass turns into
    Python values an outlet does not ask for. Iterating gives a dict per request."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame[list(PHASE_COLUMNS)].reset_index(drop=True)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping]) -> EndedPhases:
        rows = list(rows)
        return cls(pd.DataFrame({name: pd.Series([row.get(name) for row in rows], dtype=object)
                                 for name in PHASE_COLUMNS}))

    def column(self, name: str) -> list:
        """Column ``name`` as Python values, None where it is NULL."""
        values = self.frame[name]
        return values.astype(object).where(values.notna(), None).tolist()

    def floats(self, name: str) -> np.ndarray:
        """Numeric column ``name`` as float64, NaN where it is NULL."""
        return pd.to_numeric(self.frame[name]).to_numpy(dtype=np.float64, na_value=np.nan)

    def __len__(self) -> int:
        return len(self.frame)

    def __iter__(self) -> Iterator[dict]:
        return (dict(zip(PHASE_COLUMNS, row, strict=True))
                for row in zip(*(self.column(name) for name in PHASE_COLUMNS), strict=True))


@dataclass(frozen=True)
class LivePass:
    """What one pass found: the analysed range and report (None when no request ended), its matrix cells
    (the report's and the in-flight ones), and the phases of the requests that ended in it."""

    analysed: TimeRange | None
    report: AnalysisReport | None
    cells: list[Cell]
    phases: EndedPhases

    @property
    def latest_cells(self) -> list[Cell]:
        """Per server, GPU and indicator, the verdict that holds now: its newest cell with data, else its newest.

        The pass's last window is still filling: a figure it has no data for yet
        (no request arrived in it) keeps the verdict of the window before.
        """
        latest: dict[tuple[str, int, str, str], Cell] = {}
        for cell in sorted(self.cells, key=lambda cell: cell.window_start_ns):
            key = (cell.node, cell.server_port, cell.device_id, cell.indicator)
            if cell.state != NO_DATA or key not in latest or latest[key].state == NO_DATA:
                latest[key] = cell
        return list(latest.values())


def _start_seconds(requests: pd.DataFrame) -> dict[int, list[int]]:
    """``LiveAnalysis._new_starts`` of requests held in memory."""
    seconds = pd.DataFrame({"port": requests["server_port"], "second": requests["req_start"] // NS_PER_S})
    return {int(port): sorted(int(second) for second in group.unique())
            for port, group in seconds.groupby("port")["second"]}


class Outlet(Protocol):
    """Somewhere a pass's results go besides the store (``analytics/outlets.py``)."""

    name: str

    def publish(self, result: LivePass) -> None: ...


class LiveAnalysis:
    """Analyses ``node``'s servers every ``every_s`` seconds (see the module docstring)."""

    def __init__(self, store: Store, node: str, *, every_s: int = DEFAULT_LIVE_EVERY_S,
                 settle_s: float = DEFAULT_SETTLE_S, config: AnalyticsConfig = DEFAULT_CONFIG,
                 outlets: Sequence[Outlet] = (), samples_inflight: bool = False,
                 clock_ns: Callable[[], int] = time.time_ns, before_pass: Callable[[], None] | None = None,
                 hold_requests: bool = False) -> None:
        if not isinstance(every_s, int) or isinstance(every_s, bool) or every_s < 1:
            raise ValueError(f"the analysis window must be a whole number of seconds ≥ 1, got {every_s!r}")
        if settle_s < 0:
            raise ValueError("settle_s must not be negative")
        self.store, self.node, self.every_s, self.config = store, node, every_s, config
        self.settle_ns = int(settle_s * NS_PER_S)
        self.outlets = list(outlets)
        self.clock_ns = clock_ns
        # The agent's: its request sink feeds the store's views the rows it inserted without them.
        self.before_pass = before_pass
        # A (re)started agent first covers the window before it: a previous agent may have stopped in it.
        self.watermark_ns = clock_ns() - self.settle_ns - every_s * NS_PER_S
        self.passes = self.failures = 0
        self.passes_held = 0  # passes that took their requests from memory (``held``)
        self.cpu_s = 0.0  # CPU the passes took on their thread (the store's pool threads not included)
        self.slo_minutes = SloMinutes()  # so a pass counts only the minutes new since the last one
        self.idle_floors = IdleArrivalFloors()  # so a pass reads the idle arrivals since the last one's oldest
        self.occupancy = KeptOccupancy()  # so a pass reads the phases it wrote, not the occupancy's look-back
        self.fits = KeptFits(config.spans.live_refit_every_s)  # so a pass fits only when they are due
        self.outlet_failures: dict[str, int] = {}
        self.samples_inflight = samples_inflight
        self._offered: tuple[int, list[dict]] | None = None  # (taken at, Unix ns; samples)
        self._offer_lock = threading.Lock()
        self._inflight_wanted, self._inflight_ready = threading.Event(), threading.Event()
        self._stalled: set[tuple[str, int]] = set()  # servers not ok last pass: judged until they are
        self._failing = False
        self._indexed = False  # whether request_ends holds every row a pass reads: not before the first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The agent's own requests, fed by its request sink (``RequestSink.watch(live.held.add)``).
        self.held = HeldRequests(node, since_ns=clock_ns()) if hold_requests else None

    # -- one pass ---------------------------------------------------------------------------
    def run_once(self) -> LivePass | None:
        """One pass; None when it has nothing to say (no request ended, no server to judge in flight).
        Raises what the store raised."""
        started_ns = self.clock_ns()
        until_ns = started_ns - self.settle_ns
        if until_ns <= self.watermark_ns:
            return None
        if self.before_pass is not None:
            self.before_pass()
        inflight = self._fresh_inflight(started_ns)
        ended = TimeRange(self.watermark_ns, until_ns)
        held = self._held_requests(ended)
        starts = self._new_starts(ended) if held is None else _start_seconds(held)
        analysed = report = None
        cells, phases = [], EndedPhases.from_rows([])
        if starts:
            window_ns = self.every_s * NS_PER_S
            earliest = max(min(seconds[0] for seconds in starts.values()) * NS_PER_S,
                           until_ns - MAX_SPAN_S * NS_PER_S)
            analysed = TimeRange(earliest // window_ns * window_ns, until_ns)
            scope = Scope(tuple(Server(port, self.node) for port in starts))
            new_requests = None
            if held is None:
                new, parameters, started = self._ended_condition(ended, starts)
                new_requests = (new, parameters)
                self.occupancy.expect(f"node = {{live_node:String}} AND {started}", parameters, PHASE_EXPRESSIONS)
            # The agent made the schema when it started; the requests before these have their phases.
            # computed_at is real time (the clock may be a test's), so a pass's rows replace older ones.
            computed_ns = time.time_ns()
            self.fits.due(started_ns)
            report = analyze(self.store, analysed, window_s=self.every_s, scope=scope, config=self.config,
                             now_ns=computed_ns, new_requests=new_requests, schema_ready=True,
                             slo_minutes=self.slo_minutes, idle_floors=self.idle_floors,
                             occupancy=self.occupancy, fits=self.fits, summarize=False, held=held)
            self.passes_held += held is not None
            cells, phases = list(report.cells), self._ended_phases()
        if inflight is not None:
            cells += self._judge_inflight(inflight, {(self.node, port) for port in starts}, until_ns)
        self.occupancy.commit()
        self.watermark_ns = until_ns
        self._indexed = True  # rows that end from now on are stored after the agent made the view
        if not cells:
            return None
        result = LivePass(analysed, report, cells, phases)
        self._publish(result)
        return result

    # -- requests in flight -------------------------------------------------------------------
    def inflight_wanted(self) -> bool:
        """Whether a pass waits for a snapshot (the capture thread polls this)."""
        return self._inflight_wanted.is_set()

    def offer_inflight(self, samples: list[dict], taken_ns: int) -> None:
        """The requests in flight at ``taken_ns`` (Unix ns), from the thread that tracks them."""
        with self._offer_lock:
            self._offered = (taken_ns, samples)
        self._inflight_ready.set()

    def _fresh_inflight(self, since_ns: int) -> list[dict] | None:
        """A snapshot taken for this pass, or None (not sampling, or the capture thread did not answer)."""
        if not self.samples_inflight:
            return None
        self._inflight_wanted.set()
        self._inflight_ready.wait(INFLIGHT_WAIT_S)
        self._inflight_wanted.clear()
        self._inflight_ready.clear()
        with self._offer_lock:
            offered, self._offered = self._offered, None
        # One offered for an earlier pass that gave up waiting is stale: judge nothing rather than old news.
        return offered[1] if offered is not None and offered[0] >= since_ns - INFLIGHT_WAIT_S * NS_PER_S else None

    def _judge_inflight(self, samples: list[dict], ended_servers: set[tuple[str, int]], until_ns: int) -> list[Cell]:
        store_samples(self.store, samples)
        window_ns = self.every_s * NS_PER_S
        window = (until_ns // window_ns * window_ns, until_ns)
        cells = stall_cells(samples, ended_servers | self._stalled, window, self.config.thresholds)
        if cells:
            self.store.insert_rows(INDICATOR_MATRIX_TABLE, [cell.row(self.clock_ns()) for cell in cells])
        self._stalled = {(cell.node, cell.server_port) for cell in cells if cell.state != OK}
        return cells

    def _held_requests(self, ended: TimeRange) -> pd.DataFrame | None:
        """The requests that ended in ``ended`` (and started at most MAX_SPAN_S before), from memory, or None
        where the agent does not hold them all. Either way what ended before its end is no longer held."""
        if self.held is None:
            return None
        complete = self.held.complete_from(ended.start_ns)
        taken = self.held.take(ended.end_ns)
        if not complete:
            return None
        # as the store's conditions choose them (ENDED_AT in ended, req_start in _started_recently)
        recent = ended.extended_back(MAX_SPAN_S)
        chosen = ((taken["ended_ns"] >= ended.start_ns) & (taken["req_start"] >= recent.start_ns)
                  & (taken["req_start"] < recent.end_ns))
        return taken[chosen].reset_index(drop=True)

    def _new_starts(self, ended: TimeRange) -> dict[int, list[int]]:
        """Per server of this node with inference requests that ended in ``ended`` (and started at most
        MAX_SPAN_S before): the seconds (Unix) they started in, ascending."""
        recent, parameters = self._started_recently(ended)
        if self._indexed:
            in_range, range_parameters = range_condition("ended_at", "ended", ended)
            source = f"{self.store.table(REQUEST_ENDS_TABLE)} WHERE {in_range}"
        else:
            in_range, range_parameters = range_condition(measures.ENDED_AT, "ended", ended)
            source = f"{self.store.table(REQUESTS_TABLE)} WHERE {measures.IS_INFERENCE} AND {in_range}"
        rows = self.store.query_rows(
            f"SELECT server_port, arraySort(groupUniqArray(intDiv(toUnixTimestamp64Nano(req_start), {NS_PER_S})))"
            f" FROM {source} AND node = {{live_node:String}} AND {recent} GROUP BY server_port ORDER BY server_port",
            {**parameters, **range_parameters, "live_node": self.node})
        return {int(port): [int(second) for second in seconds] for port, seconds in rows}

    def _ended_condition(self, ended: TimeRange, starts: dict[int, list[int]]) -> tuple[str, dict, str]:
        """This node's inference requests that ended in ``ended``, with its parameters, and the part of it
        that bounds ``req_start`` (the ranges ``starts`` lie in: what the primary keys narrow reads by)."""
        in_range, parameters = range_condition(measures.ENDED_AT, "ended", ended)
        recent, recent_parameters = self._started_recently(ended)  # the ranges are whole seconds: cut to it
        parameters.update(recent_parameters)
        ranges: list[list[int]] = []
        for second in sorted({second for seconds in starts.values() for second in seconds}):
            if ranges and second - ranges[-1][1] < START_GAP_S:
                ranges[-1][1] = second + 1
            else:
                ranges.append([second, second + 1])
        started = []
        for index, (first, last) in enumerate(ranges):
            condition, range_parameters = range_condition(
                "req_start", f"started_{index}", TimeRange(first * NS_PER_S, last * NS_PER_S))
            started.append(f"({condition})")
            parameters.update(range_parameters)
        started_sql = f"{recent} AND ({' OR '.join(started)})"
        return (f"{measures.IS_INFERENCE} AND node = {{live_node:String}} AND {in_range} AND {started_sql}",
                {**parameters, "live_node": self.node}, started_sql)

    @staticmethod
    def _started_recently(ended: TimeRange) -> tuple[str, dict]:
        return range_condition("req_start", "recent", ended.extended_back(MAX_SPAN_S))

    def _ended_phases(self) -> EndedPhases:
        """The phases this pass computed: those of the requests that ended in it, the only rows it wrote
        (``analyze(new_requests=)``), which the occupancy read (``KeptOccupancy.written``)."""
        written = self.occupancy.written
        if written is None or written.empty:
            return EndedPhases.from_rows([])
        written = written.sort_values(PHASE_READ["req_end"], kind="stable")
        return EndedPhases(written[list(PHASE_READ.values())].set_axis(list(PHASE_READ), axis=1))

    def _publish(self, result: LivePass) -> None:
        for outlet in self.outlets:
            try:
                outlet.publish(result)
            except Exception:  # an outlet's failure must not stop analysis nor the other outlets
                count = self.outlet_failures.get(outlet.name, 0) + 1
                self.outlet_failures[outlet.name] = count
                if count == 1:
                    log.warning("live analysis: publishing to %s failed (logged once; counted after)",
                                outlet.name, exc_info=True)

    # -- the thread -------------------------------------------------------------------------
    def tick(self) -> None:
        """``run_once`` that counts and logs failures instead of raising, and its CPU."""
        cpu_started = time.thread_time()
        try:
            self.run_once()
        except Exception:
            self.failures += 1
            if not self._failing:
                self._failing = True
                log.warning("live analysis failed (logged once until it recovers; failures are counted)",
                            exc_info=True)
            return
        finally:
            self.cpu_s += time.thread_time() - cpu_started
        self.passes += 1
        if self._failing:
            self._failing = False
            log.info("live analysis recovered after %d failed passes", self.failures)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("live analysis already started")
        self._thread = threading.Thread(target=self._loop, name="tokenprobe-live-analysis", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the pass in progress, if any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
