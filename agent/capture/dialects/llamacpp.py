"""llama.cpp server native API: /completion (and its alias /completions).

Each streamed event carries generated `content`; the last (`"stop": true`) adds
`model`, `tokens_evaluated` (prompt), `tokens_predicted` (generated) and
`timings` with the server's own `prompt_ms` and `predicted_ms`. It also echoes
the prompt and the settings, so it can be too large to parse: the counts and
timings are then read from its tail, where the server writes them. A stream
that fails after its 200 sends `{"error": {"code", "message", "type"}}`.
"""

from __future__ import annotations

from ..exchange import Exchange
from .base import Dialect, reported_error, set_engine_ms, set_id_model, set_usage
from .json_scan import is_text, last_number, number_key, text_value

__all__ = ["LLAMACPP", "content_text", "set_timings"]

_PROMPT_MS = number_key(b"prompt_ms")
_PREDICTED_MS = number_key(b"predicted_ms")


def content_text(obj: dict) -> bool:
    """True if the event's top-level `content` carries text."""
    return is_text(obj.get("content"))


def set_timings(exchange: Exchange, timings) -> None:
    """llama.cpp's `timings` object (also on the last chunk of its OpenAI routes)."""
    if isinstance(timings, dict):
        set_engine_ms(exchange, timings.get("prompt_ms"), timings.get("predicted_ms"))


class _LlamaCpp(Dialect):
    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        if content_text(obj):
            exchange.record_output(ts)
        elif reported_error(exchange, obj):
            return
        if obj.get("stop") is True:
            self.body(exchange, obj)

    def body(self, exchange: Exchange, obj: dict) -> None:
        set_id_model(exchange, None, obj.get("model"))
        set_usage(exchange, *self.usage(obj))
        set_timings(exchange, obj.get("timings"))

    def partial(self, exchange: Exchange, head: bytes, tail: bytes, ts: int | None) -> None:
        super().partial(exchange, head, tail, ts)
        set_engine_ms(exchange, last_number(_PROMPT_MS, tail), last_number(_PREDICTED_MS, tail))


LLAMACPP = _LlamaCpp("llamacpp", counts=("", "tokens_evaluated", "tokens_predicted"), has_id=False,
                     visible=text_value(b"content"))
