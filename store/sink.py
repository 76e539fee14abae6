"""The agent's batched sink of request rows: never blocks the caller, spools through outages."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError
from clickhouse_connect.driver.exceptions import Error as ClickHouseError

from ..contract.requests import REQUEST_COLUMN_TYPES, REQUESTS_TABLE
from .client import TRANSIENT_ERROR_CODES, Store, StoreUnavailable
from .embedded import open_store
from .rows import RowSchema
from .spool import DEFAULT_MAX_BYTES, Spool, UnreadableSpoolFile, new_batch_token
from .url import StoreURL, parse_store_url

logger = logging.getLogger(__name__)

EMBEDDED_SPOOL_DIR = ".tokenprobe-spool"
DEFAULT_SPOOL_DIR = Path("~/.cache/tokenprobe/spool")
# Rows held in memory while the store is slow, by estimated size: past this they are spooled.
DEFAULT_MAX_PENDING_BYTES = 64 << 20
# Overflows put() hands to the spooling thread, the one it is writing included: past this many (the disk
# slower than the rows come) a further overflow is dropped and counted as lost rather than held or
# waited for, so put() never blocks on the disk and memory stays bounded.
MAX_OVERFLOWS_WAITING = 2
# What a request row costs in memory besides its token offsets (dict, strings, timestamps).
_ROW_BYTES = 1200
_OFFSET_BYTES = 32  # one token offset: an int object plus its list slot


def _estimated_bytes(row: Mapping) -> int:
    return _ROW_BYTES + _OFFSET_BYTES * len(row.get("token_offsets_us") or ())


@dataclass(frozen=True)
class SinkStats:
    """The sink's counters. Every row put is in exactly one of: written, pending, spooled, rejected, lost."""

    rows_written: int
    rows_pending: int
    rows_spooled: int
    rows_rejected: int
    rows_lost: int
    inserts: int
    last_error: str | None
    # Rows the bounded spool dropped (oldest first) since it was created, across restarts.
    spool_dropped_rows: int = 0
    spool_bytes: int = 0
    # CPU the writer thread took delivering batches (Arrow conversion, inserts: an embedded store's own
    # work on them, its views included, runs on this thread), in seconds.
    cpu_s: float = 0.0


def _is_transient(error: Exception) -> bool:
    """Whether a failed insert may succeed later, as opposed to the batch itself being refused."""
    if isinstance(error, UnreadableSpoolFile):
        return False
    if isinstance(error, OperationalError):
        return True
    if isinstance(error, DatabaseError):
        return error.code in TRANSIENT_ERROR_CODES
    if isinstance(error, ClickHouseError):
        return False  # the client judged the request itself wrong
    # Outages (StoreUnavailable, OSError) and anything unexpected: keep the data and retry.
    return True


class RequestSink:
    """The agent's batched, outage-proof writer of request rows.

    ``put(row)`` checks the row (ValueError for a bad one) and queues it
    without waiting on the store. A background thread inserts a batch every
    ``flush_interval`` seconds, or as soon as ``batch_rows`` rows are queued
    (an insert costs chDB 8-10 ms of CPU whatever it holds: every 2 s rather
    than every 1 s took the writer from 27 to 19 ms a second at 10k token
    events/s, bench_store_writes).
    Batches the store cannot take now go to an on-disk spool, replayed oldest
    first once it answers again (retries back off from ``retry_min_s`` to
    ``retry_max_s``); if the store stalls and ``max_pending_rows`` rows (or
    about ``max_pending_bytes``) pile up in memory, ``put`` hands them to a
    spooling thread of their own (the writer may be stuck in an insert) and
    returns: Arrow conversion and the disk write took the caller 670 ms at
    5,000 rows (issue 35), the agent's capture loop stalled for it. At most
    ``MAX_OVERFLOWS_WAITING`` overflows are held for that thread (the one it
    writes included); one more is dropped and counted in ``rows_lost``.
    Batches the store refuses outright are kept in the spool's ``rejected/``
    folder. Every batch carries an insert deduplication token, kept in its
    spool file's name: a batch whose insert succeeded but whose answer was
    lost (or a replay interrupted by a crash) is sent again and dropped by the
    store, so rows are stored once. The spool holds at most
    ``spool_max_bytes``; past that its oldest batches are dropped and counted.

    Where the store lets it (an embedded store's ``requests``,
    ``Store.views_fed_apart``), a batch is inserted without running the
    store's materialized views, and the views are fed the batches of every
    ``views_every`` seconds in one insert, at close, and whenever
    ``feed_views()`` is called (the live analysis calls it before each pass).
    A feed costs the writer 60-120 ms of CPU whatever it holds (chDB plans four
    views and writes a part for each), so the default 30 s keeps it near 3 ms a
    second on a quiet node, and with the agent's live analysis every 30 s the
    views are fed once a window, as its pass asks. Nothing that reads them
    waits on that: the live analysis has them fed first, and the dashboard
    scans ``requests`` where the rollup does not count a window whole. A sink killed before that leaves those rows in ``requests`` without their
    rollups, ends and figures (the readers of the figures check them against
    ``requests`` and compute what is missing).

    ``store`` is an open Store (the caller keeps ownership) or a URL the sink
    opens itself, lazily and again after failures, and closes with the sink.
    """

    def __init__(
        self,
        store: Store | str,
        *,
        table: str = REQUESTS_TABLE,
        column_types: Mapping[str, str] = REQUEST_COLUMN_TYPES,
        spool_dir: str | Path | None = None,
        flush_interval: float = 2.0,
        batch_rows: int = 20_000,
        max_pending_rows: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        spool_max_bytes: int = DEFAULT_MAX_BYTES,
        retry_min_s: float = 1.0,
        retry_max_s: float = 30.0,
        views_every: float = 30.0,
    ):
        if flush_interval <= 0 or batch_rows < 1 or views_every <= 0:
            raise ValueError("flush_interval and views_every must be > 0 and batch_rows >= 1")
        self._store = store if isinstance(store, Store) else None
        self._store_url = None if isinstance(store, Store) else store
        target = store.target if isinstance(store, Store) else parse_store_url(store)
        self._table = table
        self._row_schema = RowSchema(column_types)
        self._flush_interval = flush_interval
        self._batch_rows = batch_rows
        self._max_pending_rows = max_pending_rows or 5 * batch_rows
        self._max_pending_bytes = max_pending_bytes
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._spool = Spool(Path(spool_dir).expanduser() if spool_dir else default_spool_dir(target) / table,
                            max_bytes=spool_max_bytes)

        # Guards the queue, the flags and the counters that both threads touch.
        self._condition = threading.Condition()
        self._queued: list[dict] = []
        self._queued_bytes = 0
        self._in_flight: list[dict] = []
        self._in_flight_token = ""
        self._closing = False
        self._abandoned = False
        self._retry_at = 0.0
        self._retry_delay = retry_min_s
        self._rows_written = 0
        self._rows_rejected = 0
        self._rows_lost = 0
        self._inserts = 0
        self._cpu_s = 0.0
        self._last_error: str | None = None
        # Batches inserted with their views left for later, grouped by the feed that takes them, each group
        # with its deduplication token (a group whose feed failed is retried as it was).
        self._views_every = views_every
        self._views_due = time.monotonic() + views_every
        self._unfed: list[pa.Table] = []
        self._unfed_groups: list[tuple[list[pa.Table], str]] = []
        self._feed_asked = False
        self._feeds = 0  # done by the writer thread: feed_views() waits for the next one
        # Every row put before this wall time is written, spooled, or counted lost or rejected.
        self._durable_until = time.time()
        # Handed to the spooling thread, not yet written: rows, token, wall time handed over.
        self._overflows: list[tuple[list[dict], str, float]] = []
        self._overflow_rows = 0
        self._watchers: list[Callable[[dict], None]] = []
        self._thread = threading.Thread(target=self._run, name=f"tokenprobe-sink-{table}", daemon=True)
        self._thread.start()
        self._spooler = threading.Thread(target=self._spool_overflows, name=f"tokenprobe-spool-{table}", daemon=True)
        self._spooler.start()

    # -- the caller's side ------------------------------------------------------

    def watch(self, watcher: Callable[[dict], None]) -> None:
        """Hand ``watcher`` every row ``put`` takes from now on, on the caller's thread (the agent's live
        analysis holds its requests so: ``analytics/held.py``). It must be quick and must not raise."""
        self._watchers.append(watcher)

    def put(self, row: dict) -> None:
        """Queue one row; never waits for the store nor the disk. ValueError if the row does not fit the table."""
        self._row_schema.check(row)
        overflow = None
        with self._condition:
            if self._closing:
                raise RuntimeError("RequestSink is closed")
            self._queued.append(row)
            self._queued_bytes += _estimated_bytes(row)
            if len(self._queued) >= self._max_pending_rows or self._queued_bytes >= self._max_pending_bytes:
                overflow, self._queued, self._queued_bytes = self._queued, [], 0
                if len(self._overflows) < MAX_OVERFLOWS_WAITING:
                    self._overflows.append((overflow, new_batch_token(), time.time()))
                    self._overflow_rows += len(overflow)
                    self._condition.notify_all()
                    overflow = None
            elif len(self._queued) >= self._batch_rows:
                self._condition.notify_all()  # all: one notify could wake a feed_views() caller, not the writer
        for watcher in self._watchers:
            watcher(row)
        if overflow:
            self._record_failure(f"lost {len(overflow)} rows: the store is slow and the disk too, "
                                 f"{MAX_OVERFLOWS_WAITING} overflows still wait to be spooled", lost=len(overflow))

    @property
    def rows_written(self) -> int:
        return self._rows_written

    @property
    def rows_spooled(self) -> int:
        return self._spool.rows

    @property
    def rows_pending(self) -> int:
        with self._condition:
            return len(self._queued) + len(self._in_flight) + self._overflow_rows

    @property
    def durable_until(self) -> float:
        """The wall time (s) before which every row put is written or spooled (or counted lost or
        rejected): what a crash now would not lose. The agent's heartbeat records it."""
        with self._condition:
            if not (self._queued or self._in_flight or self._overflows):
                return time.time()  # nothing put is waiting: all of it is durable now
            handed = self._overflows[0][2] if self._overflows else math.inf
            return min(self._durable_until, handed)

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def stats(self) -> SinkStats:
        with self._condition:
            return SinkStats(
                rows_written=self._rows_written,
                rows_pending=len(self._queued) + len(self._in_flight) + self._overflow_rows,
                rows_spooled=self._spool.rows,
                rows_rejected=self._rows_rejected,
                rows_lost=self._rows_lost,
                inserts=self._inserts,
                last_error=self._last_error,
                spool_dropped_rows=self._spool.dropped_rows,
                spool_bytes=self._spool.bytes,
                cpu_s=self._cpu_s,
            )

    def feed_views(self, timeout: float = 10.0) -> None:
        """Have the writer thread feed the store's views now (see the class docstring), and wait for it
        at most ``timeout`` seconds. The live analysis calls it before each pass."""
        with self._condition:
            if self._closing:
                return
            feeds, self._feed_asked = self._feeds, True
            self._condition.notify_all()
            self._condition.wait_for(lambda: self._feeds > feeds or self._closing, timeout)

    def close(self, timeout: float = 30.0) -> SinkStats:
        """Deliver or spool everything queued, stop, and return the final counts.

        If the store hangs past ``timeout``, rows still in memory (including a
        batch mid-insert, which may then also arrive) are spooled.
        """
        with self._condition:
            if self._closing:
                return self.stats()
            self._closing = True
            self._condition.notify_all()  # the writer thread and any feed_views() caller
        deadline = time.monotonic() + timeout
        self._spooler.join(timeout)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            with self._condition:
                self._abandoned = True
                # The batch mid-insert keeps its token: if that insert lands after all, its replay is dropped.
                leftovers = [(self._in_flight, self._in_flight_token), (self._queued, new_batch_token())]
                self._queued, self._in_flight, self._queued_bytes = [], [], 0
            logger.warning("store did not answer within %.0f s: spooling %d rows", timeout,
                           sum(len(rows) for rows, _ in leftovers))
            for rows, token in leftovers:
                if rows:
                    self._spool_rows(rows, token)
        elif self._store_url is not None and self._store is not None:
            self._store.close()
        with self._condition:  # the last feed failed, or the writer never got to it
            unfed = sum(map(len, self._unfed)) + sum(sum(map(len, tables)) for tables, _ in self._unfed_groups)
        if unfed:
            self._record_failure(f"{unfed} rows stored in {self._table} without their views having run"
                                 " (rollups, ends, figures): the store did not take the last feed")
        self._spool.close()
        return self.stats()

    # -- the spooling thread ----------------------------------------------------

    def _spool_overflows(self) -> None:
        """Writes what put() handed over to the spool, oldest first, until the sink closes and none is left."""
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._overflows or self._closing)
                if not self._overflows:
                    return
                rows, token, _handed = self._overflows[0]
            logger.warning("store is slow: spooling %d queued rows to %s", len(rows), self._spool.directory)
            self._spool_rows(rows, token)
            with self._condition:
                self._overflows.pop(0)
                self._overflow_rows -= len(rows)

    # -- the writer thread ------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: self._closing or self._feed_asked or len(self._queued) >= self._batch_rows,
                    self._flush_interval,
                )
                batch = self._queued[:self._batch_rows]
                del self._queued[:self._batch_rows]
                self._queued_bytes = sum(map(_estimated_bytes, self._queued)) if self._queued else 0
                self._in_flight, self._in_flight_token = batch, new_batch_token()
                token = self._in_flight_token
                finished = self._closing and not self._queued
                asked = self._feed_asked
                emptied_at = None if self._queued else time.time()  # all put before it is in this batch
            started = time.thread_time()
            self._deliver(batch, token)
            if finished or asked or time.monotonic() >= self._views_due:
                self._feed_views()
            with self._condition:
                self._in_flight = []
                if emptied_at is not None:
                    self._durable_until = max(self._durable_until, emptied_at)
                self._cpu_s += time.thread_time() - started
                if asked:
                    self._feed_asked = False
                    self._feeds += 1
                    self._condition.notify_all()
            if finished:
                return

    def _deliver(self, batch: list[dict], token: str) -> None:
        table = self._to_arrow(batch) if batch else None
        if time.monotonic() < self._retry_at:
            if table is not None:
                self._spool_table(table, token)  # the store is down: do not queue behind it
            return
        try:
            self._replay_spool()
            if table is not None:
                self._insert(table, token, views_later=True)
        except Exception as error:  # classified: an outage spools the batch, a refusal sets it aside
            transient = _is_transient(error)
            if table is not None and not self._abandoned:  # close() has already spooled an abandoned batch
                self._spool_table(table, token, refused_because=None if transient else error)
            if transient:
                self._note_outage(error)
            return
        self._retry_delay = self._retry_min_s

    def _insert(self, table: pa.Table, token: str, *, views_later: bool = False) -> None:
        if self._store is None:
            store = open_store(self._store_url)
            # The store may have been down since before anything created the
            # tables (an agent started during an outage): create them now.
            store.ensure_schema()
            self._store = store
        later = views_later and self._store.views_fed_apart(self._table)
        self._store.insert_arrow(self._table, table, deduplication_token=token, views_later=later)
        with self._condition:
            self._rows_written += table.num_rows
            self._inserts += 1
            if later:
                self._unfed.append(table)

    def _feed_views(self) -> None:
        """Run the store's materialized views over the rows inserted without them (the writer thread's
        work). Failures are kept for the next feed (an outage) or logged (a refusal), never raised."""
        with self._condition:
            if self._unfed:
                self._unfed_groups.append((self._unfed, new_batch_token()))
                self._unfed = []
            groups, self._unfed_groups = self._unfed_groups, []
            self._views_due = time.monotonic() + self._views_every
        while groups:
            tables, token = groups[0]
            try:
                if self._store is None:
                    raise StoreUnavailable("the store is not open")
                self._store.feed_views(self._table, tables, deduplication_token=token)
            except Exception as error:  # classified: an outage keeps the groups, a refusal drops one
                if _is_transient(error):
                    break
                self._record_failure(f"the store refused to run its views over {sum(map(len, tables))} rows of"
                                     f" {self._table} (stored, without their rollups, ends and figures): {error}")
            groups.pop(0)
        # A store that keeps taking rows but not the views' feed: keep as many rows as the queue may hold.
        while sum(sum(map(len, tables)) for tables, _ in groups) > self._max_pending_rows:
            tables, _ = groups.pop(0)
            self._record_failure(f"gave up running the store's views over {sum(map(len, tables))} rows of"
                                 f" {self._table} (stored, without their rollups, ends and figures): the store did"
                                 " not take them while it took newer rows")
        with self._condition:
            self._unfed_groups[:0] = groups

    def _replay_spool(self) -> None:
        """Insert spooled batches oldest first, one file per insert with the file's own token."""
        while (path := self._spool.oldest()) is not None:
            try:
                self._insert(self._spool.read(path), self._spool.token_of(path))
            except Exception as error:  # classified: an outage ends the replay, a refusal sets the file aside
                if _is_transient(error):
                    raise
                self._set_aside(path, error)
                continue
            self._spool.remove(path)

    def _set_aside(self, path: Path, error: Exception) -> None:
        rows = self._spool.rows_in(path)
        self._spool.reject(path, str(error))
        self._record_failure(
            f"store refused {rows} rows (kept in {self._spool.rejected_directory}): {error}", rejected=rows
        )

    def _to_arrow(self, rows: list[dict]) -> pa.Table | None:
        try:
            return self._row_schema.to_arrow(rows)
        except ValueError as error:  # put() checked every row, so this is a bug, reported loudly
            self._record_failure(f"lost {len(rows)} rows that could not be converted to Arrow: {error}",
                                 lost=len(rows))
            return None

    def _note_outage(self, error: Exception) -> None:
        self._last_error = f"store unavailable, spooling to {self._spool.directory}: {error}"
        logger.warning("%s; retrying in %.1f s", self._last_error, self._retry_delay)
        self._retry_at = time.monotonic() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, self._retry_max_s)
        if self._store_url is not None and self._store is not None:
            # A store the sink opened is reopened from scratch next time (an embedded owner may have changed).
            self._store.close()
            self._store = None

    def _spool_rows(self, rows: list[dict], token: str) -> None:
        table = self._to_arrow(rows)
        if table is not None:
            self._spool_table(table, token)

    def _spool_table(self, table: pa.Table, token: str, refused_because: Exception | None = None) -> None:
        try:
            path = self._spool.append(table, token)
        except OSError as error:
            self._record_failure(
                f"lost {table.num_rows} rows: the spool at {self._spool.directory} refused them: {error}",
                lost=table.num_rows,
            )
            return
        if refused_because is not None:
            self._set_aside(path, refused_because)

    def _record_failure(self, message: str, *, rejected: int = 0, lost: int = 0) -> None:
        with self._condition:
            self._rows_rejected += rejected
            self._rows_lost += lost
            self._last_error = message
        logger.error("%s", message)


def default_spool_dir(target: StoreURL) -> Path:
    """Where the sinks of a store spool by default (one folder a table below): kept per store, beside an
    embedded one; the agent's heartbeat lives there too."""
    if target.kind == "embedded":
        return Path(target.path) / EMBEDDED_SPOOL_DIR
    return DEFAULT_SPOOL_DIR.expanduser()
