"""OpenAI Chat Completions (/v1/chat/completions) and Completions (/v1/completions).

Each streamed chunk carries `choices`, one per choice of the request (`n`),
each with an `index`: a chat choice's `delta` holds `content` (visible text),
`reasoning_content` / `reasoning` (vLLM, SGLang, DeepSeek) or `tool_calls`; a
completions choice holds `text`. `usage` comes in a final chunk with
`"choices": []` when the client asked for it. llama.cpp adds `timings`
(its own prompt and generation times) to that chunk; vLLM started with
`--enable-per-request-metrics` adds `metrics` (its own queue, prefill and
generation times) to it, and to a non-streamed body. A stream that fails after
its 200 ends in an error event (`{"error": {...}}`, base.reported_error).
"""

from __future__ import annotations

import re

from ..exchange import Exchange
from . import llamacpp, tgi
from .base import (
    Dialect,
    choice_index,
    reported_error,
    set_engine_ms,
    set_id_model,
    set_usage,
)
from .json_scan import is_text, last_number, number_key, text_value

__all__ = ["CHAT", "COMPLETIONS", "USAGE", "ChoicesDialect"]

_NONE, _HIDDEN, _VISIBLE = 0, 1, 2


# vLLM's per-request `metrics` (--enable-per-request-metrics), from the engine's own timestamps:
# queue_time_ms = scheduled - queued, time_to_first_token_ms = first token - scheduled (the prefill,
# counted from scheduling), generation_time_ms = last token - first token (the decode).
_VLLM_QUEUE_MS = number_key(b"queue_time_ms")
_VLLM_PREFILL_MS = number_key(b"time_to_first_token_ms")
_VLLM_DECODE_MS = number_key(b"generation_time_ms")


def set_vllm_metrics(exchange: Exchange, metrics) -> None:
    """vLLM's `metrics` object, where the response carries one."""
    if isinstance(metrics, dict):
        set_engine_ms(exchange, metrics.get("time_to_first_token_ms"), metrics.get("generation_time_ms"),
                      queue=metrics.get("queue_time_ms"))


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


# The shape of a vLLM/SGLang chunk with no usage, no finish reason and no tool call, byte
# for byte: where it matches, it is valid JSON (the strings as json.loads takes them, no
# whitespace, no key that the parse reads twice) and says all `event` would read from it.
_STRING = rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9A-Fa-f]{4})[^"\\\x00-\x1f]*)*"'
_INT = rb'-?(?:0|[1-9][0-9]{0,30})'  # json.loads refuses integers of more than 4300 digits
_KEY = rb'"[a-z_]{1,32}"'


def _nulls(but: bytes, values: bytes = b"null") -> bytes:
    """Further `"key": value` members, none of them the keys in `but` (a regex alternation)."""
    return rb'(?:,(?!"(?:' + but + rb')")' + _KEY + rb':(?:' + values + rb'))*'


# A delta's text key may be followed by nulls (SGLang), never by the same key again.
_CHOICE = re.compile(rb'\{"index":(' + _INT + rb'),(?:"delta":\{(?:"role":(?:"assistant"|null),)?'
                     rb'"(content|reasoning_content|reasoning)":(' + _STRING + rb')' + _nulls(rb'\2') + rb'\}'
                     rb'|"text":(' + _STRING + rb'))' + _nulls(rb'index|delta|text') + rb'\}')
# The start of a chunk with its first choice, if any, in one match: the groups are _CHOICE's. Servers
# leave out `created` and `model` (a chunk without `model` names none: `event` reads nothing there
# either) and OpenAI adds `system_fingerprint`, which nothing reads. An `"object": "error"` is an error
# event (base.reported_error): its object is plain bytes other than those.
_CHUNK_START = re.compile(rb'\{"id":' + _STRING + rb',"object":(?!"error")"[^"\\\x00-\x1f]*"(?:,"created":' + _INT
                          + rb')?(?:,"model":' + _STRING + rb')?(?:,"system_fingerprint":(?:null|' + _STRING
                          + rb'))?,"choices":\[(?:' + _CHOICE.pattern + rb')?')
# Top-level members after `choices` hold null or a string: never a usage object, never
# llama.cpp's top-level `content`, never an `error` (a string there is TGI's error event).
_CHUNK_END = re.compile(rb'\]' + _nulls(rb'choices|content|error', rb'null|' + _STRING) + rb'\}')


# A chunk's members whose values are the response's own: its id (plain string bytes) and, where it
# has one, its creation time (digits after the first, which stays: a JSON number has no leading zero).
_OWN_FIELDS = re.compile(rb'\{"id":"([^"\\\x00-\x1f]*)","object":' + _STRING + rb'(?:,"created":[1-9]([0-9]*))?,')


def _scanned_output(choice: re.Match) -> tuple[int, int]:
    """(_choice_output, JSON index) of a choice matched by _CHOICE: a JSON string is text iff it is not `""`."""
    text = choice[4]
    if text is not None:
        output = _VISIBLE if len(text) > 2 else _NONE
    elif len(choice[3]) == 2:
        output = _NONE
    else:
        output = _VISIBLE if choice[2] == b"content" else _HIDDEN
    return output, int(choice[1])


def _scanned_choices(payload: bytes) -> list[tuple[int, int]] | None:
    """(output, JSON index) of each choice of a chunk of the common shape; None if it has another shape."""
    choice = _CHUNK_START.match(payload)
    if choice is None:
        return None
    pos = choice.end()
    choices = []
    if choice[1] is not None:
        choices.append(_scanned_output(choice))
        while payload[pos:pos + 1] == b",":
            choice = _CHOICE.match(payload, pos + 1)
            if choice is None:
                return None
            choices.append(_scanned_output(choice))
            pos = choice.end()
    return choices if _CHUNK_END.fullmatch(payload, pos) else None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _record_choices(exchange: Exchange, ts: int, outputs) -> bool:
    """Record (output, JSON index) pairs of a chunk's choices; True if any carried output."""
    first = _NONE  # choice 0's output in this chunk: recorded once, however many entries
    others = False
    for output, raw_index in outputs:
        if output:
            index = choice_index(raw_index)
            if index:
                exchange.record_output(ts, index)
                others = True
            elif output > first:
                first = output
    if first:
        exchange.record_output(ts, 0, first == _VISIBLE)
    return bool(first) or others


class ChoicesDialect(Dialect):
    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        set_id_model(exchange, obj.get("id"), obj.get("model"))
        if isinstance(obj.get("usage"), dict):  # the last chunk or two: the rest of the time, one lookup
            set_usage(exchange, *self.usage(obj))
            llamacpp.set_timings(exchange, obj.get("timings"))
            set_vllm_metrics(exchange, obj.get("metrics"))
        elif reported_error(exchange, obj):
            return
        choices = obj.get("choices")
        recorded = isinstance(choices, list) and _record_choices(
            exchange, ts, ((_choice_output(choice), choice.get("index"))
                           for choice in choices if isinstance(choice, dict)))
        if not recorded and (tgi.token_text(obj) or llamacpp.content_text(obj)):
            # Native chunks on an OpenAI route (relayed by a proxy, or mixed in by a
            # server): their text is still generated output, as before dialects.
            exchange.record_output(ts)

    def body(self, exchange: Exchange, obj: dict) -> None:
        super().body(exchange, obj)
        llamacpp.set_timings(exchange, obj.get("timings"))
        set_vllm_metrics(exchange, obj.get("metrics"))

    def partial(self, exchange: Exchange, head: bytes, tail: bytes, ts: int | None) -> None:
        super().partial(exchange, head, tail, ts)
        if ts is None:  # a body too large to parse: the engine's figures follow the choices, in its tail
            set_engine_ms(exchange, last_number(_VLLM_PREFILL_MS, tail), last_number(_VLLM_DECODE_MS, tail),
                          queue=last_number(_VLLM_QUEUE_MS, tail))

    def scan(self, exchange: Exchange, payload: bytes, ts: int) -> bool:
        # Once id and model are known, a chunk of the common shape only counts output (one without a
        # model once the id is: a chunk that may name one is parsed until one is known).
        if exchange.response_id is None or (exchange.resp_model is None and b'"model":' in payload):
            return False
        choices = _scanned_choices(payload)
        if choices is None or not (payload.isascii() or _is_utf8(payload)):  # json.loads refuses bad UTF-8
            return False
        _record_choices(exchange, ts, choices)
        return True

    def steady_text(self, payload: bytes) -> tuple[int, int] | None:
        if b'"content":"' not in payload and b'"text":"' not in payload:
            return None  # no visible text at all (reasoning, tool calls): a cheap no
        start = _CHUNK_START.match(payload)
        if start is None:
            return None
        text = 4 if start[4] is not None else 3
        if start[text] is None:
            return None
        span = start.start(text) + 1, start.end(text) - 1  # inside the quotes
        # Checked on a stand-in rather than inferred from the regexes: with a one-letter text the
        # chunk reads as one event of visible text of choice 0. Any other plain text matches _STRING
        # as that letter does; a text json.loads refuses (bad UTF-8) is read by `partial`, which
        # finds the same visible text.
        if _scanned_choices(payload[:span[0]] + b"x" + payload[span[1]:]) != [(_VISIBLE, 0)]:
            return None
        return span

    def counts_steady(self, exchange: Exchange) -> bool:
        # What scan needs: a template's model, if it has one, was read from the response's own event
        # of that shape (the template's first, read whole), so the events like it name no other.
        return exchange.response_id is not None

    def steady_own_fields(self, payload: bytes) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        found = _OWN_FIELDS.match(payload)
        if found is None:
            return (), ()
        return tuple(span for span in (found.span(2),) if span[1] > span[0]), \
            tuple(span for span in (found.span(1),) if span[1] > span[0])


CHAT = ChoicesDialect("openai.chat", counts=USAGE, visible=_TEXT_VALUE, hidden=_HIDDEN_VALUE)
COMPLETIONS = ChoicesDialect("openai.completions", counts=USAGE, visible=_TEXT_VALUE, hidden=_HIDDEN_VALUE)
