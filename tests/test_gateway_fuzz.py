"""The gateway's readers of client and server bytes, fuzzed: any body gives an estimate within its caps
or InvalidRequest (the gateway's 400), never another exception; any response bytes give the usage
the server reported or nothing, and memory stays bounded on garbage."""

from __future__ import annotations

import json
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenprobe.actuator.asgi import UsageScanner
from tokenprobe.actuator.engine import DEFAULT_CONTEXT_TOKENS, MAX_CHOICES
from tokenprobe.actuator.gateway import InvalidRequest, estimate_request

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIZE_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens", "n",
               "num_predict", "n_predict", "best_of")
# JSON a client might send for a size: every type, and numbers at and past every bound.
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.text(max_size=8), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from(SIZE_FIELDS), st.integers(), max_size=2),
)


def request_bodies():
    fields = st.dictionaries(st.sampled_from(SIZE_FIELDS + ("model", "prompt", "messages", "options",
                                                            "parameters", "input")), ODD_VALUES, max_size=6)
    return st.one_of(fields.map(lambda d: json.dumps(d).encode()), st.binary(max_size=2048))


@FUZZ
@given(request_bodies())
def test_any_body_gives_a_capped_estimate_or_a_400(body):
    try:
        estimate = estimate_request(body)
    except InvalidRequest:
        return
    assert isinstance(estimate.model, str)
    assert 0 <= estimate.estimated_tokens <= len(body) + DEFAULT_CONTEXT_TOKENS * MAX_CHOICES


@FUZZ
@given(st.lists(st.binary(max_size=512), max_size=20), st.sampled_from([b"text/event-stream", b"application/json",
                                                                        b"application/x-ndjson", b""]))
def test_any_response_bytes_give_the_reported_usage_or_none(chunks, content_type):
    scanner = UsageScanner()
    scanner.start(content_type)
    for chunk in chunks:
        scanner.feed(chunk)
    total = scanner.total_tokens()
    assert total is None or (isinstance(total, int) and total >= 0)


def test_a_stream_s_usage_is_read_however_it_is_cut():
    stream = (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}\n\ndata: [DONE]\n\n')
    for cut in range(1, len(stream)):
        scanner = UsageScanner()
        scanner.start(b"text/event-stream")
        scanner.feed(stream[:cut])
        scanner.feed(stream[cut:])
        assert scanner.total_tokens() == 12, cut


def test_garbage_responses_keep_the_scanner_small():
    scanner = UsageScanner()
    scanner.start(b"text/event-stream")
    tracemalloc.start()
    try:
        for _ in range(64):  # 4 MiB without a line end, then 4 MiB of short lines
            scanner.feed(b"x" * 65536)
        for _ in range(64):
            scanner.feed(b"data: {\n" * 8192)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"\nusage scanner: peak {peak / 2**20:.1f} MiB over 8 MiB of garbage")
    assert peak < 16 * 2**20
    assert scanner.total_tokens() is None


def test_an_overlong_line_is_skipped_and_the_usage_after_it_still_read():
    scanner = UsageScanner()
    scanner.start(b"text/event-stream")
    for _ in range(40):
        scanner.feed(b"data: " + b"y" * 65536)  # 2.5 MiB in one line, past the line bound
    scanner.feed(b'"}\n\ndata: {"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n')
    assert scanner.total_tokens() == 7
