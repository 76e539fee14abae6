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
token. The writer token has the owner's rights over the store; the reader
token runs every statement with ``readonly = 2`` (reads and settings only:
no INSERT, DDL, DROP or SYSTEM). Neither reaches past the store: a statement
whose syntax tree (the engine's own parser, ``EXPLAIN AST``) calls a table
function, table engine or dictionary source that touches files, URLs, other
servers or programs (``file``, ``url``, ``s3``, ``remote``, ``mysql``,
``executable``, ...), or reads or writes a file (``FROM INFILE``, ``INTO
OUTFILE``), is refused: the owner is the agent, which runs as root.

The owner is the agent, so nothing a client sends may cost it unbounded
memory or threads: a request is authenticated from its head before any of
its body is read; Content-Length and chunk sizes are plain non-negative
numbers (else 400) within ``max_body_bytes`` (else 413), and so is a body
once decompressed (a gzip or zstd bomb stops at the limit); at most
``max_connections`` connections are served at once (the next is answered 503
at once), and a connection that sends nothing for ``read_timeout_s`` is closed.
"""

from __future__ import annotations

import base64
import binascii
import email.parser
import email.policy
import hmac
import json
import logging
import os
import re
import socket
import tempfile
import threading
import uuid
import zlib
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import chdb

logger = logging.getLogger(__name__)

# ClickHouse error codes used for failures this server detects itself.
_BAD_ARGUMENTS = 36
_UNKNOWN_COMPRESSION_METHOD = 89
_ABORTED = 236
_TOO_LARGE = 307  # TOO_MANY_BYTES
_ACCESS_DENIED = 497
_AUTHENTICATION_FAILED = 516
_ERROR_NAMES = {
    _BAD_ARGUMENTS: "BAD_ARGUMENTS",
    _UNKNOWN_COMPRESSION_METHOD: "UNKNOWN_COMPRESSION_METHOD",
    _ABORTED: "ABORTED",
    _TOO_LARGE: "TOO_MANY_BYTES",
    _ACCESS_DENIED: "ACCESS_DENIED",
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
_TOO_MANY_SIMULTANEOUS_QUERIES = 202
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
# `INSERT INTO t [(cols)] [SETTINGS ...] FORMAT f` followed by data. ClickHouse
# starts the data after the format name, its trailing blanks and at most one
# newline. Matched on bytes: the data may be binary. Possessive quantifiers
# keep matching linear: a client cannot make it backtrack over long blanks.
_INSERT_WITH_DATA = re.compile(
    rb"\s*+INSERT\s++INTO\s++(?:TABLE\s++)?"
    rb"(?P<table>(?:`[^`]*+`|\"[^\"]*+\"|[\w.])++)\s*+"
    rb"(?P<columns>\([^()]*+\))?\s*+"
    rb"(?:SETTINGS\s++(?P<settings>(?:[^;\s]++|\s++(?!FORMAT\s))*+)\s++)?"
    rb"FORMAT\s++(?P<format>\w++)[ \t\f]*+(?:\r?\n)?",
    re.IGNORECASE,
)
# The statement part of an insert is short; never scan megabytes of data for it.
_MAX_INSERT_HEAD_BYTES = 256 * 1024

# Table functions, table engines and dictionary sources that reach outside the store (lower case).
_EXTERNAL_ACCESS = frozenset({
    "file", "filecluster", "url", "urlcluster", "http", "s3", "s3cluster", "s3queue", "gcs", "oss", "cosn",
    "azureblobstorage", "azureblobstoragecluster", "azurequeue", "hdfs", "hdfscluster", "remote", "remotesecure",
    "cluster", "clusterallreplicas", "distributed", "clickhouse", "mysql", "materializedmysql", "postgresql",
    "materializedpostgresql", "sqlite", "mongodb", "redis", "jdbc", "odbc", "executable", "executablepool",
    "kafka", "rabbitmq", "nats", "filelog", "hive", "iceberg", "icebergs3", "icebergazure", "iceberghdfs",
    "iceberglocal", "deltalake", "deltalakeazure", "hudi", "python", "arrowflight", "ytsaurus",
})
_AST_FUNCTION = re.compile(r"^\s*(?:Function|FunctionWithKeyValueArguments)\s+(\w+)", re.MULTILINE)
# A literal right under a query's root is its INFILE / OUTFILE name (or that file's compression).
_AST_ROOT_LITERAL = re.compile(r"^ Literal ", re.MULTILINE)
_AST_FILE_ROOTS = ("InsertQuery", "SelectWithUnionQuery", "Show", "Explain", "Describe")

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


def _refuse_external_access(connection, sql: str, bind_params: dict[str, str]) -> None:
    """Refuse `sql` if it reaches files, URLs, other servers or programs (see the module docstring).

    Judged on the engine's own parse of it, so no quoting, comment or case
    trick reads differently here and at execution.
    """
    tree = connection.query("EXPLAIN AST " + sql, "TabSeparated", params=bind_params).bytes().decode()
    reached = {name.lower() for name in _AST_FUNCTION.findall(tree)} & _EXTERNAL_ACCESS
    if reached:
        raise ClickHouseHTTPError(_ACCESS_DENIED, f"The embedded store does not serve {sorted(reached)[0]}(): "
                                  "it reaches outside the store", HTTPStatus.FORBIDDEN)
    if tree.startswith(_AST_FILE_ROOTS) and _AST_ROOT_LITERAL.search(tree):
        raise ClickHouseHTTPError(_ACCESS_DENIED, "The embedded store does not read or write files "
                                  "(INFILE, OUTFILE)", HTTPStatus.FORBIDDEN)


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


class StoreServer:
    """Serves the ClickHouse HTTP protocol for the chDB engine this process owns.

    The caller must keep its own chDB client open on ``engine_path`` for the
    server's lifetime: the server opens short-lived handles on that engine and
    must never be the one to (re)start it.
    """

    def __init__(self, engine_path: str, token: str, *, reader_token: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, max_body_bytes: int = MAX_BODY_BYTES, max_connections: int = MAX_CONNECTIONS,
                 read_timeout_s: float = READ_TIMEOUT_S):
        if not token or reader_token == "" or reader_token == token:
            raise ValueError("StoreServer needs a non-empty token, and a reader token different from it")
        self._engine_path = os.path.realpath(engine_path)
        self._token = token.encode()
        self._reader_token = reader_token.encode() if reader_token else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self._display_name = socket.gethostname()
        self._closed = False
        self._inflight = 0
        self._inflight_changed = threading.Condition()
        self._timezone, self._setting_names = self._engine_facts()
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

    def _engine_facts(self) -> tuple[str, frozenset[str]]:
        connection = chdb.connect(self._engine_path)
        try:
            timezone = connection.query("SELECT timezone()", "TabSeparated").bytes().decode().strip()
            names = connection.query("SELECT name FROM system.settings", "TabSeparated").bytes().decode().split()
        finally:
            connection.close()
        return timezone, frozenset(names)

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
        """Run one request's statement on a fresh handle and build ClickHouse's reply headers."""
        with self._inflight_changed:
            if self._closed:
                raise ClickHouseHTTPError(_ABORTED, "The embedded store is shutting down")
            self._inflight += 1
        try:
            return self._execute(statement, params, read_only)
        finally:
            with self._inflight_changed:
                self._inflight -= 1
                self._inflight_changed.notify_all()

    def _execute(self, statement: bytes, params: dict[str, str], read_only: bool) -> _Reply:
        output_format = params.get("default_format") or "TabSeparated"
        if not _FORMAT_NAME.match(output_format) or output_format.lower() in _PYTHON_ONLY_FORMATS:
            raise ClickHouseHTTPError(_BAD_ARGUMENTS, f"Unknown output format {output_format!r}")
        bind_params = {name[len("param_"):]: value for name, value in params.items() if name.startswith("param_")}
        settings = {
            name: value
            for name, value in params.items()
            if name not in _TRANSPORT_PARAMETERS and name in self._setting_names
        }
        connection = chdb.connect(self._engine_path)
        data_file = None
        try:
            if read_only:
                # First, so no setting the reader sends can lift it.
                connection.query("SET readonly = 2", "TabSeparated")
            if params.get("database"):
                connection.query(f"USE {_quote_identifier(params['database'])}", "TabSeparated")
            for name, value in settings.items():
                connection.query(f"SET {name} = {_quote_string(value)}", "TabSeparated")
            insert = _INSERT_WITH_DATA.match(statement[:_MAX_INSERT_HEAD_BYTES])
            # The client's own words are judged; the INFILE rewrite below is the server's.
            client_sql = _utf8(statement[:insert.end()] if insert else statement)
            if not client_sql.strip():
                raise ClickHouseHTTPError(_BAD_ARGUMENTS, "Empty query")
            _refuse_external_access(connection, client_sql, bind_params)
            if insert:
                data_file = self._spill_insert_data(statement[insert.end():])
                sql = self._insert_from_file_sql(insert, data_file)
            else:
                sql = client_sql
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
        return (f"INSERT INTO {part('table')} {part('columns')} FROM INFILE {_quote_string(data_file)}"
                f"{settings} FORMAT {part('format')}")

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


class _StoreRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as clickhouse-connect's connection pool expects
    # Garbage is answered with a status line too: no HTTP/0.9 bare bodies.
    default_request_version = "HTTP/1.1"
    server_version = "tokenprobe-store"

    @property
    def _store(self) -> StoreServer:
        return self.server.store_server  # type: ignore[attr-defined]

    def setup(self) -> None:
        # An idle or stalled connection must not pin one of the few workers.
        self.timeout = self._store.read_timeout_s
        super().setup()

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
            body = self._read_body()
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
    """A thread per connection, up to a fixed number; the next connection is answered 503 at once."""

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
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

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
