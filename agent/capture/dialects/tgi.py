"""Hugging Face TGI native API: /generate_stream (SSE) and /generate (JSON).

Each event carries one generated `token` (`text`, `special` for tokens such as
EOS that are not text a user reads); the last adds `generated_text` and
`details` with `generated_tokens` and `input_length`. There is no response id
or model name. The event's `index` is the token's position, not a choice. A
stream that fails after its 200 sends `{"error": "<message>", "error_type":
"generation"}` (also `overloaded`, `validation`, `incomplete_generation`).
"""

from __future__ import annotations

from ..exchange import Exchange
from .base import Dialect, reported_error, set_usage
from .json_scan import is_text, text_value

__all__ = ["TGI", "token_text"]


def token_text(obj: dict) -> bool:
    """True if the event's `token` carries text."""
    token = obj.get("token")
    return isinstance(token, dict) and is_text(token.get("text"))


class _Tgi(Dialect):
    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        if reported_error(exchange, obj):
            return
        if token_text(obj):
            exchange.record_output(ts, 0, obj["token"].get("special") is not True)
        if obj.get("details") is not None:  # the last event
            set_usage(exchange, *self.usage(obj))


TGI = _Tgi("tgi", counts=("details", "input_length", "generated_tokens"), has_id=False,
           visible=text_value(b"text"))
