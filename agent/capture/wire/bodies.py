"""Readers of a request body and of a whole (non-streamed) JSON response body, and the choice of
a response body's reader (shared by HTTP/1 and HTTP/2).

Each keeps a bounded sample of its body; nothing else of the content is kept.
"""

from __future__ import annotations

import re

from ....contract.tenant import printable
from .. import dialects
from ..dialects.json_scan import (
    field_text,
    first_json_string,
    json_object,
    last_json_string,
    last_match,
    string_key,
)
from ..exchange import Exchange
from .byte_samples import (
    REQUEST_BODY_HEAD,
    REQUEST_BODY_TAIL,
    HeadTailSample,
    body_fingerprint,
)
from .sse import NdjsonBody, SseBody

__all__ = ["JsonBody", "RequestBody", "path_of", "response_body_reader"]

RESPONSE_BODY_HEAD = 4096
RESPONSE_BODY_TAIL = 4096

_MODEL_KEY = string_key(b"model")
_STREAM_KEY = re.compile(rb'[{,]\s*"stream"\s*:\s*(true|false)\b')


class _SampledBody:
    """A body reader that keeps its body's head and tail, and reads them at the end."""

    __slots__ = ("_exchange", "_sample")

    def __init__(self, exchange: Exchange, head_cap: int, tail_cap: int) -> None:
        self._exchange = exchange
        self._sample = HeadTailSample(head_cap, tail_cap)

    def data(self, ts: int, chunk) -> None:
        self._sample.add(chunk)

    def gap(self, ts: int, nbytes: int) -> None:
        self._sample.add_gap(nbytes)


class RequestBody(_SampledBody):
    """Request body reader: keyed fingerprint, and `model` / `stream` from its head and tail."""

    __slots__ = ("_key", "_read_fields")

    def __init__(self, exchange: Exchange, key: bytes, *, read_fields: bool) -> None:
        super().__init__(exchange, REQUEST_BODY_HEAD, REQUEST_BODY_TAIL)
        self._key = key
        self._read_fields = read_fields

    def finish(self) -> None:
        exchange = self._exchange
        exchange.body_fp = body_fingerprint(self._key, self._sample)
        if self._read_fields:
            exchange.req_model, exchange.req_stream = _request_fields(self._sample)


def _request_fields(sample: HeadTailSample) -> tuple[str | None, bool | None]:
    whole = sample.whole()
    body = json_object(whole) if whole is not None else None
    if body is not None:
        stream = body.get("stream")
        return field_text(body.get("model")), stream if isinstance(stream, bool) else None
    # A large body: openai-python puts `model` after `messages`, so look in the tail too.
    head, tail = bytes(sample.head), bytes(sample.tail)
    model = first_json_string(_MODEL_KEY, head) or last_json_string(_MODEL_KEY, tail)
    stream_match = _STREAM_KEY.search(head) or last_match(_STREAM_KEY, tail)
    stream = None if stream_match is None else stream_match[1] == b"true"
    return model, stream


class JsonBody(_SampledBody):
    """Non-streamed JSON response: id, model and usage from its first and last 4 KiB,
    read by the response's dialect (chosen from the body when the path named none)."""

    __slots__ = ("_dialect",)

    def __init__(self, exchange: Exchange, dialect: dialects.Dialect | None) -> None:
        super().__init__(exchange, RESPONSE_BODY_HEAD, RESPONSE_BODY_TAIL)
        self._dialect = dialect

    def finish(self) -> None:
        exchange = self._exchange
        whole = self._sample.whole()
        body = json_object(whole) if whole is not None else None
        dialect = self._dialect
        if body is None:
            (dialect or dialects.UNKNOWN).partial(
                exchange, bytes(self._sample.head), bytes(self._sample.tail), None)
            return
        if dialect is None:
            dialect = dialects.sniff(body)
            if dialect is None:  # not an LLM API body (errors, model lists): the usual fields only
                dialect = dialects.UNKNOWN
            else:
                exchange.api = dialect.name
        dialect.body(exchange, body)


def path_of(target: bytes) -> str:
    return target.split(b"?", 1)[0].split(b"#", 1)[0].decode("utf-8", "replace")


def response_body_reader(exchange: Exchange, headers: dict[str, str], *, scan: bool = True):
    """The reader of a response body, or None when its content is not read. The
    API dialect is chosen here, once per response: by the request path when it
    names one, else by the readers from the first event or the body itself.
    `scan`: event streams let the dialect read events without parsing them."""
    dialect = dialects.for_path(exchange.path)
    if dialect is not None:
        exchange.api = dialect.name
    content_type = headers.get("content-type", "").lower()
    event_stream = content_type.startswith("text/event-stream")
    ndjson = content_type.startswith("application/x-ndjson")  # Ollama: one JSON object a line
    exchange.streamed = event_stream or ndjson
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        exchange.error = f"response body is {printable(encoding)}-encoded; its content was not read"
        return None
    if event_stream:
        return SseBody(exchange, dialect, scan=scan)
    if ndjson:
        return NdjsonBody(exchange, dialect, scan=scan)
    if not content_type or "json" in content_type:
        return JsonBody(exchange, dialect)
    return None
