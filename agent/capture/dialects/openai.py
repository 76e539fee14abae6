"""OpenAI Chat Completions (/v1/chat/completions) and Completions (/v1/completions).

Each streamed chunk carries `choices`, one per choice of the request (`n`),
each with an `index`: a chat choice's `delta` holds `content` (visible text),
`reasoning_content` / `reasoning` (vLLM, SGLang, DeepSeek) or `tool_calls`; a
completions choice holds `text`. `usage` comes in a final chunk with
`"choices": []` when the client asked for it. llama.cpp adds `timings`
(its own prompt and generation times) to that chunk.
"""

from __future__ import annotations

from ..exchange import Exchange
from ..json_scan import is_text, text_value
from . import llamacpp, tgi
from .base import Dialect, choice_index, set_id_model, set_usage

__all__ = ["CHAT", "COMPLETIONS", "USAGE", "ChoicesDialect"]

_NONE, _HIDDEN, _VISIBLE = 0, 1, 2


def _choice_output(choice: dict) -> int:
    """What a choice of a chunk generated: visible text, hidden output, or nothing."""
    if is_text(choice.get("text")):  # /v1/completions
        return _VISIBLE
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if is_text(delta.get("content")):
            return _VISIBLE
        if is_text(delta.get("reasoning_content")) or is_text(delta.get("reasoning")):
            return _HIDDEN
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list) and tool_calls:
            return _HIDDEN
    return _NONE


USAGE = ("usage", "prompt_tokens", "completion_tokens")  # where OpenAI-style APIs put the counts
# Output in an event too large to parse: visible text, or reasoning and tool calls.
_TEXT_VALUE = text_value(b"content", b"text")
_HIDDEN_VALUE = text_value(b"reasoning_content", b"reasoning") + rb'|[{,]\s*"tool_calls"\s*:\s*\[\s*\{'


class ChoicesDialect(Dialect):
    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        set_id_model(exchange, obj.get("id"), obj.get("model"))
        if isinstance(obj.get("usage"), dict):  # the last chunk or two: the rest of the time, one lookup
            set_usage(exchange, *self.usage(obj))
            llamacpp.set_timings(exchange, obj.get("timings"))
        first = _NONE  # choice 0's output in this chunk: recorded once, however many entries
        others = False
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                output = _choice_output(choice)
                if output:
                    index = choice_index(choice.get("index"))
                    if index:
                        exchange.record_output(ts, index)
                        others = True
                    elif output > first:
                        first = output
        if first:
            exchange.record_output(ts, 0, first == _VISIBLE)
        elif not others and (tgi.token_text(obj) or llamacpp.content_text(obj)):
            # Native chunks on an OpenAI route (relayed by a proxy, or mixed in by a
            # server): their text is still generated output, as before dialects.
            exchange.record_output(ts)


CHAT = ChoicesDialect("openai.chat", counts=USAGE, visible=_TEXT_VALUE, hidden=_HIDDEN_VALUE)
COMPLETIONS = ChoicesDialect("openai.completions", counts=USAGE, visible=_TEXT_VALUE, hidden=_HIDDEN_VALUE)
