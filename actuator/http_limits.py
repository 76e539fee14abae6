"""The gateway's HTTP/1.1 server: uvicorn's httptools protocol, with the request head bounded.

uvicorn reads a request head of any size (a 64 MiB header was read whole and
forwarded), with any number of fields, for as long as the client takes to
send it (a connection that sends one byte a minute is never closed). A
gateway in front of a shared server cannot allow any of it, so this protocol
refuses, before any application code runs:

- a head (request line and fields) over ``max_head_bytes``: 431, connection closed;
- more than ``max_header_fields`` fields: 431;
- a head not received whole within ``head_timeout_s`` of the connection
  opening, or of the first byte of a later request on it: 408.

The head is counted as it arrives, so memory stays within the limit plus one
read of the socket, however large the client's head.

It also offers the application a way to drop a connection at once, answer
unflushed (``ABORT_EXTENSION`` in the scope's extensions): ASGI has none, and
a response left unfinished is closed by uvicorn only once what it buffered
reaches the client, which a client that stopped reading never lets happen.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

ABORT_EXTENSION = "tokenprobe.abort"


@dataclass(frozen=True)
class HeadLimits:
    max_head_bytes: int = 64 * 1024
    max_header_fields: int = 100
    head_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_head_bytes < 1 or self.max_header_fields < 1 or not self.head_timeout_s > 0:
            raise ValueError(f"head limits must be positive: {self}")


class _HeadRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LimitedHttpProtocol(HttpToolsProtocol):
    """One client connection; `limits` is set on the subclass `limited_http_protocol` makes."""

    limits = HeadLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_bytes = 0
        self._header_fields = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._reading_head = True
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            if isinstance(error.__context__, _HeadRefused):
                self._refuse(error.__context__.status, str(error.__context__))
                return
            self._refuse(400, "Invalid HTTP request received.")
            return
        except httptools.HttpParserError:
            self._refuse(400, "Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._reading_head:
            # Everything this read held belongs to the unfinished head.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(431, f"request head larger than {self.limits.max_head_bytes} bytes")

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {ABORT_EXTENSION: {"abort": self.transport.abort}}
        self._reading_head = True
        self._header_fields = 0
        if self._head_timer is None:  # a later request on a kept-alive connection
            self._head_bytes = 0
            self._start_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        if self._header_fields > self.limits.max_header_fields:
            raise _HeadRefused(431, f"more than {self.limits.max_header_fields} header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    # The head's deadline

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._reading_head and not self.transport.is_closing():
            self._refuse(408, f"request head not received within {self.limits.head_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` in plain text and close the connection (uvicorn's own 400, for any status)."""
        self._stop_head_timer()
        self.logger.debug("refused a request: %s", message)  # debug: an attack must not flood the log
        body = message.encode("ascii")
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: text/plain; charset=utf-8\r\n",
                        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                        b"connection: close\r\n\r\n", body])
        self.transport.write(b"".join(content))
        self.transport.close()


def limited_http_protocol(limits: HeadLimits) -> type[LimitedHttpProtocol]:
    """The protocol class to give uvicorn (`http=`), enforcing `limits`."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})
