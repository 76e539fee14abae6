"""OpenAI Responses API (/v1/responses): typed semantic events, no `[DONE]`.

`response.created` carries the response object (its `id` and `model`); output
arrives in `*.delta` events: `response.output_text.delta` and
`response.refusal.delta` are visible text, the others (`reasoning_text`,
`reasoning_summary_text`, `function_call_arguments`, ...) hidden output. The
stream ends with `response.completed` (or `.incomplete`, `.failed`), whose
response object holds `usage` with `input_tokens` and `output_tokens`. A
non-streamed body is that response object itself.
"""

from __future__ import annotations

import re

from ..exchange import Exchange
from ..json_scan import count_key
from .base import Dialect, usage_object

__all__ = ["RESPONSES"]

_VISIBLE_DELTAS = frozenset({"response.output_text.delta", "response.refusal.delta"})
# Events that carry the whole response object.
_RESPONSE_EVENTS = frozenset({"response.created", "response.in_progress", "response.completed",
                              "response.incomplete", "response.failed"})


class _Responses(Dialect):
    __slots__ = ()
    prompt_key = count_key(b"input_tokens")
    completion_key = count_key(b"output_tokens")
    visible_output = re.compile(rb'[{,]\s*"type"\s*:\s*"response\.(?:output_text|refusal)\.delta"')
    hidden_output = re.compile(rb'[{,]\s*"type"\s*:\s*"response\.[a-z_.]+\.delta"')

    def usage(self, obj: dict) -> tuple[int | None, int | None]:
        usage = usage_object(obj, "response")
        if usage is None:
            return None, None
        return usage.get("input_tokens"), usage.get("output_tokens")

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


RESPONSES = _Responses("openai.responses")
