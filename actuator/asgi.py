"""ASGI middleware: the actuator's hook in front of a Python gateway's routes.

For each request to an inference route (contract/apis.py) it reads the
body whole (to estimate tokens; a body that is too large, too slow or cut off
is answered 413/408 or dropped, never forwarded), asks the ``GatewayGuard``,
and then either answers 429/503 with Retry-After itself, waits out a delay,
or passes the request on. Other methods than POST on those routes are
refused (405) unless safe and bodiless. The reservation is settled on every
outcome: with the response's token usage where it reports one (the ``usage``
object of a JSON body or of the last SSE events — the server's own count),
so the tenant pays what the server counted, not what was guessed; with
nothing for an error or a response that never started; with the prompt and
the output that passed for a success without usage.

    app = ActuatorMiddleware(proxy_app, GatewayGuard("127.0.0.1:50051", ClientAuth(bearer_token=...)),
                             upstream="vllm-a")
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..agent.capture.dialects import OPENAI_CHAT
from ..agent.capture.dialects.json_scan import count, json_object
from ..contract.apis import INFERENCE_METHOD, SAFE_METHODS, request_kind
from ..contract.tenant import DEFAULT_TENANT_HEADER
from .gateway import (
    CHARS_PER_TOKEN,
    DEFAULT_COMPLETION_TOKENS,
    DEFAULT_CONTEXT_TOKENS,
    GatewayGuard,
    InvalidRequest,
    RequestEstimate,
    estimate_request,
    rejection_response,
)
from .target import BadTarget, canonical_scope
from .tenant import TenantIdentity

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# The longest a client may take to send a request body; a slower one is answered 408 and closed.
DEFAULT_BODY_TIMEOUT_S = 30.0
# The request bodies a gateway holds at once, over all its requests: past it, 503.
DEFAULT_MAX_BUFFERED_BODY_BYTES = 256 * 1024 * 1024
# A JSON response bigger than this is passed through without reading its usage.
MAX_JSON_RESPONSE_BYTES = 4 * 1024 * 1024
MAX_LABEL_LENGTH = 256
# An SSE line longer than this cannot be a usage event: it is skipped, not held, so a response without
# line ends cannot grow the gateway's memory.
MAX_EVENT_LINE_BYTES = 1 << 20
_ALLOWED_ON_INFERENCE_ROUTES = ", ".join(sorted({INFERENCE_METHOD, *SAFE_METHODS}))


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
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        bodies: BodyAllowance | None = None,
        default_completion_tokens: int = DEFAULT_COMPLETION_TOKENS,
        context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    ):
        self._app = app
        self._guard = guard
        self._upstream = upstream
        self._tenant_header = tenant_header.lower().encode("latin-1")
        self._identity = TenantIdentity(tenant_header, trust_header=trust_tenant_header)
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._bodies = bodies or BodyAllowance()
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
        headers = scope.get("headers", ())
        kind = request_kind(scope["method"], scope["path"], has_body(headers))
        if kind == "refuse":
            await send_error(send, 405, f"{scope['method']} is not served on an inference route: POST runs the "
                             "model; GET, HEAD and OPTIONS pass without a body",
                             [(b"allow", _ALLOWED_ON_INFERENCE_ROUTES.encode())])
            return
        if kind == "pass":
            await self._app(scope, receive, send)
            return
        async with self._bodies.read(receive, self._max_body_bytes, self._body_timeout_s) as body:
            if body.outcome is not BodyOutcome.COMPLETE:
                await refuse_body(send, body.outcome)  # a body that did not arrive whole is never forwarded
                return
            await self._guarded(scope, body.data, receive, send)

    async def _guarded(self, scope, body: bytes, receive, send) -> None:
        """Estimate, ask, and answer or pass the request on; settle what it was charged."""
        headers = scope.get("headers", ())
        try:
            estimate = estimate_request(body, self._default_completion_tokens, self._context_tokens)
        except InvalidRequest as error:
            await send_error(send, 400, str(error))
            return
        tenant = self._identity(headers)
        scope = self._naming_tenant(scope, tenant.tenant)
        verdict = await self._guard.check_async(self._upstream, estimate.model[:MAX_LABEL_LENGTH],
                                                tenant.tenant, estimate.estimated_tokens)
        if not verdict.allowed:
            status, headers, payload = rejection_response(verdict)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
            return
        response = ResponseWatch(send)
        try:
            if verdict.delay_s > 0:
                await asyncio.sleep(verdict.delay_s)
            await self._app(scope, replay(body, receive), response.send)
        finally:
            # Every outcome settles: an upstream error, a cut stream or a client that left
            # refunds what was not generated, so no reservation keeps a bucket spent.
            self._identity.accepted(tenant, response.status)
            if verdict.reservation_id:
                self._guard.settle(verdict.reservation_id, response.observed_tokens(estimate))

    def _naming_tenant(self, scope, tenant: str) -> dict:
        """`scope` with the tenant header set to the tenant charged, whatever the client sent,
        so the agent at the server books the request to the same tenant."""
        if not self._tenant_header:
            return scope
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != self._tenant_header]
        return {**scope, "headers": [*headers, (self._tenant_header, tenant.encode("latin-1"))]}


async def send_error(send, status: int, message: str, headers=()) -> None:
    """Answer a request with an OpenAI-style error of the gateway's own."""
    body = json.dumps({"error": {"message": message, "type": "gateway_error", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def has_body(headers) -> bool:
    """Whether a request's headers announce a body (a non-zero Content-Length, or any Transfer-Encoding)."""
    return any(name.lower() == b"transfer-encoding"
               or (name.lower() == b"content-length" and value.strip().lstrip(b"0") != b"")
               for name, value in headers)


class BodyOutcome(enum.Enum):
    COMPLETE = "complete"
    TOO_LARGE = "too large"
    TIMED_OUT = "timed out"
    GATEWAY_FULL = "gateway full"  # the bodies held over all requests reached their limit
    CLIENT_LEFT = "client left"  # or the server cut the body as malformed: what came is not the request


@dataclass(frozen=True)
class RequestBody:
    outcome: BodyOutcome
    data: bytes = b""


class BodyAllowance:
    """The request-body bytes a gateway holds at once, over all its requests.

    Each request is bounded on its own (size, time), but a thousand clients each sending most of
    a large body, slowly, would still add up: a body that would take the total past `max_bytes`
    is refused (503) instead. A body counts from its first byte until its request is done."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES):
        self.max_bytes = max_bytes
        self.held = 0

    @contextlib.asynccontextmanager
    async def read(self, receive, limit: int, timeout_s: float) -> AsyncIterator[RequestBody]:
        """Read a whole request body (at most `limit` bytes, within `timeout_s` seconds), held until the block ends."""
        chunks: list[bytes] = []
        try:
            outcome = await self._read(receive, chunks, limit, timeout_s)
            yield RequestBody(outcome, b"".join(chunks) if outcome is BodyOutcome.COMPLETE else b"")
        finally:
            self.held -= sum(map(len, chunks))

    async def _read(self, receive, chunks: list[bytes], limit: int, timeout_s: float) -> BodyOutcome:
        size = 0
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return BodyOutcome.CLIENT_LEFT
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return BodyOutcome.TOO_LARGE
                    if self.held + len(chunk) > self.max_bytes:
                        return BodyOutcome.GATEWAY_FULL
                    self.held += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return BodyOutcome.COMPLETE
        except TimeoutError:
            return BodyOutcome.TIMED_OUT


_BODY_REFUSALS = {
    BodyOutcome.TOO_LARGE: (413, "request body too large", ()),
    BodyOutcome.TIMED_OUT: (408, "request body not received in time", ()),
    BodyOutcome.GATEWAY_FULL: (503, "the gateway holds as many request bodies as it may", ((b"retry-after", b"1"),)),
}


async def refuse_body(send, outcome: BodyOutcome) -> None:
    """Answer a body that was not read whole (413, 408, 503) and close the connection; nothing to a client
    that left."""
    if outcome is BodyOutcome.CLIENT_LEFT:
        return
    status, message, headers = _BODY_REFUSALS[outcome]
    await send_error(send, status, message, [(b"connection", b"close"), *headers])


def replay(body: bytes, receive):
    """A receive() that first hands back the body the middleware read, then reads on (for the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replaying_receive():
        if pending:
            return pending.pop()
        return await receive()
    return replaying_receive


class ResponseWatch:
    """Passes a response on, noting its status and the usage it reports."""

    def __init__(self, send):
        self._send = send
        self.status: int | None = None  # None until the response starts
        self._scanner = UsageScanner()

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self._scanner.start(dict(message.get("headers", ())).get(b"content-type", b""))
        elif message["type"] == "http.response.body":
            self._scanner.feed(message.get("body", b""))
        await self._send(message)

    def observed_tokens(self, estimate: RequestEstimate) -> int:
        """The tokens to settle at: the server's usage where it reported one; else nothing for a response
        that never started or is an error, and for a success the prompt plus the output that passed."""
        usage = self._scanner.total_tokens()
        if usage is not None:
            return usage
        if self.status is None or not 200 <= self.status < 300:
            return 0
        return min(estimate.estimated_tokens, estimate.prompt_tokens + self._scanner.output_tokens_passed())


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
        self._data_events = 0  # SSE data lines: one token each, where no usage says how many
        self._body_bytes = 0

    def start(self, content_type: bytes) -> None:
        self._sse = content_type.split(b";")[0].strip().lower() == b"text/event-stream"

    def feed(self, chunk: bytes) -> None:
        self._body_bytes += len(chunk)
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
        if not line.startswith(b"data:"):
            return
        self._data_events += 1
        if b'"usage"' in line:
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

    def output_tokens_passed(self) -> int:
        """A generous count of the output tokens that passed, for a response with no usage: one per SSE
        data event, else one per CHARS_PER_TOKEN bytes of body."""
        return self._data_events if self._sse else math.ceil(self._body_bytes / CHARS_PER_TOKEN)
