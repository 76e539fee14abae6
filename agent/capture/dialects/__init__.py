"""API dialects: what the responses of each LLM API mean, one module each behind `Dialect`.

A response's dialect is chosen once: by its request path when the table of APIs
(contract/apis.py) names one for it (`for_path`), else from the first streamed event
or the body (`sniff`). A new API is a new module here plus its entry in that table.
"""

from __future__ import annotations

from ....contract.apis import dialect_routes
from ..exchange import Exchange
from .anthropic import ANTHROPIC
from .base import Dialect, reported_error, set_id_model, set_usage
from .llamacpp import LLAMACPP
from .ollama import OLLAMA_CHAT, OLLAMA_GENERATE
from .openai import CHAT as OPENAI_CHAT
from .openai import COMPLETIONS as OPENAI_COMPLETIONS
from .openai import USAGE, ChoicesDialect
from .responses import RESPONSES
from .sglang import SGLANG
from .tgi import TGI

__all__ = ["Dialect", "OPENAI_CHAT", "UNKNOWN", "for_path", "sniff"]


class _Unknown(ChoicesDialect):
    """A response in no known shape: no output is counted from it; id, model and
    an OpenAI-style `usage` are still read, since most APIs name them so."""

    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        if reported_error(exchange, obj):  # a stream that failed before any event named its API
            return
        set_id_model(exchange, obj.get("id"), obj.get("model"))
        set_usage(exchange, *self.usage(obj))

    # Its events count no output: every one is parsed, none is counted from a template.
    scan = Dialect.scan
    steady_text = Dialect.steady_text
    counts_steady = Dialect.counts_steady
    steady_own_fields = Dialect.steady_own_fields


UNKNOWN = _Unknown("unknown", counts=USAGE)

_BY_NAME = {dialect.name: dialect for dialect in (OPENAI_CHAT, OPENAI_COMPLETIONS, RESPONSES, ANTHROPIC,
                                                  OLLAMA_GENERATE, OLLAMA_CHAT, TGI, SGLANG, LLAMACPP)}
# The routes the table of APIs names a dialect for; a route shared by several (/generate) is sniffed.
_BY_PATH = {route: _BY_NAME[name] for route, name in dialect_routes().items()}
_ANTHROPIC_TYPES = frozenset({"message_start", "content_block_start", "content_block_delta",
                              "content_block_stop", "message_delta", "message_stop", "ping", "message"})


def for_path(path: str) -> Dialect | None:
    """The dialect a request path names, or None (unknown path, or one shared by several)."""
    return _BY_PATH.get(path)


def sniff(obj: dict) -> Dialect | None:
    """The dialect whose shape a parsed event or body has, or None."""
    choices = obj.get("choices")
    if isinstance(choices, list):
        kind = obj.get("object")
        if isinstance(kind, str):
            return OPENAI_CHAT if kind.startswith("chat.") else OPENAI_COMPLETIONS
        first = choices[0] if choices else None
        return OPENAI_CHAT if not isinstance(first, dict) or "text" not in first else OPENAI_COMPLETIONS
    kind = obj.get("type")
    if isinstance(kind, str):
        if kind.startswith("response."):
            return RESPONSES
        if kind in _ANTHROPIC_TYPES:
            return ANTHROPIC
        if kind == "error":  # a stream that failed first thing: Anthropic nests the error, Responses does not
            return ANTHROPIC if isinstance(obj.get("error"), dict) else RESPONSES
    if obj.get("object") == "response":
        return RESPONSES
    if isinstance(obj.get("meta_info"), dict):
        return SGLANG
    if isinstance(obj.get("token"), dict) or "generated_text" in obj:
        return TGI
    if "done" in obj:
        if "message" in obj:
            return OLLAMA_CHAT
        if "response" in obj:
            return OLLAMA_GENERATE
    if isinstance(obj.get("content"), str):
        return LLAMACPP
    return None
