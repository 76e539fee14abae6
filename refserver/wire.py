"""HTTP/1.1 on a raw socket: request parsing and response framing.

The server writes straight to the socket (one sendall per SSE chunk) so the
bytes on the wire, and the syscalls that carry them, are exactly what an
observer in the kernel should see. That rules out http.server's buffered
writers, and it is why request parsing lives here too.
"""

from __future__ import annotations

import email.utils
import re
import socket
import time
from dataclasses import dataclass, field

RECV_SIZE = 65536
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_CHUNK_LINE_BYTES = 4096

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}

_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_HEADER_END = re.compile(rb"\r?\n\r?\n")


class BadRequest(Exception):
    """The request cannot be served; answer with `status` and close the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class PeerClosed(Exception):
    """The client closed or reset the connection, or stopped sending in time."""


@dataclass
class HttpRequest:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes
    first_byte_ns: int  # CLOCK_MONOTONIC when this request's first byte was received
    arrival_ns: int  # CLOCK_MONOTONIC after its last body byte was read
    keep_alive: bool = field(init=False)

    def __post_init__(self) -> None:
        connection = self.headers.get("connection", "").lower()
        tokens = {t.strip() for t in connection.split(",")}
        if self.version == "HTTP/1.0":
            self.keep_alive = "keep-alive" in tokens
        else:
            self.keep_alive = "close" not in tokens

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


class RequestReader:
    """Reads successive HTTP/1.1 requests from one connection (keep-alive, pipelining)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buffer = bytearray()
        self._last_recv_ns = 0

    @property
    def last_recv_ns(self) -> int:
        """CLOCK_MONOTONIC of the latest recv() that returned data (0 before any)."""
        return self._last_recv_ns

    def _recv(self) -> None:
        try:
            data = self._sock.recv(RECV_SIZE)
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise PeerClosed(str(exc)) from exc
        if not data:
            raise PeerClosed("connection closed by peer")
        self._last_recv_ns = time.monotonic_ns()
        self._buffer += data

    def read_request(self) -> HttpRequest | None:
        """The next request, or None when the peer closed cleanly between requests.

        Raises BadRequest for malformed input and PeerClosed for a connection
        lost in the middle of a request.
        """
        # RFC 9112 2.2: ignore empty lines before the request line.
        while True:
            stripped = self._buffer.lstrip(b"\r\n")
            del self._buffer[: len(self._buffer) - len(stripped)]
            if self._buffer:
                break
            try:
                self._recv()
            except PeerClosed:
                return None
        first_byte_ns = self._last_recv_ns

        head = self._read_head()
        method, target, version, headers = _parse_head(head)
        if _expects_body(headers) and headers.get("expect", "").lower() == "100-continue":
            self._send_continue()
        body = self._read_body(headers)
        return HttpRequest(method, target, version, headers, body, first_byte_ns, time.monotonic_ns())

    def _read_head(self) -> bytes:
        while True:
            match = _HEADER_END.search(self._buffer)
            if match:
                head = bytes(self._buffer[: match.start()])
                del self._buffer[: match.end()]
                return head
            if len(self._buffer) > MAX_HEADER_BYTES:
                raise BadRequest(431, f"request head larger than {MAX_HEADER_BYTES} bytes")
            self._recv()

    def _send_continue(self) -> None:
        try:
            self._sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc

    def _read_exact(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._recv()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _read_line(self) -> bytes:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end]).rstrip(b"\r")
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > MAX_CHUNK_LINE_BYTES:
                raise BadRequest(400, "chunk size line too long")
            self._recv()

    def _read_body(self, headers: dict[str, str]) -> bytes:
        if "transfer-encoding" in headers:
            return self._read_chunked_body()
        length = headers.get("content-length")
        if length is None:
            return b""
        size = int(length)  # validated by _parse_head
        if size > MAX_BODY_BYTES:
            raise BadRequest(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        return self._read_exact(size)

    def _read_chunked_body(self) -> bytes:
        body = bytearray()
        while True:
            size_text = self._read_line().split(b";", 1)[0].strip()
            if not size_text or not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size_text):
                raise BadRequest(400, f"invalid chunk size {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            if len(body) + size > MAX_BODY_BYTES:
                raise BadRequest(413, f"request body larger than {MAX_BODY_BYTES} bytes")
            body += self._read_exact(size)
            if self._read_line() != b"":
                raise BadRequest(400, "chunk data not followed by CRLF")
        # Trailer fields (ignored) end with an empty line.
        trailer_bytes = 0
        while line := self._read_line():
            trailer_bytes += len(line)
            if trailer_bytes > MAX_HEADER_BYTES:
                raise BadRequest(431, "request trailers too large")
        return bytes(body)


def _expects_body(headers: dict[str, str]) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0") != "0"


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    lines = head.split(b"\n")
    request_line = lines[0].rstrip(b"\r")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1]:
        raise BadRequest(400, f"malformed request line {request_line[:80]!r}")
    method, target, version = (p.decode("latin-1") for p in parts)
    if not re.fullmatch(r"HTTP/\d\.\d", version):
        raise BadRequest(400, f"malformed HTTP version {version[:20]!r}")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(505, f"{version} is not supported; use HTTP/1.1")

    headers: dict[str, str] = {}
    content_lengths: set[str] = set()
    for raw in lines[1:]:
        line = raw.rstrip(b"\r")
        if line[:1] in (b" ", b"\t"):
            raise BadRequest(400, "obsolete header line folding is not accepted")
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            raise BadRequest(400, f"malformed header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key == "content-length":
            content_lengths.update(v.strip() for v in text.split(","))
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    if "transfer-encoding" in headers:
        if content_lengths:
            # Both framings at once is the classic request-smuggling shape.
            raise BadRequest(400, "both Transfer-Encoding and Content-Length given")
        if headers["transfer-encoding"].lower() != "chunked":
            raise BadRequest(501, f"unsupported Transfer-Encoding {headers['transfer-encoding'][:40]!r}")
    elif content_lengths:
        if len(content_lengths) != 1 or not next(iter(content_lengths)).isdigit():
            raise BadRequest(400, f"invalid Content-Length {headers['content-length'][:40]!r}")
        headers["content-length"] = next(iter(content_lengths))
    return method, target, version, headers


def response_head(status: int, headers: list[tuple[str, str]]) -> bytes:
    """Status line and header block, lowercase names as uvicorn writes them."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    lines.append(f"date: {email.utils.formatdate(usegmt=True)}")
    lines.extend(f"{name}: {value}" for name, value in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk: lowercase hex size without padding, as the vLLM capture shows."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


LAST_CHUNK = b"0\r\n\r\n"
