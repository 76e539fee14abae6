"""Anthropic Messages API (/v1/messages): named SSE events whose data's `type` repeats the name.

`message_start` carries the message (`id`, `model`, `usage` with `input_tokens`,
cache token counts and a first `output_tokens`); `content_block_delta` events
carry output: `text_delta` (visible), `thinking_delta` and `input_json_delta`
(tool input), hidden. `message_delta` carries the cumulative `usage.output_tokens`.
The prompt's size is `input_tokens` plus the cache counts: Anthropic's
`input_tokens` excludes tokens read from or written to the prompt cache.
A non-streamed body is the message itself. A stream that fails after its 200
sends `event: error` with `{"type": "error", "error": {"type": "overloaded_error",
"message": ...}}` (also `api_error`, `rate_limit_error`, ...).
"""

from __future__ import annotations

import re

from ..exchange import Exchange
from .base import Dialect, record_error, set_id_model, set_usage
from .json_scan import count

__all__ = ["ANTHROPIC"]

# delta type -> (field with the generated text, visible)
_DELTAS = {"text_delta": ("text", True), "thinking_delta": ("thinking", False),
           "input_json_delta": ("partial_json", False)}


# A text delta as Anthropic writes it, byte for byte, its text of plain bytes (no quote, backslash or
# control byte). Every event like it is valid JSON and reads as one event of visible text: a content
# block's index is not a choice (the row's output is choice 0's).
_TEXT_DELTA = re.compile(rb'\{"type":"content_block_delta","index":(?:0|[1-9][0-9]{0,8}),'
                         rb'"delta":\{"type":"text_delta","text":"[^"\\\x00-\x1f]+"\}\}')


def _prompt_tokens(usage: dict) -> int | None:
    tokens = count(usage.get("input_tokens"))
    if tokens is None:
        return None
    for key in ("cache_creation_input_tokens", "cache_read_input_tokens"):
        tokens += count(usage.get(key)) or 0
    return tokens


class _Anthropic(Dialect):
    __slots__ = ()

    def usage(self, obj: dict) -> tuple[int | None, int | None]:
        message = obj.get("message")  # message_start wraps the message; the others do not
        usage = (message if isinstance(message, dict) else obj).get("usage")
        if not isinstance(usage, dict):
            return None, None
        # message_delta's input_tokens (when sent) omits the cache counts: its prompt is not taken.
        prompt = None if obj.get("type") == "message_delta" else _prompt_tokens(usage)
        return prompt, usage.get("output_tokens")

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            delta_type = delta.get("type") if isinstance(delta, dict) else None
            if isinstance(delta_type, str):
                field = _DELTAS.get(delta_type)
                if field is not None:
                    text = delta.get(field[0])
                    if isinstance(text, str) and text:
                        exchange.record_output(ts, 0, field[1])
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                set_id_model(exchange, message.get("id"), message.get("model"))
            set_usage(exchange, *self.usage(obj))
        elif kind == "message_delta":
            set_usage(exchange, *self.usage(obj))
        elif kind == "error":
            error = obj.get("error")
            record_error(exchange, error.get("type") if isinstance(error, dict) else None)

    def steady_text(self, payload: bytes) -> tuple[int, int] | None:
        if _TEXT_DELTA.fullmatch(payload) is None:
            return None
        return payload.rindex(b'"text":"') + 8, len(payload) - 3

    def counts_steady(self, exchange: Exchange) -> bool:
        return True  # a text delta says nothing of the message (its id, model and usage are in others)


ANTHROPIC = _Anthropic("anthropic.messages", counts=("usage", "input_tokens", "output_tokens"),
                       visible=rb'[{,]\s*"type"\s*:\s*"text_delta"',
                       hidden=rb'[{,]\s*"type"\s*:\s*"(?:thinking|input_json)_delta"')
