"""ClickHouse DDL for tokenprobe's tables, and the registry other modules add theirs to.

Every table is a DDL template with two placeholders, ``{db}`` (the database,
``tokenprobe`` unless the store URL names another) and ``{ttl_days}`` (how long
rows live). ``Store.ensure_schema()`` creates the database and every registered
table, so a module that owns a table registers it at import time::

    from tokenprobe.agent import schema
    schema.register_table("gpu_samples", GPU_SAMPLES_DDL)

The same DDL serves embedded chDB and a ClickHouse server.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

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
NULLABLE_TIMESTAMP_TYPE = f"Nullable({TIMESTAMP_TYPE})"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    codec: str

    def ddl(self) -> str:
        return f"`{self.name}` {self.type} {self.codec}"


# One row per HTTP request, exactly as docs/ROW_SCHEMA.md lists it (names,
# types, order). Timestamps carry an explicit UTC zone so every reader decodes
# the same instant whatever the server's or the host's time zone.
REQUEST_SCHEMA: tuple[Column, ...] = (
    Column("node", "LowCardinality(String)", OPAQUE_CODEC),
    Column("conn_id", "UInt64", INTEGER_CODEC),
    Column("req_seq", "UInt32", INTEGER_CODEC),
    Column("role", "LowCardinality(String)", OPAQUE_CODEC),
    Column("pid", "UInt32", INTEGER_CODEC),
    Column("comm", "LowCardinality(String)", OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("client_addr", "String", OPAQUE_CODEC),
    Column("client_port", "UInt16", INTEGER_CODEC),
    Column("tenant", "LowCardinality(String)", OPAQUE_CODEC),
    Column("tls", "Bool", OPAQUE_CODEC),
    Column("accept_ts", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("tls_done_ts", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("req_start", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
    Column("req_end", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("resp_start", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("first_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("last_token", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("resp_end", NULLABLE_TIMESTAMP_TYPE, TIMESTAMP_CODEC),
    Column("method", "LowCardinality(String)", OPAQUE_CODEC),
    Column("path", "LowCardinality(String)", OPAQUE_CODEC),
    Column("status", "UInt16", INTEGER_CODEC),
    Column("model", "LowCardinality(String)", OPAQUE_CODEC),
    Column("response_id", "String", OPAQUE_CODEC),
    Column("streamed", "Bool", OPAQUE_CODEC),
    Column("token_events", "UInt32", INTEGER_CODEC),
    Column("sse_events", "UInt32", INTEGER_CODEC),
    Column("token_offsets_us", "Array(UInt32)", OPAQUE_CODEC),
    Column("prompt_tokens", "Nullable(UInt32)", INTEGER_CODEC),
    Column("completion_tokens", "Nullable(UInt32)", INTEGER_CODEC),
    Column("inflight_at_arrival", "UInt32", INTEGER_CODEC),
    Column("bytes_in", "UInt64", INTEGER_CODEC),
    Column("bytes_out", "UInt64", INTEGER_CODEC),
    Column("body_fp", "UInt64", OPAQUE_CODEC),
    Column("outcome", "LowCardinality(String)", OPAQUE_CODEC),
    Column("error", "String", OPAQUE_CODEC),
    Column("capture", "LowCardinality(String)", OPAQUE_CODEC),
    Column("bytes_unseen", "UInt64", INTEGER_CODEC),
)

REQUESTS_TABLE = "requests"
REQUEST_COLUMNS: list[str] = [column.name for column in REQUEST_SCHEMA]
# name -> ClickHouse type, for writers that must build typed batches without
# asking the store (the sink spools while the store is down).
REQUEST_COLUMN_TYPES: dict[str, str] = {column.name: column.type for column in REQUEST_SCHEMA}

_column_lines = ",\n    ".join(column.ddl() for column in REQUEST_SCHEMA)
REQUESTS_DDL = f"""CREATE TABLE IF NOT EXISTS {{db}}.{REQUESTS_TABLE}
(
    {_column_lines}
)
ENGINE = MergeTree
PARTITION BY toDate(req_start)
ORDER BY (server_port, req_start, conn_id)
TTL toDateTime(req_start) + INTERVAL {{ttl_days}} DAY"""

# table name -> DDL template ({db}, {ttl_days}). Mutate through register_table.
TABLES: dict[str, str] = {REQUESTS_TABLE: REQUESTS_DDL}


def register_table(name: str, ddl_template: str) -> None:
    """Add a table that ``Store.ensure_schema()`` will create.

    Registering the same DDL twice is a no-op (module reloads); a different DDL
    under a taken name is an error, since two modules would fight over it.
    """
    if not name.isidentifier():
        raise ValueError(f"table name {name!r} is not a plain identifier")
    try:
        ddl_template.format(db=DEFAULT_DATABASE, ttl_days=DEFAULT_TTL_DAYS)
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"DDL template for {name!r} may only use the placeholders {{db}} and {{ttl_days}}"
            f" (literal braces must be doubled): {error!r}"
        ) from None
    existing = TABLES.get(name)
    if existing is not None and existing != ddl_template:
        raise ValueError(f"table {name!r} is already registered with a different DDL")
    TABLES[name] = ddl_template


def create_statements(database: str = DEFAULT_DATABASE, ttl_days: int = DEFAULT_TTL_DAYS) -> list[str]:
    """The statements that create the database and every registered table, in order."""
    if not database.isidentifier():
        raise ValueError(f"database name {database!r} is not a plain identifier")
    if not isinstance(ttl_days, int) or isinstance(ttl_days, bool) or ttl_days < 1:
        raise ValueError(f"ttl_days must be a positive integer, got {ttl_days!r}")
    statements = [f"CREATE DATABASE IF NOT EXISTS {database}"]
    statements += [template.format(db=database, ttl_days=ttl_days) for template in TABLES.values()]
    return statements


def add_missing_request_columns(database: str, existing_columns: Collection[str]) -> list[str]:
    """The statements that give a requests table made by an older tokenprobe the
    REQUEST_SCHEMA columns it lacks, each in its schema place (after the column
    before it, which is either already there or added by an earlier statement)."""
    statements = []
    previous: str | None = None
    for column in REQUEST_SCHEMA:
        if column.name not in existing_columns:
            place = f"AFTER `{previous}`" if previous else "FIRST"
            statements.append(f"ALTER TABLE {database}.{REQUESTS_TABLE} "
                              f"ADD COLUMN IF NOT EXISTS {column.ddl()} {place}")
        previous = column.name
    return statements
