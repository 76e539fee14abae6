"""Ollama native API: /api/generate and /api/chat, streamed as NDJSON (one JSON object a line).

/api/generate lines carry generated text in `response` (and `thinking`); /api/chat
lines in `message.content` (and `message.thinking`, `message.tool_calls`). The last
line (`"done": true`) carries `prompt_eval_count`, `eval_count` and the server's
own `prompt_eval_duration` and `eval_duration` in ns. There is no response id.
/api/generate's last line may also hold a long `context` array: its counts and
durations follow it, at the tail, where the regex fallback looks. A stream that
fails after its 200 ends in a line `{"error": "<message>"}`: it names no type.
"""

from __future__ import annotations

import re

from ..exchange import Exchange
from .base import Dialect, reported_error, set_engine_ms, set_id_model, set_usage
from .json_scan import is_text, last_number, number_key, text_value

__all__ = ["OLLAMA_CHAT", "OLLAMA_GENERATE"]

_NS_TO_MS = 1e-6
_COUNTS = ("", "prompt_eval_count", "eval_count")
_PROMPT_DURATION = number_key(b"prompt_eval_duration")
_EVAL_DURATION = number_key(b"eval_duration")


# A line of visible text as Ollama writes it, byte for byte (its text after `before`, then `after`): its
# model's name, creation time and text in plain string bytes (the time is a span of the line's own).
def _text_line_shape(before: bytes, after: bytes) -> re.Pattern:
    return re.compile(rb'\{"model":"[^"\\\x00-\x1f]+","created_at":"([^"\\\x00-\x1f]+)",' + before
                      + rb'"([^"\\\x00-\x1f]+)"' + after + rb',"done":false\}')


class _Ollama(Dialect):
    __slots__ = ()
    _text_line: re.Pattern  # a visible text line's shape (_text_line_shape), fullmatched

    def steady_text(self, payload: bytes) -> tuple[int, int] | None:
        # A line of that shape whatever its plain text is valid JSON (a text json.loads refuses, bad
        # UTF-8, is read by `partial`, which finds the same visible text), and one event of visible text.
        line = self._text_line.fullmatch(payload)
        return line.span(2) if line else None

    def counts_steady(self, exchange: Exchange) -> bool:
        return exchange.resp_model is not None  # what `event` reads of a text line besides its text

    def steady_own_fields(self, payload: bytes) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        line = self._text_line.fullmatch(payload)
        return ((), (line.span(1),)) if line else ((), ())

    def _output(self, obj: dict) -> int:
        """0: nothing generated; 1: thinking or tool calls only; 2: visible text."""
        raise NotImplementedError

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        if reported_error(exchange, obj):
            return
        output = self._output(obj)
        if output:
            exchange.record_output(ts, 0, output == 2)
        if exchange.resp_model is None:
            set_id_model(exchange, None, obj.get("model"))
        if obj.get("done") is True:
            self.body(exchange, obj)

    def body(self, exchange: Exchange, obj: dict) -> None:
        set_id_model(exchange, None, obj.get("model"))
        set_usage(exchange, *self.usage(obj))
        set_engine_ms(exchange, obj.get("prompt_eval_duration"), obj.get("eval_duration"), _NS_TO_MS)

    def partial(self, exchange: Exchange, head: bytes, tail: bytes, ts: int | None) -> None:
        super().partial(exchange, head, tail, ts)
        set_engine_ms(exchange, last_number(_PROMPT_DURATION, tail), last_number(_EVAL_DURATION, tail),
                      _NS_TO_MS)


class _Generate(_Ollama):
    __slots__ = ()
    _text_line = _text_line_shape(rb'"response":', b"")

    def _output(self, obj: dict) -> int:
        if is_text(obj.get("response")):
            return 2
        return 1 if is_text(obj.get("thinking")) else 0


class _Chat(_Ollama):
    __slots__ = ()
    _text_line = _text_line_shape(rb'"message":\{"role":"assistant","content":', rb"\}")

    def _output(self, obj: dict) -> int:
        message = obj.get("message")
        if not isinstance(message, dict):
            return 0
        if is_text(message.get("content")):
            return 2
        tool_calls = message.get("tool_calls")
        return 1 if is_text(message.get("thinking")) or (isinstance(tool_calls, list) and tool_calls) else 0


OLLAMA_GENERATE = _Generate("ollama.generate", counts=_COUNTS, has_id=False,
                            visible=text_value(b"response"), hidden=text_value(b"thinking"))
OLLAMA_CHAT = _Chat("ollama.chat", counts=_COUNTS, has_id=False, visible=text_value(b"content"),
                    hidden=text_value(b"thinking") + rb'|[{,]\s*"tool_calls"\s*:\s*\[\s*\{')
