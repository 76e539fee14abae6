"""The OpenAI-compatible surface: request validation and vLLM-shaped response bodies.

Chunk layouts copy the vLLM 0.32 captures in shared/fixtures byte for byte in
structure (key order, null fields, compact separators), so an observer that
parses vLLM streams parses these the same way.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .text import CHAT_TOKENS_PER_MESSAGE, estimate_tokens

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
SYSTEM_FINGERPRINT = "tokenprobe-refserver"
MAX_MODEL_NAME_CHARS = 256
DONE_EVENT = b"data: [DONE]\n\n"


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt_tokens: int  # estimated from the prompt; the text itself is not kept
    seed: int


def parse_completion_request(
    body: bytes, *, chat: bool, default_model: str, default_max_tokens: int, max_tokens_limit: int
) -> CompletionRequest:
    """Validate a /v1/chat/completions or /v1/completions body. Raises ApiError(400)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object")

    model = payload.get("model", default_model)
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME_CHARS:
        raise ApiError(400, f"'model' must be a string of 1 to {MAX_MODEL_NAME_CHARS} characters")

    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false")
    stream_options = payload.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object")
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "'stream_options.include_usage' must be true or false")

    # Chat prefers the newer name; null means "use the default" in the OpenAI API.
    max_tokens = payload.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = payload.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_tokens_limit:
        raise ApiError(400, f"'max_tokens' must be an integer from 1 to {max_tokens_limit}")

    seed = payload.get("seed", 0)
    if seed is None:
        seed = 0
    if not _is_int(seed):
        raise ApiError(400, "'seed' must be an integer")

    prompt_tokens = _chat_prompt_tokens(payload) if chat else _completion_prompt_tokens(payload)
    return CompletionRequest(chat, model, stream, stream and include_usage, max_tokens, prompt_tokens, seed)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_prompt_tokens(payload: dict[str, Any]) -> int:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list")
    total = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a string 'role'")
        total += CHAT_TOKENS_PER_MESSAGE + _content_tokens(message.get("content"), index)
    return total


def _content_tokens(content: Any, index: int) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return estimate_tokens(content)
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}")
        return sum(estimate_tokens(t) for t in texts)
    raise ApiError(400, f"messages[{index}].content must be a string, a list of text parts, or null")


def _completion_prompt_tokens(payload: dict[str, Any]) -> int:
    prompt = payload.get("prompt")
    # A one-element batch is the same request as its element.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return len(prompt)  # already token ids
    raise ApiError(400, "'prompt' must be a string or a list of token ids (batched prompts are not supported)")


def new_response_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def error_body(status: int, reason: str, message: str) -> bytes:
    error_type = reason.replace(" ", "") + "Error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return _dumps(body)


def stream_error_event(error_type: str, message: str, code: int) -> bytes:
    """The event vLLM (and SGLang) send when a request fails after its 200 and stream began."""
    return b"data: " + _dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}) + b"\n\n"


def per_request_metrics(queued_ns: int, scheduled_ns: int, first_token_ns: int, last_token_ns: int,
                        tokens: int) -> dict[str, float | None]:
    """vLLM's per-request `metrics` object (--enable-per-request-metrics), from the engine's timestamps:
    the queue (scheduled - queued), the time to first token counted from scheduling, the generation
    (last token - first token), the mean inter-token latency and tokens per second since scheduling."""
    generation_ms = (last_token_ns - first_token_ns) / 1e6
    running_s = (last_token_ns - scheduled_ns) / 1e9
    return {
        "time_to_first_token_ms": (first_token_ns - scheduled_ns) / 1e6,
        "generation_time_ms": generation_ms,
        "queue_time_ms": (scheduled_ns - queued_ns) / 1e6,
        "mean_itl_ms": generation_ms / (tokens - 1) if tokens > 1 else None,
        "tokens_per_second": tokens / running_s if running_s > 0 else None,
    }


def models_body(model: str) -> bytes:
    entry = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "tokenprobe", "root": model}
    return _dumps({"object": "list", "data": [entry]})


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class ResponseFormatter:
    """Builds the SSE events and the non-streamed body for one completion."""

    def __init__(self, request: CompletionRequest, response_id: str):
        self._request = request
        self._chat = request.chat
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": int(time.time()),
            "model": request.model,
        }

    def role_event(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._event({**self._head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None})

    def token_event(self, text: str, last: bool) -> bytes:
        if self._chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
            choice.update({"finish_reason": "length", "stop_reason": None} if last else {"finish_reason": None})
            choice["token_ids"] = None
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length" if last else None,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        return self._event({**self._head, "choices": [choice]})

    def usage_event(self, completion_tokens: int, metrics: dict[str, float | None] | None = None) -> bytes:
        """The last chunk's usage, and vLLM's `metrics` when given (a stream drops its None fields, as vLLM's)."""
        event = {**self._head, "choices": [], "usage": self._usage(completion_tokens)}
        if metrics is not None:
            event["metrics"] = {name: value for name, value in metrics.items() if value is not None}
        return self._event({**event, "system_fingerprint": SYSTEM_FINGERPRINT})

    def full_body(self, text: str, completion_tokens: int, metrics: dict[str, float | None] | None = None) -> bytes:
        """The stream=false response: the whole completion and its usage in one JSON body (and vLLM's
        `metrics` when given)."""
        finish = {"logprobs": None, "finish_reason": "length", "stop_reason": None}
        if self._chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, **finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, **finish}
            kind = "text_completion"
        body = {
            **self._head,
            "object": kind,
            "choices": [choice],
            "usage": self._usage(completion_tokens),
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        if metrics is not None:
            body["metrics"] = metrics
        return _dumps(body)

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self._request.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return b"data: " + _dumps(obj) + b"\n\n"
