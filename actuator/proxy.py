"""A small streaming reverse proxy: the gateway the demo and the tests put in front of a server.

``ReverseProxy`` is an ASGI app that forwards every request to one upstream
base URL and streams the response back chunk by chunk as it arrives, so
server-sent events reach the client unbuffered. ``gateway_app`` wraps it in
``ActuatorMiddleware``: that is a complete gateway enforcing the actuator's
decisions, and ``python -m tokenprobe.actuator.proxy`` runs it.

It is deliberately small: HTTP/1.1 to one upstream, request bodies read
whole (completion requests are small; bigger ones get 413), hop-by-hop
headers dropped, and 502 when the upstream cannot be reached. Nothing a
client or the upstream does holds its resources for longer than a limit
(``ProxyLimits``):

- at most ``max_in_flight`` requests at the upstream at once (its connection
  pool is as large, so the pool never queues): past that, 503 at once;
- the upstream has ``first_byte_timeout_s`` to start its answer (else 504)
  and ``idle_timeout_s`` between two chunks of it (else the response is cut);
- a client that leaves cancels its upstream request, which closes that
  connection (an inference server stops generating when its client's
  connection closes), and a client that stops reading its answer for
  ``client_timeout_s`` is cut off; a body not received whole within it, 408;
- a body over ``max_body_bytes`` is 413, and the bodies held at once, over all
  requests, stay within ``max_buffered_body_bytes`` (503 past it);
- the request head (size, header count, time) is bounded by the HTTP server
  (actuator/http_limits.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import prometheus_client
import uvicorn

from ..contract.tenant import DEFAULT_TENANT_HEADER
from .asgi import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUFFERED_BODY_BYTES,
    ActuatorMiddleware,
    BodyAllowance,
    BodyOutcome,
    refuse_body,
    send_error,
)
from .auth import ClientAuth
from .gateway import DEFAULT_CONTEXT_TOKENS, DEFAULT_DEADLINE_S, GatewayGuard
from .http_limits import ABORT_EXTENSION, HeadLimits, limited_http_protocol
from .target import BadTarget, canonical_path, canonical_scope

# Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus
# the ones the HTTP libraries set again on each side. Those a message's own
# Connection header names are hop-by-hop too.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
                        b"proxy-connection"})
# Headers some frameworks route by instead of the request line: the gateway judged the method and path
# it read, so none of them travels on to change what the upstream serves.
ROUTING_OVERRIDES = frozenset({b"x-http-method-override", b"x-http-method", b"x-method-override",
                               b"x-original-url", b"x-rewrite-url", b"x-original-method"})


@dataclass(frozen=True)
class ProxyLimits:
    max_in_flight: int = 256  # requests at the upstream at once
    first_byte_timeout_s: float = 120.0  # for the upstream's response head: queueing and prefill included
    idle_timeout_s: float = 60.0  # between two chunks of the upstream's response
    connect_timeout_s: float = 5.0
    client_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # for a client to send its body, or take each chunk
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_buffered_body_bytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES  # over all requests at once

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.max_body_bytes, self.max_buffered_body_bytes) < 1 or min(
                self.first_byte_timeout_s, self.idle_timeout_s, self.connect_timeout_s, self.client_timeout_s) <= 0:
            raise ValueError(f"proxy limits must be positive: {self}")


class ReverseProxy:
    def __init__(self, upstream_url: str, limits: ProxyLimits = ProxyLimits(), bodies: BodyAllowance | None = None):
        self._upstream_url = httpx.URL(upstream_url)
        # The base path is canonical too, and the request's path is appended to
        # it whole: a canonical path has no `..` to climb out of it with.
        self._base_path = canonical_path(self._upstream_url.raw_path.split(b"?")[0]).rstrip("/").encode("ascii")
        self.limits = limits
        self._bodies = bodies or BodyAllowance(limits.max_buffered_body_bytes)
        # The first byte's deadline is kept around the whole send; httpx's own read timeout only
        # guards each read, so it is left to the idle deadline around each chunk.
        self._timeout = httpx.Timeout(connect=limits.connect_timeout_s, read=None, write=limits.client_timeout_s,
                                      pool=limits.connect_timeout_s)
        self._pool = httpx.Limits(max_connections=limits.max_in_flight,
                                  max_keepalive_connections=limits.max_in_flight)
        self.in_flight = 0
        # Made on first use: an httpx client belongs to the event loop that first uses it.
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets are not proxied: uvicorn closes them
        try:
            scope = canonical_scope(scope)
        except BadTarget as error:
            await send_error(send, 400, str(error))
            return
        # Behind the hook, a guarded body is counted twice (its copy and this one): erring on the safe side.
        async with self._bodies.read(receive, self.limits.max_body_bytes, self.limits.client_timeout_s) as body:
            if body.outcome is not BodyOutcome.COMPLETE:
                await refuse_body(send, body.outcome)  # a body cut off is not the request: never forwarded
                return
            if self.in_flight >= self.limits.max_in_flight:
                await send_error(send, 503, f"the upstream has {self.in_flight} requests in flight, the gateway's "
                                 "limit", [(b"retry-after", b"1")])
                return
            self.in_flight += 1
            try:
                await _unless_client_leaves(receive, self._forward(scope, body.data, send))
            finally:
                self.in_flight -= 1

    async def _forward(self, scope, body: bytes, send) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._pool)
        target = self._base_path + scope["raw_path"]
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        # The path goes out as decided on: set raw, never re-parsed from a string.
        url = self._upstream_url.copy_with(raw_path=target)
        headers = [(k, v) for k, v in end_to_end(scope.get("headers", ())) if k.lower() not in ROUTING_OVERRIDES]
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            async with asyncio.timeout(self.limits.first_byte_timeout_s):
                response = await self._client.send(request, stream=True)
        except TimeoutError:
            await send_error(send, 504, f"the upstream sent no answer within {self.limits.first_byte_timeout_s:g} s")
            return
        except httpx.PoolTimeout:
            await send_error(send, 503, "no connection to the upstream free in time", [(b"retry-after", b"1")])
            return
        except httpx.HTTPError as error:
            await send_error(send, 502, f"upstream unreachable: {type(error).__name__}")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": end_to_end(response.headers.raw)})
            # Raw bytes: the body goes out exactly as it came, content-encoding included.
            chunks = response.aiter_raw()
            while True:
                async with asyncio.timeout(self.limits.idle_timeout_s):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                async with asyncio.timeout(self.limits.client_timeout_s):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (httpx.HTTPError, TimeoutError):
            # The upstream broke off or went quiet, or the client stopped reading: the response is
            # left unfinished, and the client's connection dropped.
            await _abort_client(scope)
        finally:
            await response.aclose()

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _unless_client_leaves(receive, forwarding) -> None:
    """Run `forwarding` until it ends or the client disconnects, whichever is first.

    After the body, the next ASGI message a server delivers is the disconnect: waiting for it is how a
    proxy learns that its client left, and then the upstream request is cancelled, not finished."""
    work = asyncio.ensure_future(forwarding)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.done() and not work.cancelled() and work.exception() is not None:
        raise work.exception()


async def _abort_client(scope) -> None:
    """Drop the client's connection at once, what is buffered for it unsent (where the server offers it)."""
    extension = scope.get("extensions", {}).get(ABORT_EXTENSION)
    if extension is not None:
        extension["abort"]()
        await asyncio.sleep(0)  # the server sees the connection lost before the app returns


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def end_to_end(headers) -> list[tuple[bytes, bytes]]:
    """The headers to forward: all but the hop-by-hop ones and those the Connection header names."""
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def gateway_app(upstream_url: str, guard: GatewayGuard, *, upstream: str, tenant_header: str = DEFAULT_TENANT_HEADER,
                trust_tenant_header: bool = False, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                limits: ProxyLimits = ProxyLimits()) -> ActuatorMiddleware:
    """A gateway: the reverse proxy to `upstream_url` behind the actuator hook for `upstream`."""
    bodies = BodyAllowance(limits.max_buffered_body_bytes)  # one allowance for the hook and the proxy
    return ActuatorMiddleware(ReverseProxy(upstream_url, limits, bodies), guard, upstream=upstream,
                              tenant_header=tenant_header, trust_tenant_header=trust_tenant_header,
                              max_body_bytes=limits.max_body_bytes, body_timeout_s=limits.client_timeout_s,
                              bodies=bodies, context_tokens=context_tokens)


# Each limit's option, the field it sets, and what it bounds.
_LIMIT_OPTIONS = (
    ("--max-in-flight", ProxyLimits, "max_in_flight", "requests at the upstream at once; past it, 503"),
    ("--first-byte-timeout", ProxyLimits, "first_byte_timeout_s",
     "seconds for the upstream to start its answer; past it, 504"),
    ("--idle-timeout", ProxyLimits, "idle_timeout_s",
     "seconds between two chunks of the upstream's answer; past it, the response is cut"),
    ("--client-timeout", ProxyLimits, "client_timeout_s",
     "seconds for a client to send its body (else 408) or to take each chunk of its answer (else it is cut off)"),
    ("--max-body-bytes", ProxyLimits, "max_body_bytes", "largest request body; past it, 413"),
    ("--max-buffered-body-bytes", ProxyLimits, "max_buffered_body_bytes",
     "request bodies held at once, over all requests; past it, 503"),
    ("--max-head-bytes", HeadLimits, "max_head_bytes", "largest request line and header fields together; past it, 431"),
    ("--max-header-fields", HeadLimits, "max_header_fields", "most header fields in a request; past it, 431"),
    ("--head-timeout", HeadLimits, "head_timeout_s", "seconds for a client to send its request head; past it, 408"),
)


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenprobe.actuator.proxy`: a gateway in its own process."""
    parser = argparse.ArgumentParser(
        prog="python -m tokenprobe.actuator.proxy",
        description="A streaming reverse proxy to one inference server, enforcing the actuator's decisions "
                    "(429/503 with Retry-After on reject; fails open when the actuator does not answer).")
    parser.add_argument("--upstream-url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--upstream", required=True,
                        help="the server's name in decisions: NODE:PORT as the agent names it")
    parser.add_argument("--actuator", required=True, help="the actuator's host:port")
    parser.add_argument("--token-file", type=Path, required=True, help="file holding a bearer token for the actuator")
    parser.add_argument("--tenant-header", default=DEFAULT_TENANT_HEADER,
                        help="request header the gateway sets to the tenant it charged, for the agent to read "
                             "(default %(default)s, as the agent reads it)")
    parser.add_argument("--trust-tenant-header", action="store_true",
                        help="take the tenant from the client's --tenant-header, for clients behind a proxy that "
                             "sets it; by default the tenant is a hash of the client's API key, so no client can "
                             "spend another's budget")
    parser.add_argument("--context-tokens", type=_positive_int, default=DEFAULT_CONTEXT_TOKENS,
                        help="the longest context the server takes; caps each request's token estimate "
                             "(default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds to wait for the actuator before admitting the request (default %(default)s)")
    limits = parser.add_argument_group("limits", "what bounds each client and the upstream")
    for flag, owner, field, meaning in _LIMIT_OPTIONS:
        default = getattr(owner, field)
        whole = isinstance(default, int)
        limits.add_argument(flag, dest=field, type=_positive_int if whole else _positive_float,
                            metavar="N" if whole else "SECONDS", default=default, help=f"{meaning} (default %(default)s)")
    parser.add_argument("--metrics-port", type=int,
                        help="serve the gateway's own Prometheus /metrics on this port (on --host), e.g. "
                             "tokenprobe_gateway_fail_open_total{reason}")
    args = parser.parse_args(argv)
    try:
        token = args.token_file.read_text().strip()
    except OSError as error:
        print(f"gateway: cannot read the token file: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    guard = GatewayGuard(args.actuator, ClientAuth(bearer_token=token), deadline_s=args.deadline)
    if args.metrics_port is not None:
        # Its own port: the upstream's /metrics stays reachable through the gateway.
        prometheus_client.start_http_server(args.metrics_port, addr=args.host, registry=guard.metrics)
    proxy_limits, head_limits = (owner(**{field: getattr(args, field) for _, of, field, _ in _LIMIT_OPTIONS
                                          if of is owner}) for owner in (ProxyLimits, HeadLimits))
    app = gateway_app(args.upstream_url, guard, upstream=args.upstream, tenant_header=args.tenant_header,
                      trust_tenant_header=args.trust_tenant_header, context_tokens=args.context_tokens,
                      limits=proxy_limits)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                http=limited_http_protocol(head_limits))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
