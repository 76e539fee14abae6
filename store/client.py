"""The ClickHouse store: embedded chDB or a server, one API for both.

``open_store`` (``embedded``) gives a ``Store`` for a URL (``url``): the
embedded engine's owner, a client of that owner, or a client of a server.
Everything goes through clickhouse-connect, whose chDB and HTTP clients share
one interface; batches travel as Arrow, which both accept with exact
nanosecond timestamps.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import pandas as pd
import pyarrow as pa
from clickhouse_connect.driver.exceptions import OperationalError

logger = logging.getLogger(__name__)
# At DEBUG, every call's elapsed time and the start of its statement: where an analysis spends its seconds.
QUERY_LOG_CHARS = 160

from ..contract.analysis import RETIRED_TABLES
from ..contract.registry import TABLES, create_statements, materialized_views, tables
from ..contract.requests import REQUESTS_FOR_VIEWS_TABLE, REQUESTS_TABLE, RETIRED_EMBEDDED_VIEWS
from ..contract.tables import DEDUPLICATION_WINDOW_SETTING, DEFAULT_TTL_DAYS, Table, View
from .rows import RowSchema
from .url import StoreURL

# ClickHouse error codes that mean "try again later", not "this batch is bad".
TRANSIENT_ERROR_CODES = frozenset({
    159,  # TIMEOUT_EXCEEDED
    202,  # TOO_MANY_SIMULTANEOUS_QUERIES
    209,  # SOCKET_TIMEOUT
    210,  # NETWORK_ERROR
    236,  # ABORTED (an embedded owner shutting down)
    241,  # MEMORY_LIMIT_EXCEEDED
    242,  # TABLE_IS_READ_ONLY
    252,  # TOO_MANY_PARTS
    394,  # QUERY_WAS_CANCELLED (KILL QUERY: the insert did not land, or its retry is deduplicated)
    425,  # SYSTEM_ERROR
    516,  # AUTHENTICATION_FAILED (an embedded owner restarted with a new token on the old port)
})


class StoreUnavailable(RuntimeError):
    """The store cannot be reached now (server down, owner gone, store closed); retrying may succeed."""


def network_reason(error: BaseException) -> str:
    """Why a connection failed, in a few words: the innermost system error a client library wrapped (e.g.
    "Connection refused", "Name or service not known"), else the error's own message on one line."""
    innermost, cause = None, error
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            innermost = cause
        cause = cause.__cause__ or cause.__context__
    return innermost.strerror if innermost is not None else " ".join(str(error).split())


# --------------------------------------------------------------------------- the store


class Store:
    """One store, embedded or server, behind clickhouse-connect's client.

    ``mode`` is "embedded-owner" (this process owns the chDB directory),
    "embedded-via-owner" (another process owns it; this talks HTTP to it) or
    "server". Every method is safe to call from several threads: calls are
    serialized, because a chDB client must be used by one thread at a time.
    Table names without a database are taken to be in ``database``.
    ``ownership`` is what an embedded owner holds (``embedded``), released on close.
    """

    def __init__(self, target: StoreURL, client, mode: str, ownership=None):
        self.target = target
        self.url = target.display()
        self.database = target.database
        self.client = client
        self.mode = mode
        self._ownership = ownership
        self._lock = threading.RLock()
        self._closed = False
        self._row_schemas: dict[str, RowSchema] = {}
        self._views_read_apart = False  # known once it holds (views_fed_apart)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, mode={self.mode!r})"

    def table(self, name: str) -> str:
        """The qualified name of ``name`` (``database.name`` unless it names a database already)."""
        return name if "." in name else f"{self.database}.{name}"

    def _call(self, method: Callable, statement: str, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"store {self.url} is closed")
            started = time.perf_counter()
            try:
                return method(statement, *args, **kwargs)
            except OperationalError as error:
                raise StoreUnavailable(f"store {self.url} is unreachable: {network_reason(error)}") from error
            finally:
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("%7.3f s  %s %s", time.perf_counter() - started, method.__name__,
                                 re.sub(r"\s+", " ", statement.strip())[:QUERY_LOG_CHARS])

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None):
        """Run a statement; returns its (small) result as clickhouse-connect's command() does."""
        return self._call(self.client.command, sql, parameters=parameters)

    def query_df(self, sql: str, parameters: Mapping[str, Any] | None = None) -> pd.DataFrame:
        return self._call(self.client.query_df, sql, parameters=parameters)

    def query_rows(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[tuple]:
        return self._call(self.client.query, sql, parameters=parameters).result_rows

    def insert_arrow(self, table: str, arrow_table: pa.Table, *, deduplication_token: str | None = None,
                     views_later: bool = False) -> int:
        """Insert an Arrow table (columns by name); returns the number of rows sent.

        An insert with the ``deduplication_token`` of an earlier one into the same table (a replay of a
        batch whose answer was lost) is dropped by ClickHouse instead of storing the rows twice.
        Where the store's writers feed the views over ``table`` (``views_fed_apart``), the rows are fed to
        them too, unless ``views_later``: a later ``feed_views`` of the same rows does.
        """
        if arrow_table.num_rows == 0:
            return 0
        apart = self.views_fed_apart(table)
        if views_later and not apart:
            raise ValueError(f"the views over {self.table(table)} in store {self.url} cannot be fed apart")
        settings = self._insert_settings(deduplication_token) or None
        self._call(self.client.insert_arrow, self.table(table), arrow_table, settings=settings)
        if apart and not views_later:
            self.feed_views(table, [arrow_table], deduplication_token=deduplication_token)
        return arrow_table.num_rows

    def insert_select(self, table: str, select: str, parameters: Mapping[str, Any] | None = None, *,
                      columns: Sequence[str] = ()) -> None:
        """``INSERT INTO table [(columns)] select``. Where the store's writers feed the views over ``table``
        (``views_fed_apart``), the same SELECT is inserted into what they read: it must give the same rows
        twice (no rand(), no now())."""
        names = f" ({', '.join(columns)})" if columns else ""
        self.command(f"INSERT INTO {self.table(table)}{names}\n{select}", parameters)
        if self.views_fed_apart(table):
            self.command(f"INSERT INTO {self.table(REQUESTS_FOR_VIEWS_TABLE)}{names}\n{select}", parameters)

    def views_fed_apart(self, table: str) -> bool:
        """Whether the store's writers, not the store, feed the materialized views over ``table``: an
        embedded store's ``requests`` (contract/requests.py says why), once ``ensure_schema`` has made it so."""
        if self.table(table) != self.table(REQUESTS_TABLE) or not self.mode.startswith("embedded"):
            return False
        if not self._views_read_apart:  # asked again until it holds: another process may make the schema
            self._views_read_apart = bool(self.query_rows(
                "SELECT 1 FROM system.tables WHERE database = {database:String} AND name = {table:String}",
                {"database": self.database, "table": REQUESTS_FOR_VIEWS_TABLE}))
        return self._views_read_apart

    def feed_views(self, table: str, arrow_tables: Sequence[pa.Table], *, deduplication_token: str | None) -> int:
        """Run the materialized views over ``table`` on rows inserted into it with ``views_later``, in one
        insert (``deduplication_token``: a retry of a feed whose answer was lost counts nothing twice)."""
        if not self.views_fed_apart(table):
            raise ValueError(f"the views over {self.table(table)} in store {self.url} cannot be fed apart")
        return self.insert_arrow(REQUESTS_FOR_VIEWS_TABLE, pa.concat_tables(arrow_tables),
                                 deduplication_token=deduplication_token)

    @staticmethod
    def _insert_settings(deduplication_token: str | None) -> dict[str, Any]:
        # The materialized views an insert feeds deduplicate alongside it (the heatmap rollup).
        return {"insert_deduplication_token": deduplication_token,
                "deduplicate_blocks_in_dependent_materialized_views": 1} if deduplication_token else {}

    def insert_rows(self, table: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert row dicts, converted per the table's column types (DateTime64 from int epoch units)."""
        if not rows:
            return 0
        row_schema = self.row_schema(table)
        for row in rows:
            row_schema.check(row)
        return self.insert_arrow(table, row_schema.to_arrow(rows))

    def row_schema(self, table: str) -> RowSchema:
        """The RowSchema of a table, read from the store once and cached."""
        qualified = self.table(table)
        if qualified not in self._row_schemas:
            database, _, name = qualified.partition(".")
            columns = self.query_rows(
                "SELECT name, type, default_kind FROM system.columns"
                " WHERE database = {database:String} AND table = {table:String}"
                " AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') ORDER BY position",
                {"database": database, "table": name},
            )
            if not columns:
                raise ValueError(f"table {qualified} does not exist in store {self.url}")
            self._row_schemas[qualified] = RowSchema(
                {column: ch_type for column, ch_type, _ in columns},
                optional=[column for column, _, default_kind in columns if default_kind],
            )
        return self._row_schemas[qualified]

    def ensure_schema(self, ttl_days: int = DEFAULT_TTL_DAYS) -> None:
        """Create the database and every registered table; safe to repeat.

        A table made by an older tokenprobe gets the columns added since (rows
        stored before read the column type's default); a materialized view made
        by another definition is replaced by the current one (its target table,
        and the rows in it, stay). ``ttl_days`` applies to tables this call
        creates; existing tables keep theirs.
        """
        embedded = self.mode.startswith("embedded")
        created_tables = {table.ddl_template.format(db=self.database, ttl_days=ttl_days): table
                          for table in tables(embedded)}
        views = {view.ddl_template.format(db=self.database): view for view in materialized_views(embedded)}
        existing = {name for (name,) in self.query_rows(
            "SELECT name FROM system.tables WHERE database = {database:String}", {"database": self.database})}
        if embedded:
            self._drop_retired_views(existing)
        self._drop_retired_tables(existing)
        for statement in create_statements(self.database, ttl_days, embedded=embedded):
            if statement in views:
                self._drop_outdated_view(views[statement])
            self.command(statement)
            if statement in created_tables:
                # Before the views that read the table are created: one may read a new column.
                self._add_missing_columns(created_tables[statement])
        self._enable_insert_deduplication()
        self._backfill_new_views([view for view in views.values() if view.name not in existing])
        self._views_read_apart = False

    def _on_cluster(self) -> bool:
        """Whether this store is a cluster's (deploy/clickhouse/cluster.sql: Replicated and Distributed tables)."""
        (requests_engine,), = self.query_rows(
            "SELECT engine FROM system.tables WHERE database = {database:String} AND name = {table:String}",
            {"database": self.database, "table": REQUESTS_TABLE})
        return requests_engine.startswith(("Replicated", "Distributed"))

    def _backfill_new_views(self, created: Sequence[View]) -> None:
        """Give the views just created what they would have written for the rows already stored (a store
        made by an older tokenprobe). Rows inserted meanwhile may be written twice: the readers of such a
        table check it against its source before they use it."""
        backfills = [view for view in created if view.backfill is not None]
        if not backfills or self._on_cluster():  # a cluster's views are created from cluster.sql
            return
        for view in backfills:
            logger.info("store %s: writing %s for the rows stored before it", self.url, self.table(view.name))
            self.command(view.backfill.format(db=self.database))

    def _drop_retired_views(self, existing: Collection[str]) -> None:
        """Drop the views an older release made in an embedded store that this one has no more."""
        for name in RETIRED_EMBEDDED_VIEWS:
            if name in existing:
                logger.info("store %s: dropping materialized view %s (its writers now feed the views)", self.url,
                            self.table(name))
                self.command(f"DROP VIEW IF EXISTS {self.table(name)}")

    def _drop_retired_tables(self, existing: Collection[str]) -> None:
        """Drop the tables an older release made that this one has no more (derived data an analysis
        recomputes). A cluster's are the operator's to drop (deploy/clickhouse/cluster.sql)."""
        retired = [name for name in RETIRED_TABLES if name in existing]
        if retired and not self._on_cluster():
            for name in retired:
                logger.info("store %s: dropping table %s (retired)", self.url, self.table(name))
                self.command(f"DROP TABLE IF EXISTS {self.table(name)}")

    def _drop_outdated_view(self, view: View) -> None:
        """Drop ``view`` if the store has it by another definition than the current one (its comment
        names the definition's digest), so that the statement after this creates the current one."""
        rows = self.query_rows("SELECT comment FROM system.tables WHERE database = {database:String}"
                               " AND name = {view:String}", {"database": self.database, "view": view.name})
        if not rows or rows[0][0] == view.comment:
            return
        if self._on_cluster():
            # A cluster's view reads the shard-local tables (deploy/render.py): the single-node one
            # would count every request again.
            logger.warning("store %s: materialized view %s was made by another definition (%s); on a cluster"
                           " replace it from deploy/clickhouse/cluster.sql (DROP VIEW ... ON CLUSTER, then its"
                           " CREATE)", self.url, self.table(view.name), rows[0][0] or "no digest")
            return
        # Rows inserted between the drop and the create miss the view; its readers check that it counts
        # every row of a window before they use it.
        logger.warning("store %s: replacing materialized view %s, made by another definition (%s), with the"
                       " current one (%s); the rows it already wrote stay", self.url, self.table(view.name),
                       rows[0][0] or "no digest", view.comment)
        self.command(f"DROP VIEW IF EXISTS {self.table(view.name)}")

    def _add_missing_columns(self, table: Table) -> None:
        existing = {name for (name,) in self.query_rows(
            "SELECT name FROM system.columns WHERE database = {database:String} AND table = {table:String}",
            {"database": self.database, "table": table.name})}
        statements = table.missing_column_statements(self.database, existing)
        for statement in statements:
            self.command(statement)
        if statements:
            self._row_schemas.pop(self.table(table.name), None)  # the cached one lacks them

    def _enable_insert_deduplication(self) -> None:
        """Give plain-MergeTree tables made before deduplication tokens the window they need."""
        for table in TABLES:
            if DEDUPLICATION_WINDOW_SETTING not in table.settings:
                continue
            rows = self.query_rows("SELECT engine, engine_full FROM system.tables"
                                   " WHERE database = {database:String} AND name = {table:String}",
                                   {"database": self.database, "table": table.name})
            # A cluster's Replicated*/Distributed tables deduplicate by their own rules.
            if rows and not rows[0][0].startswith(("Replicated", "Distributed")) \
                    and "non_replicated_deduplication_window" not in rows[0][1]:
                self.command(f"ALTER TABLE {self.table(table.name)} MODIFY SETTING {DEDUPLICATION_WINDOW_SETTING}")

    def close(self) -> None:
        """Stop serving (owner), close the client and release the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._ownership is not None:
                self._ownership.stop_serving()
            self.client.close()
            if self._ownership is not None:
                self._ownership.release()


