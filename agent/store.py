"""The ClickHouse store: embedded chDB or a server, one API for both, and the agent's batched sink.

Store URLs:

- ``chdb:///abs/dir``, ``chdb://./rel/dir`` or a bare directory path: the
  embedded engine. One process owns the directory (an exclusive ``flock`` on
  ``DIR/.tokenprobe.lock``) and serves it to every other process over the
  ClickHouse HTTP protocol (see ``store_server``); it publishes the port and a
  fresh token in ``DIR/.tokenprobe-serve.json``. ``open_store`` on a directory
  another live process owns returns a client of that owner, so readers work
  unchanged while the agent writes.
- ``http://[user:pass@]host[:8123]/`` or ``https://...[:8443]/``: a server.

Any URL may end in ``?database=NAME`` (default ``tokenprobe``).

Everything goes through clickhouse-connect, whose chDB and HTTP clients share
one interface; batches travel as Arrow, which both accept with exact
nanosecond timestamps.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import clickhouse_connect
import pandas as pd
import pyarrow as pa
from clickhouse_connect.driver.exceptions import DatabaseError, Error as ClickHouseError, OperationalError

from tokenprobe.agent import schema
from tokenprobe.agent.store_server import StoreServer

logger = logging.getLogger(__name__)

LOCK_FILE = ".tokenprobe.lock"
SERVE_FILE = ".tokenprobe-serve.json"
EMBEDDED_SPOOL_DIR = ".tokenprobe-spool"
DEFAULT_SPOOL_DIR = Path("~/.cache/tokenprobe/spool")
DEFAULT_HTTP_PORT = 8123
DEFAULT_HTTPS_PORT = 8443
# How long a reader waits for a starting owner to publish its serve file.
DEFAULT_OWNER_WAIT_S = 15.0

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
    425,  # SYSTEM_ERROR
    516,  # AUTHENTICATION_FAILED (an embedded owner restarted with a new token on the old port)
})


class StoreUnavailable(RuntimeError):
    """The store cannot be reached now (server down, owner gone, store closed); retrying may succeed."""


# --------------------------------------------------------------------------- URLs


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``kind`` is "embedded" (``path`` set) or "server"."""

    kind: str
    database: str
    path: str = ""
    scheme: str = ""
    host: str = ""
    port: int = 0
    username: str = ""
    password: str = ""
    proxy_path: str = ""

    def display(self) -> str:
        """The URL without its password, for messages and logs."""
        if self.kind == "embedded":
            return f"chdb://{self.path}"
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{user}{host}:{self.port}/{self.proxy_path}"


def parse_store_url(url: str) -> StoreURL:
    """Parse a store URL (see the module docstring); ValueError says what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("store URL is empty: give chdb:///DIR, a directory path, or http(s)://host:port/")
    url = url.strip()
    if "://" not in url:
        return StoreURL("embedded", schema.DEFAULT_DATABASE, path=_directory(url))
    scheme = url.split("://", 1)[0].lower()
    if scheme == "chdb":
        location, _, query = url.split("://", 1)[1].partition("?")
        if not location:
            raise ValueError(f"store URL {url!r} names no directory: use chdb:///abs/dir or chdb://./rel/dir")
        return StoreURL("embedded", _database_parameter(query, url), path=_directory(unquote(location)))
    if scheme in ("http", "https"):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"store URL {_redact(url)!r} has an invalid port") from None
        if not parts.hostname:
            raise ValueError(f"store URL {_redact(url)!r} names no host")
        return StoreURL(
            "server",
            _database_parameter(parts.query, _redact(url)),
            scheme=scheme,
            host=parts.hostname,
            port=port or (DEFAULT_HTTPS_PORT if scheme == "https" else DEFAULT_HTTP_PORT),
            username=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            proxy_path=parts.path.strip("/"),
        )
    raise ValueError(
        f"unsupported store URL scheme {scheme!r} in {_redact(url)!r}: "
        "use chdb:///DIR, a directory path, http://host:8123/ or https://host:8443/"
    )


def _directory(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _database_parameter(query: str, url: str) -> str:
    try:
        parameters = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"store URL {url!r} has a malformed query string") from None
    unknown = set(parameters) - {"database"}
    if unknown:
        raise ValueError(
            f"store URL {url!r} has unknown parameter(s) {sorted(unknown)}; only 'database' is accepted"
        )
    database = parameters.get("database", [schema.DEFAULT_DATABASE])[-1]
    if not database.isidentifier():
        raise ValueError(f"store URL {url!r}: database {database!r} is not a plain identifier")
    return database


# --------------------------------------------------------------------------- typed rows


@dataclass(frozen=True)
class _ColumnType:
    """How one ClickHouse column type is checked in Python and carried in Arrow."""

    arrow: pa.DataType
    accepts: Callable[[Any], bool]
    expected: str
    nullable: bool


def _int_between(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_INTEGER_BITS = {"8": 8, "16": 16, "32": 32, "64": 64}
_TIMESTAMP_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}
_SIMPLE_TYPES = {
    "String": (pa.string(), lambda value: isinstance(value, str), "a str"),
    "Bool": (pa.bool_(), lambda value: isinstance(value, bool), "a bool"),
    "Float32": (pa.float32(), _is_number, "a number"),
    "Float64": (pa.float64(), _is_number, "a number"),
}


def _column_type(ch_type: str) -> _ColumnType:
    """Map a ClickHouse type name (as system.columns prints it) to its Python check and Arrow type."""
    nullable = ch_type.startswith("Nullable(")
    base = ch_type[len("Nullable("):-1] if nullable else ch_type
    if base.startswith("LowCardinality("):
        inner = _column_type(base[len("LowCardinality("):-1])
        return _ColumnType(inner.arrow, inner.accepts, inner.expected, nullable or inner.nullable)
    if base.startswith("Array("):
        element = _column_type(base[len("Array("):-1])
        return _ColumnType(
            pa.list_(element.arrow),
            lambda value: isinstance(value, (list, tuple)) and all(element.accepts(item) for item in value),
            f"a list of {element.expected}",
            nullable,
        )
    for prefix, signed in (("UInt", False), ("Int", True)):
        bits = _INTEGER_BITS.get(base[len(prefix):]) if base.startswith(prefix) else None
        if bits:
            low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
            arrow = getattr(pa, f"{'int' if signed else 'uint'}{bits}")()
            return _ColumnType(arrow, _int_between(low, high), f"an int in [{low}, {high})", nullable)
    if base.startswith("DateTime64("):
        precision = int(base[len("DateTime64("):].split(",")[0].rstrip(")"))
        if precision not in _TIMESTAMP_UNITS:
            raise ValueError(f"cannot carry {ch_type} in Arrow (precision must be 0, 3, 6 or 9)")
        unit = _TIMESTAMP_UNITS[precision]
        # Arrow timestamps are 64-bit counts of the unit since the epoch.
        return _ColumnType(pa.timestamp(unit, tz="UTC"), _int_between(-(1 << 63), 1 << 63),
                           f"an int ({unit} since the epoch)", nullable)
    if base in _SIMPLE_TYPES:
        arrow, accepts, expected = _SIMPLE_TYPES[base]
        return _ColumnType(arrow, accepts, expected, nullable)
    raise ValueError(
        f"cannot convert Python values to ClickHouse type {ch_type}; build an Arrow table and use insert_arrow"
    )


def _describe(value: Any) -> str:
    """A value for an error message: numbers as they are, anything else by type only (it may be user text)."""
    return repr(value) if _is_number(value) or isinstance(value, bool) else type(value).__name__


class RowSchema:
    """Checks row dicts against a table's columns and turns batches of them into Arrow tables.

    Columns that may be missing from a row: Nullable ones (written as NULL) and
    ``optional`` ones, which have a server-side default and are left out of a
    batch when no row in it carries them.
    """

    def __init__(self, column_types: Mapping[str, str], optional: Sequence[str] = ()):
        self.types = {name: _column_type(ch_type) for name, ch_type in column_types.items()}
        self._optional = frozenset(optional)
        self._required = [
            name for name, column in self.types.items() if not column.nullable and name not in self._optional
        ]

    def check(self, row: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first bad column of ``row``."""
        if not isinstance(row, Mapping):
            raise ValueError(f"a row must be a dict, not {type(row).__name__}")
        for name, value in row.items():
            column = self.types.get(name)
            if column is None:
                raise ValueError(f"unknown column {name!r}")
            if value is None:
                if not column.nullable:
                    raise ValueError(f"column {name!r} cannot be None")
            elif not column.accepts(value):
                raise ValueError(f"column {name!r} must be {column.expected}, got {_describe(value)}")
        missing = [name for name in self._required if name not in row]
        if missing:
            raise ValueError(f"row lacks required column(s) {missing}")

    def to_arrow(self, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
        names = [
            name for name in self.types
            if name not in self._optional or any(name in row for row in rows)
        ]
        arrays = []
        for name in names:
            try:
                arrays.append(pa.array([row.get(name) for row in rows], type=self.types[name].arrow))
            except (pa.ArrowException, OverflowError, TypeError) as error:
                raise ValueError(f"column {name!r}: {error}") from None
        return pa.Table.from_arrays(arrays, names=names)


# --------------------------------------------------------------------------- the store


class Store:
    """One store, embedded or server, behind clickhouse-connect's client.

    ``mode`` is "embedded-owner" (this process owns the chDB directory),
    "embedded-via-owner" (another process owns it; this talks HTTP to it) or
    "server". Every method is safe to call from several threads: calls are
    serialized, because a chDB client must be used by one thread at a time.
    Table names without a database are taken to be in ``database``.
    """

    def __init__(self, target: StoreURL, client, mode: str, ownership: _Ownership | None = None):
        self.target = target
        self.url = target.display()
        self.database = target.database
        self.client = client
        self.mode = mode
        self._ownership = ownership
        self._lock = threading.RLock()
        self._closed = False
        self._row_schemas: dict[str, RowSchema] = {}

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, mode={self.mode!r})"

    def table(self, name: str) -> str:
        """The qualified name of ``name`` (``database.name`` unless it names a database already)."""
        return name if "." in name else f"{self.database}.{name}"

    def _call(self, method: Callable, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"store {self.url} is closed")
            try:
                return method(*args, **kwargs)
            except OperationalError as error:
                raise StoreUnavailable(f"store {self.url} is unreachable: {error}") from error

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None):
        """Run a statement; returns its (small) result as clickhouse-connect's command() does."""
        return self._call(self.client.command, sql, parameters=parameters)

    def query_df(self, sql: str, parameters: Mapping[str, Any] | None = None) -> pd.DataFrame:
        return self._call(self.client.query_df, sql, parameters=parameters)

    def query_rows(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[tuple]:
        return self._call(self.client.query, sql, parameters=parameters).result_rows

    def insert_arrow(self, table: str, arrow_table: pa.Table) -> int:
        """Insert an Arrow table (columns by name); returns the number of rows sent."""
        if arrow_table.num_rows == 0:
            return 0
        self._call(self.client.insert_arrow, self.table(table), arrow_table)
        return arrow_table.num_rows

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

    def ensure_schema(self, ttl_days: int = schema.DEFAULT_TTL_DAYS) -> None:
        """Create the database and every registered table; safe to repeat.

        A requests table made by an older tokenprobe gets the columns added since
        (rows stored before read the column type's default). ``ttl_days`` applies to
        tables this call creates; existing tables keep theirs.
        """
        requests_ddl = schema.REQUESTS_DDL.format(db=self.database, ttl_days=ttl_days)
        for statement in schema.create_statements(self.database, ttl_days):
            self.command(statement)
            if statement == requests_ddl:
                # Before the views that read the table are created: one may read a new column.
                self._add_missing_request_columns()

    def _add_missing_request_columns(self) -> None:
        existing = {name for (name,) in self.query_rows(
            "SELECT name FROM system.columns WHERE database = {database:String} AND table = {table:String}",
            {"database": self.database, "table": schema.REQUESTS_TABLE})}
        statements = schema.add_missing_request_columns(self.database, existing)
        for statement in statements:
            self.command(statement)
        if statements:
            self._row_schemas.pop(self.table(schema.REQUESTS_TABLE), None)  # the cached one lacks them

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


class _Ownership:
    """What an embedded owner holds: the directory lock and, when serving, the read server."""

    def __init__(self, directory: Path, lock_fd: int):
        self.directory = directory
        self.lock_fd = lock_fd
        self.server: StoreServer | None = None

    def publish(self, server: StoreServer, token: str, reader_token: str) -> None:
        """Start advertising ``server``: write the serve file atomically, readable by this user only."""
        self.server = server
        serve_file = self.directory / SERVE_FILE
        temporary = serve_file.with_name(f"{SERVE_FILE}.{os.getpid()}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump({"pid": os.getpid(), "port": server.port, "token": token, "reader_token": reader_token},
                      handle)
        os.replace(temporary, serve_file)

    def stop_serving(self) -> None:
        if self.server is None:
            return
        # Withdraw the advertisement first, so no new reader tries a closing server.
        if _read_json(self.directory / SERVE_FILE).get("pid") == os.getpid():
            (self.directory / SERVE_FILE).unlink(missing_ok=True)
        self.server.close()
        self.server = None

    def release(self) -> None:
        fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        os.close(self.lock_fd)


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def _read_lock_owner(lock_path: Path) -> int | None:
    try:
        return int(lock_path.read_text().strip())
    except (OSError, ValueError):
        return None


def open_store(url: str, *, serve: bool = True, owner_wait_s: float = DEFAULT_OWNER_WAIT_S,
               read_only: bool = False) -> Store:
    """Open the store at ``url`` (see the module docstring).

    Embedded: become the directory's owner if no live process is, serving it to
    other processes when ``serve``; else connect to the owner, waiting up to
    ``owner_wait_s`` for a starting owner to publish its serve file, with its
    reader token when ``read_only`` (a server store is as read-only as the
    user in its URL). Raises StoreUnavailable when the store cannot be reached.
    """
    target = parse_store_url(url)
    if target.kind == "server":
        return _open_server(target)
    return _open_embedded(target, serve=serve, owner_wait_s=owner_wait_s, read_only=read_only)


def _open_server(target: StoreURL) -> Store:
    try:
        client = clickhouse_connect.get_client(
            interface=target.scheme,
            host=target.host,
            port=target.port,
            username=target.username,
            password=target.password,
            proxy_path=target.proxy_path,
            # No server-side sessions: the store needs none, and they forbid concurrent queries.
            autogenerate_session_id=False,
        )
    except OperationalError as error:
        raise StoreUnavailable(f"cannot reach ClickHouse at {target.display()}: {error}") from error
    return Store(target, client, "server")


def _open_embedded(target: StoreURL, *, serve: bool, owner_wait_s: float, read_only: bool) -> Store:
    directory = Path(target.path)
    try:
        # The store holds what every request did, and the owner's tokens: this user's alone.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if directory.stat().st_uid == os.getuid():
            directory.chmod(0o700)
    except OSError as error:
        raise StoreUnavailable(f"cannot create the embedded store directory {directory}: {error}") from error
    lock_path = directory / LOCK_FILE
    deadline = time.monotonic() + owner_wait_s
    while True:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
        else:
            return _become_owner(target, directory, lock_fd, serve=serve)
        # A live process holds the lock (the kernel drops a dead holder's lock).
        # Its serve file counts only once it carries that holder's pid: an
        # older file is a stale leftover of a previous owner.
        owner_pid = _read_lock_owner(lock_path)
        advert = _read_json(directory / SERVE_FILE)
        if owner_pid is not None and advert.get("pid") == owner_pid:
            return _open_via_owner(target, owner_pid, advert, read_only=read_only)
        if time.monotonic() >= deadline:
            raise StoreUnavailable(
                f"embedded store {directory} is owned by pid {owner_pid or 'unknown'}, which does not serve it"
                " to other processes (started with serving off, or still starting)"
            )
        time.sleep(0.1)


def _become_owner(target: StoreURL, directory: Path, lock_fd: int, *, serve: bool) -> Store:
    ownership = _Ownership(directory, lock_fd)
    client = None
    try:
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        # Whatever serve file is here belongs to a dead owner.
        (directory / SERVE_FILE).unlink(missing_ok=True)
        try:
            client = clickhouse_connect.get_client(interface="chdb", path=str(directory))
        except ClickHouseError as error:
            raise StoreUnavailable(f"chDB cannot open {directory}: {error}") from error
        if serve:
            token, reader_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
            ownership.publish(StoreServer(str(directory), token, reader_token=reader_token), token, reader_token)
    except BaseException:
        ownership.stop_serving()
        if client is not None:
            client.close()
        ownership.release()
        raise
    return Store(target, client, "embedded-owner", ownership)


def _open_via_owner(target: StoreURL, owner_pid: int, advert: dict, *, read_only: bool) -> Store:
    try:
        client = clickhouse_connect.get_client(
            host="127.0.0.1",
            port=int(advert["port"]),
            username="default",
            password=str(advert["reader_token" if read_only else "token"]),
            # The owner is on this host: compression would only cost CPU on both ends.
            compress=False,
            autogenerate_session_id=False,
        )
    except (KeyError, ValueError) as error:
        raise StoreUnavailable(f"the serve file of embedded store {target.path} is malformed: {error!r}") from None
    except OperationalError as error:
        raise StoreUnavailable(
            f"embedded store {target.path} is owned by pid {owner_pid}, which does not answer: {error}"
        ) from error
    return Store(target, client, "embedded-via-owner")


# --------------------------------------------------------------------------- the sink


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


class _UnreadableSpoolFile(Exception):
    """A spool file that cannot be read back (truncated by a crash, disk error)."""


class _Spool:
    """Undelivered batches on disk, one Arrow IPC file each, replayed oldest first.

    File names sort in arrival order and carry their row count
    (``<time_ns>-<seq>-<rows>.arrow``), so counting needs no reading. Batches
    the store refused outright go to ``rejected/`` with the reason beside them:
    kept for an operator, never retried automatically.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.rejected_directory = directory / "rejected"
        self.rejected_directory.mkdir(parents=True, exist_ok=True)
        # Two sinks replaying one spool would insert every batch twice.
        self._lock_fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"spool directory {directory} is in use by another tokenprobe sink") from None
        self._mutex = threading.Lock()
        self._sequence = 0
        self.rows = sum(self.rows_in(path) for path in self.files())

    @staticmethod
    def rows_in(path: Path) -> int:
        return int(path.stem.rsplit("-", 1)[1])

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("*-*-*.arrow"))

    def append(self, table: pa.Table) -> Path:
        """Write one batch durably (fsync, then an atomic rename). Raises OSError if the disk refuses."""
        with self._mutex:
            self._sequence += 1
            path = self.directory / f"{time.time_ns():020d}-{self._sequence:08d}-{table.num_rows}.arrow"
            temporary = path.with_name(f".{path.name}.tmp")
            try:
                with open(temporary, "wb") as handle:
                    with pa.ipc.new_file(handle, table.schema) as writer:
                        writer.write_table(table)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temporary, path)
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            self.rows += table.num_rows
            return path

    def oldest(self, max_rows: int) -> list[Path]:
        """The oldest files: at least one, and no more than ``max_rows`` rows unless one file alone has more."""
        chosen, rows = [], 0
        for path in self.files():
            if chosen and rows + self.rows_in(path) > max_rows:
                break
            chosen.append(path)
            rows += self.rows_in(path)
        return chosen

    @staticmethod
    def read(paths: Sequence[Path]) -> pa.Table:
        try:
            tables = []
            for path in paths:
                with pa.memory_map(str(path)) as source:
                    tables.append(pa.ipc.open_file(source).read_all())
            return pa.concat_tables(tables, promote_options="default")
        except (OSError, pa.ArrowException) as error:
            raise _UnreadableSpoolFile(f"unreadable spool file: {error}") from error

    def remove(self, paths: Sequence[Path]) -> None:
        with self._mutex:
            for path in paths:
                path.unlink()
                self.rows -= self.rows_in(path)

    def reject(self, path: Path, reason: str) -> None:
        with self._mutex:
            path.replace(self.rejected_directory / path.name)
            (self.rejected_directory / f"{path.name}.reason.txt").write_text(reason + "\n")
            self.rows -= self.rows_in(path)

    def close(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)


def _is_transient(error: Exception) -> bool:
    """Whether a failed insert may succeed later, as opposed to the batch itself being refused."""
    if isinstance(error, _UnreadableSpoolFile):
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
    ``flush_interval`` seconds, or as soon as ``batch_rows`` rows are queued.
    Batches the store cannot take now go to an on-disk spool, replayed oldest
    first once it answers again (retries back off from ``retry_min_s`` to
    ``retry_max_s``); if the store stalls and ``max_pending_rows`` pile up in
    memory, ``put`` spools them itself. Batches the store refuses outright are
    kept in the spool's ``rejected/`` folder. Delivery is at-least-once: a
    batch whose insert succeeded but whose answer was lost is sent again.

    ``store`` is an open Store (the caller keeps ownership) or a URL the sink
    opens itself, lazily and again after failures, and closes with the sink.
    """

    def __init__(
        self,
        store: Store | str,
        *,
        table: str = schema.REQUESTS_TABLE,
        column_types: Mapping[str, str] = schema.REQUEST_COLUMN_TYPES,
        spool_dir: str | Path | None = None,
        flush_interval: float = 1.0,
        batch_rows: int = 20_000,
        max_pending_rows: int | None = None,
        retry_min_s: float = 1.0,
        retry_max_s: float = 30.0,
    ):
        if flush_interval <= 0 or batch_rows < 1:
            raise ValueError("flush_interval must be > 0 and batch_rows >= 1")
        self._store = store if isinstance(store, Store) else None
        self._store_url = None if isinstance(store, Store) else store
        target = store.target if isinstance(store, Store) else parse_store_url(store)
        self._table = table
        self._row_schema = RowSchema(column_types)
        self._flush_interval = flush_interval
        self._batch_rows = batch_rows
        self._max_pending_rows = max_pending_rows or 5 * batch_rows
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._spool = _Spool(Path(spool_dir).expanduser() if spool_dir else _default_spool_dir(target) / table)

        # Guards the queue, the flags and the counters that both threads touch.
        self._condition = threading.Condition()
        self._queued: list[dict] = []
        self._in_flight: list[dict] = []
        self._closing = False
        self._abandoned = False
        self._retry_at = 0.0
        self._retry_delay = retry_min_s
        self._rows_written = 0
        self._rows_rejected = 0
        self._rows_lost = 0
        self._inserts = 0
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"tokenprobe-sink-{table}", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------

    def put(self, row: dict) -> None:
        """Queue one row; never waits for the store. ValueError if the row does not fit the table."""
        self._row_schema.check(row)
        overflow = None
        with self._condition:
            if self._closing:
                raise RuntimeError("RequestSink is closed")
            self._queued.append(row)
            if len(self._queued) >= self._max_pending_rows:
                overflow, self._queued = self._queued, []
            elif len(self._queued) >= self._batch_rows:
                self._condition.notify()
        if overflow:
            logger.warning("store is slow: spooling %d queued rows to %s", len(overflow), self._spool.directory)
            self._spool_rows(overflow)

    @property
    def rows_written(self) -> int:
        return self._rows_written

    @property
    def rows_spooled(self) -> int:
        return self._spool.rows

    @property
    def rows_pending(self) -> int:
        with self._condition:
            return len(self._queued) + len(self._in_flight)

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def stats(self) -> SinkStats:
        with self._condition:
            return SinkStats(
                rows_written=self._rows_written,
                rows_pending=len(self._queued) + len(self._in_flight),
                rows_spooled=self._spool.rows,
                rows_rejected=self._rows_rejected,
                rows_lost=self._rows_lost,
                inserts=self._inserts,
                last_error=self._last_error,
            )

    def close(self, timeout: float = 30.0) -> SinkStats:
        """Deliver or spool everything queued, stop, and return the final counts.

        If the store hangs past ``timeout``, rows still in memory (including a
        batch mid-insert, which may then also arrive) are spooled.
        """
        with self._condition:
            if self._closing:
                return self.stats()
            self._closing = True
            self._condition.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._condition:
                self._abandoned = True
                leftovers = self._in_flight + self._queued
                self._queued, self._in_flight = [], []
            logger.warning("store did not answer within %.0f s: spooling %d rows", timeout, len(leftovers))
            if leftovers:
                self._spool_rows(leftovers)
        elif self._store_url is not None and self._store is not None:
            self._store.close()
        self._spool.close()
        return self.stats()

    # -- the writer thread ------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: self._closing or len(self._queued) >= self._batch_rows, self._flush_interval
                )
                batch = self._queued[:self._batch_rows]
                del self._queued[:self._batch_rows]
                self._in_flight = batch
                finished = self._closing and not self._queued
            self._deliver(batch)
            with self._condition:
                self._in_flight = []
            if finished:
                return

    def _deliver(self, batch: list[dict]) -> None:
        table = self._to_arrow(batch) if batch else None
        if time.monotonic() < self._retry_at:
            if table is not None:
                self._spool_table(table)  # the store is down: do not queue behind it
            return
        try:
            self._replay_spool()
            if table is not None:
                self._insert(table)
        except Exception as error:  # classified: an outage spools the batch, a refusal sets it aside
            transient = _is_transient(error)
            if table is not None and not self._abandoned:  # close() has already spooled an abandoned batch
                self._spool_table(table, refused_because=None if transient else error)
            if transient:
                self._note_outage(error)
            return
        self._retry_delay = self._retry_min_s

    def _insert(self, table: pa.Table) -> None:
        if self._store is None:
            store = open_store(self._store_url)
            # The store may have been down since before anything created the
            # tables (an agent started during an outage): create them now.
            store.ensure_schema()
            self._store = store
        self._store.insert_arrow(self._table, table)
        with self._condition:
            self._rows_written += table.num_rows
            self._inserts += 1

    def _replay_spool(self) -> None:
        """Insert spooled batches oldest first, in batches of up to batch_rows rows."""
        while paths := self._spool.oldest(self._batch_rows):
            try:
                self._replay(paths)
            except Exception as error:  # classified: an outage ends the replay
                if _is_transient(error):
                    raise
                # One refused file must not condemn the others read with it.
                for path in paths:
                    self._replay_alone(path)

    def _replay(self, paths: Sequence[Path]) -> None:
        self._insert(self._spool.read(paths))
        self._spool.remove(paths)

    def _replay_alone(self, path: Path) -> None:
        try:
            self._replay([path])
        except Exception as error:  # classified: an outage ends the replay, a refusal sets the file aside
            if _is_transient(error):
                raise
            self._set_aside(path, error)

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

    def _spool_rows(self, rows: list[dict]) -> None:
        table = self._to_arrow(rows)
        if table is not None:
            self._spool_table(table)

    def _spool_table(self, table: pa.Table, refused_because: Exception | None = None) -> None:
        try:
            path = self._spool.append(table)
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


def _default_spool_dir(target: StoreURL) -> Path:
    if target.kind == "embedded":
        return Path(target.path) / EMBEDDED_SPOOL_DIR
    return DEFAULT_SPOOL_DIR.expanduser()
