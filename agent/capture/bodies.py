"""Readers of a request body and of a whole (non-streamed) JSON response body.

Each keeps a bounded sample of its body; nothing else of the content is kept.
"""

from __future__ import annotations

import re

from . import dialects
from .byte_samples import REQUEST_BODY_HEAD, REQUEST_BODY_TAIL, HeadTailSample, body_fingerprint
from .exchange import Exchange
from .json_scan import field_text, first_json_string, json_object, last_json_string, last_match, string_key

__all__ = ["JsonBody", "RequestBody"]

RESPONSE_BODY_HEAD = 4096
RESPONSE_BODY_TAIL = 4096

_MODEL_KEY = string_key(b"model")
_STREAM_KEY = re.compile(rb'[{,]\s*"stream"\s*:\s*(true|false)\b')


class RequestBody:
    """Request body reader: keyed fingerprint, and `model` / `stream` from its head and tail."""

    __slots__ = ("_exchange", "_key", "_read_fields", "_sample")

    def __init__(self, exchange: Exchange, key: bytes, *, read_fields: bool) -> None:
        self._exchange = exchange
        self._key = key
        self._read_fields = read_fields
        self._sample = HeadTailSample(REQUEST_BODY_HEAD, REQUEST_BODY_TAIL)

    def data(self, ts: int, chunk) -> None:
        self._sample.add(chunk)

    def gap(self, ts: int, nbytes: int) -> None:
        self._sample.add_gap(nbytes)

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


class JsonBody:
    """Non-streamed JSON response: id, model and usage from its first and last 4 KiB,
    read by the response's dialect (chosen from the body when the path named none)."""

    __slots__ = ("_dialect", "_exchange", "_sample")

    def __init__(self, exchange: Exchange, dialect: dialects.Dialect | None) -> None:
        self._exchange = exchange
        self._dialect = dialect
        self._sample = HeadTailSample(RESPONSE_BODY_HEAD, RESPONSE_BODY_TAIL)

    def data(self, ts: int, chunk) -> None:
        self._sample.add(chunk)

    def gap(self, ts: int, nbytes: int) -> None:
        self._sample.add_gap(nbytes)

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
