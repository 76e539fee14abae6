"""A small streaming reverse proxy: the gateway the demo and the tests put in front of a server.

``ReverseProxy`` is an ASGI app that forwards every request to one upstream
base URL and streams the response back chunk by chunk as it arrives, so
server-sent events reach the client unbuffered. ``gateway_app`` wraps it in
``ActuatorMiddleware``: that is a complete gateway enforcing the actuator's
decisions, and ``python -m tokenprobe.actuator.proxy`` runs it.

It is deliberately small: HTTP/1.1 to one upstream, request bodies read
whole (completion requests are small; bigger ones get 413), hop-by-hop
headers dropped, and 502 when the upstream cannot be reached.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import httpx
import prometheus_client
import uvicorn

from ..contract.tenant import DEFAULT_TENANT_HEADER
from .asgi import DEFAULT_MAX_BODY_BYTES, ActuatorMiddleware, send_error
from .auth import ClientAuth
from .gateway import DEFAULT_CONTEXT_TOKENS, DEFAULT_DEADLINE_S, GatewayGuard
from .target import BadTarget, canonical_path, canonical_scope

# Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus
# the ones the HTTP libraries set again on each side. Those a message's own
# Connection header names are hop-by-hop too.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
                        b"proxy-connection"})
DEFAULT_TIMEOUT_S = 120.0


class ReverseProxy:
    def __init__(self, upstream_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_connections: int = 256, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self._upstream_url = httpx.URL(upstream_url)
        # The base path is canonical too, and the request's path is appended to
        # it whole: a canonical path has no `..` to climb out of it with.
        self._base_path = canonical_path(self._upstream_url.raw_path.split(b"?")[0]).rstrip("/").encode("ascii")
        self._timeout = httpx.Timeout(timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._max_body_bytes = max_body_bytes
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
        body = await _read_body(receive, self._max_body_bytes)
        if body is None:
            await send_error(send, 413, "request body too large")
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        target = self._base_path + scope["raw_path"]
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        # The path goes out as decided on: set raw, never re-parsed from a string.
        url = self._upstream_url.copy_with(raw_path=target)
        request = self._client.build_request(scope["method"], url, headers=end_to_end(scope.get("headers", ())),
                                             content=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as error:
            await send_error(send, 502, f"upstream unreachable: {type(error).__name__}")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": end_to_end(response.headers.raw)})
            # Raw bytes: the body goes out exactly as it came, content-encoding included.
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError:
            pass  # the upstream broke off mid-response: the server closes the client's connection too
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


async def _read_body(receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)  # the client left; the upstream call fails or is ignored
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def end_to_end(headers) -> list[tuple[bytes, bytes]]:
    """The headers to forward: all but the hop-by-hop ones and those the Connection header names."""
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def gateway_app(upstream_url: str, guard: GatewayGuard, *, upstream: str, tenant_header: str = DEFAULT_TENANT_HEADER,
                trust_tenant_header: bool = False,
                context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> ActuatorMiddleware:
    """A gateway: the reverse proxy to `upstream_url` behind the actuator hook for `upstream`."""
    return ActuatorMiddleware(ReverseProxy(upstream_url), guard, upstream=upstream, tenant_header=tenant_header,
                              trust_tenant_header=trust_tenant_header, context_tokens=context_tokens)


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
    guard = GatewayGuard(args.actuator, ClientAuth(bearer_token=token), deadline_s=args.deadline)
    if args.metrics_port is not None:
        # Its own port: the upstream's /metrics stays reachable through the gateway.
        prometheus_client.start_http_server(args.metrics_port, addr=args.host, registry=guard.metrics)
    app = gateway_app(args.upstream_url, guard, upstream=args.upstream, tenant_header=args.tenant_header,
                      trust_tenant_header=args.trust_tenant_header, context_tokens=args.context_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
