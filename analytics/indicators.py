"""The indicator matrix: per server (and GPU) per window, which warning signs are lit.

Each cell has a value, a state (``ok``, ``warn``, ``crit``, or ``n/a`` where
the data for it does not exist), the thresholds it was judged by, which side
of them is bad (``comparison``), and one line a person can act on.

Indicators (thresholds in ``config.Thresholds``):

- ``gpu_memory_pressure`` (per GPU): mean used / total memory.
- ``fragmentation`` (per GPU): seconds for which memory has been over 85%
  used with more than 10 requests queued and the GPU under 30% busy, up to
  the window's end: warn as soon as it holds, crit once it held 2 minutes.
- ``batch_fill``: requests holding a slot / the server's slots (the
  engine's, else the knee). Only a low fill while requests queue is a
  warning: the engine leaves room unused.
- ``queue_wait_p95``: p95 of the queue phase of requests that arrived.
- ``kv_cache_usage``: the engine's own figure, where it exports one.
- ``token_rate_decay``: median over long streams of the decode rate in their
  last quarter over their first.
- ``tpot_trend``: how much TPOT p50 rose across the last windows (a robust
  slope through the windows' TPOT p50, × the span, / the median).
- ``stall_rate``: share of inter-token gaps over 5× their stream's median.
- ``retry_storm``: share of requests whose fingerprint (method, path, keyed
  hash of the body and its size) repeats one of the same client's within 60 s;
  its explanation says how many repeated a failed request (``measures.FAILED``:
  5xx, an error inside a 200 stream, cut off).
- ``knee_proximity``: mean requests in flight / knee concurrency.
- ``inflight_stall``: the longest a request still in flight has gone without
  progress (no text event, no request byte), from the agent's in-flight
  samples (``analytics/inflight.py``; live analysis only): a stall that
  never ends has no row to show it otherwise.

Occupancy (in flight, queued, running) is time-averaged from the request
intervals of their phases (``phases.phases_source``): a request is in flight from its first byte
to its last response byte, queued from its last request byte for its queue
time, and running from then to its last token. It is computed on sub-buckets
of ``gcd(window, 10 s)``, which also serve the 2-minute fragmentation test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..contract import measures
from ..contract.analysis import INDICATOR_MATRIX_TABLE, REQUEST_SPLIT_TABLE
from ..contract.indicators import (
    ABOVE,
    CRIT,
    INDICATORS_BY_NAME,
    NO_DATA,
    OK,
    WARN,
)
from ..contract.requests import REQUESTS_TABLE
from ..contract.samples import (
    ENGINE_SAMPLES_TABLE,
    GPU_SAMPLES_TABLE,
    SERVER_GPUS_TABLE,
)
from ..store.client import Store
from .config import Thresholds
from .phases import grouped_phases, phases_source
from .robust import theil_sen
from .scope import Scope
from .split import NO_TIME, first_known
from .timerange import NS_PER_S, TimeRange, range_condition

SUB_BUCKET_MAX_S = 10
MAX_WINDOWS = 5000  # per analysis: beyond this the matrix stops being something to read
# Requests this long before the first sub-bucket are read too: they may still be in flight in it.
OCCUPANCY_LOOKBACK_S = 600.0


@dataclass(frozen=True)
class Capacity:
    """What a server can hold at once: the engine's slot count and/or the knee of its TTFT curve."""

    knee_concurrency: float | None = None
    engine_slots: float | None = None

    @property
    def slots(self) -> tuple[float, str] | None:
        """(slots, where from) for batch fill: the engine's count first."""
        if self.engine_slots is not None:
            return self.engine_slots, "engine slots"
        return (self.knee_concurrency, "the knee") if self.knee_concurrency is not None else None

    @property
    def knee(self) -> tuple[float, str] | None:
        """(concurrency, where from) for knee proximity: the knee first."""
        if self.knee_concurrency is not None:
            return self.knee_concurrency, "the knee"
        return (self.engine_slots, "engine slots") if self.engine_slots is not None else None


@dataclass(frozen=True)
class Cell:
    window_start_ns: int
    window_end_ns: int
    node: str
    server_port: int
    device_id: str
    indicator: str
    value: float | None
    state: str
    warn: float | None
    crit: float | None
    explanation: str

    def row(self, computed_at_ns: int) -> dict:
        spec = INDICATORS_BY_NAME[self.indicator]
        return {
            "window_start": self.window_start_ns, "window_end": self.window_end_ns, "node": self.node,
            "server_port": self.server_port, "device_id": self.device_id, "indicator": self.indicator,
            "value": self.value, "unit": spec.unit, "state": self.state, "warn": self.warn, "crit": self.crit,
            "comparison": spec.comparison, "explanation": self.explanation, "computed_at": computed_at_ns,
        }


@dataclass(frozen=True)
class Windows:
    """Tumbling windows of ``window_s`` aligned to the epoch, covering a range, cut into sub-buckets.

    Sub-buckets are numbered from ``base_ns``, which lies ``lead_s`` before
    the first window so tests that look back (fragmentation) have data.
    """

    analysed: TimeRange
    window_s: int
    lead_s: int

    @property
    def sub_s(self) -> int:
        return math.gcd(self.window_s, SUB_BUCKET_MAX_S)

    @property
    def origin_ns(self) -> int:
        return self.analysed.start_ns // (self.window_s * NS_PER_S) * self.window_s * NS_PER_S

    @property
    def base_ns(self) -> int:
        return self.origin_ns - self.lead_s * NS_PER_S

    @property
    def count(self) -> int:
        return math.ceil((self.analysed.end_ns - self.origin_ns) / (self.window_s * NS_PER_S))

    @property
    def buckets(self) -> int:
        return math.ceil((self.analysed.end_ns - self.base_ns) / (self.sub_s * NS_PER_S))

    def bounds(self, window: int) -> tuple[int, int]:
        start = self.origin_ns + window * self.window_s * NS_PER_S
        return start, min(start + self.window_s * NS_PER_S, self.analysed.end_ns)

    def bucket_slice(self, window: int) -> slice:
        per_window = self.window_s // self.sub_s
        first = self.lead_s // self.sub_s + window * per_window
        return slice(first, min(first + per_window, self.buckets))

    def bucket_seconds(self) -> np.ndarray:
        """Each sub-bucket's length in seconds (the last may be cut short by the range's end)."""
        starts = self.base_ns + np.arange(self.buckets, dtype=np.int64) * self.sub_s * NS_PER_S
        return np.minimum(self.sub_s * NS_PER_S, self.analysed.end_ns - starts) / NS_PER_S


def compute_matrix(store: Store, analysed: TimeRange, window_s: int, scope: Scope, thresholds: Thresholds,
                   capacities: Mapping[tuple[str, int], Capacity], now_ns: int,
                   occupancy: KeptOccupancy | None = None) -> list[Cell]:
    """Every cell of every window in ``analysed``, stored in ``indicator_matrix`` and returned.

    Needs the split (``request_split``) computed from ``thresholds.fragmentation_sustain_s``
    before the first window (``matrix_lead_s``) to the range's end. ``occupancy``: the intervals an
    earlier pass kept (``KeptOccupancy``; this run's phases were computed at ``now_ns``).
    """
    if not isinstance(window_s, int) or window_s < 1:
        raise ValueError(f"window must be a whole number of seconds, at least 1, got {window_s!r}")
    windows = Windows(analysed, window_s, matrix_lead_s(window_s, thresholds))
    if windows.count > MAX_WINDOWS:
        raise ValueError(f"{windows.count} windows of {window_s} s in this range; at most {MAX_WINDOWS}: "
                         "use a longer window or a shorter range")
    data = _MatrixData.load(store, windows, scope, thresholds, occupancy, now_ns)
    cells = []
    for server in data.servers():
        judge = _ServerJudge(server, windows, data, thresholds, capacities.get(server, Capacity()))
        for window in range(windows.count):
            if judge.active(window):
                cells.extend(judge.cells(window))
    if cells:
        store.insert_rows(INDICATOR_MATRIX_TABLE, [cell.row(now_ns) for cell in cells])
    return cells


def matrix_lead_s(window_s: int, thresholds: Thresholds) -> int:
    """How far before the first window the matrix reads data (whole sub-buckets)."""
    sub = math.gcd(window_s, SUB_BUCKET_MAX_S)
    return math.ceil(thresholds.fragmentation_sustain_s / sub) * sub


class _MatrixData:
    """Everything the matrix is judged from, pulled as aggregates: sub-bucket series and per-window stats."""

    def __init__(self, occupancy, stats, retries, gpu, engine, windows: Windows):
        self.occupancy, self.stats, self.retries, self.gpu, self.engine = occupancy, stats, retries, gpu, engine
        self.windows = windows
        # each frame's rows per server, split once (filtering a frame server by server costs a pass each)
        self._by_server = {name: _split_by_server(frame) for name, frame in (
            ("occupancy", occupancy), ("stats", stats), ("retries", retries), ("gpu", gpu), ("engine", engine))}

    @classmethod
    def load(cls, store: Store, windows: Windows, scope: Scope, thresholds: Thresholds,
             kept: KeptOccupancy | None, now_ns: int) -> _MatrixData:
        occupancy = (kept.occupancy(store, windows, scope, thresholds, now_ns) if kept
                     else _occupancy(store, windows, scope))
        return cls(occupancy, _request_stats(store, windows, scope, thresholds),
                   _retries(store, windows, scope, thresholds.retry_window_s), _gpu_buckets(store, windows, scope),
                   _engine_buckets(store, windows, scope), windows)

    def servers(self) -> list[tuple[str, int]]:
        return sorted({server for frame in ("occupancy", "stats", "gpu", "engine")
                       for server in self._by_server[frame]})

    def rows_of(self, frame: str, server: tuple[str, int]) -> pd.DataFrame:
        """One server's rows of the frame named (an empty result has no columns at all)."""
        return self._by_server[frame].get(server, _NO_ROWS)

    def series(self, rows: pd.DataFrame, column: str, fill: float) -> np.ndarray:
        """A column of one server's ``rows`` as a dense array over the sub-buckets."""
        values = np.full(self.windows.buckets, fill, dtype=np.float64)
        if rows.empty:
            return values
        values[rows["bucket"].to_numpy(dtype=np.int64)] = rows[column].to_numpy(dtype=np.float64, na_value=np.nan)
        return values


_NO_ROWS = pd.DataFrame()


def _split_by_server(frame: pd.DataFrame) -> dict[tuple[str, int], pd.DataFrame]:
    if frame.empty:
        return {}
    return {(node, int(port)): rows
            for (node, port), rows in frame.groupby(["node", "server_port"], sort=False, observed=True)}


def _bucket_sql(timestamp_ns: str) -> str:
    return f"intDiv({timestamp_ns} - {{base_ns:Int64}}, {{sub_ns:Int64}})"


def _bucket_parameters(windows: Windows) -> dict[str, int]:
    return {"base_ns": windows.base_ns, "sub_ns": windows.sub_s * NS_PER_S, "buckets": windows.buckets,
            "origin_ns": windows.origin_ns, "window_ns": windows.window_s * NS_PER_S}


def _occupancy_rows(store: Store, windows: Windows, scope: Scope) -> tuple[str, dict]:
    """The splits (``request_split``: each with its occupancy interval) of the requests that may overlap the
    sub-buckets, as a SELECT, and its parameters. Those of the look-back that finished before the first
    sub-bucket overlap none and are left out unread."""
    in_scope, scope_parameters = scope.condition()
    since = TimeRange(windows.base_ns, windows.analysed.end_ns)
    in_range, range_parameters = range_condition("req_start", "occupancy", since.extended_back(
        OCCUPANCY_LOOKBACK_S))
    overlapping = (f"SELECT * FROM {store.table(REQUEST_SPLIT_TABLE)} FINAL WHERE {in_range} AND {in_scope}"
                   " AND finished_at >= fromUnixTimestamp64Nano({base_ns:Int64}, 'UTC')")
    return overlapping, {**range_parameters, **scope_parameters, **_bucket_parameters(windows)}


def _occupancy(store: Store, windows: Windows, scope: Scope) -> pd.DataFrame:
    """Per server and sub-bucket: request-seconds in flight, queued and running (overlap summed)."""

    def offset(timestamp: str) -> str:
        return f"((toUnixTimestamp64Nano({timestamp}) - {{base_ns:Int64}}) / 1e9)"

    def overlap(start: str, end: str) -> str:
        return f"greatest(0, least({end}, (bucket + 1) * sub) - greatest({start}, bucket * sub))"

    overlapping, parameters = _occupancy_rows(store, windows, scope)
    return store.query_df(
        f"""SELECT node, server_port, bucket,
                   sum({overlap('arrived', 'finished')}) AS in_flight_s,
                   sum({overlap('arrived_whole', 'slot')}) AS queued_s,
                   sum({overlap('slot', 'generated')}) AS running_s
            FROM (
                SELECT node, server_port, {{sub_ns:Int64}} / 1e9 AS sub,
                       {offset('req_start')} AS arrived,
                       {offset('finished_at')} AS finished,
                       {offset('coalesce(req_end, req_start)')} AS arrived_whole,
                       arrived_whole + ifNull(queue_ms, 0) / 1000 AS slot,
                       if(last_token IS NULL, slot, {offset('last_token')}) AS generated,
                       -- every sub-bucket the request overlaps, within the range
                       arrayJoin(range(
                           toUInt64(greatest(0, floor(arrived / sub))),
                           toUInt64(greatest(0, least(toFloat64({{buckets:Int64}}), floor(finished / sub) + 1)))
                       )) AS bucket
                FROM ({overlapping})
            )
            GROUP BY node, server_port, bucket""", parameters)


# Each request (its key) and its occupancy interval, as ``_occupancy`` reads it (Unix ns; no last token: -1).
_INTERVAL_COLUMNS = ("node", "server_port", "conn_id", "req_seq", "toUnixTimestamp64Nano(req_start) AS start_ns",
                     "toUnixTimestamp64Nano(finished_at) AS finished_ns",
                     "toUnixTimestamp64Nano(coalesce(req_end, req_start)) AS arrived_whole_ns",
                     "ifNull(queue_ms, 0) AS queue_or_zero_ms",
                     "ifNull(toUnixTimestamp64Nano(last_token), -1) AS last_token_ns")
_INTERVAL_ARRAYS = {"conn_id": np.uint64, "req_seq": np.int64, "start_ns": np.int64, "finished_ns": np.int64,
                    "arrived_whole_ns": np.int64, "queue_or_zero_ms": np.float64, "last_token_ns": np.int64}
Intervals = dict[str, np.ndarray]  # _INTERVAL_ARRAYS, "server" (a code: KeptOccupancy.servers) and "reread"
# At most this many passes between two whole reads (each pass's time is in the check for foreign rows).
KEPT_PASSES_MAX = 1000
# Intervals are kept this many windows before a pass's base: the next may start a little earlier (a request
# that ran longer than the others ended) without a whole read.
KEPT_WINDOWS_BACK = 4
PORTS = 1 << 16


class KeptOccupancy:
    """The live analysis's occupancy: the intervals of the requests that may still overlap a later pass's
    sub-buckets, kept, so a pass reads only the rows it wrote instead of the 10-minute look-back.

    A pass's sub-buckets from ``base_ns`` on are overlapped by the requests of the look-back that finished
    at or after it: those kept at an earlier pass whose base was no later (the rows of ``request_split``
    only change when a pass writes them) and the rows this pass wrote (``expect``). The whole look-back is
    read again (``FINAL``, as ``_occupancy``) on the first pass, when a server or an earlier base is
    asked for, after ``KEPT_PASSES_MAX`` passes, and when ``request_split`` holds rows in the look-back
    that no kept pass wrote since (a ``tokenprobe analyze`` of the same range, a pass that failed after
    writing): the sums are then those of the query, to the rounding of their order.
    """

    def __init__(self) -> None:
        self.intervals: Intervals | None = None
        self.servers: dict[tuple[str, int], int] = {}  # (node, port) -> its code in the intervals
        self.covered: set[int] = set()  # the servers whose intervals are all there
        self.floor_ns = 0  # the base they cover from
        self.read_ns = 0  # when they were last read whole: every row written until then is in them
        self.passes: list[int] = []  # the computed_at of each pass's rows since
        self.written: pd.DataFrame | None = None  # the rows this pass wrote (interval and ``columns``)
        self._expected: tuple[str, dict, tuple[str, ...]] | pd.DataFrame | None = None
        self._pending: tuple | None = None

    def expect(self, condition: str, parameters: dict, columns: Sequence[str]) -> None:
        """The next pass writes its rows within ``condition`` (on the columns a request's figures and split
        share); read ``columns`` of their phases too (SQL expressions), into ``written``."""
        self._expected, self.written, self._pending = (condition, parameters, tuple(columns)), None, None

    def expect_held(self, requests: pd.DataFrame, split: pd.DataFrame) -> None:
        """The next pass writes the split of ``requests`` (``held.HeldRequests.take``), in memory: their
        intervals are computed here, as ``_INTERVAL_COLUMNS`` reads them, instead of read back; ``written``
        also has their model, ``req_end_ns``, ``first_token_ns`` (NA where none), ``queue_ms`` and
        ``prefill_ms``."""
        def nullable(name: str) -> pd.arrays.IntegerArray:
            times = requests[name].to_numpy(np.int64)
            return pd.arrays.IntegerArray(times, times == NO_TIME)

        queue_ms = split["queue_ms"].to_numpy()
        written = pd.DataFrame({
            "node": requests["node"].to_numpy(), "server_port": requests["server_port"].to_numpy(),
            "model": requests["model"].to_numpy(),
            "conn_id": requests["conn_id"].to_numpy(np.uint64), "req_seq": requests["req_seq"].to_numpy(np.int64),
            "start_ns": requests["req_start"].to_numpy(), "finished_ns": split["finished_at"].to_numpy(),
            "arrived_whole_ns": first_known(requests, ("req_end", "req_start")),
            "queue_or_zero_ms": np.where(np.isnan(queue_ms), 0.0, queue_ms),
            "last_token_ns": requests["last_token"].to_numpy(),
            "req_end_ns": nullable("req_end"), "first_token_ns": nullable("first_token"),
            "queue_ms": queue_ms, "prefill_ms": split["prefill_ms"].to_numpy(),
        })
        self._expected, self.written, self._pending = written, None, None

    def commit(self) -> None:
        """The pass succeeded: keep what it read (a failed one's rows are foreign to the next)."""
        if self._pending is not None:
            self.intervals, self.covered, self.floor_ns, self.read_ns, self.passes = self._pending
            self._pending = None

    def occupancy(self, store: Store, windows: Windows, scope: Scope, thresholds: Thresholds,
                  written_ns: int) -> pd.DataFrame:
        """``_occupancy``'s frame for ``windows``, the pass's rows being those computed at ``written_ns``."""
        if self._expected is None:
            raise RuntimeError("KeptOccupancy.expect() or expect_held() must say which rows the pass writes")
        if isinstance(self._expected, pd.DataFrame):
            self.written = self._expected
        else:
            condition, parameters, columns = self._expected
            by_this_pass = f"{condition} AND computed_at = fromUnixTimestamp64Nano({{occupancy_written:Int64}}, 'UTC')"
            written_phases = phases_source(store, condition, thresholds, split_condition=by_this_pass)
            self.written = store.query_df(
                f"SELECT {', '.join((*_INTERVAL_COLUMNS, *columns))} FROM ({written_phases}) WHERE {by_this_pass}",
                {**parameters, "occupancy_written": written_ns})
        self._expected = None
        written = self._arrays(self.written, reread=False)
        in_scope = self._codes(scope)
        if self._reusable(store, windows, scope, in_scope, written_ns):
            # the servers out of scope wrote nothing: theirs stay whole
            parts, covered = (_replaced(self.intervals, written), written), self.covered
            read_ns, passes, read_from_ns = self.read_ns, [*self.passes, written_ns], self.floor_ns
        else:  # this pass's rows among them
            overlapping, overlapping_parameters = _occupancy_rows(store, windows, scope)
            reread = store.query_df(f"SELECT {', '.join(_INTERVAL_COLUMNS)} FROM ({overlapping})",
                                    overlapping_parameters)
            # a request read here that no pass has seen end yet (a re-analysis wrote it) is written again later
            parts, covered = (self._arrays(reread, reread=True),), set(in_scope)
            read_ns, passes, read_from_ns = written_ns, [], windows.base_ns
        intervals = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        # what finished before the floor is left out: kept, the intervals hold all that finished after it
        floor_ns = max(read_from_ns, windows.base_ns - KEPT_WINDOWS_BACK * windows.window_s * NS_PER_S)
        intervals = _selected(intervals, intervals["finished_ns"] >= floor_ns)
        self._pending = (intervals, covered, floor_ns, read_ns, passes)
        return self._bucket_sums(_selected(intervals, np.isin(intervals["server"], in_scope)), windows)

    def _codes(self, scope: Scope) -> list[int]:
        """The codes of the known servers ``scope`` selects (as ``Scope.condition`` does)."""
        return [code for (node, port), code in self.servers.items()
                if any(server.port == port and server.node in (None, node) for server in scope.servers)]

    def _arrays(self, frame: pd.DataFrame, reread: bool) -> Intervals:
        if frame.empty:
            return {"server": np.empty(0, np.int64), "reread": np.empty(0, bool),
                    **{name: np.empty(0, kind) for name, kind in _INTERVAL_ARRAYS.items()}}
        nodes, names = pd.factorize(frame["node"])
        unique, pairs = np.unique(nodes * PORTS + frame["server_port"].to_numpy(np.int64), return_inverse=True)
        codes = np.array([self.servers.setdefault((names[pair // PORTS], int(pair % PORTS)), len(self.servers))
                          for pair in unique])
        return {"server": codes[pairs], "reread": np.full(len(frame), reread),
                **{name: frame[name].to_numpy(kind) for name, kind in _INTERVAL_ARRAYS.items()}}

    def _reusable(self, store: Store, windows: Windows, scope: Scope, in_scope: list[int], written_ns: int) -> bool:
        if (self.intervals is None or scope.models or not scope.servers
                or len(in_scope) < len(scope.servers) or not set(in_scope) <= self.covered
                or windows.base_ns < self.floor_ns or len(self.passes) >= KEPT_PASSES_MAX):
            return False
        scope_condition, scope_parameters = scope.condition()
        in_range, range_parameters = range_condition("req_start", "foreign", TimeRange(
            windows.base_ns, windows.analysed.end_ns).extended_back(OCCUPANCY_LOOKBACK_S))
        foreign = store.query_rows(
            f"""SELECT count() FROM {store.table(REQUEST_SPLIT_TABLE)}
                WHERE {in_range} AND {scope_condition}
                  AND computed_at > fromUnixTimestamp64Nano({{read:Int64}}, 'UTC')
                  AND toUnixTimestamp64Nano(computed_at) NOT IN {{passes:Array(Int64)}}""",
            {**range_parameters, **scope_parameters, "read": self.read_ns, "passes": [*self.passes, written_ns]})
        return not foreign[0][0]

    def _bucket_sums(self, intervals: Intervals, windows: Windows) -> pd.DataFrame:
        """``_occupancy``'s sums, from the requests' intervals, computed as its SQL does."""
        base_ns, sub, buckets = windows.base_ns, windows.sub_s * NS_PER_S / 1e9, windows.buckets
        starts = intervals["start_ns"]
        intervals = _selected(intervals, (starts >= windows.base_ns - int(OCCUPANCY_LOOKBACK_S * NS_PER_S))
                              & (starts < windows.analysed.end_ns))

        def offset(name: str) -> np.ndarray:
            return (intervals[name] - base_ns) / 1e9

        arrived, finished, arrived_whole = offset("start_ns"), offset("finished_ns"), offset("arrived_whole_ns")
        slot = arrived_whole + intervals["queue_or_zero_ms"] / 1000
        generated = np.where(intervals["last_token_ns"] < 0, slot, offset("last_token_ns"))
        first = np.maximum(0, np.floor(arrived / sub)).astype(np.int64)
        stop = np.maximum(0, np.minimum(float(buckets), np.floor(finished / sub) + 1)).astype(np.int64)
        spans = np.maximum(stop - first, 0)
        request = np.repeat(np.arange(len(first)), spans)  # one entry per request and sub-bucket it overlaps
        bucket = first[request] + np.arange(len(request)) - np.repeat(np.cumsum(spans) - spans, spans)
        low, high = bucket * sub, (bucket + 1) * sub
        cell = intervals["server"][request] * buckets + bucket  # per server and sub-bucket
        size = len(self.servers) * buckets

        def overlap(start: np.ndarray, end: np.ndarray) -> np.ndarray:
            seconds = np.maximum(0, np.minimum(end[request], high) - np.maximum(start[request], low))
            return np.bincount(cell, weights=seconds, minlength=size)[present]

        present = np.flatnonzero(np.bincount(cell, minlength=size))
        servers = list(self.servers)
        return pd.DataFrame({
            "node": [servers[code][0] for code in present // buckets],
            "server_port": [servers[code][1] for code in present // buckets], "bucket": present % buckets,
            "in_flight_s": overlap(arrived, finished), "queued_s": overlap(arrived_whole, slot),
            "running_s": overlap(slot, generated)})


def _selected(intervals: Intervals, chosen: np.ndarray) -> Intervals:
    return {name: values[chosen] for name, values in intervals.items()}


def _replaced(kept: Intervals, written: Intervals) -> Intervals:
    """The kept intervals less those of requests ``written`` again (their newest rows, which ``FINAL`` reads):
    only those read whole may be, where a re-analysis by hand wrote a request no pass had seen end."""
    if not len(written["start_ns"]):
        return kept
    # only those that started when a written one did can be one (a cheap look before the keys' comparison)
    starts = kept["start_ns"]
    candidates = np.flatnonzero(kept["reread"] & (starts >= written["start_ns"].min())
                                & (starts <= written["start_ns"].max()))
    if not len(candidates):
        return kept
    key = ("server", "start_ns", "conn_id", "req_seq")  # request_split's sorting key, the node in the server
    again = pd.MultiIndex.from_arrays([kept[name][candidates] for name in key]).isin(
        pd.MultiIndex.from_arrays([written[name] for name in key]))
    chosen = np.ones(len(kept["start_ns"]), dtype=bool)
    chosen[candidates[again]] = False
    return _selected(kept, chosen)


def _request_stats(store: Store, windows: Windows, scope: Scope, thresholds: Thresholds) -> pd.DataFrame:
    in_scope, scope_parameters = scope.condition()
    in_range, range_parameters = range_condition("req_start", "stats", TimeRange(windows.origin_ns,
                                                                                 windows.analysed.end_ns))
    window = "intDiv(toUnixTimestamp64Nano(req_start) - {origin_ns:Int64}, {window_ns:Int64})"
    return store.query_df(
        grouped_phases(store, f"{in_range} AND {in_scope}", thresholds,
                       {"node": "node", "server_port": "server_port", "window": window},
                       figures="count() AS requests, sum(stalls) AS total_stalls, sum(itl_gaps) AS total_gaps, "
                               "countIf(decode_rate_ratio IS NOT NULL) AS long_streams, "
                               "quantile(0.5)(decode_rate_ratio) AS decode_rate_ratio_p50, "
                               "quantile(0.5)(tpot_ms) AS tpot_p50_ms",
                       split="countIf(queue_ms IS NOT NULL) AS split, quantile(0.95)(queue_ms) AS queue_p95_ms"),
        {**range_parameters, **scope_parameters, **_bucket_parameters(windows)},
    )


# A request's fingerprint: the same client sending the same method, path and body (keyed hash of its size
# and content, computed in the agent) to the same server.
_FINGERPRINT = "cityHash64(node, server_port, client_addr, method, path, body_fp)"


def _retries(store: Store, windows: Windows, scope: Scope, retry_window_s: float) -> pd.DataFrame:
    """Per server and window: fingerprinted requests, those repeating one of their client's recent ones, and
    of those the ones whose earlier request failed (``after_failure``).

    The fingerprinted requests are counted as they are; only the fingerprints that repeat in the range have
    their requests put in time order (an array per fingerprint), each paired with the one before it: an
    array for every fingerprint, nearly all of one request, cost more than the rest of the query.
    """
    in_scope, scope_parameters = scope.condition()
    in_range, range_parameters = range_condition("req_start", "retries", TimeRange(
        windows.origin_ns, windows.analysed.end_ns).extended_back(retry_window_s))
    requests = (f"{store.table(REQUESTS_TABLE)}"
                f" WHERE {measures.IS_INFERENCE} AND body_fp != 0 AND {in_range} AND {in_scope}")

    def window(start_ns: str) -> str:
        return f"intDiv({start_ns} - {{origin_ns:Int64}}, {{window_ns:Int64}})"

    return store.query_df(
        f"""SELECT node, server_port, window, sum(fingerprinted) AS fingerprinted, sum(retries) AS retries,
                   sum(after_failure) AS after_failure
            FROM (
                SELECT node, server_port, {window("toUnixTimestamp64Nano(req_start)")} AS window,
                       count() AS fingerprinted, 0 AS retries, 0 AS after_failure
                FROM {requests} AND req_start >= fromUnixTimestamp64Nano({{origin_ns:Int64}}, 'UTC')
                GROUP BY node, server_port, window
                UNION ALL
                SELECT request.2 AS node, request.3 AS server_port, {window("request.1")} AS window,
                       0 AS fingerprinted,
                       countIf(previous_ns > 0 AND request.1 - previous_ns <= {{retry_ns:Int64}}) AS retries,
                       countIf(previous_ns > 0 AND request.1 - previous_ns <= {{retry_ns:Int64}}
                               AND previous_failed) AS after_failure
                FROM (
                    SELECT arraySort(groupArray((toUnixTimestamp64Nano(req_start), node, server_port,
                                                 {measures.FAILED}))) AS requests,
                           arrayPushFront(arrayPopBack(arrayMap(earlier -> earlier.1, requests)), 0) AS previous,
                           arrayPushFront(arrayPopBack(arrayMap(earlier -> earlier.4, requests)), 0)
                               AS previous_failures
                    FROM {requests}
                      AND {_FINGERPRINT} IN (SELECT {_FINGERPRINT} FROM {requests}
                                             GROUP BY {_FINGERPRINT} HAVING count() > 1)
                    GROUP BY {_FINGERPRINT}
                )
                ARRAY JOIN requests AS request, previous AS previous_ns, previous_failures AS previous_failed
                WHERE request.1 >= {{origin_ns:Int64}}
                GROUP BY node, server_port, window
            )
            GROUP BY node, server_port, window""",
        {**range_parameters, **scope_parameters, **_bucket_parameters(windows),
         "retry_ns": int(retry_window_s * NS_PER_S)},
    )


def _gpu_buckets(store: Store, windows: Windows, scope: Scope) -> pd.DataFrame:
    """Per server, GPU device and sub-bucket: mean memory used / total and mean utilization."""
    span = TimeRange(windows.base_ns, windows.analysed.end_ns)
    any_samples, any_parameters = range_condition("ts", "gpu_any", span)
    # Most servers have no GPU sampled (no NVML, no dcgm-exporter): one look at the small samples table
    # spares reading the range's requests for their pids.
    if not store.query_rows(f"SELECT 1 FROM {store.table(GPU_SAMPLES_TABLE)} WHERE {any_samples} LIMIT 1",
                            any_parameters):
        return pd.DataFrame()
    samples_in_range, sample_parameters = range_condition("g.ts", "gpu", span)
    requests_in_range, request_parameters = range_condition("req_start", "gpu_requests", span)
    in_scope, scope_parameters = scope.condition()
    mapping_scope, mapping_parameters = scope.condition(with_model=False)
    total = "coalesce(g.mem_total_bytes, g.mem_used_bytes + g.mem_free_bytes + ifNull(g.mem_reserved_bytes, 0))"
    return store.query_df(
        f"""WITH devices AS (
                SELECT DISTINCT m.node AS node, p.server_port AS server_port, m.device_id AS device_id
                FROM {store.table(SERVER_GPUS_TABLE)} AS m
                INNER JOIN (SELECT DISTINCT node, pid, server_port FROM {store.table(REQUESTS_TABLE)}
                            WHERE {requests_in_range} AND {in_scope}) AS p
                    ON m.node = p.node AND m.pid = p.pid
                WHERE m.source = 'nvml'
                UNION DISTINCT
                SELECT DISTINCT node, server_port, device_id FROM {store.table(SERVER_GPUS_TABLE)}
                WHERE source = 'config' AND server_port != 0 AND {mapping_scope}
            )
            SELECT d.node AS node, d.server_port AS server_port, d.device_id AS device_id,
                   {_bucket_sql('toUnixTimestamp64Nano(g.ts)')} AS bucket,
                   avg(g.mem_used_bytes / nullIf({total}, 0)) AS memory_used,
                   avg(g.gpu_util_pct) AS util_pct
            FROM {store.table(GPU_SAMPLES_TABLE)} AS g
            INNER JOIN devices AS d ON g.node = d.node AND g.device_id = d.device_id
            WHERE {samples_in_range}
            GROUP BY node, server_port, device_id, bucket""",
        {**sample_parameters, **request_parameters, **scope_parameters, **mapping_parameters,
         **_bucket_parameters(windows)},
    )


def _engine_buckets(store: Store, windows: Windows, scope: Scope) -> pd.DataFrame:
    in_range, range_parameters = range_condition("ts", "engine", TimeRange(windows.base_ns, windows.analysed.end_ns))
    in_scope, scope_parameters = scope.condition(with_model=False)
    return store.query_df(
        f"""SELECT node, server_port, {_bucket_sql('toUnixTimestamp64Nano(ts)')} AS bucket,
                   avg(requests_waiting) AS waiting, avg(kv_cache_usage) AS kv_mean, max(kv_cache_usage) AS kv_max,
                   min(preemptions_total) AS preemptions_first, max(preemptions_total) AS preemptions_last
            FROM {store.table(ENGINE_SAMPLES_TABLE)}
            WHERE {in_range} AND {in_scope}
            GROUP BY node, server_port, bucket""",
        {**range_parameters, **scope_parameters, **_bucket_parameters(windows)},
    )


def state_of(value: float | None, warn: float | None, crit: float | None, comparison: str) -> str:
    """The verdict on ``value`` against its thresholds; ``comparison`` says which side is bad."""
    if value is None:
        return NO_DATA
    worse = (lambda limit: value > limit) if comparison == ABOVE else (lambda limit: value < limit)
    if crit is not None and worse(crit):
        return CRIT
    if warn is not None and worse(warn):
        return WARN
    return OK


def _mean(values: np.ndarray, weights: np.ndarray) -> float | None:
    present = ~np.isnan(values)
    if not present.any() or weights[present].sum() <= 0:
        return None
    return float(np.average(values[present], weights=weights[present]))


def _pct(ratio: float) -> str:
    return f"{ratio:.0%}"


class _ServerJudge:
    """Turns one server's data into its cells, window by window."""

    def __init__(self, server: tuple[str, int], windows: Windows, data: _MatrixData, thresholds: Thresholds,
                 capacity: Capacity):
        self.node, self.port = server
        self.windows, self.thresholds, self.capacity = windows, thresholds, capacity
        self.seconds = windows.bucket_seconds()
        occupancy, engine = data.rows_of("occupancy", server), data.rows_of("engine", server)
        self.in_flight = data.series(occupancy, "in_flight_s", 0.0) / self.seconds
        self.queued = data.series(occupancy, "queued_s", 0.0) / self.seconds
        self.running = data.series(occupancy, "running_s", 0.0) / self.seconds
        self.waiting = data.series(engine, "waiting", np.nan)
        self.kv_mean = data.series(engine, "kv_mean", np.nan)
        self.kv_max = data.series(engine, "kv_max", np.nan)
        self.preempt_first = data.series(engine, "preemptions_first", np.nan)
        self.preempt_last = data.series(engine, "preemptions_last", np.nan)
        self.stats = self._per_window(data.rows_of("stats", server))
        self.retries = self._per_window(data.rows_of("retries", server))
        gpu = data.rows_of("gpu", server)
        self.devices = {} if gpu.empty else {
            device: (data.series(rows, "memory_used", np.nan), data.series(rows, "util_pct", np.nan))
            for device, rows in gpu.groupby("device_id", sort=True, observed=True)
        }

    @staticmethod
    def _per_window(rows: pd.DataFrame) -> dict[int, pd.Series]:
        return {int(row["window"]): row for _, row in rows.iterrows()}

    def active(self, window: int) -> bool:
        buckets = self.windows.bucket_slice(window)
        return bool(
            window in self.stats or self.in_flight[buckets].any()
            or any(not np.isnan(memory[buckets]).all() for memory, _ in self.devices.values())
            or not np.isnan(self.waiting[buckets]).all()
        )

    def cells(self, window: int) -> list[Cell]:
        start, end = self.windows.bounds(window)
        buckets = self.windows.bucket_slice(window)
        weights = self.seconds[buckets]
        stats = self.stats.get(window)

        def cell(name: str, value: float | None, warn: float | None, crit: float | None, explanation: str,
                 device: str = "", state: str | None = None) -> Cell:
            """A cell judged by its thresholds, unless the indicator states its own ``state``."""
            state = state or state_of(value, warn, crit, INDICATORS_BY_NAME[name].comparison)
            return Cell(start, end, self.node, self.port, device, name, value, state, warn, crit, explanation)

        cells = self._gpu_cells(cell, buckets, weights)
        cells.append(self._batch_fill(cell, buckets, weights))
        cells.append(self._queue_wait(cell, stats))
        cells.append(self._kv_cache(cell, buckets, weights))
        cells.append(self._decay(cell, stats))
        cells.append(self._tpot_trend(cell, window))
        cells.append(self._stalls(cell, stats))
        cells.append(self._retry_storm(cell, self.retries.get(window)))
        cells.append(self._knee_proximity(cell, buckets, weights))
        return cells

    # -- one method per indicator; each returns a Cell built by ``cell``

    def _gpu_cells(self, cell, buckets: slice, weights: np.ndarray) -> list[Cell]:
        t = self.thresholds
        if not self.devices:
            why = "no GPU samples mapped to this server (NVML or dcgm-exporter, and server_gpus)"
            return [cell("gpu_memory_pressure", None, t.gpu_memory_warn, t.gpu_memory_crit, why),
                    cell("fragmentation", None, 0.0, t.fragmentation_sustain_s, why)]
        cells = []
        for device, (memory, util) in self.devices.items():
            used = _mean(memory[buckets], weights)
            if used is None:
                explanation = "no GPU samples in this window"
            elif used > t.gpu_memory_crit:
                explanation = (f"GPU memory {_pct(used)} used (crit > {_pct(t.gpu_memory_crit)}): allocations "
                               "may fail and the engine preempt; shed load or give the model more memory")
            elif used > t.gpu_memory_warn:
                explanation = (f"GPU memory {_pct(used)} used (warn > {_pct(t.gpu_memory_warn)}): little room "
                               "left for the KV cache to grow; watch batch fill and preemptions")
            else:
                explanation = f"GPU memory {_pct(used)} used"
            cells.append(cell("gpu_memory_pressure", used, t.gpu_memory_warn, t.gpu_memory_crit, explanation,
                              device))
            cells.append(self._fragmentation(cell, device, memory, util, buckets))
        return cells

    def _fragmentation(self, cell, device: str, memory: np.ndarray, util: np.ndarray, buckets: slice) -> Cell:
        t = self.thresholds
        queue = np.where(np.isnan(self.waiting), self.queued, self.waiting)
        holds = (memory > t.fragmentation_memory) & (queue > t.fragmentation_queue) & (util < t.fragmentation_util_pct)
        if np.isnan(memory[buckets]).all():
            return cell("fragmentation", None, 0.0, t.fragmentation_sustain_s, "no GPU samples in this window",
                        device)
        # seconds the condition has held without a break, up to the window's last sub-bucket
        held = 0.0
        for index in range(buckets.stop - 1, -1, -1):
            if not holds[index]:
                break
            held += self.seconds[index]
        state = CRIT if held >= t.fragmentation_sustain_s else WARN if held > 0 else OK
        if state == CRIT:
            explanation = (f"memory over {_pct(t.fragmentation_memory)} used, over {t.fragmentation_queue:g} "
                           f"requests queued and the GPU under {t.fragmentation_util_pct:g}% busy for {held:.0f} s: "
                           "memory is held but not used (fragmented KV cache?); restart the engine or lower "
                           "max-model-len / block size")
        elif state == WARN:
            explanation = (f"memory full, queue long and GPU idle for {held:.0f} s: fragmentation suspected if it "
                           f"lasts {t.fragmentation_sustain_s:.0f} s")
        else:
            explanation = "no sign of fragmentation (memory full with a long queue on an idle GPU)"
        return cell("fragmentation", held, 0.0, t.fragmentation_sustain_s, explanation, device, state)

    def _batch_fill(self, cell, buckets: slice, weights: np.ndarray) -> Cell:
        t = self.thresholds
        slots = self.capacity.slots
        if slots is None:
            return cell("batch_fill", None, t.batch_fill_warn, None,
                        "server's slot count unknown: no engine metrics and no knee seen yet")
        count, source = slots
        running = _mean(self.running[buckets], weights) or 0.0
        queued = _mean(self.queued[buckets], weights) or 0.0
        fill = running / count
        # Only a low fill while requests queue is wrong: at light load spare slots are expected.
        starved = fill < t.batch_fill_warn and queued >= t.batch_queue_min
        if starved:
            explanation = (f"batch {_pct(fill)} full ({running:.1f} of {count:.1f} slots by {source}) while "
                           f"{queued:.1f} requests queue: the engine leaves room unused (KV cache or scheduler "
                           "limit?)")
        elif fill >= t.batch_fill_ok:
            explanation = f"batch {_pct(fill)} full ({running:.1f} of {count:.1f} slots by {source})"
        else:
            explanation = (f"batch {_pct(fill)} full ({running:.1f} of {count:.1f} slots by {source}); "
                           "no queue, so spare room is fine")
        return cell("batch_fill", fill, t.batch_fill_warn, None, explanation, state=WARN if starved else OK)

    def _queue_wait(self, cell, stats: pd.Series | None) -> Cell:
        t = self.thresholds
        if stats is None or not stats["split"]:
            why = ("no requests arrived in this window" if stats is None else
                   "queue and prefill not split: no prefill calibration yet (needs requests to an idle server), "
                   "or one too poor to split with")
            return cell("queue_wait_p95", None, t.queue_wait_p95_warn_ms, t.queue_wait_p95_crit_ms, why)
        p95 = float(stats["queue_p95_ms"])
        if p95 > t.queue_wait_p95_crit_ms:
            explanation = (f"p95 queue wait {p95:.0f} ms (crit > {t.queue_wait_p95_crit_ms:.0f} ms): requests "
                           "wait for a slot; add replicas or throttle")
        elif p95 > t.queue_wait_p95_warn_ms:
            explanation = (f"p95 queue wait {p95:.0f} ms (warn > {t.queue_wait_p95_warn_ms:.0f} ms): slots are "
                           "running out")
        else:
            explanation = f"p95 queue wait {p95:.0f} ms"
        return cell("queue_wait_p95", p95, t.queue_wait_p95_warn_ms, t.queue_wait_p95_crit_ms, explanation)

    def _kv_cache(self, cell, buckets: slice, weights: np.ndarray) -> Cell:
        t = self.thresholds
        usage = _mean(self.kv_mean[buckets], weights)
        if usage is None:
            return cell("kv_cache_usage", None, t.kv_cache_warn, t.kv_cache_crit,
                        "the engine exports no KV-cache usage (or no engine metrics are scraped)")
        peak = float(np.nanmax(self.kv_max[buckets]))
        preempted = np.nanmax(self.preempt_last[buckets]) - np.nanmin(self.preempt_first[buckets]) \
            if not np.isnan(self.preempt_last[buckets]).all() else 0.0
        explanation = f"engine KV cache {_pct(usage)} used on average, {_pct(peak)} at peak"
        if preempted > 0:
            explanation += f"; {preempted:.0f} preemptions"
        if usage > t.kv_cache_warn:
            explanation += ": sequences will be evicted and recomputed; lower max-num-seqs or context length"
        return cell("kv_cache_usage", usage, t.kv_cache_warn, t.kv_cache_crit, explanation)

    def _decay(self, cell, stats: pd.Series | None) -> Cell:
        t = self.thresholds
        if stats is None or not stats["long_streams"]:
            return cell("token_rate_decay", None, t.decay_warn, t.decay_crit,
                        f"no streams of {t.long_stream_events}+ token events in this window")
        ratio = float(stats["decode_rate_ratio_p50"])
        explanation = (f"decode rate in the last quarter of long streams is {_pct(ratio)} of the first "
                       f"({int(stats['long_streams'])} streams)")
        if ratio < t.decay_warn:
            explanation += ": generation slows as streams grow (KV pressure, long contexts, preemption)"
        return cell("token_rate_decay", ratio, t.decay_warn, t.decay_crit, explanation)

    def _tpot_trend(self, cell, window: int) -> Cell:
        t = self.thresholds
        span = range(max(0, window - t.tpot_trend_windows + 1), window + 1)
        points = [(index, float(self.stats[index]["tpot_p50_ms"])) for index in span
                  if index in self.stats and not np.isnan(self.stats[index]["tpot_p50_ms"])]
        if len(points) < 3:
            return cell("tpot_trend", None, t.tpot_trend_warn, t.tpot_trend_crit,
                        "fewer than 3 windows with TPOT to draw a trend through")
        x, y = np.array(points).T
        fit = theil_sen(x, y)
        median = float(np.median(y))
        rise = float(fit.slope * (x[-1] - x[0]) / median) if median > 0 else 0.0
        explanation = f"TPOT p50 {'rose' if rise >= 0 else 'fell'} {abs(rise):.0%} over the last {len(points)} windows"
        if rise > t.tpot_trend_warn:
            explanation += f" (now {y[-1]:.1f} ms): decoding is slowing; check batch size, preemptions, GPU clocks"
        return cell("tpot_trend", rise, t.tpot_trend_warn, t.tpot_trend_crit, explanation)

    def _stalls(self, cell, stats: pd.Series | None) -> Cell:
        t = self.thresholds
        if stats is None or not stats["total_gaps"]:
            return cell("stall_rate", None, t.stall_rate_warn, t.stall_rate_crit,
                        "no inter-token gaps in this window")
        rate = float(stats["total_stalls"]) / float(stats["total_gaps"])
        explanation = (f"{rate:.1%} of inter-token gaps are stalls (over {t.stall_factor:g}x their stream's "
                       "median gap)")
        if rate > t.stall_rate_warn:
            explanation += ": streams pause mid-generation (preemption, GC, a slow reader holding the socket)"
        return cell("stall_rate", rate, t.stall_rate_warn, t.stall_rate_crit, explanation)

    def _retry_storm(self, cell, retries: pd.Series | None) -> Cell:
        t = self.thresholds
        if retries is None or not retries["fingerprinted"]:
            return cell("retry_storm", None, t.retry_rate_warn, t.retry_rate_crit,
                        "no fingerprinted requests in this window")
        share = float(retries["retries"]) / float(retries["fingerprinted"])
        explanation = (f"{share:.1%} of requests repeat one from the same client within "
                       f"{t.retry_window_s:.0f} s")
        if retries.get("after_failure"):
            explanation += f" ({int(retries['after_failure'])} of them after that request failed)"
        if share > t.retry_rate_warn:
            explanation += ": clients are retrying (timeouts?), adding load; make them back off or fix the cause"
        return cell("retry_storm", share, t.retry_rate_warn, t.retry_rate_crit, explanation)

    def _knee_proximity(self, cell, buckets: slice, weights: np.ndarray) -> Cell:
        t = self.thresholds
        knee = self.capacity.knee
        if knee is None:
            return cell("knee_proximity", None, t.knee_proximity_warn, t.knee_proximity_crit,
                        "no knee seen yet: the server has not been loaded past its capacity")
        concurrency, source = knee
        in_flight = _mean(self.in_flight[buckets], weights) or 0.0
        proximity = in_flight / concurrency
        explanation = f"{in_flight:.1f} requests in flight on average, {source} at {concurrency:.1f}"
        if proximity > t.knee_proximity_crit:
            explanation += ": past the knee, every extra request adds queueing; throttle or scale out"
        elif proximity > t.knee_proximity_warn:
            explanation += ": close to the knee, where latency turns steep"
        return cell("knee_proximity", proximity, t.knee_proximity_warn, t.knee_proximity_crit, explanation)
