"""The gateway hook: token estimates, usage scanning, and the ASGI middleware against a real actuator.

The middleware is driven with real ASGI messages (as uvicorn would send
them) in front of a small real ASGI upstream app, and it asks a real actuator
over gRPC on loopback.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from tokenprobe.actuator.asgi import ActuatorMiddleware, ResponseWatch, UsageScanner
from tokenprobe.actuator.auth import ClientAuth, ServerAuth
from tokenprobe.actuator.engine import Enforcer, Verdict, VerdictKind
from tokenprobe.actuator.gateway import (
    GatewayGuard,
    InvalidRequest,
    RequestEstimate,
    estimate_request,
    rejection_response,
)
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.actuator.tenant import tenant_of_key
from tokenprobe.actuator.v1 import actuator_pb2_grpc as pb_grpc
from tokenprobe.contract.decisions import BreakerState

from tests.actuator_support import (
    TOKEN,
    apply,
    breaker,
    budget,
    tokens_available,
    unique_upstream,
)
from tests.support import asgi_body, free_port, wait_until

# --------------------------------------------------------------------------- pure pieces


def test_estimate_from_chat_messages_and_max_tokens():
    body = json.dumps({"model": "small", "max_tokens": 100, "n": 2,
                       "messages": [{"role": "user", "content": "x" * 400},
                                    {"role": "user", "content": [{"type": "text", "text": "y" * 40}]}]}).encode()
    assert estimate_request(body) == (estimate_request(body).__class__("small", 110 + 200, 110))


def test_estimate_prefers_max_completion_tokens_and_defaults():
    assert estimate_request(b'{"prompt": "abcd", "max_completion_tokens": 7, "max_tokens": 50}').estimated_tokens == 8
    assert estimate_request(b'{"prompt": ["ab", "cd"]}', default_completion_tokens=10).estimated_tokens == 11
    not_json = estimate_request(b"\xff" * 40, default_completion_tokens=10)
    assert (not_json.model, not_json.estimated_tokens) == ("", 20)
    assert estimate_request(b'[1, 2]', default_completion_tokens=10).estimated_tokens == 12
    assert estimate_request(b'{"model": 5, "max_tokens": null}', default_completion_tokens=3).model == ""


@pytest.mark.parametrize("body, tokens", [
    (b'{"max_tokens": 1000000000, "n": 1000000}', 131_072 * 128),  # capped by the context, n by 128
    (b'{"max_tokens": 18446744073709551615}', 131_072),
    (b'{"max_tokens": 100.0}', 100),
    (b'{"options": {"num_predict": -1}}', 131_072),  # Ollama: until the context is full
    (b'{"n_predict": -1, "prompt": "abcd"}', 131_072),  # llama.cpp
    (b'{"parameters": {"max_new_tokens": 20}, "inputs": "abcd"}', 21),  # TGI
    (b'{"sampling_params": {"max_new_tokens": 20, "n": 2}, "text": "abcd"}', 41),  # SGLang
    (b'{"max_output_tokens": 9, "input": [{"role": "user", "content": "abcd"}]}', 10),  # Responses
    (b'{"max_tokens": 9, "system": "abcd", "messages": []}', 10),  # Anthropic
    (b"[" * 1_000_000 + b"]" * 1_000_000, 131_072),  # nested beyond reason: sized from its length, capped
])
def test_estimates_are_capped_by_the_context_length(body, tokens):
    assert estimate_request(body, default_completion_tokens=0).estimated_tokens == tokens


@pytest.mark.parametrize("body", [b'{"max_tokens": -1}', b'{"max_tokens": 18446744073709551616}',
                                  b'{"max_tokens": 1.5}', b'{"max_tokens": "100"}', b'{"max_tokens": true}',
                                  b'{"max_tokens": 1e30}',
                                  b'{"n": -3}', b'{"max_tokens": NaN}', b'{"max_tokens": Infinity}',
                                  b'{"options": {"num_predict": -3}}'])
def test_nonsense_sizes_are_invalid_requests(body):
    with pytest.raises(InvalidRequest):
        estimate_request(body)


def test_usage_scanner_reads_sse_split_anywhere():
    stream = (b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}\r\n\r\n'
              b"data: [DONE]\n\n")
    for cut in range(0, len(stream), 7):
        scanner = UsageScanner()
        scanner.start(b"text/event-stream; charset=utf-8")
        scanner.feed(stream[:cut])
        scanner.feed(stream[cut:])
        assert scanner.total_tokens() == 42


def test_usage_scanner_reads_json_and_tolerates_absence():
    scanner = UsageScanner()
    scanner.start(b"application/json")
    scanner.feed(b'{"id":"x","usage":{"prompt_tokens":5,')
    scanner.feed(b'"completion_tokens":6}}')
    assert scanner.total_tokens() == 11
    for body in (b'{"id": "x"}', b"not json", b'{"usage": {"total_tokens": -1}}'):
        scanner = UsageScanner()
        scanner.start(b"application/json")
        scanner.feed(body)
        assert scanner.total_tokens() is None


SSE = b"text/event-stream"
JSON = b"application/json"


@pytest.mark.parametrize("status, content_type, body, settled", [
    (200, JSON, b'{"usage": {"prompt_tokens": 7, "completion_tokens": 5}}', 12),  # the server's count
    (400, JSON, b'{"usage": {"prompt_tokens": 7, "completion_tokens": 0}}', 7),  # even on an error
    (400, JSON, b'{"error": {"message": "bad"}}', 0),  # an error without usage generated nothing
    (503, JSON, b"", 0),
    (None, None, None, 0),  # no answer at all: the client left, or the upstream never answered
    (200, SSE, b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n' * 3, 100 + 3),  # prompt + events
    (200, JSON, b"x" * 40, 100 + 10),  # prompt + body bytes / 4
    (200, SSE, b'data: {"x": 1}\n\n' * 5000, 356),  # never more than the estimate
])
def test_every_outcome_settles_at_what_was_generated(status, content_type, body, settled):
    sent = []

    async def send(message):
        sent.append(message)

    async def answer():
        watch = ResponseWatch(send)
        if status is not None:
            await watch.send({"type": "http.response.start", "status": status,
                              "headers": [(b"content-type", content_type)]})
            await watch.send({"type": "http.response.body", "body": body, "more_body": False})
        return watch.observed_tokens(RequestEstimate("m", estimated_tokens=356, prompt_tokens=100))
    assert asyncio.run(answer()) == settled
    assert len(sent) == (0 if status is None else 2)  # passed on untouched


def test_rejection_response_carries_status_and_retry_after():
    status, headers, body = rejection_response(Verdict(VerdictKind.REJECT, 429, retry_after_s=2.2, reason="spent"))
    assert status == 429 and ("retry-after", "3") in headers
    assert json.loads(body)["error"] == {"message": "spent", "type": "rate_limit_exceeded", "code": 429}
    status, headers, _ = rejection_response(Verdict(VerdictKind.REJECT, 503, retry_after_s=0.0))
    assert status == 503 and ("retry-after", "1") in headers


# --------------------------------------------------------------------------- the middleware


class Upstream:
    """A small OpenAI-style ASGI app: records what it received, answers with usage.

    Like a server run with ignore_eos, it generates exactly max_tokens; it
    counts the prompt as 10 tokens.
    """

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        self.bodies.append(body)
        request = json.loads(body) if scope["path"] != "/health" else {}
        completion = request.get("max_tokens", 0)
        usage = {"prompt_tokens": 10, "completion_tokens": completion, "total_tokens": 10 + completion}
        if request.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for event in ({"choices": [{"delta": {"content": "a"}}]}, {"choices": [], "usage": usage}):
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            payload = json.dumps({"id": "cmpl-1", "usage": usage}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload, "more_body": False})


ACME_KEY = "sk-acme-0123456789"
ACME = tenant_of_key(ACME_KEY)


async def call(app, body: bytes, *, path: str = "/v1/chat/completions", api_key: str = ACME_KEY, chunk: int = 64):
    """Send one HTTP request through `app` as an ASGI server would; returns status, headers, body.

    The client also names itself in x-tenant-id, which the gateway believes only when told to."""
    messages = [{"type": "http.request", "body": body[i:i + chunk], "more_body": i + chunk < len(body)}
                for i in range(0, max(len(body), 1), chunk)]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"x-tenant-id", b"acme"),
                         (b"authorization", f"Bearer {api_key}".encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    pending = iter(messages)

    async def receive():
        return next(pending, {"type": "http.disconnect"})
    sent = []

    async def send(message):
        sent.append(message)
    await app(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def introduce(app, api_key: str = ACME_KEY) -> None:
    """One request the upstream accepts with `api_key` (charged to the unknown keys): from then on the key
    is its own tenant."""
    assert asyncio.run(call(app, chat(max_tokens=1), api_key=api_key))[0] == 200


def chat(max_tokens: int = 100, stream: bool = False) -> bytes:
    return json.dumps({"model": "small", "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "z" * 400}]}).encode()


@pytest.fixture(scope="module")
def server():
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})), enforcer=Enforcer(min_dwell_s=3.0)) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as opened:
        yield pb_grpc.ActuatorStub(opened)


@pytest.fixture
def guard(server):
    # A generous deadline: this machine is shared, and the fail-open path is tested on its own.
    with GatewayGuard(f"127.0.0.1:{server.port}", ClientAuth(bearer_token=TOKEN), deadline_s=5.0) as opened:
        yield opened


def test_allowed_requests_pass_through_untouched(guard):
    upstream_app = Upstream()
    app = ActuatorMiddleware(upstream_app, guard, upstream=unique_upstream())
    body = chat()
    status, headers, answer = asyncio.run(call(app, body, chunk=50))
    assert status == 200 and upstream_app.bodies == [body]
    assert json.loads(answer)["usage"]["total_tokens"] == 110


def test_spent_budget_answers_429_without_reaching_the_upstream(guard, stub):
    upstream = unique_upstream()
    apply(stub, budget(upstream, ACME, rate=1.0, burst=1000.0, ttl=300.0))
    upstream_app = Upstream()
    app = ActuatorMiddleware(upstream_app, guard, upstream=upstream)
    introduce(app)
    assert asyncio.run(call(app, chat(max_tokens=500)))[0] == 200  # 600 estimated, 510 settled
    status, headers, answer = asyncio.run(call(app, chat(max_tokens=500)))
    assert status == 429 and int(headers[b"retry-after"]) >= 100  # 110 tokens short at 1 token/s
    assert json.loads(answer)["error"]["type"] == "rate_limit_exceeded"
    assert len(upstream_app.bodies) == 2  # the introduction and the first
    assert asyncio.run(call(app, chat(max_tokens=500), api_key="sk-globex"))[0] == 200  # another tenant


def test_open_breaker_answers_503_and_other_routes_pass(guard, stub):
    upstream = unique_upstream()
    apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=30.0, probe_share=0.1))
    app = ActuatorMiddleware(Upstream(), guard, upstream=upstream)
    status, headers, _ = asyncio.run(call(app, chat()))
    assert status == 503 and 25 <= int(headers[b"retry-after"]) <= 30
    assert asyncio.run(call(app, b"", path="/health"))[0] == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_reservation_is_settled_with_the_servers_usage(guard, stub, stream):
    upstream = unique_upstream()
    apply(stub, budget(upstream, ACME, rate=0.001, burst=10_000.0))
    app = ActuatorMiddleware(Upstream(), guard, upstream=upstream)
    introduce(app)
    assert asyncio.run(call(app, chat(max_tokens=1000, stream=stream)))[0] == 200
    # Estimated 100 (prompt) + 1000 (max_tokens); the server counted 10 + 1000.
    wait_until(lambda: tokens_available(stub, upstream) > 10_000 - 1100 + 1)
    assert tokens_available(stub, upstream) == pytest.approx(10_000 - 1010, abs=1)


def test_paced_request_is_delayed_not_rejected(guard, stub):
    upstream = unique_upstream()
    apply(stub, budget(upstream, ACME, rate=1000.0, burst=1000.0, max_delay_s=5.0))
    upstream_app = Upstream()
    app = ActuatorMiddleware(upstream_app, guard, upstream=upstream)
    introduce(app)
    assert asyncio.run(call(app, chat(max_tokens=900)))[0] == 200  # 910 tokens settled: 90 left
    started = time.monotonic()
    assert asyncio.run(call(app, chat(max_tokens=400)))[0] == 200  # 500 estimated: 0.41 s of refill
    assert time.monotonic() - started >= 0.3
    assert len(upstream_app.bodies) == 3


@pytest.mark.parametrize("body", [b"{" + b" " * 2000 + b"}", b'{"model": "m"'], ids=["too large", "client left"])
def test_a_body_not_read_whole_is_never_forwarded(guard, body):
    upstream_app = Upstream()
    app = ActuatorMiddleware(upstream_app, guard, upstream=unique_upstream(), max_body_bytes=1000)

    async def cut_off():  # the client sends part of the body, then leaves
        messages = iter([{"type": "http.request", "body": body, "more_body": True}])
        sent = []

        async def receive():
            return next(messages, {"type": "http.disconnect"})

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "headers": []}
        await app(scope, receive, send)
        return [m["status"] for m in sent if m["type"] == "http.response.start"]
    statuses = asyncio.run(cut_off())
    assert statuses == ([413] if len(body) > 1000 else [])
    assert upstream_app.bodies == []


def test_middleware_fails_open_when_the_actuator_is_unreachable():
    with GatewayGuard(f"127.0.0.1:{free_port()}", ClientAuth(bearer_token=TOKEN), deadline_s=0.05) as lost:
        upstream_app = Upstream()
        app = ActuatorMiddleware(upstream_app, lost, upstream="vllm-a")
        assert asyncio.run(call(app, chat()))[0] == 200
        assert len(upstream_app.bodies) == 1 and lost.fail_open_total == 1


def test_non_http_scopes_pass_through(guard):
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(ActuatorMiddleware(app, guard, upstream="vllm-a")({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_check_async_matches_check(guard, stub):
    upstream = unique_upstream()
    apply(stub, breaker(upstream, BreakerState.OPEN, cooldown_s=30.0, probe_share=0.1))

    async def both():
        return await asyncio.gather(guard.check_async(upstream, "small", "acme", 1),
                                    guard.check_async(unique_upstream(), "small", "acme", 1))
    rejected, allowed = asyncio.run(both())
    assert (rejected.kind, rejected.http_status) == (VerdictKind.REJECT, 503)
    assert allowed.kind == VerdictKind.ALLOW
    assert guard.check(upstream, "small", "acme", 1).kind == VerdictKind.REJECT
