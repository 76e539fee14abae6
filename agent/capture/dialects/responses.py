"""OpenAI Responses API (/v1/responses): typed semantic events, no `[DONE]`.

`response.created` carries the response object (its `id` and `model`); output
arrives in `*.delta` events: `response.output_text.delta` and
`response.refusal.delta` are visible text, the others (`reasoning_text`,
`reasoning_summary_text`, `function_call_arguments`, ...) hidden output. The
stream ends with `response.completed` (or `.incomplete`, `.failed`), whose
response object holds `usage` with `input_tokens` and `output_tokens`. A
non-streamed body is that response object itself. A response that fails ends
in `response.failed`, its response's `error` naming a `code` (`server_error`,
`rate_limit_exceeded`, ...); a stream that fails outside a response sends an
`error` event with its own `code`.
"""

from __future__ import annotations

from ..exchange import Exchange
from .base import Dialect, record_error

__all__ = ["RESPONSES"]

_VISIBLE_DELTAS = frozenset({"response.output_text.delta", "response.refusal.delta"})
# Events that carry the whole response object.
_RESPONSE_EVENTS = frozenset({"response.created", "response.in_progress", "response.completed",
                              "response.incomplete", "response.failed"})


class _Responses(Dialect):
    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        kind = obj.get("type")
        if not isinstance(kind, str):
            return
        if kind.endswith(".delta"):
            delta = obj.get("delta")
            if isinstance(delta, str) and delta:
                exchange.record_output(ts, 0, kind in _VISIBLE_DELTAS)
        elif kind in _RESPONSE_EVENTS:
            response = obj.get("response")
            if isinstance(response, dict):
                self.body(exchange, response)
                if kind == "response.failed":
                    error = response.get("error")
                    record_error(exchange, *((error.get("code"), error.get("type")) if isinstance(error, dict) else ()))
        elif kind == "error":
            error = obj.get("error")  # some servers nest it: {"type": "error", "error": {"type", "code"}}
            nested = (error.get("code"), error.get("type")) if isinstance(error, dict) else ()
            record_error(exchange, obj.get("code"), *nested)


RESPONSES = _Responses(
    "openai.responses", counts=("usage", "input_tokens", "output_tokens"), wrapper="response",
    visible=rb'[{,]\s*"type"\s*:\s*"response\.(?:output_text|refusal)\.delta"',
    hidden=rb'[{,]\s*"type"\s*:\s*"response\.[a-z_.]+\.delta"')
