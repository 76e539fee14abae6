"""What the matrix's Python servers stream: a scripted LLM in three API dialects.

Every server stack (Starlette under uvicorn, granian and hypercorn, aiohttp)
writes exactly these frames, one write per frame with a short pause between,
so that what differs between stacks is only how they put the bytes on the
wire. A request with `"burst": true` gets its frames without pauses, as an
engine catching up sends them: events microseconds apart, which a server may
coalesce into fewer writes. The reply follows the request: `max_tokens` (`options.num_predict` for
Ollama) text events, the request's `model` echoed (the tests use it as the
request's key), usage counted from the prompt's words.

- /v1/chat/completions: OpenAI SSE `data:` chunks, a role-only first chunk, a
  finish chunk, a usage chunk when `stream_options.include_usage`, `[DONE]`;
- /v1/messages: Anthropic `event:` frames, usage in message_start/message_delta;
- /api/chat: Ollama NDJSON, counts and durations in the `done` line.
"""

from __future__ import annotations

import json
import uuid

FRAME_GAP_S = 0.01  # between frames (a 100 token/s decode): each is its own write, even where writes queue

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


def _words(request: dict) -> int:
    text = " ".join(str(m.get("content", "")) for m in request.get("messages", []))
    return max(1, len(text.split()))


def _sse(obj: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj)}\n\n".encode()


def _openai(request: dict, tokens: int, prompt: int) -> list[bytes]:
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    model = request.get("model", "m")

    def chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
        return _sse({"id": rid, "object": "chat.completion.chunk", "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": f" tok{i}"}) for i in range(tokens)]
    frames.append(chunk({}, "length"))
    if (request.get("stream_options") or {}).get("include_usage"):
        frames.append(_sse({"id": rid, "object": "chat.completion.chunk", "model": model, "choices": [],
                            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                                      "total_tokens": prompt + tokens}}))
    frames.append(b"data: [DONE]\n\n")
    return frames


def _anthropic(request: dict, tokens: int, prompt: int) -> list[bytes]:
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [],
               "model": request.get("model", "m"), "usage": {"input_tokens": prompt, "output_tokens": 1}}
    frames = [_sse({"type": "message_start", "message": message}, "message_start"),
              _sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                   "content_block_start")]
    frames += [_sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": f" tok{i}"}},
                    "content_block_delta") for i in range(tokens)]
    frames += [_sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
               _sse({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                     "usage": {"output_tokens": tokens}}, "message_delta"),
               _sse({"type": "message_stop"}, "message_stop")]
    return frames


def _ollama(request: dict, tokens: int, prompt: int) -> list[bytes]:
    model = request.get("model", "m")

    def line(obj: dict) -> bytes:
        return json.dumps({"model": model, **obj}).encode() + b"\n"

    frames = [line({"message": {"role": "assistant", "content": f" tok{i}"}, "done": False}) for i in range(tokens)]
    frames.append(line({"message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "length",
                        "prompt_eval_count": prompt, "eval_count": tokens,
                        "prompt_eval_duration": 1_000_000, "eval_duration": 2_000_000}))
    return frames


ROUTES = {
    "/v1/chat/completions": (SSE, _openai, "max_tokens"),
    "/v1/messages": (SSE, _anthropic, "max_tokens"),
    "/api/chat": (NDJSON, _ollama, "num_predict"),
}


def reply(path: str, body: bytes) -> tuple[str, list[bytes], float] | None:
    """(content type, frames, pause after each) for a request to `path`, or None for an unknown path."""
    route = ROUTES.get(path)
    if route is None:
        return None
    content_type, frames_of, tokens_key = route
    request = json.loads(body or b"{}")
    tokens = int((request.get("options") or request).get(tokens_key, 4))
    gap = 0.0 if request.get("burst") else FRAME_GAP_S
    return content_type, frames_of(request, tokens, _words(request)), gap
