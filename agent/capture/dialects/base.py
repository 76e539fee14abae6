"""The one interface every API dialect implements, and what dialects share.

A dialect is chosen once per response (by the request path, else by the first
event or the body) and then reads every event of that response. Dialects are
stateless singletons: what a response must remember lives on its Exchange.
"""

from __future__ import annotations

import re

from ..exchange import Exchange
from .json_scan import (
    count,
    count_key,
    field_text,
    first_json_string,
    last_count,
    string_key,
)

__all__ = ["Dialect", "GENERIC_ERROR", "MAX_ENGINE_MS", "choice_index", "error_label", "record_error",
           "reported_error", "set_engine_ms", "set_id_model", "set_usage"]

# Choice indexes are read up to this (the row's `choices` is UInt16; OpenAI allows n <= 128).
_MAX_CHOICE = 0xFFFE
# An engine time above this (11.6 days) is not one request's: it is not stored (the row's Float32
# would also turn the largest JSON numbers into inf).
MAX_ENGINE_MS = 1e9
_ID_KEY = string_key(b"id")
_MODEL_KEY = string_key(b"model")


def choice_index(value) -> int:
    """The choice a JSON `index` names; 0 for a missing or unusable one."""
    return value if type(value) is int and 0 < value <= _MAX_CHOICE else 0


def set_id_model(exchange: Exchange, response_id, model) -> None:
    """The response id and model from the first event (or body) that names them."""
    if exchange.response_id is None:
        exchange.response_id = field_text(response_id)
    if exchange.resp_model is None:
        exchange.resp_model = field_text(model)


def set_usage(exchange: Exchange, prompt_tokens, completion_tokens) -> None:
    """Token counts as the server reported them; a later report replaces an earlier one."""
    prompt_tokens = count(prompt_tokens)
    if prompt_tokens is not None:
        exchange.prompt_tokens = prompt_tokens
    completion_tokens = count(completion_tokens)
    if completion_tokens is not None:
        exchange.completion_tokens = completion_tokens


def _duration_ms(value, scale: float) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        ms = value * scale
        if ms <= MAX_ENGINE_MS:
            return ms
    return None


def set_engine_ms(exchange: Exchange, prompt, decode, scale: float = 1.0, queue=None) -> None:
    """The engine's own prompt (prefill), generation and (where it states one) queue times, as it
    reported them (JSON numbers; `scale` turns their unit into ms)."""
    queue_ms = _duration_ms(queue, scale)
    if queue_ms is not None:
        exchange.engine_queue_ms = queue_ms
    prompt_ms = _duration_ms(prompt, scale)
    if prompt_ms is not None:
        exchange.engine_prompt_ms = prompt_ms
    decode_ms = _duration_ms(decode, scale)
    if decode_ms is not None:
        exchange.engine_decode_ms = decode_ms


# An error's label as an API names it (`overloaded_error`, `BadRequestError`, `server_error`, `503`): a
# short identifier. Anything else (a message, free text: user-influenced) is never stored.
_ERROR_LABEL = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,47}")
GENERIC_ERROR = "error"  # the label of an error that names no type of its own


def error_label(value) -> str | None:
    """`value` as an error label: an identifier-like string, or an HTTP-like integer code; else None."""
    if isinstance(value, str):
        return value if _ERROR_LABEL.fullmatch(value) else None
    if type(value) is int and 100 <= value <= 999:
        return str(value)
    return None


def record_error(exchange: Exchange, *labels) -> None:
    """The server said, inside its response, that the request failed (an error event in a 200 stream):
    the row's outcome is `error`, labelled by the first of `labels` that is one (error_label)."""
    exchange.outcome = "error"
    for label in labels:
        label = error_label(label)
        if label is not None:
            exchange.error_type = label
            return
    exchange.error_type = GENERIC_ERROR


def reported_error(exchange: Exchange, obj: dict) -> bool:
    """An error event in the shape OpenAI-compatible servers send inside a stream, recorded: vLLM, SGLang,
    LiteLLM, llama.cpp `{"error": {"type", "code", "message"}}`, older vLLM `{"object": "error", "type"}`,
    TGI `{"error": "<message>", "error_type"}`. True if `obj` was one."""
    error = obj.get("error")
    if isinstance(error, dict):
        record_error(exchange, error.get("type"), error.get("code"))
    elif isinstance(error, str):
        record_error(exchange, obj.get("error_type"))  # the string is a message: never a label
    elif obj.get("object") == "error":
        record_error(exchange, obj.get("type"), obj.get("code"))
    else:
        return False
    return True


class Dialect:
    """What the responses of one API mean: its id, model, usage and generated output.

    A dialect says where its API puts the token counts: `counts` is (the key of
    the object holding them, "" for the event or body itself; the prompt count's
    name; the generated count's name), and `wrapper` the key under which some
    events carry the whole response. `visible` and `hidden` are regexes for
    output (text a user reads; reasoning or tool calls) in an event too large to
    parse or cut by a capture gap. Subclasses implement `event`; the defaults of
    `usage`, `body` and `partial` read those places and suit most APIs."""

    __slots__ = ("name", "_counts", "_prompt", "_completion", "_wrapper", "_id_key", "_prompt_key",
                 "_completion_key", "_visible", "_hidden")

    def __init__(self, name: str, *, counts: tuple[str, str, str], wrapper: str = "",
                 has_id: bool = True, visible: bytes | None = None, hidden: bytes | None = None) -> None:
        self.name = name  # the row's `api`
        self._counts, self._prompt, self._completion = counts
        self._wrapper = wrapper
        self._id_key = _ID_KEY if has_id else None
        self._prompt_key = count_key(self._prompt.encode())
        self._completion_key = count_key(self._completion.encode())
        self._visible = re.compile(visible) if visible else None
        self._hidden = re.compile(hidden) if hidden else None

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        """One streamed event (an SSE event's data, an NDJSON line), parsed, at ts."""
        raise NotImplementedError

    def scan(self, exchange: Exchange, payload: bytes, ts: int) -> bool:
        """Read an event without parsing it, where its bytes alone say exactly what
        `event` would record; False (nothing done) when they do not, or the dialect
        has no such reading: then the event is parsed."""
        return False

    def steady_text(self, payload: bytes) -> tuple[int, int] | None:
        """Where the text lies in an event (payload[start:end]) that reads as one event of
        visible text of choice 0 and nothing else, such that every event differing from it only
        in a text that is a non-empty run of bytes, none of them a quote, a backslash or a
        control byte, reads the same, once `counts_steady` holds: the kernel then counts such
        events from their size alone (kernel batching, bpf/steady.c). None when the event
        is not one of those, or the dialect has no such reading."""
        return None

    def counts_steady(self, exchange: Exchange) -> bool:
        """Whether events of a template `steady_text` named can be counted without their bytes now."""
        return False

    def steady_own_fields(self, payload: bytes) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The spans, before the text `steady_text` found, that hold values of the response's own
        (an id, a creation time), which another response on the connection has other values in:
        (spans of digits, spans of plain string bytes). Every event that differs from the template
        also there, in other bytes of the same kind, reads the same once `counts_steady` holds
        (those values are read from the response's first event alone)."""
        return (), ()

    def usage(self, obj: dict) -> tuple[int | None, int | None]:
        """(prompt, completion) tokens that an event or body reports, None where it does not."""
        inner = obj.get(self._wrapper) if self._wrapper else None
        holder = inner if isinstance(inner, dict) else obj
        if self._counts:
            holder = holder.get(self._counts)
            if not isinstance(holder, dict):
                return None, None
        return holder.get(self._prompt), holder.get(self._completion)

    def body(self, exchange: Exchange, obj: dict) -> None:
        """A whole non-streamed JSON response body."""
        set_id_model(exchange, obj.get("id"), obj.get("model"))
        set_usage(exchange, *self.usage(obj))

    def partial(self, exchange: Exchange, head: bytes, tail: bytes, ts: int | None) -> None:
        """An event (ts given) or a body (ts None) that could not be parsed: its kept
        head and tail. Id and model are looked for near the start, counts near the
        end, where the APIs put them."""
        if exchange.response_id is None and self._id_key is not None:
            exchange.response_id = first_json_string(self._id_key, head)
        if exchange.resp_model is None:
            exchange.resp_model = first_json_string(_MODEL_KEY, head)
        set_usage(exchange, last_count(self._prompt_key, tail, head),
                  last_count(self._completion_key, tail, head))
        if ts is None:
            return
        if self._visible is not None and (self._visible.search(head) or self._visible.search(tail)):
            exchange.record_output(ts)
        elif self._hidden is not None and (self._hidden.search(head) or self._hidden.search(tail)):
            exchange.record_output(ts, visible=False)
