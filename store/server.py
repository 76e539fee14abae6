"""A ClickHouse-compatible HTTP interface over this process's embedded chDB engine.

chDB lets one process own a data directory. The owner (normally the agent)
runs this server so that every other process (dashboard, analytics CLI) reads
and writes the same store through clickhouse-connect's ordinary HTTP client,
exactly as it would talk to a ClickHouse server: one code path for both modes.

It implements the part of ClickHouse's HTTP protocol that clickhouse-connect
and curl use: ``GET /ping``; ``GET|POST /`` with the SQL in the ``query`` URL
parameter and/or the body (concatenated, as ClickHouse does), ``database``,
``default_format``, ``param_<name>`` bind parameters, multipart form fields,
gzip/deflate/lz4/zstd request bodies, and ``INSERT ... FORMAT <fmt>`` followed
by data in any input format chDB reads (Native, Arrow, RowBinary, TSV, ...).
Other URL parameters that name a ClickHouse setting are applied to the
request's own session; the rest are HTTP-transport options and are ignored.
Each request runs on its own chDB connection handle, so ``USE`` and ``SET``
never leak between requests or into the owner's session. There are no
server-side sessions (``session_id`` is ignored) and no external data.

Clients authenticate with a token the owner published, sent as the password
(basic auth, ``X-ClickHouse-Key``, the ``password`` parameter) or as a bearer
token. What each token may run is judged before it runs (``guard``): the
reader one SELECT over the project's tables, the writer inserts into them and
the schema's own DDL; neither a file, a URL, another server or a program, nor
KILL, SET or a second statement. A reader's statement runs with ``readonly =
1`` after the server's limits (``ReaderLimits``: memory, time, threads, result
size) are set, so no setting of its own can lift them; it may send only a few
harmless settings (``READER_SETTINGS``). Each token runs at most a few queries
at once (``max_queries``); the next waits ``query_wait_s`` for a turn, then is
answered 503 (TOO_MANY_SIMULTANEOUS_QUERIES).

The owner is the agent, so nothing a client sends may cost it unbounded
memory or threads: a request is authenticated from its head before any of
its body is read; Content-Length and chunk sizes are plain non-negative
numbers (else 400) within ``max_body_bytes`` (else 413), and so is a body
once decompressed (a gzip or zstd bomb stops at the limit). At most
``max_connections`` connections are held at once. A request's head must
arrive whole within ``head_timeout_s`` of the connection's opening (or of its
previous answer), however slowly its bytes trickle in; and when every
connection is taken, the one that has waited longest for its head is closed
to make room: connections that never authenticate cannot lock clients out.
An authenticated body that stalls for ``read_timeout_s`` is cut off.
"""

from __future__ import annotations

import base64
import binascii
import email.parser
import email.policy
import hmac
import io
import json
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import chdb

from ..contract.tables import DEFAULT_DATABASE
from .guard import Refused, StatementGuard

logger = logging.getLogger(__name__)

# ClickHouse error codes used for failures this server detects itself.
_BAD_ARGUMENTS = 36
_UNKNOWN_COMPRESSION_METHOD = 89
_ABORTED = 236
_TOO_LARGE = 307  # TOO_MANY_BYTES
_READONLY = 164
_SOCKET_TIMEOUT = 209
_TOO_MANY_SIMULTANEOUS_QUERIES = 202
_ACCESS_DENIED = 497
_AUTHENTICATION_FAILED = 516
_ERROR_NAMES = {
    _BAD_ARGUMENTS: "BAD_ARGUMENTS",
    _UNKNOWN_COMPRESSION_METHOD: "UNKNOWN_COMPRESSION_METHOD",
    _ABORTED: "ABORTED",
    _TOO_LARGE: "TOO_MANY_BYTES",
    _ACCESS_DENIED: "ACCESS_DENIED",
    _READONLY: "READONLY",
    _SOCKET_TIMEOUT: "SOCKET_TIMEOUT",
    _TOO_MANY_SIMULTANEOUS_QUERIES: "TOO_MANY_SIMULTANEOUS_QUERIES",
    _AUTHENTICATION_FAILED: "AUTHENTICATION_FAILED",
}
_BAD_REQUEST = HTTPStatus.BAD_REQUEST
# The client's mistakes, answered with the HTTP status ClickHouse gives them.
_ENGINE_ERROR_STATUS = {
    62: HTTPStatus.BAD_REQUEST,  # SYNTAX_ERROR
    60: HTTPStatus.NOT_FOUND,  # UNKNOWN_TABLE
    81: HTTPStatus.NOT_FOUND,  # UNKNOWN_DATABASE
    164: HTTPStatus.FORBIDDEN,  # READONLY
    497: HTTPStatus.FORBIDDEN,  # ACCESS_DENIED
}
# Code 1001 (STD_EXCEPTION) is what ClickHouse reports when an error has no code of its own.
_UNKNOWN_ERROR_CODE = 1001

# A batch insert of 100k wide rows is tens of MiB; this cap, on a body as sent
# and once decompressed, stops a client from exhausting the owner's memory.
MAX_BODY_BYTES = 256 << 20
MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 30.0
# ClickHouse closes an idle keep-alive connection after 10 s (3 s in older releases); clients reconnect.
HEAD_TIMEOUT_S = 5.0
# Queries run at once per token; the next waits this long for a turn: a reader's query waits out those
# before it, which its time limit stops by then (ReaderLimits.max_execution_time).
MAX_QUERIES = {"reader": 2, "writer": 4}
QUERY_WAIT_S = 30.0
# Settings a reader may send: how values are read and printed, never what a query may cost or touch.
READER_SETTINGS = frozenset({
    "date_time_input_format", "date_time_output_format", "cast_string_to_dynamic_use_inference",
    "cancel_http_readonly_queries_on_client_close", "send_progress_in_http_headers",
    "http_headers_progress_interval_ms", "join_use_nulls", "session_timezone",
    "output_format_json_quote_64bit_integers", "output_format_arrow_string_as_string",
})
_CONTENT_LENGTH = re.compile(rb"^[0-9]{1,19}$")
_CHUNK_SIZE = re.compile(rb"^[0-9A-Fa-f]{1,16}$")

# Parameters that steer the HTTP exchange itself, never the engine.
_TRANSPORT_PARAMETERS = frozenset(
    {
        "query", "database", "default_format", "user", "password", "query_id", "quota_key",
        "session_id", "session_timeout", "session_check", "compress", "decompress", "buffer_size",
        "wait_end_of_query", "client_protocol_version", "role",
    }
)
# chDB's Python API turns these "formats" into Python objects instead of bytes.
_PYTHON_ONLY_FORMATS = frozenset({"dataframe", "datastore", "arrowtable"})
_FORMAT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
_CODE_IN_MESSAGE = re.compile(r"\bCode:\s*(\d+)")
_TRAILING_FORMAT = re.compile(r"\bFORMAT\s++(\w++)\s*+;?\s*+$", re.IGNORECASE)
_LEADING_COMMENTS = r"(?:\s|--[^\n]*(?:\n|$)|/\*.*?\*/)*"
# Statements whose answer is a result set; ClickHouse announces its format for them.
_RESULT_STATEMENT = re.compile(
    _LEADING_COMMENTS + r"(?:SELECT|WITH|SHOW|DESC|DESCRIBE|EXPLAIN|EXISTS|CHECK)\b", re.IGNORECASE | re.DOTALL
)
# `INSERT INTO t [(cols)] [SETTINGS ...] FORMAT f` or `... VALUES` followed by
# data. ClickHouse starts the data after the format name, its trailing blanks
# and at most one newline. Matched on bytes: the data may be binary.
# Possessive quantifiers keep matching linear: a client cannot make it
# backtrack over long blanks. The data always goes through a file: the engine
# runs whatever follows inline VALUES data after a `;` as a statement of its own.
_INSERT_WITH_DATA = re.compile(
    rb"\s*+INSERT\s++INTO\s++(?:TABLE\s++)?"
    rb"(?P<table>(?:`[^`]*+`|\"[^\"]*+\"|[\w.])++)\s*+"
    rb"(?P<columns>\([^()]*+\))?\s*+"
    rb"(?:SETTINGS\s++(?P<settings>(?:[^;\s]++|\s++(?!(?:FORMAT|VALUES)\s))*+)\s++)?"
    rb"(?:FORMAT\s++(?P<format>\w++)[ \t\f]*+(?:\r?\n)?|(?P<values>VALUES)\b)",
    re.IGNORECASE,
)
# The statement part of an insert is short; never scan megabytes of data for it.
_MAX_INSERT_HEAD_BYTES = 256 * 1024

_CONTENT_TYPES = (
    ("TabSeparated", "text/tab-separated-values; charset=UTF-8"),
    ("TSV", "text/tab-separated-values; charset=UTF-8"),
    ("CSV", "text/csv; charset=UTF-8"),
    ("JSON", "application/json; charset=UTF-8"),
    ("Pretty", "text/plain; charset=UTF-8"),
)


class ClickHouseHTTPError(Exception):
    """An error reported to the client the way ClickHouse reports it."""

    def __init__(self, code: int, message: str, status: int = HTTPStatus.INTERNAL_SERVER_ERROR):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status

    @classmethod
    def from_engine(cls, error: Exception) -> ClickHouseHTTPError:
        message = str(error).strip()
        # chDB prefixes engine messages with its own context; ClickHouse's text starts at "Code:".
        start = message.find("Code: ")
        if start > 0:
            message = message[start:]
        match = _CODE_IN_MESSAGE.search(message)
        code = int(match.group(1)) if match else _UNKNOWN_ERROR_CODE
        return cls(code, message, _ENGINE_ERROR_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR))

    def body(self) -> bytes:
        if self.message.startswith("Code: "):
            text = self.message
        else:
            name = _ERROR_NAMES.get(self.code, "STD_EXCEPTION")
            text = f"Code: {self.code}. DB::Exception: {self.message}. ({name})"
        return (text.rstrip() + "\n").encode()


@dataclass
class _Reply:
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _quote_identifier(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _quote_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _content_type(fmt: str) -> str:
    for prefix, content_type in _CONTENT_TYPES:
        if fmt.startswith(prefix):
            return content_type
    return "application/octet-stream"


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo a request's Content-Encoding, as ClickHouse does for compressed inserts, to at most `limit` bytes."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    try:
        if encoding == "gzip":
            return _bounded_decompress(body, lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), limit)
        if encoding == "deflate":
            return _bounded_decompress(body, zlib.decompressobj, limit)
        if encoding == "lz4":
            # lz4 and backports.zstd ship with clickhouse-connect, the client that sends them.
            import lz4.frame

            return _bounded_decompress(body, lz4.frame.LZ4FrameDecompressor, limit)
        if encoding == "zstd":
            from backports import zstd

            return _bounded_decompress(body, zstd.ZstdDecompressor, limit)
    except ImportError as error:
        raise ClickHouseHTTPError(
            _UNKNOWN_COMPRESSION_METHOD, f"Content-Encoding {encoding} needs the missing module {error.name}"
        ) from None
    except ClickHouseHTTPError:
        raise
    except Exception as error:  # each codec raises its own error type for corrupt input
        raise ClickHouseHTTPError(
            _BAD_ARGUMENTS, f"Cannot decompress the {encoding} request body: {error}", _BAD_REQUEST
        ) from None
    raise ClickHouseHTTPError(_UNKNOWN_COMPRESSION_METHOD, f"Unsupported Content-Encoding {encoding!r}")


def _bounded_decompress(body: bytes, new_decompressor, limit: int) -> bytes:
    """Decompress every frame (gzip member) of `body`, refusing to produce more than `limit` bytes.

    Each codec's incremental decompressor takes a `max_length`, so a bomb is
    stopped after `limit` bytes of output instead of after all of it.
    """
    output, size, data = [], 0, body
    while data:
        decompressor = new_decompressor()
        chunk = decompressor.decompress(data, limit + 1 - size)
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, "once decompressed")
        if not decompressor.eof:
            raise ValueError("truncated input")
        output.append(chunk)
        data = decompressor.unused_data
    return b"".join(output)


def _too_large(limit: int, what: str = "") -> ClickHouseHTTPError:
    return ClickHouseHTTPError(_TOO_LARGE, f"Request body over {limit} bytes {what}".rstrip(),
                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


def _utf8(sql: bytes) -> str:
    try:
        return sql.decode("utf-8")
    except UnicodeDecodeError:
        raise ClickHouseHTTPError(_BAD_ARGUMENTS, "The query is not valid UTF-8") from None


def _form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The fields of a multipart/form-data body (clickhouse-connect moves large bind parameters there)."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise ClickHouseHTTPError(_BAD_ARGUMENTS, "Malformed multipart/form-data body")
    fields = {}
    for part in message.iter_parts():
        if part.get_filename() is not None:
            raise ClickHouseHTTPError(
                _BAD_ARGUMENTS, "External data (file parts) is not supported by the embedded store"
            )
        name = part.get_param("name", header="content-disposition")
        if name:
            try:
                fields[name] = part.get_payload(decode=True).decode("utf-8")
            except UnicodeDecodeError:
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, f"Form field {name!r} is not valid UTF-8") from None
    return fields


@dataclass(frozen=True)
class ReaderLimits:
    """What one reader's query may cost the owner: ClickHouse's own per-query limits, which the engine enforces
    (a query past one fails with MEMORY_LIMIT_EXCEEDED, TIMEOUT_EXCEEDED or TOO_MANY_ROWS_OR_BYTES)."""

    max_memory_usage: int = 512 << 20
    max_execution_time: int = 30  # seconds
    max_threads: int = 4
    max_result_bytes: int = 256 << 20

    def set_statement(self) -> str:
        return "SET " + ", ".join(f"{name} = {int(value)}" for name, value in self.__dict__.items())


class StoreServer:
    """Serves the ClickHouse HTTP protocol for the chDB engine this process owns.

    The caller must keep its own chDB client open on ``engine_path`` for the
    server's lifetime: the server opens short-lived handles on that engine and
    must never be the one to (re)start it.
    """

    def __init__(self, engine_path: str, token: str, *, reader_token: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, database: str = DEFAULT_DATABASE, max_body_bytes: int = MAX_BODY_BYTES,
                 max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S,
                 head_timeout_s: float = HEAD_TIMEOUT_S, reader_limits: ReaderLimits = ReaderLimits(),
                 max_queries: dict[str, int] | None = None, query_wait_s: float = QUERY_WAIT_S):
        if not token or reader_token == "" or reader_token == token:
            raise ValueError("StoreServer needs a non-empty token, and a reader token different from it")
        self._engine_path = os.path.realpath(engine_path)
        self._token = token.encode()
        self._reader_token = reader_token.encode() if reader_token else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.head_timeout_s = head_timeout_s
        self._database = database
        self._reader_limits = reader_limits
        self._max_queries = {**MAX_QUERIES, **(max_queries or {})}
        self._query_turns = {credential: threading.BoundedSemaphore(count)
                             for credential, count in self._max_queries.items()}
        self._query_wait_s = query_wait_s
        self._display_name = socket.gethostname()
        self._closed = False
        self._inflight = 0
        self._inflight_changed = threading.Condition()
        self._timezone, self._setting_names, table_functions = self._engine_facts()
        self._guard = StatementGuard(database, table_functions, self._setting_names)
        self._httpd = _BoundedHTTPServer((host, port), _StoreRequestHandler, max_connections)
        self._httpd.store_server = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tokenprobe-store-server", daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return self._httpd.server_address[0]

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting requests and wait up to ``timeout`` s for running ones."""
        with self._inflight_changed:
            if self._closed:
                return
            # From here on no request starts on the engine, which the owner is about to close.
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        with self._inflight_changed:
            if not self._inflight_changed.wait_for(lambda: self._inflight == 0, timeout):
                logger.warning("store server closed with %d request(s) still running", self._inflight)

    # -- engine ---------------------------------------------------------------

    def _engine_facts(self) -> tuple[str, frozenset[str], frozenset[str]]:
        connection = chdb.connect(self._engine_path)
        try:
            def names(sql: str) -> frozenset[str]:
                return frozenset(connection.query(sql, "TabSeparated").bytes().decode().split())

            timezone = connection.query("SELECT timezone()", "TabSeparated").bytes().decode().strip()
            settings = names("SELECT name FROM system.settings")
            table_functions = names("SELECT name FROM system.table_functions")
        finally:
            connection.close()
        return timezone, settings, table_functions

    def check_credentials(self, password: str | None) -> bool:
        """Whether `password` is the reader's token (False: the writer's); raises when it is neither."""
        if password is not None:
            offered = password.encode()
            # Both compared, in constant time, so timing tells nothing of which matched.
            writer = hmac.compare_digest(offered, self._token)
            reader = self._reader_token is not None and hmac.compare_digest(offered, self._reader_token)
            if writer or reader:
                return reader
        raise ClickHouseHTTPError(
                _AUTHENTICATION_FAILED,
                "Authentication failed: wrong or missing token for the embedded tokenprobe store",
                HTTPStatus.UNAUTHORIZED,
            )

    def execute(self, statement: bytes, params: dict[str, str], *, read_only: bool = False) -> _Reply:
        """Run one request's statement on a fresh handle, in its token's turn, and build ClickHouse's reply headers."""
        credential = "reader" if read_only else "writer"
        if not self._query_turns[credential].acquire(timeout=self._query_wait_s):
            raise ClickHouseHTTPError(
                _TOO_MANY_SIMULTANEOUS_QUERIES, f"Too many simultaneous queries with the {credential}'s token "
                f"(at most {self._max_queries[credential]}); retry later", HTTPStatus.SERVICE_UNAVAILABLE)
        with self._inflight_changed:
            if self._closed:
                self._query_turns[credential].release()
                raise ClickHouseHTTPError(_ABORTED, "The embedded store is shutting down")
            self._inflight += 1
        try:
            return self._execute(statement, params, read_only)
        finally:
            self._query_turns[credential].release()
            with self._inflight_changed:
                self._inflight -= 1
                self._inflight_changed.notify_all()

    def _session_settings(self, params: dict[str, str], read_only: bool) -> dict[str, str]:
        """The settings a request asks for in its URL that its token may change (else ClickHouseHTTPError)."""
        settings = {name: value for name, value in params.items()
                    if name not in _TRANSPORT_PARAMETERS and name in self._setting_names}
        for name in settings:
            if read_only and name not in READER_SETTINGS:
                raise ClickHouseHTTPError(_READONLY, f"Cannot modify '{name}' setting with the reader's token of the "
                                          "embedded store", HTTPStatus.FORBIDDEN)
            if name in self._guard.reaching_settings:
                raise ClickHouseHTTPError(_ACCESS_DENIED, f"The setting {name} reaches a file or URL: the embedded "
                                          "store does not take it", HTTPStatus.FORBIDDEN)
        return settings

    def _execute(self, statement: bytes, params: dict[str, str], read_only: bool) -> _Reply:
        output_format = params.get("default_format") or "TabSeparated"
        if not _FORMAT_NAME.match(output_format) or output_format.lower() in _PYTHON_ONLY_FORMATS:
            raise ClickHouseHTTPError(_BAD_ARGUMENTS, f"Unknown output format {output_format!r}")
        bind_params = {name[len("param_"):]: value for name, value in params.items() if name.startswith("param_")}
        settings = self._session_settings(params, read_only)
        if params.get("database", self._database) != self._database:
            raise ClickHouseHTTPError(_ACCESS_DENIED, f"The embedded store serves the database {self._database} only",
                                      HTTPStatus.FORBIDDEN)
        connection = chdb.connect(self._engine_path)
        data_file = None
        try:
            if params.get("database"):
                connection.query(f"USE {_quote_identifier(params['database'])}", "TabSeparated")
            for name, value in settings.items():
                connection.query(f"SET {name} = {_quote_string(value)}", "TabSeparated")
            if read_only:
                # Last: readonly = 1 refuses every later SET and SETTINGS clause, so nothing lifts the limits.
                connection.query(self._reader_limits.set_statement(), "TabSeparated")
                connection.query("SET readonly = 1", "TabSeparated")
            insert = _INSERT_WITH_DATA.match(statement[:_MAX_INSERT_HEAD_BYTES])
            # The client's own words are judged; the INFILE rewrite below is the server's.
            client_sql = _utf8(statement[:insert.start("values")] + b"FORMAT Values" if insert and insert.group("values")
                               else statement[:insert.end()] if insert else statement)
            if not client_sql.strip():
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, "Empty query")
            try:
                judged = self._guard.judge(connection, client_sql, bind_params, reader=read_only,
                                           data_apart=insert is not None)
            except Refused as refusal:
                raise ClickHouseHTTPError(_ACCESS_DENIED, f"The embedded store refuses this statement: {refusal}",
                                          HTTPStatus.FORBIDDEN) from None
            if insert:
                data_file = self._spill_insert_data(statement[insert.end():])
                sql = self._insert_from_file_sql(insert, data_file)
            else:
                sql = judged  # what was judged is what runs
            result = connection.query(sql, output_format, params=bind_params)
        except ClickHouseHTTPError:
            raise
        except Exception as error:  # chDB raises ChdbError or RuntimeError with ClickHouse's message
            raise ClickHouseHTTPError.from_engine(error) from None
        finally:
            connection.close()
            if data_file is not None:
                os.unlink(data_file)
        return self._reply(sql, output_format, result, is_insert=insert is not None)

    @staticmethod
    def _spill_insert_data(data: bytes) -> str:
        # chDB reads insert data from a file (INSERT ... FROM INFILE), not from a stream.
        descriptor, path = tempfile.mkstemp(prefix="tokenprobe-insert-", suffix=".data")
        with os.fdopen(descriptor, "wb") as data_file:
            data_file.write(data)
        return path

    @staticmethod
    def _insert_from_file_sql(insert: re.Match, data_file: str) -> str:
        def part(name: str) -> str:
            value = insert.group(name)
            return value.decode("utf-8") if value else ""

        settings = f" SETTINGS {part('settings')}" if insert.group("settings") else ""
        data_format = "Values" if insert.group("values") else part("format")
        return (f"INSERT INTO {part('table')} {part('columns')} FROM INFILE {_quote_string(data_file)}"
                f"{settings} FORMAT {data_format}")

    def _reply(self, sql: str, output_format: str, result, *, is_insert: bool) -> _Reply:
        body = result.bytes() or b""
        summary = {
            "read_rows": str(result.rows_read()),
            "read_bytes": str(result.bytes_read()),
            # An INFILE insert reads exactly the rows it writes.
            "written_rows": str(result.rows_read() if is_insert else result.rows_written()),
            "written_bytes": str(result.bytes_read() if is_insert else result.bytes_written()),
            "result_bytes": str(len(body)),
            "elapsed_ns": str(int(result.elapsed() * 1e9)),
        }
        headers = {"X-ClickHouse-Summary": json.dumps(summary)}
        if _RESULT_STATEMENT.match(sql):
            trailing = _TRAILING_FORMAT.search(sql)
            result_format = trailing.group(1) if trailing else output_format
            headers["X-ClickHouse-Format"] = result_format
            headers["Content-Type"] = _content_type(result_format)
        else:
            headers["Content-Type"] = "text/plain; charset=UTF-8"
        return _Reply(body, headers)

    def common_headers(self, query_id: str) -> dict[str, str]:
        return {
            "X-ClickHouse-Server-Display-Name": self._display_name,
            "X-ClickHouse-Timezone": self._timezone,
            "X-ClickHouse-Query-Id": query_id,
        }


class _DeadlineReader(io.RawIOBase):
    """A connection's socket as a raw stream whose reads end by a deadline when one is set (a head trickled in a
    byte at a time still ends on time), else after ``timeout_s`` without a byte."""

    def __init__(self, connection: socket.socket, timeout_s: float):
        self._connection = connection
        self._timeout_s = timeout_s
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        timeout = self._timeout_s
        if self.deadline is not None:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError("the request's head did not arrive in time")
        self._connection.settimeout(timeout)
        return self._connection.recv_into(buffer)


class _StoreRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as clickhouse-connect's connection pool expects
    # Garbage is answered with a status line too: no HTTP/0.9 bare bodies.
    default_request_version = "HTTP/1.1"
    server_version = "tokenprobe-store"

    @property
    def _store(self) -> StoreServer:
        return self.server.store_server  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        # An idle, stalled or trickling connection must not pin one of the few workers.
        self._reader = _DeadlineReader(self.connection, self._store.read_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        # Until its head is in, a request must arrive by the deadline, and its connection may be closed to make room.
        self._reader.deadline = time.monotonic() + self._store.head_timeout_s
        self.server.awaiting_head(self.connection)  # type: ignore[attr-defined]
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers: the head is in
        self._reader.deadline = None
        self.server.head_received(self.connection)  # type: ignore[attr-defined]
        return parsed

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        # Request lines carry SQL in the URL; keep them out of the default stderr log.
        logger.debug("store server: %s", format % args)

    def _handle(self) -> None:
        url = urlsplit(self.path)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        query_id = params.get("query_id") or str(uuid.uuid4())
        try:
            # Nothing of the body is read before the head is judged: an answer
            # given first closes the connection, with the body unread.
            body_announced = "Transfer-Encoding" in self.headers or \
                self.headers.get("Content-Length", "").strip() not in ("", "0")
            self.close_connection = body_announced or not self._keep_alive_asked()
            if url.path == "/ping" or (url.path == "/" and self.command == "GET" and not params.get("query")):
                self._send(HTTPStatus.OK, _Reply(b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"}), query_id)
                return
            if url.path != "/":
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, f"No handler for path {url.path}", HTTPStatus.NOT_FOUND)
            read_only = self._store.check_credentials(self._password(params))
            try:
                body = self._read_body()
            except TimeoutError:
                raise ClickHouseHTTPError(_SOCKET_TIMEOUT, f"The request body stalled for "
                                          f"{self._store.read_timeout_s} s", HTTPStatus.REQUEST_TIMEOUT) from None
            self.close_connection = not self._keep_alive_asked()
            statement = self._statement(params, body)
            self._send(HTTPStatus.OK, self._store.execute(statement, params, read_only=read_only), query_id)
        except ClickHouseHTTPError as error:
            self._send_error(error, query_id)
        except Exception as error:  # a handler bug must still answer the client, in ClickHouse's shape
            logger.exception("store server request failed")
            self._send_error(ClickHouseHTTPError(_UNKNOWN_ERROR_CODE, f"Internal error: {error!r}"), query_id)

    def _keep_alive_asked(self) -> bool:
        return self.headers.get("Connection", "").strip().lower() != "close" and self.request_version == "HTTP/1.1"

    def _read_body(self) -> bytes:
        limit = self._store.max_body_bytes
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers:
            if lengths or self.headers["Transfer-Encoding"].strip().lower() != "chunked":
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, "Only Transfer-Encoding: chunked, without Content-Length",
                                          _BAD_REQUEST)
            body = self._read_chunked(limit)
        else:
            if len(set(lengths)) > 1 or not all(_CONTENT_LENGTH.match(value.strip().encode()) for value in lengths):
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, "Invalid Content-Length", _BAD_REQUEST)
            length = int(lengths[0]) if lengths else 0
            if length > limit:
                raise _too_large(limit)
            body = self._read_exactly(length)
        return _decompress(body, self.headers.get("Content-Encoding", ""), limit)

    def _read_exactly(self, size: int) -> bytes:
        data = self.rfile.read(size)
        if len(data) != size:
            raise ClickHouseHTTPError(_BAD_ARGUMENTS, "The request body ended early", _BAD_REQUEST)
        return data

    def _read_chunked(self, limit: int) -> bytes:
        chunks, total = [], 0
        while True:
            size_line = self.rfile.readline(1024).split(b";")[0].strip()
            if not _CHUNK_SIZE.match(size_line):
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, "Malformed chunked request body", _BAD_REQUEST)
            size = int(size_line, 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailer headers carry nothing we use
                return b"".join(chunks)
            total += size
            if total > limit:
                raise _too_large(limit)
            chunks.append(self._read_exactly(size))
            self.rfile.readline(1024)

    def _statement(self, params: dict[str, str], body: bytes) -> bytes:
        content_type = self.headers.get("Content-Type", "")
        if content_type.lower().startswith("multipart/form-data"):
            params.update(_form_fields(content_type, body))
            body = b""
        query = params.get("query", "").encode()
        if self.command == "GET":
            body = b""  # ClickHouse ignores a GET body
        if query and body:
            # ClickHouse joins the URL query and the body with a newline.
            return query + b"\n" + body
        return query or body

    def _password(self, params: dict[str, str]) -> str | None:
        authorization = self.headers.get("Authorization", "")
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "basic":
            try:
                return base64.b64decode(credentials, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return None
        if scheme.lower() == "bearer":
            return credentials.strip()
        return self.headers.get("X-ClickHouse-Key") or params.get("password")

    def _send_error(self, error: ClickHouseHTTPError, query_id: str) -> None:
        reply = _Reply(error.body(), {
            "Content-Type": "text/plain; charset=UTF-8",
            "X-ClickHouse-Exception-Code": str(error.code),
        })
        self._send(error.status, reply, query_id)

    def _send(self, status: int, reply: _Reply, query_id: str) -> None:
        self.send_response(status)
        for name, value in {**self._store.common_headers(query_id), **reply.headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(reply.body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(reply.body)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, up to a fixed number. When all are taken, the connection that has waited longest
    for a request's head is closed to make room for the next; if none is waiting, the next is answered 503."""

    # How long a new connection waits for the thread of the connection closed to make room to end.
    ROOM_WAIT_S = 1.0

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._awaiting_head: dict[socket.socket, None] = {}  # oldest first
        self._awaiting_lock = threading.Lock()

    def awaiting_head(self, connection: socket.socket) -> None:
        with self._awaiting_lock:
            self._awaiting_head[connection] = None

    def head_received(self, connection: socket.socket) -> None:
        with self._awaiting_lock:
            self._awaiting_head.pop(connection, None)

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for its head; whether its thread then made room."""
        with self._awaiting_lock:
            oldest = next(iter(self._awaiting_head), None)
            self._awaiting_head.pop(oldest, None)
        if oldest is None:
            return False
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once, and the thread ends
        except OSError:
            pass  # closed already
        return self._slots.acquire(timeout=self.ROOM_WAIT_S)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False) and not self._make_room():
            body = (f"Code: {_TOO_MANY_SIMULTANEOUS_QUERIES}. DB::Exception: Too many connections to the embedded "
                    "store. (TOO_MANY_SIMULTANEOUS_QUERIES)\n").encode()
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
                                b"Content-Type: text/plain; charset=UTF-8\r\n"
                                b"X-ClickHouse-Exception-Code: %d\r\nContent-Length: %d\r\n\r\n%s"
                                % (_TOO_MANY_SIMULTANEOUS_QUERIES, len(body), body))
            except OSError:
                pass  # the client is gone already
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address) -> None:
        # A client gone mid-answer (a broken pipe, a reset) is the client's doing, not worth a traceback on stderr.
        if isinstance(sys.exc_info()[1], OSError):
            logger.debug("store server: connection from %s ended early", client_address, exc_info=True)
            return
        logger.exception("store server: connection from %s failed", client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.head_received(request)
            self._slots.release()
