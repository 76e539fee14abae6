"""The canonical request target the gateway decides on and forwards, and the shared list of inference routes."""

from __future__ import annotations

import pytest
from tokenprobe.actuator.target import BadTarget, canonical_path, check_framing
from tokenprobe.contract.apis import is_inference_request


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


@pytest.mark.parametrize("method, path, inference", [
    ("POST", "/v1/chat/completions", True), ("post", "/V1/Messages/", True), ("POST", "/v1/responses", True),
    ("POST", "/api/chat", True), ("POST", "/generate_stream", True), ("POST", "/completion", True),
    ("POST", "/v2/models/llama/versions/1/generate", True), ("POST", "/v2/models/llama/generate_stream", True),
    ("GET", "/v1/chat/completions", False), ("POST", "/v1/models", False), ("GET", "/health", False),
    ("POST", "/tokenize", False), ("POST", "/v2/models/a/b/generate", False),
])
def test_inference_requests(method, path, inference):
    assert is_inference_request(method, path) is inference
