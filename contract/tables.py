"""How a table is declared: columns with their codecs, and the table around them.

Every table of tokenprobe is one ``Table`` value in a module of this room and
is listed once in ``registry``. ``Table.ddl_template`` renders it with two
placeholders, ``{db}`` (the database, ``tokenprobe`` unless the store URL names
another) and ``{ttl_days}`` (how long rows live); the same DDL serves embedded
chDB and a ClickHouse server. ``arrow_type`` gives the Arrow type that inserts
into a column, for writers that build typed batches themselves.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import pyarrow as pa

DEFAULT_DATABASE = "tokenprobe"
DEFAULT_TTL_DAYS = 30

# Codecs. Timestamps are nanoseconds: consecutive values in a part are close,
# so delta coding leaves small numbers for ZSTD. DoubleDelta suits a column the
# part is sorted by (near-constant steps); Delta suits timestamps that follow
# the sort order only roughly. T64 strips the unused high bits of integers that
# are small in practice (ports, counts, pids). Hashes and free text are
# incompressible by transforms, so they get ZSTD alone.
SORTED_TIMESTAMP_CODEC = "CODEC(DoubleDelta, ZSTD(1))"
TIMESTAMP_CODEC = "CODEC(Delta, ZSTD(1))"
INTEGER_CODEC = "CODEC(T64, ZSTD(1))"
OPAQUE_CODEC = "CODEC(ZSTD(1))"
# Gauges sampled on a clock: floats that change little between ticks, Gorilla's case.
GAUGE_CODEC = "CODEC(Gorilla, ZSTD(1))"

TIMESTAMP_TYPE = "DateTime64(9, 'UTC')"

# The sink gives every batch an insert_deduplication_token that a replay from
# its spool reuses; a plain MergeTree honours it only within this window of
# recent inserts (replicated tables deduplicate by default). Tables written by
# the sink, and those its materialized views feed, carry it.
DEDUPLICATION_WINDOW_SETTING = "non_replicated_deduplication_window = 1000"
NULLABLE_TIMESTAMP_TYPE = f"Nullable({TIMESTAMP_TYPE})"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    codec: str
    default: str | None = None  # a DEFAULT expression: writers may leave the column out

    def ddl(self) -> str:
        default = "" if self.default is None else f" DEFAULT {self.default}"
        return f"`{self.name}` {self.type}{default} {self.codec}"


@dataclass(frozen=True)
class Table:
    """A MergeTree-family table: its columns, engine, partitioning, sort key and TTL.

    ``partition_by`` and ``ttl_column`` name a timestamp column: rows are
    partitioned by its day and live ``{ttl_days}`` days after it. ``settings``
    are the table's MergeTree settings, as ClickHouse writes them after SETTINGS.
    A table of engine ``Null`` (``feeding``) stores nothing: only the
    materialized views that read it see its rows.
    """

    name: str
    columns: tuple[Column, ...]
    order_by: str
    partition_by: str
    ttl_column: str
    engine: str = "MergeTree"
    settings: str = ""

    @property
    def column_names(self) -> list[str]:
        return [column.name for column in self.columns]

    def feeding(self, name: str) -> Table:
        """A table ``name`` with this one's columns that stores nothing: views read the rows inserted."""
        return replace(self, name=name, engine="Null", settings="")

    @property
    def ddl_template(self) -> str:
        column_lines = ",\n    ".join(column.ddl() for column in self.columns)
        head = f"""CREATE TABLE IF NOT EXISTS {{db}}.{self.name}
(
    {column_lines}
)
ENGINE = {self.engine}"""
        if self.engine == "Null":
            return head
        return head + f"""
PARTITION BY toDate({self.partition_by})
ORDER BY ({self.order_by})
TTL toDateTime({self.ttl_column}) + INTERVAL {{ttl_days}} DAY""" + (
            f"\nSETTINGS {self.settings}" if self.settings else "")

    def missing_column_statements(self, database: str, existing_columns: Collection[str]) -> list[str]:
        """The statements that give this table, made by an older tokenprobe, the columns it lacks, each
        in its place (after the column before it, already there or added by an earlier statement)."""
        statements = []
        previous: str | None = None
        for column in self.columns:
            if column.name not in existing_columns:
                place = f"AFTER `{previous}`" if previous else "FIRST"
                statements.append(f"ALTER TABLE {database}.{self.name} ADD COLUMN IF NOT EXISTS {column.ddl()} {place}")
            previous = column.name
        return statements

    def arrow(self, rows: Sequence[dict]) -> pa.Table:
        """Row dicts (every column present) as an Arrow table typed for this table's columns."""
        return pa.table({column.name: pa.array([row[column.name] for row in rows], arrow_type(column.type))
                         for column in self.columns})


VIEW_DEFINITION_PREFIX = "tokenprobe definition "


@dataclass(frozen=True)
class View:
    """A view or materialized view: ``definition`` is its whole CREATE statement ({db} placeholder).

    The view is created with a comment naming a digest of its definition
    (``comment``), so that a store can tell a view made by an older definition
    from the current one (``Store.ensure_schema`` replaces it). ``backfill``,
    where given, is the statement ({db}) that writes what the view would have
    written for the rows stored before it existed; ``Store.ensure_schema`` runs
    it when it creates the view in a store that had none.
    """

    name: str
    definition: str
    backfill: str | None = None

    @property
    def comment(self) -> str:
        return VIEW_DEFINITION_PREFIX + hashlib.sha256(self.definition.encode()).hexdigest()[:16]

    @property
    def ddl_template(self) -> str:
        return f"{self.definition}\nCOMMENT '{self.comment}'"

    def reading(self, table: str, instead: str) -> View:
        """This view reading table ``instead`` where it reads ``table`` (its backfill still reads ``table``)."""
        definition, found = re.subn(rf"\{{db\}}\.{table}\b", lambda _: f"{{db}}.{instead}", self.definition)
        if not found:
            raise ValueError(f"view {self.name} does not read {table}")
        return replace(self, definition=definition)


_SIMPLE_ARROW_TYPES = {
    TIMESTAMP_TYPE: pa.timestamp("ns", tz="UTC"),
    "String": pa.string(),
    "Bool": pa.bool_(),
    "UInt16": pa.uint16(),
    "UInt32": pa.uint32(),
    "UInt64": pa.uint64(),
    "Float32": pa.float32(),
    "Float64": pa.float64(),
}


def arrow_type(clickhouse_type: str) -> pa.DataType:
    """The Arrow type that inserts into a column of ``clickhouse_type`` (the ones these tables use)."""
    for wrapper in ("Nullable(", "LowCardinality("):
        if clickhouse_type.startswith(wrapper):
            return arrow_type(clickhouse_type[len(wrapper) : -1])
    if clickhouse_type.startswith("Array("):
        return pa.list_(arrow_type(clickhouse_type[len("Array(") : -1]))
    if clickhouse_type.startswith("Map("):
        key, value = clickhouse_type[len("Map(") : -1].split(", ", 1)
        return pa.map_(arrow_type(key), arrow_type(value))
    if clickhouse_type not in _SIMPLE_ARROW_TYPES:
        raise ValueError(f"no Arrow type for ClickHouse type {clickhouse_type!r}")
    return _SIMPLE_ARROW_TYPES[clickhouse_type]
