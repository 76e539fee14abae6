"""ASGI middleware: the actuator's hook in front of a Python gateway's routes.

For each completion request it reads the body (to estimate tokens), asks the
``GatewayGuard``, and then either answers 429/503 with Retry-After itself,
waits out a delay, or passes the request on untouched. When the response
reports its token usage (the ``usage`` object of a JSON body or of the last
SSE events — the upstream server's own count), the reservation is settled
with it, so the tenant pays what the server counted, not what was guessed.

    app = ActuatorMiddleware(proxy_app, GatewayGuard("127.0.0.1:50051", ClientAuth(bearer_token=...)),
                             upstream="vllm-a")
"""

from __future__ import annotations

import asyncio
import json

from ..agent.capture.dialects import OPENAI_CHAT
from ..agent.capture.dialects.json_scan import count, json_object
from ..contract.apis import is_inference_request
from ..contract.tenant import DEFAULT_TENANT_HEADER
from .gateway import (
    DEFAULT_COMPLETION_TOKENS,
    DEFAULT_CONTEXT_TOKENS,
    GatewayGuard,
    InvalidRequest,
    estimate_request,
    rejection_response,
)
from .target import BadTarget, canonical_scope
from .tenant import TenantIdentity

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# A JSON response bigger than this is passed through without reading its usage.
MAX_JSON_RESPONSE_BYTES = 4 * 1024 * 1024
MAX_LABEL_LENGTH = 256
# An SSE line longer than this cannot be a usage event: it is skipped, not held, so a response without
# line ends cannot grow the gateway's memory.
MAX_EVENT_LINE_BYTES = 1 << 20


class ActuatorMiddleware:
    def __init__(
        self,
        app,
        guard: GatewayGuard,
        *,
        upstream: str,
        tenant_header: str = DEFAULT_TENANT_HEADER,
        trust_tenant_header: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        default_completion_tokens: int = DEFAULT_COMPLETION_TOKENS,
        context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    ):
        self._app = app
        self._guard = guard
        self._upstream = upstream
        self._tenant_header = tenant_header.lower().encode("latin-1")
        self._identity = TenantIdentity(tenant_header, trust_header=trust_tenant_header)
        self._max_body_bytes = max_body_bytes
        self._default_completion_tokens = default_completion_tokens
        self._context_tokens = context_tokens

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        # Decide on the canonical path and hand the same one on, so the app
        # forwards exactly the request that was judged.
        try:
            scope = canonical_scope(scope)
        except BadTarget as error:
            await send_error(send, 400, str(error))
            return
        if not is_inference_request(scope["method"], scope["path"]):
            await self._app(scope, receive, send)
            return
        received, body = await _read_body(receive, self._max_body_bytes)
        try:
            # A body cut at the limit is not JSON: it is then estimated from its size.
            estimate = estimate_request(body, self._default_completion_tokens, self._context_tokens)
        except InvalidRequest as error:
            await send_error(send, 400, str(error))
            return
        tenant = self._identity(scope.get("headers", ()))
        scope = self._naming_tenant(scope, tenant)
        verdict = await self._guard.check_async(self._upstream, estimate.model[:MAX_LABEL_LENGTH],
                                                tenant, estimate.estimated_tokens)
        if not verdict.allowed:
            status, headers, payload = rejection_response(verdict)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
            return
        if verdict.delay_s > 0:
            await asyncio.sleep(verdict.delay_s)
        if verdict.reservation_id:
            send = _settling_send(send, self._guard, verdict.reservation_id)
        await self._app(scope, _replay(received, receive), send)

    def _naming_tenant(self, scope, tenant: str) -> dict:
        """`scope` with the tenant header set to the tenant charged, whatever the client sent,
        so the agent at the server books the request to the same tenant."""
        if not self._tenant_header:
            return scope
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != self._tenant_header]
        return {**scope, "headers": [*headers, (self._tenant_header, tenant.encode("latin-1"))]}


async def send_error(send, status: int, message: str) -> None:
    """Answer a request with an OpenAI-style error of the gateway's own."""
    body = json.dumps({"error": {"message": message, "type": "gateway_error", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _read_body(receive, limit: int) -> tuple[list[dict], bytes]:
    """Read the request body, stopping once more than `limit` bytes came.

    Returns the messages read (to replay to the app) and the body bytes read.
    """
    received: list[dict] = []
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        received.append(message)
        if message["type"] != "http.request":  # the client went away
            return received, b"".join(chunks)
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False) or size > limit:
            return received, b"".join(chunks)


def _replay(received: list[dict], receive):
    """A receive() that first hands back what the middleware read, then reads on."""
    pending = list(received)

    async def replaying_receive():
        if pending:
            return pending.pop(0)
        return await receive()
    return replaying_receive


def _settling_send(send, guard: GatewayGuard, reservation_id: str):
    scanner = UsageScanner()

    async def settling_send(message):
        if message["type"] == "http.response.start":
            scanner.start(dict(message.get("headers", ())).get(b"content-type", b""))
        elif message["type"] == "http.response.body":
            scanner.feed(message.get("body", b""))
            if not message.get("more_body", False):
                observed = scanner.total_tokens()
                if observed is not None:
                    guard.settle(reservation_id, observed)
        await send(message)
    return settling_send


class UsageScanner:
    """Finds the token usage in an OpenAI-style response, JSON or SSE.

    It reads the stream as it passes and keeps only the usage figures (and,
    for SSE, the current partial line): no response text is retained.
    """

    def __init__(self) -> None:
        self._sse = False
        self._partial = b""
        self._skipping_line = False  # inside a line over MAX_EVENT_LINE_BYTES
        self._json_body: list[bytes] | None = []
        self._json_size = 0
        self._usage: tuple[int, int] | None = None  # (prompt, completion) tokens

    def start(self, content_type: bytes) -> None:
        self._sse = content_type.split(b";")[0].strip().lower() == b"text/event-stream"

    def feed(self, chunk: bytes) -> None:
        if self._sse:
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            if self._skipping_line and lines:
                lines.pop(0)  # the end of the overlong line
                self._skipping_line = False
            if len(self._partial) > MAX_EVENT_LINE_BYTES:
                self._partial, self._skipping_line = b"", True
            for line in lines:
                self._read_event_line(line.rstrip(b"\r"))
        elif self._json_body is not None:
            self._json_size += len(chunk)
            if self._json_size > MAX_JSON_RESPONSE_BYTES:
                self._json_body = None
            else:
                self._json_body.append(chunk)

    def _read_event_line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or b'"usage"' not in line:
            return
        self._take_usage(line[5:])

    def _take_usage(self, document: bytes) -> None:
        parsed = json_object(document)
        if parsed is not None:
            # The agent's reading of the same object: both sides count tokens alike.
            prompt, completion = (count(value) for value in OPENAI_CHAT.usage(parsed))
            if prompt is not None and completion is not None:
                self._usage = (prompt, completion)

    def total_tokens(self) -> int | None:
        """prompt + completion tokens as the server reported them, None if it did not."""
        if not self._sse and self._json_body:
            self._take_usage(b"".join(self._json_body))
        return None if self._usage is None else sum(self._usage)
