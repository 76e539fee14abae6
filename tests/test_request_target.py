"""The canonical request target the gateway decides on and forwards, and the shared list of inference routes."""

from __future__ import annotations

import pytest
from tokenprobe.actuator.target import BadTarget, canonical_path, check_framing
from tokenprobe.contract.apis import (
    dialect_routes,
    is_inference_request,
    is_inference_route,
    request_kind,
)


def dialect_paths() -> list[str]:
    """The request paths the agent reads a dialect from (its table), and TGI's and SGLang's shared /generate."""
    return ["/generate", *sorted(dialect_routes())]


@pytest.mark.parametrize("raw, canonical", [
    (b"/v1/chat/completions", "/v1/chat/completions"),
    (b"//v1//chat/./completions", "/v1/chat/completions"),
    (b"/a/b/../../../c", "/c"),
    (b"/%2E%2e/%7euser/%41", "/~user/A"),
    (b"/a%3ab%5b", "/a%3Ab%5B"),
    (b"/caf%c3%a9", "/caf%C3%A9"),
    (b"/a/", "/a/"),
    (b"/a/..", "/"),
    (b"/", "/"),
])
def test_canonical_path(raw, canonical):
    assert canonical_path(raw) == canonical
    assert canonical_path(canonical.encode()) == canonical  # a canonical path is its own canonical form


@pytest.mark.parametrize("raw", [b"v1/chat", b"/a%2Fb", b"/a%3F", b"/a%23", b"/a%25", b"/a%00", b"/a%5C", b"/a\\b",
                                 b"/a%", b"/a%4", b"/a%g0", b"/a b", b"/\xc3\xa9", b"/a?b", b"/a#b",
                                 b"/v1/chat/completions;x=1", b"/v1/chat/completions%3bx", b"/v1/chat/completions%20",
                                 b"/" + b"a" * 9000])
def test_targets_without_a_canonical_form_are_refused(raw):
    with pytest.raises(BadTarget):
        canonical_path(raw)


@pytest.mark.parametrize("headers", [
    [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")],
    [(b"content-length", b"5"), (b"content-length", b"6")],
    [(b"content-length", b"-1")],
    [(b"content-length", b"+5")],
])
def test_ambiguous_framing_is_refused(headers):
    with pytest.raises(BadTarget):
        check_framing(headers)


def test_framing_that_one_reading_allows_passes():
    check_framing([(b"content-length", b"5"), (b"Content-Length", b"5")])
    check_framing([(b"transfer-encoding", b"chunked")])


@pytest.mark.parametrize("method, path, guarded", [
    ("POST", "/v1/chat/completions", True), ("post", "/V1/Messages/", True), ("POST", "/v1/responses", True),
    ("POST", "/api/chat", True), ("POST", "/generate_stream", True), ("POST", "/completion", True),
    ("POST", "/v2/models/llama/versions/1/generate", True), ("POST", "/v2/models/llama/generate_stream", True),
    ("GET", "/v1/chat/completions", False), ("POST", "/v1/models", False), ("GET", "/health", False),
    ("POST", "/tokenize", True), ("POST", "/v2/models/a/b/generate", False),
    ("POST", "/v1/audio/speech", True), ("POST", "/detokenize", True), ("POST", "/openai/v1/chat/completions", True),
    ("POST", "/api/v1/chat/completions", True), ("POST", "/openai/deployments/gpt/chat/completions", True),
    ("POST", "/engines/davinci/completions", True), ("POST", "/proxy/v1/messages/", True),
    ("POST", "/openai/v1/models", False), ("POST", "/v1/chat/completions/x", False), ("POST", "/v1x/chat", False),
    ("POST", "/v1/engines/davinci/chat/completions", True), ("POST", "/chat_tokenize", True),
    ("POST", "/v1/batches", True), ("POST", "/v1beta/models/gemini-2.0-flash:streamGenerateContent", True),
    ("POST", "/v1/projects/p/locations/l/publishers/google/models/gemini:generateContent", True),
    ("POST", "/model/anthropic.claude-v2/invoke-with-response-stream", True),
    ("POST", "/v1beta/models/gemini:list", False), ("POST", "/model/x/list", False),
])
def test_guarded_requests(method, path, guarded):
    assert (request_kind(method, path, has_body=True) == "guard") is guarded


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/chat_tokenize", "/v1/messages/count_tokens",
                                  "/v1/batches"])
def test_tokenizer_and_batch_routes_are_guarded_but_run_no_inference(path):
    """The gateway guards them; the analytics count no latency of theirs."""
    assert request_kind("POST", path, has_body=True) == "guard"
    assert not is_inference_request("POST", path)


@pytest.mark.parametrize("method, has_body, kind", [
    ("POST", True, "guard"), ("GET", False, "pass"), ("HEAD", False, "pass"), ("OPTIONS", False, "pass"),
    ("GET", True, "refuse"), ("PUT", True, "refuse"), ("PATCH", False, "refuse"), ("DELETE", False, "refuse"),
    ("FOO", True, "refuse"),
])
def test_every_method_on_an_inference_route_is_guarded_passed_or_refused(method, has_body, kind):
    assert request_kind(method, "/v1/chat/completions", has_body) == kind
    assert request_kind(method, "/v1/models", has_body) == "pass"


def test_every_route_the_agent_reads_a_dialect_from_is_guarded():
    assert all(is_inference_route(path) for path in dialect_paths()), dialect_paths()
