"""Tests for the API dialects (agent/capture/dialects/) through the assembler.

Every stream below is byte-exact as its API reference documents it (event
names, field order, `data:` spacing, line ends), with the values shortened;
the vLLM streams are the real captures in tests/data. Each response is fed
one event per segment, event i stamped EVENT_T0 + i, so a timestamp names the
event that produced it; each is also fed one byte per segment, which must
read the same.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tokenprobe.agent.capture import dialects
from tokenprobe.agent.capture.dialects.base import MAX_ENGINE_MS
from tokenprobe.agent.capture.exchange import Exchange
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.capture.kernel.records import DIR_READ, DIR_WRITE, EV_DATA
from tokenprobe.agent.capture.tracker import ConnectionTracker
from tokenprobe.agent.capture.wire.assembler import HttpConnectionAssembler
from tokenprobe.contract.requests import REQUEST_COLUMN_TYPES
from tokenprobe.store.rows import RowSchema

from tests.test_tracker import ev

DATA = Path(__file__).parent / "data"
KEY = b"dialect-test-key"
RESP_T0 = 500
EVENT_T0 = 1_000


def request(path: str, body: bytes = b'{"model": "m", "stream": true}') -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def response_head(content_type: str) -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run(path: str, events: list[bytes], content_type: str = "text/event-stream",
        byte_by_byte: bool = False, outcome: str = "complete") -> Exchange:
    """One exchange: each event one chunk (and one segment), then the last chunk."""
    asm = HttpConnectionAssembler(fingerprint_key=KEY)
    wire = request(path)
    assert asm.feed_request_bytes(1, wire, len(wire)) == []
    segments = [(RESP_T0, response_head(content_type))]
    segments += [(EVENT_T0 + i, chunk(event)) for i, event in enumerate(events)]
    segments.append((EVENT_T0 + len(events), b"0\r\n\r\n"))
    done = []
    for ts, data in segments:
        pieces = [data[i:i + 1] for i in range(len(data))] if byte_by_byte else [data]
        for piece in pieces:
            done += asm.feed_response_bytes(ts, piece, len(piece))
    [exchange] = done
    assert exchange.outcome == outcome
    return exchange


def run_both(path: str, events: list[bytes], content_type: str = "text/event-stream",
             outcome: str = "complete") -> Exchange:
    exchange = run(path, events, content_type, outcome=outcome)
    assert run(path, events, content_type, byte_by_byte=True, outcome=outcome) == exchange
    return exchange


def same_but_path(a: Exchange, b: Exchange) -> bool:
    """a and b read alike, their request paths (and so request sizes) aside."""
    return dataclasses.replace(a, path=b.path, req_bytes=b.req_bytes) == b


def sse(obj, event: str | None = None) -> bytes:
    """An SSE event as the servers write it: compact JSON, `data: `, LF line ends."""
    name = b"" if event is None else b"event: %s\n" % event.encode()
    return name + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def ndjson(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def at(*indexes: int) -> list[int]:
    """The timestamps of the events with these indexes."""
    return [EVENT_T0 + i for i in indexes]


def vllm_events(name: str) -> list[bytes]:
    """The SSE events of a real vLLM capture (one per HTTP chunk there)."""
    raw = (DATA / "fixtures" / f"vllm_sse_{name}.bin").read_bytes()
    body = raw.split(b"\r\n\r\n", 1)[1]
    events = []
    while True:
        size_line, body = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return events
        events.append(body[:size])
        body = body[size + 2:]


# -- OpenAI Chat Completions and Completions ------------------------------------------


@pytest.mark.parametrize("name, path, api", [("chat", "/v1/chat/completions", "openai.chat"),
                                             ("completions", "/v1/completions", "openai.completions")])
def test_vllm_captures(name, path, api):
    events = vllm_events(name)
    ex = run_both(path, events)
    first = 1 if name == "chat" else 0  # the chat stream opens with a role chunk
    assert ex.api == api
    assert ex.token_event_ns == at(*range(first, first + 12))
    assert (ex.first_content_index, ex.choices, ex.choice_events, ex.completion_tokens) == (0, 1, 12, 12)
    # On an unnamed path the first event names the dialect.
    assert same_but_path(run("/proxy" + path, events), ex)


CHUNK = {"id": "chatcmpl-n2", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chat_chunk(*choices, **extra) -> bytes:
    return sse({**CHUNK, "choices": list(choices), **extra})


N2_REASONING_TOOLS = [
    chat_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
               {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
    chat_chunk({"index": 0, "delta": {"reasoning_content": "Let me"}, "finish_reason": None}),
    chat_chunk({"index": 1, "delta": {"content": "B"}, "finish_reason": None}),
    chat_chunk({"index": 0, "delta": {"content": "A"}, "finish_reason": None}),
    chat_chunk({"index": 1, "delta": {"reasoning": "hm"}, "finish_reason": None}),
    chat_chunk({"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        "finish_reason": None}),
    chat_chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                "finish_reason": "tool_calls"}),
    chat_chunk({"index": 1, "delta": {}, "finish_reason": "stop"}),
    chat_chunk(usage={"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}),
    b"data: [DONE]\n\n",
]


def test_chat_n2_keeps_choice_0_timing_and_counts_every_choice():
    ex = run_both("/v1/chat/completions", N2_REASONING_TOOLS)
    assert ex.token_event_ns == at(1, 3, 5, 6)  # reasoning, text, two tool-call deltas of choice 0
    assert ex.first_content_index == 1  # the first visible text is event 3, not the reasoning
    assert (ex.choices, ex.choice_events, ex.sse_events) == (2, 6, 10)
    assert (ex.prompt_tokens, ex.completion_tokens, ex.response_id, ex.resp_model) == (9, 7, "chatcmpl-n2", "m")


def test_reasoning_only_stream_has_no_first_content():
    ex = run_both("/v1/chat/completions", N2_REASONING_TOOLS[1:2] + N2_REASONING_TOOLS[5:7])
    assert (ex.token_event_ns, ex.first_content_index) == (at(0, 1, 2), None)


def test_llamacpp_timings_on_its_openai_route():
    # llama-server's last chat chunk carries usage and timings (ggml-org/llama.cpp#15443).
    events = [chat_chunk({"finish_reason": None, "index": 0, "delta": {"content": "?"}}),
              chat_chunk({"finish_reason": "stop", "index": 0, "delta": {}},
                         usage={"completion_tokens": 11, "prompt_tokens": 14, "total_tokens": 25},
                         timings={"prompt_n": 14, "prompt_ms": 53.734, "prompt_per_token_ms": 3.838,
                                  "prompt_per_second": 260.5, "predicted_n": 11, "predicted_ms": 120.5,
                                  "predicted_per_token_ms": 10.95, "predicted_per_second": 91.3}),
              b"data: [DONE]\n\n"]
    ex = run_both("/v1/chat/completions", events)
    assert (ex.prompt_tokens, ex.completion_tokens) == (14, 11)
    assert (ex.engine_prompt_ms, ex.engine_decode_ms) == (53.734, 120.5)


# vLLM --enable-per-request-metrics: `metrics` as its PerRequestTimingMetrics serialises it (fields in
# declaration order; a streamed chunk drops None fields), figures from queued 1.0 s, scheduled 1.5 s,
# first token 2.0 s, last token 3.0 s, 10 tokens generated.
VLLM_METRICS = {"time_to_first_token_ms": 500.0, "generation_time_ms": 1000.0, "queue_time_ms": 500.0,
                "mean_itl_ms": 111.11111111111111, "tokens_per_second": 6.666666666666667}


def with_vllm_metrics(events: list[bytes], metrics: dict) -> list[bytes]:
    """A real vLLM capture with `metrics` added to its usage chunk, where vLLM puts it."""
    return [event.replace(b',"system_fingerprint"', b',"metrics":' + json.dumps(metrics, separators=(",", ":")).encode()
                          + b',"system_fingerprint"') if b'"usage":{' in event else event for event in events]


@pytest.mark.parametrize("name, path", [("chat", "/v1/chat/completions"), ("completions", "/v1/completions")])
def test_vllm_per_request_metrics_streamed(name, path):
    events = with_vllm_metrics(vllm_events(name), VLLM_METRICS)
    assert sum(b'"metrics":{' in event for event in events) == 1
    ex = run_both(path, events)
    assert (ex.engine_queue_ms, ex.engine_prompt_ms, ex.engine_decode_ms) == (500.0, 500.0, 1000.0)
    assert ex.completion_tokens == 12
    # Without the flag (the capture as it is) nothing is stated; an all-None object (the flag on, no
    # figures) streams as `{}` and states nothing either.
    for events in (vllm_events(name), with_vllm_metrics(vllm_events(name), {})):
        ex = run(path, events)
        assert (ex.engine_queue_ms, ex.engine_prompt_ms, ex.engine_decode_ms) == (None, None, None)


def test_vllm_per_request_metrics_in_a_body():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "small",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}, "metrics": VLLM_METRICS}
    for size in (0, 20_000):  # parsed whole; too large to keep whole (its figures read from the tail)
        body["choices"][0]["message"]["content"] = "x" * size + ' "queue_time_ms": 7'
        data = json.dumps(body).encode()
        asm = HttpConnectionAssembler(fingerprint_key=KEY)
        wire = request("/v1/chat/completions", b'{"model": "small"}')
        asm.feed_request_bytes(1, wire, len(wire))
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
        [ex] = asm.feed_response_bytes(2, reply + data, len(reply + data))
        assert (ex.engine_queue_ms, ex.engine_prompt_ms, ex.engine_decode_ms) == (500.0, 500.0, 1000.0), size


# -- OpenAI Responses --------------------------------------------------------------------

RESP_ID = "resp_67c9fdcecf488190bdd9a0409de3a1ec07b8b0ad4e5eb654"
MSG_ID = "msg_67c9fdcf37fc8190ba82116e33fb28c507b8b0ad4e5eb654"


def response_object(status: str, usage=None, output=()) -> dict:
    return {"id": RESP_ID, "object": "response", "created_at": 1741290958, "status": status, "error": None,
            "incomplete_details": None, "instructions": None, "max_output_tokens": None,
            "model": "gpt-4.1-2025-04-14", "output": list(output), "parallel_tool_calls": True,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": True,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": 1.0, "truncation": "disabled", "usage": usage, "user": None, "metadata": {}}


def typed(sequence: int, kind: str, **fields) -> bytes:
    return sse({"type": kind, "sequence_number": sequence, **fields}, event=kind)


RESPONSES_USAGE = {"input_tokens": 37, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 11,
                   "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 48}
RESPONSES_STREAM = [
    typed(0, "response.created", response=response_object("in_progress")),
    typed(1, "response.in_progress", response=response_object("in_progress")),
    typed(2, "response.output_item.added", output_index=0,
          item={"id": "rs_1", "type": "reasoning", "summary": [], "content": []}),
    typed(3, "response.reasoning_text.delta", item_id="rs_1", output_index=0, content_index=0, delta="Think"),
    typed(4, "response.output_item.added", output_index=1,
          item={"id": MSG_ID, "type": "message", "status": "in_progress", "role": "assistant", "content": []}),
    typed(5, "response.content_part.added", item_id=MSG_ID, output_index=1, content_index=0,
          part={"type": "output_text", "text": "", "annotations": []}),
    typed(6, "response.output_text.delta", item_id=MSG_ID, output_index=1, content_index=0, delta="Hi"),
    typed(7, "response.output_text.delta", item_id=MSG_ID, output_index=1, content_index=0, delta=" there"),
    typed(8, "response.output_text.done", item_id=MSG_ID, output_index=1, content_index=0, text="Hi there"),
    typed(9, "response.function_call_arguments.delta", item_id="fc_1", output_index=2, delta='{"a":'),
    typed(10, "response.completed", response=response_object("completed", RESPONSES_USAGE)),
]


def test_responses_stream():
    ex = run_both("/v1/responses", RESPONSES_STREAM)
    assert ex.api == "openai.responses"
    assert (ex.token_event_ns, ex.first_content_index) == (at(3, 6, 7, 9), 1)
    assert (ex.response_id, ex.resp_model) == (RESP_ID, "gpt-4.1-2025-04-14")
    assert (ex.prompt_tokens, ex.completion_tokens, ex.sse_events) == (37, 11, 11)
    assert same_but_path(run("/gateway/responses", RESPONSES_STREAM), ex)


# -- Anthropic Messages -------------------------------------------------------------------

ANTHROPIC_STREAM = [
    sse({"type": "message_start", "message": {
        "id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "type": "message", "role": "assistant", "content": [],
        "model": "claude-sonnet-4-5", "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 25, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100,
                  "output_tokens": 1}}}, event="message_start"),
    sse({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        event="content_block_start"),
    sse({"type": "ping"}, event="ping"),
    sse({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hmm"}},
        event="content_block_delta"),
    sse({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQB"}},
        event="content_block_delta"),
    sse({"type": "content_block_stop", "index": 0}, event="content_block_stop"),
    sse({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        event="content_block_start"),
    sse({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hello"}},
        event="content_block_delta"),
    sse({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "!"}},
        event="content_block_delta"),
    sse({"type": "content_block_stop", "index": 1}, event="content_block_stop"),
    sse({"type": "content_block_start", "index": 2, "content_block": {
        "type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}}}, event="content_block_start"),
    sse({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}},
        event="content_block_delta"),
    sse({"type": "content_block_delta", "index": 2,
         "delta": {"type": "input_json_delta", "partial_json": "{\"location\": \"San Fra"}},
        event="content_block_delta"),
    sse({"type": "content_block_stop", "index": 2}, event="content_block_stop"),
    sse({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 89}}, event="message_delta"),
    sse({"type": "message_stop"}, event="message_stop"),
]


def test_anthropic_messages_stream():
    ex = run_both("/v1/messages", ANTHROPIC_STREAM)
    assert ex.api == "anthropic.messages"
    # thinking, two text deltas, the non-empty tool input; not the signature or the empty input
    assert (ex.token_event_ns, ex.first_content_index) == (at(3, 7, 8, 12), 1)
    assert (ex.response_id, ex.resp_model) == ("msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "claude-sonnet-4-5")
    assert (ex.prompt_tokens, ex.completion_tokens) == (125, 89)  # input + cache read; final output count
    assert (ex.sse_events, ex.error) == (16, None)
    assert "Hello" not in repr(ex) and "San Fra" not in repr(ex)


def test_anthropic_message_body():
    body = json.dumps({"id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message", "role": "assistant",
                       "model": "claude-sonnet-4-5", "content": [{"type": "text", "text": "Hi!"}],
                       "stop_reason": "end_turn", "stop_sequence": None,
                       "usage": {"input_tokens": 2095, "output_tokens": 503}}).encode()
    for path, api in (("/v1/messages", "anthropic.messages"), ("/anthropic/v1/messages", "anthropic.messages")):
        asm = HttpConnectionAssembler(fingerprint_key=KEY)
        wire = request(path, b'{"model": "claude-sonnet-4-5"}')
        asm.feed_request_bytes(1, wire, len(wire))
        reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(body)) + body
        [ex] = asm.feed_response_bytes(2, reply, len(reply))
        assert (ex.api, ex.prompt_tokens, ex.completion_tokens) == (api, 2095, 503)
        assert ex.response_id == "msg_013Zva2CMHLNnXjNJJKqJ2EF" and not ex.streamed


# -- Ollama (NDJSON) -------------------------------------------------------------------

OLLAMA_FINAL = {"total_duration": 10706818083, "load_duration": 6338219291, "prompt_eval_count": 26,
                "prompt_eval_duration": 130079000, "eval_count": 259, "eval_duration": 4232710000}


def test_ollama_generate_stream():
    lines = [ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:24.097767Z", "response": "",
                     "thinking": "Let", "done": False}),
             ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:24.109172Z", "response": "That",
                     "done": False}),
             ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:24.121485Z", "response": "'s",
                     "done": False}),
             ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:24.166576Z", "response": "",
                     "done": True, "done_reason": "stop", "context": [1, 2, 3], **OLLAMA_FINAL})]
    ex = run_both("/api/generate", lines, "application/x-ndjson")
    assert (ex.api, ex.streamed, ex.resp_model, ex.response_id) == ("ollama.generate", True, "qwen3", None)
    assert (ex.token_event_ns, ex.first_content_index, ex.sse_events) == (at(0, 1, 2), 1, 4)
    assert (ex.prompt_tokens, ex.completion_tokens) == (26, 259)
    assert ex.engine_prompt_ms == pytest.approx(130.079) and ex.engine_decode_ms == pytest.approx(4232.71)
    # A long conversation's `context` makes the last line too long to parse: counts come from its tail.
    long_final = ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:24.166576Z", "response": "",
                         "done": True, "done_reason": "stop", "context": list(range(20_000)), **OLLAMA_FINAL})
    assert len(long_final) > 65536
    cut = run("/api/generate", lines[:3] + [long_final], "application/x-ndjson")
    assert dataclasses.replace(cut, resp_bytes=ex.resp_bytes) == ex


def test_ollama_chat_stream_and_sniffing():
    lines = [ndjson({"model": "qwen3", "created_at": "2025-05-27T22:54:57.641643Z",
                     "message": {"role": "assistant", "content": "", "thinking": "Weather"}, "done": False}),
             ndjson({"model": "qwen3", "created_at": "2025-05-27T22:54:58.100509Z",
                     "message": {"role": "assistant", "content": "", "tool_calls": [{"function": {
                         "name": "get_current_weather",
                         "arguments": {"format": "celsius", "location": "Toronto"}}}]}, "done": False}),
             ndjson({"model": "qwen3", "created_at": "2025-05-27T22:54:58.200000Z",
                     "message": {"role": "assistant", "content": "Sunny"}, "done": False}),
             ndjson({"model": "qwen3", "created_at": "2025-05-27T22:54:58.300000Z",
                     "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop",
                     **OLLAMA_FINAL})]
    ex = run_both("/api/chat", lines, "application/x-ndjson")
    assert (ex.api, ex.token_event_ns, ex.first_content_index) == ("ollama.chat", at(0, 1, 2), 2)
    assert (ex.prompt_tokens, ex.completion_tokens) == (26, 259)
    assert run("/ollama/api/chat", lines, "application/x-ndjson").api == "ollama.chat"


# -- TGI, SGLang, llama.cpp native --------------------------------------------------------


def tgi_token(index: int, text: str, special: bool = False, **last) -> bytes:
    # TGI writes `data:` without a space.
    event = {"index": index, "token": {"id": 100 + index, "text": text, "logprob": -0.25, "special": special},
             "generated_text": last.pop("generated_text", None), "details": last.pop("details", None)}
    return b"data:" + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def test_tgi_generate_stream():
    events = [tgi_token(1, " Deep"), tgi_token(2, " learning"),
              tgi_token(3, "</s>", special=True, generated_text=" Deep learning",
                        details={"finish_reason": "eos_token", "generated_tokens": 3, "input_length": 5,
                                 "seed": None})]
    ex = run_both("/generate_stream", events)
    assert (ex.api, ex.token_event_ns, ex.first_content_index) == ("tgi", at(0, 1, 2), 0)
    assert (ex.prompt_tokens, ex.completion_tokens, ex.response_id) == (5, 3, None)
    assert run("/generate", events).api == "tgi"  # a shared path: sniffed


def sglang_event(text: str, completion_tokens: int, finish_reason=None) -> bytes:
    return b"data: " + json.dumps({"text": text, "output_ids": list(range(completion_tokens)), "meta_info": {
        "id": "2cfbba1e1c6e4a5b9c7e", "finish_reason": finish_reason, "prompt_tokens": 6,
        "weight_version": "default", "completion_tokens": completion_tokens, "cached_tokens": 0,
        "e2e_latency": 0.05 * completion_tokens}, "index": 0}).encode() + b"\n\n"


def test_sglang_generate_stream():
    events = [sglang_event(" Paris", 1), sglang_event(" Paris.", 2),
              sglang_event(" Paris. It", 3, {"type": "length", "length": 3}), b"data: [DONE]\n\n"]
    ex = run_both("/generate", events)
    assert (ex.api, ex.token_event_ns, ex.response_id) == ("sglang", at(0, 1, 2), "2cfbba1e1c6e4a5b9c7e")
    assert (ex.prompt_tokens, ex.completion_tokens, ex.done_seen) == (6, 3, True)


def llamacpp_final(prompt: str) -> bytes:
    return sse({"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "model": "gguf-small",
                "tokens_predicted": 3, "tokens_evaluated": 6,
                "generation_settings": {"n_predict": 3, "temperature": 0.8}, "prompt": prompt,
                "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
                "tokens_cached": 8, "timings": {"prompt_n": 6, "prompt_ms": 30.5, "prompt_per_token_ms": 5.08,
                                                "prompt_per_second": 196.7, "predicted_n": 3,
                                                "predicted_ms": 60.25, "predicted_per_token_ms": 20.08,
                                                "predicted_per_second": 49.8}})


def test_llamacpp_completion_stream():
    tokens = [sse({"index": 0, "content": text, "tokens": [7 + i], "stop": False, "id_slot": -1,
                   "tokens_predicted": i + 1, "tokens_evaluated": 6}) for i, text in enumerate([" Pa", "ri", "s"])]
    ex = run_both("/completion", [*tokens, llamacpp_final("The capital of France is")])
    assert (ex.api, ex.token_event_ns, ex.resp_model) == ("llamacpp", at(0, 1, 2), "gguf-small")
    assert (ex.prompt_tokens, ex.completion_tokens) == (6, 3)
    assert (ex.engine_prompt_ms, ex.engine_decode_ms) == (30.5, 60.25)
    # The last event echoes the prompt: a long one is read from its head and tail.
    long = run("/completion", [*tokens, llamacpp_final("word " * 20_000)])
    assert dataclasses.replace(long, resp_bytes=ex.resp_bytes) == ex


# -- dispatch -----------------------------------------------------------------------------


def test_unknown_stream_shape_is_named_and_explained():
    ex = run_both("/stream", [sse({"step": 1, "value": "x"}), sse({"step": 2, "value": "y"})])
    assert (ex.api, ex.token_event_ns, ex.sse_events) == ("unknown", [], 2)
    assert "no known API shape (2 events)" in ex.error


def test_non_llm_responses_name_no_api():
    asm = HttpConnectionAssembler(fingerprint_key=KEY)
    wire = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    asm.feed_request_bytes(1, wire, len(wire))
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nx 1\n"
    [ex] = asm.feed_response_bytes(2, reply, len(reply))
    assert (ex.api, ex.error) == ("", None)


@pytest.mark.parametrize("path, events, api", [
    ("/v1/chat/completions", N2_REASONING_TOOLS, "openai.chat"),
    ("/relay", N2_REASONING_TOOLS, "openai.chat"),
    ("/relay", ANTHROPIC_STREAM, "anthropic.messages"),
    ("/relay", RESPONSES_STREAM, "openai.responses"),
])
def test_the_dialect_is_chosen_once_per_response(monkeypatch, path, events, api):
    calls = []
    sniff = dialects.sniff
    monkeypatch.setattr(dialects, "sniff", lambda obj: calls.append(obj) or sniff(obj))
    ex = run(path, events)
    assert ex.api == api
    assert len(calls) == (0 if dialects.for_path(path) else 1)


# -- the row ------------------------------------------------------------------------------


def tracked_rows(streams) -> tuple[ConnectionTracker, list[dict]]:
    """The rows a tracker writes for (path, events, content type) exchanges, one connection each."""
    rows: list[dict] = []
    tracker = ConnectionTracker(rows.append, clock=MonotonicWallClock(), fingerprint_key=KEY, node="n",
                                target_ports={8000})
    for fd, (path, events, content_type) in enumerate(streams, start=10):
        segments = [(1, DIR_READ, request(path)), (RESP_T0, DIR_WRITE, response_head(content_type))]
        segments += [(EVENT_T0 + i, DIR_WRITE, chunk(event)) for i, event in enumerate(events)]
        segments.append((EVENT_T0 + len(events), DIR_WRITE, b"0\r\n\r\n"))
        for ts, direction, data in segments:
            tracker.handle(ev(EV_DATA, ts, fd=fd, direction=direction, data=data))
    return tracker, rows


def test_rows_carry_the_dialect_columns():
    ollama = [ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:24Z", "response": "Hi", "done": False}),
              ndjson({"model": "qwen3", "created_at": "2025-10-26T17:15:25Z", "response": "", "done": True,
                      **OLLAMA_FINAL})]
    tracker, rows = tracked_rows([("/v1/chat/completions", N2_REASONING_TOOLS, "text/event-stream"),
                                  ("/api/generate", ollama, "application/x-ndjson"),
                                  ("/stream", [sse({"step": 1})], "text/event-stream")])
    chat, generate, unknown = rows
    wall = tracker.clock.to_wall_ns
    assert (chat["api"], chat["first_token"], chat["first_content_token"]) == (
        "openai.chat", wall(EVENT_T0 + 1), wall(EVENT_T0 + 3))
    assert (chat["choices"], chat["choice_events"], chat["token_events"]) == (2, 6, 4)
    assert (chat["engine_prompt_ms"], chat["engine_decode_ms"]) == (None, None)
    assert (generate["api"], generate["streamed"], generate["completion_tokens"]) == ("ollama.generate", True, 259)
    assert generate["engine_prompt_ms"] == pytest.approx(130.079)
    assert generate["engine_decode_ms"] == pytest.approx(4232.71)
    assert (unknown["api"], unknown["first_content_token"]) == ("unknown", None) and unknown["error"]
    assert tracker.stats.unknown_api_streams == 1
    schema = RowSchema(REQUEST_COLUMN_TYPES)
    for row in rows:
        schema.check(row)


# -- errors inside a 200 stream ------------------------------------------------------------

def anthropic_error(kind: str) -> bytes:
    return sse({"type": "error", "error": {"type": kind, "message": "Overloaded"}}, event="error")


OPENAI_ERROR = sse({"error": {"message": "The engine is dead; please restart.", "type": "InternalServerError",
                              "param": None, "code": 500}})


@pytest.mark.parametrize("path, events, content_type, api, error_type", [
    # Anthropic: an error event after the stream began (docs "Streaming Messages", Error events).
    ("/v1/messages", [sse({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                                "model": "claude-sonnet-4-5", "content": [],
                                                                "usage": {"input_tokens": 5, "output_tokens": 1}}},
                          event="message_start"),
                      sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
                          event="content_block_delta"),
                      anthropic_error("overloaded_error")],
     "text/event-stream", "anthropic.messages", "overloaded_error"),
    # vLLM (ErrorResponse(error=ErrorInfo)) after output, then its [DONE].
    ("/v1/chat/completions", [chat_chunk({"index": 0, "delta": {"content": "A"}, "finish_reason": None}),
                              OPENAI_ERROR, b"data: [DONE]\n\n"],
     "text/event-stream", "openai.chat", "InternalServerError"),
    # Older vLLM and SGLang: the error object flat, `object: error`.
    ("/v1/completions", [sse({"object": "error", "message": "boom", "type": "BadRequestError", "param": None,
                              "code": 400})], "text/event-stream", "openai.completions", "BadRequestError"),
    # LiteLLM: a string code and no usable type.
    ("/v1/chat/completions", [sse({"error": {"message": "Rate limit reached", "type": None, "param": None,
                                             "code": "429"}})], "text/event-stream", "openai.chat", "error"),
    # Responses: response.failed carries the response with its error.
    ("/v1/responses", [typed(0, "response.created", response=response_object("in_progress")),
                       typed(1, "response.failed", response={**response_object("failed"), "error": {
                           "code": "server_error", "message": "The model failed to generate a response."}})],
     "text/event-stream", "openai.responses", "server_error"),
    # Responses: an error event outside a response.
    ("/v1/responses", [typed(0, "error", code="rate_limit_exceeded", message="Slow down", param=None)],
     "text/event-stream", "openai.responses", "rate_limit_exceeded"),
    # Ollama: a last line with the message only.
    ("/api/generate", [ndjson({"model": "m", "created_at": "2025-10-26T17:15:24Z", "response": "x", "done": False}),
                       ndjson({"error": "an error was encountered while running the model: unexpected EOF"})],
     "application/x-ndjson", "ollama.generate", "error"),
    # TGI: the message and its error_type.
    ("/generate_stream", [tgi_token(1, "x"), sse({"error": "Request failed during generation: Server error: OOM",
                                                  "error_type": "generation"})],
     "text/event-stream", "tgi", "generation"),
    # SGLang native: the message only.
    ("/generate", [sse({"error": {"message": "Aborted by the scheduler"}})], "text/event-stream", "unknown", "error"),
    # llama.cpp native.
    ("/completion", [sse({"content": "x", "stop": False}),
                     sse({"error": {"code": 500, "message": "slot unavailable", "type": "server_error"}})],
     "text/event-stream", "llamacpp", "server_error"),
    # An Anthropic error as the first event on a path no dialect names.
    ("/proxy/messages", [anthropic_error("api_error")], "text/event-stream", "anthropic.messages", "api_error"),
])
def test_an_error_inside_a_200_stream_is_an_error(path, events, content_type, api, error_type):
    ex = run_both(path, events, content_type, outcome="error")
    assert (ex.status, ex.api, ex.error_type) == (200, api, error_type)
    # The message is user-influenced text: it is never kept.
    assert all(word not in repr(ex) for word in ("Overloaded", "dead", "boom", "Rate limit", "EOF", "OOM", "Slow"))


def test_error_labels_are_bounded():
    record = dialects.base.record_error
    for labels, expected in ((("overloaded_error",), "overloaded_error"), ((503,), "503"),
                             (("not a label", "api_error"), "api_error"), (("x" * 49,), "error"),
                             ((True, 5, 1e3, None, {}, "é"), "error")):
        ex = Exchange(seq=0)
        record(ex, *labels)
        assert (ex.outcome, ex.error_type) == ("error", expected), labels


def test_an_error_free_stream_names_no_error():
    ex = run_both("/v1/messages", ANTHROPIC_STREAM)
    assert (ex.outcome, ex.error_type) == ("complete", "")


# -- hostile input ------------------------------------------------------------------------

def payloads(events: list[bytes]) -> list[dict]:
    return [json.loads(event.split(b"data:", 1)[1]) for event in events if not event.endswith(b"[DONE]\n\n")]


# Sample events of each dialect, by a path that names it.
SAMPLE_STREAMS = {
    "/v1/chat/completions": payloads(N2_REASONING_TOOLS + vllm_events("chat")),
    "/v1/completions": payloads(vllm_events("completions")),
    "/v1/responses": payloads(RESPONSES_STREAM),
    "/v1/messages": payloads(ANTHROPIC_STREAM),
    "/api/generate": [{"model": "m", "response": "x", "thinking": "y", "done": False},
                      {"model": "m", "response": "", "done": True, **OLLAMA_FINAL}],
    "/api/chat": [{"model": "m", "message": {"content": "x", "thinking": "y", "tool_calls": [{}]}, "done": False},
                  {"model": "m", "message": {"content": ""}, "done": True, **OLLAMA_FINAL}],
    "/generate_stream": payloads([tgi_token(1, "x"), tgi_token(2, "y", details={"generated_tokens": 2,
                                                                                 "input_length": 1})]),
    "/generate": payloads([sglang_event("x", 1), sglang_event("xy", 2)]),
    "/completion": payloads([llamacpp_final("p"), sse({"content": "x", "stop": False})]),
}


# A value of each JSON type, and numbers no count may take.
ODD_VALUES = [None, True, -1, 2**70, 1.5, 1e308, "", "x", [], [1], {}, {"a": 1}]


def value_paths(node, prefix=()):
    """Every path (keys, list index 0) to a value in a JSON event."""
    items = node.items() if isinstance(node, dict) else [(0, node[0])] if node else []
    for key, child in items:
        yield (*prefix, key)
        if isinstance(child, (dict, list)):
            yield from value_paths(child, (*prefix, key))


def with_value(event: dict, path: tuple, value) -> dict:
    event = json.loads(json.dumps(event))
    node = event
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return event


@pytest.mark.parametrize("path", sorted(SAMPLE_STREAMS))
def test_any_value_anywhere_never_breaks_a_dialect(path):
    """Each sample event with each of its values, one at a time, replaced by each odd value,
    after the dialect's first sample event (so that "/other" sniffs the same dialect)."""
    first = SAMPLE_STREAMS[path][0]
    for event in SAMPLE_STREAMS[path]:
        for where in value_paths(event):
            for value in ODD_VALUES:
                wire = [first, with_value(event, where, value)]
                for on_path, content_type, frame in ((path, "text/event-stream", sse),
                                                     ("/other", "application/x-ndjson", ndjson)):
                    ex = run(on_path, [frame(item) for item in wire], content_type)
                    assert "internal" not in (ex.error or ""), (where, value)
                    assert len(ex.token_event_ns) <= ex.choice_events <= 2 * max(1, ex.choices)
                    assert ex.first_content_index is None or ex.first_content_index < len(ex.token_event_ns)
                    assert ex.api and ex.choices <= 0xFFFF
                    assert all(v is None or 0 <= v <= 0xFFFFFFFF for v in (ex.prompt_tokens, ex.completion_tokens))
                    assert all(v is None or 0 <= v <= MAX_ENGINE_MS
                               for v in (ex.engine_queue_ms, ex.engine_prompt_ms, ex.engine_decode_ms))
                    assert ex.error_type == "" or (len(ex.error_type) <= 48 and ex.error_type.isascii())
