"""The one interface every API dialect implements, and what dialects share.

A dialect is chosen once per response (by the request path, else by the first
event or the body) and then reads every event of that response. Dialects are
stateless singletons: what a response must remember lives on its Exchange.
"""

from __future__ import annotations

import re

from ..exchange import Exchange
from ..json_scan import count, field_text, first_json_string, last_count, string_key

__all__ = ["Dialect", "MAX_ENGINE_MS", "choice_index", "set_engine_ms", "set_id_model", "set_usage", "usage_object"]

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


def usage_object(obj: dict, wrapper: str) -> dict | None:
    """The `usage` object of obj[wrapper] when an event wraps the response in it, else obj's own."""
    inner = obj.get(wrapper)
    usage = (inner if isinstance(inner, dict) else obj).get("usage")
    return usage if isinstance(usage, dict) else None


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


def set_engine_ms(exchange: Exchange, prompt, decode, scale: float = 1.0) -> None:
    """The engine's own prompt (prefill) and generation times, as it reported them
    (JSON numbers; `scale` turns their unit into ms)."""
    prompt_ms = _duration_ms(prompt, scale)
    if prompt_ms is not None:
        exchange.engine_prompt_ms = prompt_ms
    decode_ms = _duration_ms(decode, scale)
    if decode_ms is not None:
        exchange.engine_decode_ms = decode_ms


class Dialect:
    """What the responses of one API mean: its id, model, usage and generated output.

    Subclasses implement `event` and `usage`; `body` and `partial` have defaults
    that suit most. The regexes below drive the defaults' fallback reading of an
    event or body that could not be parsed (too large, or cut by a capture gap);
    a subclass replaces those it names differently."""

    __slots__ = ("name",)

    id_key: re.Pattern | None = _ID_KEY
    model_key: re.Pattern = _MODEL_KEY
    prompt_key: re.Pattern | None = None
    completion_key: re.Pattern | None = None
    visible_output: re.Pattern | None = None  # generated text a user reads
    hidden_output: re.Pattern | None = None  # reasoning, tool calls

    def __init__(self, name: str) -> None:
        self.name = name  # the row's `api`

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        """One streamed event (an SSE event's data, an NDJSON line), parsed, at ts."""
        raise NotImplementedError

    def usage(self, obj: dict) -> tuple[int | None, int | None]:
        """(prompt, completion) tokens that an event or body reports, None where it does not."""
        raise NotImplementedError

    def body(self, exchange: Exchange, obj: dict) -> None:
        """A whole non-streamed JSON response body."""
        set_id_model(exchange, obj.get("id"), obj.get("model"))
        set_usage(exchange, *self.usage(obj))

    def partial(self, exchange: Exchange, head: bytes, tail: bytes, ts: int | None) -> None:
        """An event (ts given) or a body (ts None) that could not be parsed: its kept
        head and tail. Id and model are looked for near the start, counts near the
        end, where the APIs put them."""
        if exchange.response_id is None and self.id_key is not None:
            exchange.response_id = first_json_string(self.id_key, head)
        if exchange.resp_model is None:
            exchange.resp_model = first_json_string(self.model_key, head)
        if self.prompt_key is not None:
            set_usage(exchange, last_count(self.prompt_key, tail, head), None)
        if self.completion_key is not None:
            set_usage(exchange, None, last_count(self.completion_key, tail, head))
        if ts is None:
            return
        if self.visible_output is not None and (
                self.visible_output.search(head) or self.visible_output.search(tail)):
            exchange.record_output(ts)
        elif self.hidden_output is not None and (
                self.hidden_output.search(head) or self.hidden_output.search(tail)):
            exchange.record_output(ts, visible=False)
