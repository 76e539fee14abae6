"""The gateway's side: ask the actuator before sending a request upstream.

``GatewayGuard`` is the plain-function hook: ``guard.check(upstream, model,
tenant, estimated_tokens)`` returns a ``Verdict`` (allow, delay or reject with
the HTTP status and Retry-After to answer). It works in one of two modes:

- ask (default): one Check call per request, with a short deadline;
- watch: a background stream (WatchDecisions) keeps a local copy of the
  decisions, and requests are admitted locally with no call at all. Each
  gateway then holds its own buckets, so a tenant's budget applies per gateway.

Either way it fails open: an actuator that is down, slow or answers nonsense
costs at most the deadline and the request goes through, because an
observability tool must never be the outage. In watch mode the cached
decisions keep their expiry, so a lost actuator also lapses to normal.

``estimate_request`` and ``rejection_response`` are the other two pieces any
gateway needs: tokens from an OpenAI-style body, and the 429/503 to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
from dataclasses import dataclass

import grpc

from ..contract.decisions import InvalidDecision
from . import wire
from .auth import ClientAuth
from .engine import Enforcer, Verdict, VerdictKind, retry_after_header
from .v1 import actuator_pb2 as pb
from .v1 import actuator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 0.05
DEFAULT_COMPLETION_TOKENS = 256
# Rough characters per token for English text under BPE tokenizers; only the
# estimate uses it, and settlement corrects it with the server's real count.
CHARS_PER_TOKEN = 4
_SETTLE_DEADLINE_S = 2.0
_WATCH_BACKOFF_S = (0.2, 5.0)
_KEEPALIVE_OPTIONS = (("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000))


class GatewayGuard:
    def __init__(self, target: str, auth: ClientAuth, *, deadline_s: float = DEFAULT_DEADLINE_S,
                 watch: bool = False):
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = deadline_s
        self._channel = auth.channel(target, options=_KEEPALIVE_OPTIONS)
        self._stub = pb_grpc.ActuatorStub(self._channel)
        self._metadata = auth.metadata()
        self._lock = threading.Lock()
        self.fail_open_total = 0  # requests let through because the actuator could not answer
        self._reachable = True
        self._closed = threading.Event()
        self._cache: Enforcer | None = None
        self._synced = threading.Event()
        self._watch_call = None
        if watch:
            # The server already enforced the dwell time on what it streams.
            self._cache = Enforcer(min_dwell_s=0.0)
            self._watcher = threading.Thread(target=self._watch, name="actuator-watch", daemon=True)
            self._watcher.start()

    # -- admission -----------------------------------------------------------

    def check(self, upstream: str, model: str, tenant: str, estimated_tokens: int) -> Verdict:
        if self._cache is not None:
            return self._cache.check(upstream, model, tenant, estimated_tokens)
        request = pb.CheckRequest(upstream=upstream, model=model, tenant=tenant, estimated_tokens=estimated_tokens)
        try:
            response = self._stub.Check(request, timeout=self.deadline_s, metadata=self._metadata)
        except grpc.RpcError as error:
            return self._fail_open(error.code().name)
        return self._answered(response)

    async def check_async(self, upstream: str, model: str, tenant: str, estimated_tokens: int) -> Verdict:
        """check() for an event loop: waits on the call without holding a thread."""
        if self._cache is not None:
            return self._cache.check(upstream, model, tenant, estimated_tokens)
        request = pb.CheckRequest(upstream=upstream, model=model, tenant=tenant, estimated_tokens=estimated_tokens)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        call = self._stub.Check.future(request, timeout=self.deadline_s, metadata=self._metadata)
        call.add_done_callback(lambda _: _wake(loop, done))
        try:
            await done
        except asyncio.CancelledError:
            call.cancel()
            raise
        try:
            response = call.result()
        except grpc.RpcError as error:
            return self._fail_open(error.code().name)
        return self._answered(response)

    def settle(self, reservation_id: str, observed_tokens: int) -> None:
        """Report a request's real token count; never blocks, never raises on a lost actuator."""
        if not reservation_id:
            return
        if self._cache is not None:
            self._cache.settle(reservation_id, observed_tokens)
            return
        request = pb.SettleRequest(reservation_id=reservation_id, observed_tokens=observed_tokens)
        call = self._stub.Settle.future(request, timeout=_SETTLE_DEADLINE_S, metadata=self._metadata)
        call.add_done_callback(_log_settle_failure)

    def _answered(self, response: pb.CheckResponse) -> Verdict:
        try:
            verdict = wire.verdict_from_proto(response)
        except ValueError:
            return self._fail_open("malformed answer")
        self._mark_reachable(True, "")
        return verdict

    def _fail_open(self, why: str) -> Verdict:
        with self._lock:
            self.fail_open_total += 1
        self._mark_reachable(False, why)
        return Verdict(VerdictKind.ALLOW, reason=f"actuator did not answer ({why}): fail-open")

    def _mark_reachable(self, reachable: bool, why: str) -> None:
        if reachable == self._reachable:
            return
        self._reachable = reachable
        if reachable:
            log.info("actuator answers again; enforcing its decisions")
        else:
            log.warning("actuator did not answer (%s): letting requests through until it does", why)

    # -- watch mode ------------------------------------------------------------

    def wait_synced(self, timeout: float) -> bool:
        """Watch mode: wait until the decisions in force have been received once."""
        return self._synced.wait(timeout)

    def _watch(self) -> None:
        backoff = _WATCH_BACKOFF_S[0]
        while not self._closed.is_set():
            try:
                self._watch_call = self._stub.WatchDecisions(pb.WatchDecisionsRequest(), metadata=self._metadata)
                self._follow(self._watch_call)
                backoff = _WATCH_BACKOFF_S[0]
            except grpc.RpcError as error:
                if self._closed.is_set():
                    return
                log.debug("decision stream ended: %s", error.code().name)
            except Exception:  # noqa: BLE001 - this thread must outlive any one bad stream
                log.exception("decision stream failed; reconnecting")
            self._closed.wait(backoff)
            backoff = min(backoff * 2, _WATCH_BACKOFF_S[1])

    def _follow(self, stream) -> None:
        snapshot = []
        in_snapshot = True
        for message in stream:
            if in_snapshot and message.end_of_snapshot:
                self._cache.replace_all(snapshot)  # type: ignore[union-attr]
                in_snapshot = False
                self._synced.set()
                continue
            try:
                decision = wire.decision_from_proto(message.decision)
                if in_snapshot:
                    snapshot.append(decision)
                else:
                    self._cache.apply(decision)  # type: ignore[union-attr]
            except InvalidDecision as error:  # e.g. expired in transit
                log.debug("skipping streamed decision %s: %s", message.decision.id, error)

    def close(self) -> None:
        self._closed.set()
        if self._watch_call is not None:
            self._watch_call.cancel()
        self._channel.close()

    def __enter__(self) -> GatewayGuard:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _wake(loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
    # Runs on a gRPC thread: hand over to the loop, which may be closed already.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))


def _log_settle_failure(call) -> None:
    if call.cancelled() or call.code() == grpc.StatusCode.OK:
        return
    log.debug("settlement not delivered (%s): the estimate stands", call.code().name)


@dataclass(frozen=True)
class RequestEstimate:
    model: str
    estimated_tokens: int


def estimate_request(body: bytes, default_completion_tokens: int = DEFAULT_COMPLETION_TOKENS) -> RequestEstimate:
    """Model and prompt + completion tokens of an OpenAI-style completion request.

    The prompt is estimated from its length; the completion from max_tokens
    (or max_completion_tokens) times n, else `default_completion_tokens`.
    Only sizes are read: nothing of the text is kept.
    """
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        request = None
    if not isinstance(request, dict):
        return RequestEstimate("", math.ceil(len(body) / CHARS_PER_TOKEN) + default_completion_tokens)
    model = request.get("model") if isinstance(request.get("model"), str) else ""
    prompt_chars = _text_length(request.get("messages")) + _text_length(request.get("prompt"))
    completion = default_completion_tokens
    for field in ("max_completion_tokens", "max_tokens"):
        value = request.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            completion = value
            break
    choices = request.get("n")
    if isinstance(choices, int) and not isinstance(choices, bool) and choices > 1:
        completion *= choices
    return RequestEstimate(model, math.ceil(prompt_chars / CHARS_PER_TOKEN) + completion)


def _text_length(value) -> int:
    """Characters of text in a prompt, a message list or content parts, however nested."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_length(item) for item in value)
    if isinstance(value, dict):
        return _text_length(value.get("content")) + _text_length(value.get("text"))
    return 0


def rejection_response(verdict: Verdict) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and an OpenAI-style error body for a rejected request."""
    status = verdict.http_status or 503
    kind = "rate_limit_exceeded" if status == 429 else "overloaded"
    body = json.dumps({"error": {"message": verdict.reason or "rejected by the actuator",
                                 "type": kind, "code": status}}).encode()
    headers = [("content-type", "application/json"), ("retry-after", retry_after_header(verdict.retry_after_s)),
               ("content-length", str(len(body)))]
    return status, headers, body

