"""SGLang native API: /generate, streamed as SSE ending in `data: [DONE]`.

Each event carries `text` (by default all the text so far, not a delta) and
`meta_info` with the request `id`, `prompt_tokens` and `completion_tokens` so
far; `index` names the choice when n > 1. An event carries new output when its
`completion_tokens` grew: that holds for cumulative and incremental text alike.
There is no model name. A stream that fails after its 200 sends
`{"error": {"message": ...}}` (base.reported_error).
"""

from __future__ import annotations

from ..exchange import Exchange
from .base import Dialect, choice_index, reported_error, set_id_model, set_usage
from .json_scan import count, is_text, text_value

__all__ = ["SGLANG"]


class _SGLang(Dialect):
    __slots__ = ()

    def event(self, exchange: Exchange, obj: dict, ts: int) -> None:
        meta = obj.get("meta_info")
        if not isinstance(meta, dict):
            reported_error(exchange, obj)
            return
        choice = choice_index(obj.get("index"))
        if choice:  # the counts in the row are choice 0's: each choice counts its own
            exchange.record_output(ts, choice)
            return
        set_id_model(exchange, meta.get("id"), None)
        generated = count(meta.get("completion_tokens"))
        if generated is None:
            grew = is_text(obj.get("text"))
        else:
            grew = generated > (exchange.completion_tokens or 0)
        set_usage(exchange, *self.usage(obj))
        if grew:
            exchange.record_output(ts)

    def body(self, exchange: Exchange, obj: dict) -> None:
        meta = obj.get("meta_info")
        set_id_model(exchange, meta.get("id") if isinstance(meta, dict) else None, None)
        set_usage(exchange, *self.usage(obj))


SGLANG = _SGLang("sglang", counts=("meta_info", "prompt_tokens", "completion_tokens"),
                 visible=text_value(b"text"))
