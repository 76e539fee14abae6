"""GPU and engine samples: their rows, their Arrow batches, and the threads that take them.

The tables (``gpu_samples``, ``engine_samples``, ``server_gpus``) are declared
in ``contract.samples``.

Time. The probes stamp CLOCK_MONOTONIC (``bpf_ktime_get_ns``); the agent's
``MonotonicWallClock`` adds one measured offset, wall − monotonic, to turn
that into Unix-epoch ns. Samples are stamped the same way: read
``time.monotonic_ns()`` just before the device or page is read, then map it
through the same clock object. A request and a sample taken at the same
instant therefore carry the same ``DateTime64(9)`` value, and a step of the
wall clock (NTP, an operator) moves both alike until the offset is re-measured.

``SamplerSet`` runs each source on a thread of its own (NVML at 10 Hz by
default, each dcgm-exporter and engine page every second) and one writer
thread that inserts batches every few seconds. It never takes the agent down:
every failure is counted by kind, logged the first time that kind occurs, and
sampling goes on.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import pyarrow as pa

from ...contract.samples import (
    ENGINE_SAMPLES,
    ENGINE_SAMPLES_COLUMNS,
    ENGINE_SAMPLES_TABLE,
    GPU_SAMPLES,
    GPU_SAMPLES_COLUMNS,
    GPU_SAMPLES_TABLE,
    SERVER_GPUS,
    SERVER_GPUS_COLUMNS,
    SERVER_GPUS_TABLE,
)
from ...contract.tables import Table
from .dcgm import DcgmScraper
from .engine_metrics import EngineReading, EngineScraper
from .gpu import GpuReading, NvmlSampler, SamplerProblem, ServerGpu, ServerGpuMap
from .prom_text import ScrapeError

log = logging.getLogger(__name__)

# --- Arrow batches ------------------------------------------------------------------------------


def gpu_row(reading: GpuReading, node: str) -> dict:
    row = {column.name: getattr(reading, column.name, None) for column in GPU_SAMPLES_COLUMNS}
    row.update(
        ts=reading.ts_ns,
        node=node,
        process_pids=[process.pid for process in reading.processes],
        process_mem_bytes=[process.used_bytes for process in reading.processes],
    )
    return row


def engine_row(reading: EngineReading, node: str) -> dict:
    row = {column.name: getattr(reading, column.name, None) for column in ENGINE_SAMPLES_COLUMNS}
    row.update(ts=reading.ts_ns, node=node)
    return row


# A process's pod fields (agent/identity/: namespace, pod, container, …) by its pid.
PodOf = Callable[[int], Mapping[str, str]]


def server_gpu_row(entry: ServerGpu, ts_ns: int, node: str, pod_of: PodOf | None = None) -> dict:
    """A server_gpus row; ``pod_of`` names the pod and container of an NVML-seen process (empty fields
    for a configured port, outside containers, or without it)."""
    row = {column.name: getattr(entry, column.name, None) for column in SERVER_GPUS_COLUMNS}
    pod = pod_of(entry.pid) if pod_of is not None and entry.pid else {}
    row.update(ts=ts_ns, node=node, **{name: pod.get(name, "") for name in ("namespace", "pod", "container")})
    return row


def gpu_samples_arrow(readings: Iterable[GpuReading], node: str) -> pa.Table:
    return GPU_SAMPLES.arrow( [gpu_row(reading, node) for reading in readings])


def engine_samples_arrow(readings: Iterable[EngineReading], node: str) -> pa.Table:
    return ENGINE_SAMPLES.arrow( [engine_row(reading, node) for reading in readings])


def server_gpus_arrow(entries: Iterable[ServerGpu], ts_ns: int, node: str) -> pa.Table:
    return SERVER_GPUS.arrow( [server_gpu_row(entry, ts_ns, node) for entry in entries])


# --- the sampling threads -----------------------------------------------------------------------


class WallClock(Protocol):
    """Maps CLOCK_MONOTONIC ns to Unix-epoch ns (``capture.kernel.clock.MonotonicWallClock``)."""

    def to_wall_ns(self, mono_ns: int) -> int: ...


class ArrowStore(Protocol):
    def insert_arrow(self, table: str, arrow_table: pa.Table) -> object: ...


_TABLES: dict[str, Table] = {table.name: table for table in (GPU_SAMPLES, ENGINE_SAMPLES, SERVER_GPUS)}


class SamplerSet:
    """Runs the GPU and engine samplers in background threads and writes their rows to the store.

    ``nvml`` is None to leave NVML out; when NVML cannot start (no driver, no
    GPU) the reason is logged once, in plain words, and kept in
    ``nvml_status``; everything else runs on. ``gpu_map`` turns GPU readings
    into ``server_gpus`` rows. Rows are held in memory between flushes; if the
    store refuses them they are kept for the next flush, up to about
    ``max_buffered_rows`` per table, and the oldest beyond that are dropped
    and counted.

    A flush costs an embedded store about 10 ms of CPU for the GPU and engine
    tables whatever they hold, so the writer flushes every
    ``flush_interval_s`` (5 s: 2.4 ms a second where every 2 s took 5.3,
    ``bench_store_writes --samplers``), and the agent's live analysis calls
    ``flush()`` before each pass, which thus reads every sample taken up to it.
    """

    def __init__(
        self,
        store: ArrowStore,
        node: str,
        clock: WallClock,
        *,
        nvml: NvmlSampler | None = None,
        nvml_hz: float = 10.0,
        dcgm: Sequence[DcgmScraper] = (),
        engines: Sequence[EngineScraper] = (),
        scrape_interval_s: float = 1.0,
        gpu_map: ServerGpuMap | None = None,
        map_refresh_s: float = 60.0,
        flush_interval_s: float = 5.0,
        max_buffered_rows: int = 200_000,
        pod_of: PodOf | None = None,
    ) -> None:
        if nvml_hz <= 0 or scrape_interval_s <= 0 or flush_interval_s <= 0 or map_refresh_s <= 0:
            raise ValueError("sampling rate and intervals must be positive")
        self._store = store
        self._node = node
        self._clock = clock
        self._nvml = nvml
        self._nvml_interval_s = 1.0 / nvml_hz
        self._dcgm = list(dcgm)
        self._engines = list(engines)
        self._scrape_interval_s = scrape_interval_s
        self._gpu_map = gpu_map or ServerGpuMap()
        self._pod_of = pod_of
        self._map_refresh_ns = int(map_refresh_s * 1e9)
        self._map_written_at_ns: int | None = None
        self._flush_interval_s = flush_interval_s
        self._max_buffered_rows = max_buffered_rows

        self._lock = threading.Lock()
        self._buffers: dict[str, list[pa.Table]] = {table: [] for table in _TABLES}
        self._buffered_rows: Counter[str] = Counter()
        self._latest_gpu_readings: dict[str, list[GpuReading]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._errors: Counter[str] = Counter()
        self._rows_written: Counter[str] = Counter()
        self._rows_dropped: Counter[str] = Counter()
        self._write_cpu_s = 0.0  # what the flushes took, on whichever thread called them
        self.nvml_status = "not used"

    # -- lifecycle

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("SamplerSet already started")
        if self._nvml is not None:
            why_not = self._nvml.start()
            if why_not is None:
                self.nvml_status = "sampling"
                self._spawn("nvml", self._nvml_interval_s, functools.partial(self._nvml_tick, self._nvml))
            else:
                self.nvml_status = why_not
                log.warning("%s", why_not)
                self._nvml = None
        for scraper in self._dcgm:
            self._spawn(f"dcgm {scraper.url}", self._scrape_interval_s, functools.partial(self._dcgm_tick, scraper))
        for scraper in self._engines:
            self._spawn(f"engine {scraper.url}", self._scrape_interval_s, functools.partial(self._engine_tick, scraper))
        self._spawn("writer", self._flush_interval_s, self.flush)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every thread, write what is buffered, and release NVML."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()
        self.flush()
        if self._nvml is not None:
            self._nvml.close()

    def stats(self) -> dict:
        with self._lock:
            return {
                "nvml": self.nvml_status,
                "rows_written": dict(self._rows_written),
                "rows_dropped": dict(self._rows_dropped),
                "errors": dict(self._errors),
                "write_cpu_s": self._write_cpu_s,
            }

    # -- one tick of each source

    def _now_wall_ns(self) -> int:
        return self._clock.to_wall_ns(time.monotonic_ns())

    def _nvml_tick(self, nvml: NvmlSampler) -> None:
        result = nvml.read(self._now_wall_ns())
        self._report_problems(result.problems)
        self._add_gpu_readings("nvml", result.readings)

    def _dcgm_tick(self, scraper: DcgmScraper) -> None:
        try:
            result = scraper.read(self._now_wall_ns())
        except ScrapeError as error:
            self._report(f"dcgm {scraper.url}: unreachable", str(error))
            return
        self._report_problems(result.problems, prefix=f"{scraper.url}: ")
        self._add_gpu_readings(f"dcgm {scraper.url}", result.readings)

    def _engine_tick(self, scraper: EngineScraper) -> None:
        try:
            reading = scraper.read(self._now_wall_ns())
        except ScrapeError as error:
            self._report(f"engine {scraper.url}: unreachable", str(error))
            return
        for problem in reading.problems:
            self._report(
                f"engine {scraper.url}: unreadable line",
                f"{scraper.url} line {problem.line_number} skipped: {problem.reason}",
            )
        if reading.engine == "unknown":
            self._report(
                f"engine {scraper.url}: unknown", f"{scraper.url} shows no vLLM, SGLang, TGI or llama.cpp series"
            )
        self._buffer(ENGINE_SAMPLES_TABLE, [engine_row(reading, self._node)])

    def _add_gpu_readings(self, source: str, readings: list[GpuReading]) -> None:
        self._buffer(GPU_SAMPLES_TABLE, [gpu_row(reading, self._node) for reading in readings])
        with self._lock:
            self._latest_gpu_readings[source] = readings
            every_source = [reading for latest in self._latest_gpu_readings.values() for reading in latest]
            changed = self._gpu_map.observe(every_source)
            # Judge the configuration only once every GPU source has answered.
            gpu_sources = (1 if self._nvml is not None else 0) + len(self._dcgm)
            unresolved = self._gpu_map.unresolved() if len(self._latest_gpu_readings) == gpu_sources else []
            ts_ns = max((reading.ts_ns for reading in readings), default=self._now_wall_ns())
            due = self._map_written_at_ns is None or ts_ns - self._map_written_at_ns >= self._map_refresh_ns
            rows = []
            if changed or due:
                self._map_written_at_ns = ts_ns
                rows = [server_gpu_row(entry, ts_ns, self._node, self._pod_of) for entry in self._gpu_map.entries()]
        for port, reference in unresolved:
            self._report(
                f"gpu configuration: port {port} -> {reference} not found",
                f"GPU {reference!r}, configured for port {port}, is not among the GPUs sampled on this node;"
                " requests on that port get no GPU state from it",
            )
        self._buffer(SERVER_GPUS_TABLE, rows)

    # -- writing

    def _buffer(self, table: str, rows: list[dict]) -> None:
        """Convert one tick's rows to Arrow now, so a row that does not fit costs only its own tick."""
        if not rows:
            return
        try:
            batch = _TABLES[table].arrow(rows)
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as error:
            with self._lock:
                self._rows_dropped[table] += len(rows)
            self._report(f"{table}: rows that do not fit", f"{len(rows)} {table} rows dropped, not fitting: {error}")
            return
        self._queue(table, batch)

    def _queue(self, table: str, batch: pa.Table, *, retry: bool = False) -> None:
        """Hold a batch for the next flush; ``retry`` puts one the store refused back in front (it is oldest)."""
        with self._lock:
            queue = self._buffers[table]
            if retry:
                queue.insert(0, batch)
            else:
                queue.append(batch)
            self._buffered_rows[table] += batch.num_rows
            dropped = 0
            while self._buffered_rows[table] > self._max_buffered_rows and len(queue) > 1:
                oldest = queue.pop(0)
                self._buffered_rows[table] -= oldest.num_rows
                dropped += oldest.num_rows
            self._rows_dropped[table] += dropped
        if dropped:
            self._report(f"{table}: buffer full", f"{table}: the store is behind; the oldest rows are being dropped")

    def flush(self) -> None:
        """Insert every buffered row now (the writer thread calls this every flush interval, the live
        analysis before each pass)."""
        started = time.thread_time()
        for table in _TABLES:
            with self._lock:
                batches, self._buffers[table] = self._buffers[table], []
                self._buffered_rows[table] = 0
            if not batches:
                continue
            batch = pa.concat_tables(batches)
            try:
                self._store.insert_arrow(table, batch)
            except Exception as error:  # the store may be down or full: keep the rows, try again later
                self._report(f"store insert into {table}: {type(error).__name__}", f"{table}: {error}")
                self._queue(table, batch, retry=True)
                continue
            with self._lock:
                self._rows_written[table] += batch.num_rows
        with self._lock:
            self._write_cpu_s += time.thread_time() - started

    # -- threads and error reporting

    def _spawn(self, name: str, interval_s: float, tick: Callable[[], None]) -> None:
        thread = threading.Thread(target=self._run, args=(name, interval_s, tick), name=f"sampler {name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self, name: str, interval_s: float, tick: Callable[[], None]) -> None:
        """Call ``tick`` every ``interval_s`` on a fixed cadence until stopped; survive anything it raises."""
        interval_ns = int(interval_s * 1e9)
        next_ns = time.monotonic_ns()
        while not self._stop.is_set():
            try:
                tick()
            except Exception as error:  # a sampler bug must not end sampling, nor the agent
                self._report(f"{name}: {type(error).__name__}", f"{name} failed: {error!r}")
            next_ns += interval_ns
            now_ns = time.monotonic_ns()
            if next_ns < now_ns:  # fell behind (slow device, loaded machine): skip, don't burst
                next_ns = now_ns
            self._stop.wait((next_ns - now_ns) / 1e9)

    def _report_problems(self, problems: Iterable[SamplerProblem], prefix: str = "") -> None:
        for problem in problems:
            self._report(prefix + problem.kind, problem.message)

    def _report(self, kind: str, message: str) -> None:
        with self._lock:
            self._errors[kind] += 1
            first = self._errors[kind] == 1
        if first:
            log.warning("%s (reported once; further occurrences are counted)", message)
