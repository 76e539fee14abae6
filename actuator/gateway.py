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
Failing open is never silent: each request let through unguarded counts in
``tokenprobe_gateway_fail_open_total{reason}`` (``guard.metrics``, a
Prometheus registry), and each episode logs one line when it starts and one
when it ends. An actuator that refuses the gateway's credentials
(UNAUTHENTICATED) is a configuration error, not an outage: logged as an error.

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
from prometheus_client import CollectorRegistry, Counter

from ..contract.decisions import InvalidDecision
from . import wire
from .auth import ClientAuth
from .engine import (
    DEFAULT_CONTEXT_TOKENS,
    MAX_CHOICES,
    Enforcer,
    Verdict,
    VerdictKind,
    retry_after_header,
)
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
        self.metrics = CollectorRegistry(auto_describe=True)
        self._fail_open_counter = Counter(
            "tokenprobe_gateway_fail_open", "Requests let through unguarded because the actuator did not answer",
            ["reason"], registry=self.metrics)
        self._failing: str | None = None  # why the actuator does not answer, while it does not
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
            return self._cached_check(upstream, model, tenant, estimated_tokens)
        request = pb.CheckRequest(upstream=upstream, model=model, tenant=tenant, estimated_tokens=estimated_tokens)
        try:
            response = self._stub.Check(request, timeout=self.deadline_s, metadata=self._metadata)
        except grpc.RpcError as error:
            return self._fail_open(_reason(error))
        return self._answered(response)

    async def check_async(self, upstream: str, model: str, tenant: str, estimated_tokens: int) -> Verdict:
        """check() for an event loop: waits on the call without holding a thread."""
        if self._cache is not None:
            return self._cached_check(upstream, model, tenant, estimated_tokens)
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
            return self._fail_open(_reason(error))
        return self._answered(response)

    def _cached_check(self, upstream: str, model: str, tenant: str, estimated_tokens: int) -> Verdict:
        verdict = self._cache.check(upstream, model, tenant, estimated_tokens)  # type: ignore[union-attr]
        if self._failing is not None and not verdict.reservation_id and verdict.allowed:
            self._count_fail_open(self._failing)  # admitted with no live decision stream behind it
        return verdict

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
            return self._fail_open("malformed_answer")
        self._mark_failing(None)
        return verdict

    def _fail_open(self, reason: str) -> Verdict:
        self._count_fail_open(reason)
        self._mark_failing(reason)
        return Verdict(VerdictKind.ALLOW, reason=f"actuator did not answer ({reason}): fail-open")

    def _count_fail_open(self, reason: str) -> None:
        with self._lock:
            self.fail_open_total += 1
        self._fail_open_counter.labels(reason).inc()

    def _mark_failing(self, reason: str | None) -> None:
        """Log the start of an episode of failing open (and a change of its cause) and its end, once each."""
        with self._lock:
            if reason == self._failing:
                return
            self._failing = reason
        if reason is None:
            log.info("actuator answers again; enforcing its decisions")
        elif reason == _UNAUTHENTICATED:
            log.error("configuration error: the actuator refuses this gateway's credentials (UNAUTHENTICATED); "
                      "requests go through unguarded until the token or certificate is fixed")
        else:
            log.warning("actuator did not answer (%s): letting requests through until it does", reason)

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
                self._mark_failing(_reason(error))
            except Exception:
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
                self._mark_failing(None)
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


_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.name.lower()


def _reason(error: grpc.RpcError) -> str:
    """The fail-open reason label: the gRPC status, lower case (a small, fixed set)."""
    return error.code().name.lower()


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
    estimated_tokens: int  # prompt + completion, capped
    prompt_tokens: int = 0


class InvalidRequest(ValueError):
    """A request whose sizing fields make no sense (answer 400, as the server would)."""


_MAX_COUNT = 2 ** 64
# Completion limits by dialect: OpenAI chat, Responses, completions, Anthropic (also legacy), TGI, SGLang,
# Ollama, llama.cpp. The last two take -1 (and Ollama -2) for "until the context is full".
_COMPLETION_LIMITS = (("max_completion_tokens",), ("max_output_tokens",), ("max_tokens",),
                      ("max_tokens_to_sample",), ("parameters", "max_new_tokens"),
                      ("sampling_params", "max_new_tokens"), ("options", "num_predict"), ("n_predict",))
_UNBOUNDED_LIMITS = frozenset({("options", "num_predict"), ("n_predict",)})
_CHOICE_COUNTS = (("n",), ("best_of",), ("parameters", "best_of"), ("sampling_params", "n"))
_TEXT_FIELDS = ("messages", "prompt", "input", "instructions", "system", "inputs", "text")


def estimate_request(body: bytes, default_completion_tokens: int = DEFAULT_COMPLETION_TOKENS,
                     context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> RequestEstimate:
    """Model and prompt + completion tokens of a completion request, in any dialect it knows.

    The prompt is estimated from its length; the completion from the
    dialect's limit (max_tokens and its kin) times the number of choices,
    else `default_completion_tokens`. Each choice is capped at the context
    length, which no server generates past, so a request cannot claim (and
    be charged, or park the bucket in debt for) more than it can use. Only
    sizes are read: nothing of the text is kept. Raises InvalidRequest for a
    limit or count that is not a non-negative integer below 2**64.
    """
    try:
        request = json.loads(body)
        prompt_chars = sum(_text_length(request.get(name)) for name in _TEXT_FIELDS) \
            if isinstance(request, dict) else 0
    except (ValueError, UnicodeDecodeError, RecursionError):  # not JSON, or nested beyond reason
        request = None
    if not isinstance(request, dict):
        prompt = min(context_tokens, math.ceil(len(body) / CHARS_PER_TOKEN))
        return RequestEstimate("", min(context_tokens, prompt + default_completion_tokens), prompt)
    model = request.get("model") if isinstance(request.get("model"), str) else ""
    completion = default_completion_tokens
    for path in _COMPLETION_LIMITS:
        value = _count(request, path, allow_unbounded=path in _UNBOUNDED_LIMITS)
        if value is not None:
            completion = context_tokens if value < 0 else min(value, context_tokens)
            break
    choices = max((_count(request, path) or 1 for path in _CHOICE_COUNTS), default=1)
    choices = max(1, min(choices, MAX_CHOICES))
    prompt = min(math.ceil(prompt_chars / CHARS_PER_TOKEN), context_tokens)
    return RequestEstimate(model, min(prompt + completion * choices, context_tokens * choices), prompt)


def _count(request: dict, path: tuple[str, ...], *, allow_unbounded: bool = False) -> int | None:
    """The integer at `path` in the request; None when absent; InvalidRequest when not a count."""
    value = request
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 100.0 is a count to lenient servers
    name = ".".join(path)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {json.dumps(value)[:40]}")
    if allow_unbounded and value in (-1, -2):
        return -1
    if not 0 <= value < _MAX_COUNT:
        raise InvalidRequest(f"{name} must be between 0 and 2**64, got {str(value)[:40]}")
    return value


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

