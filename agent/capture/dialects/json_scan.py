"""Reading fields out of bounded JSON samples.

A sample that is whole is parsed; one too large to keep whole or cut by a
capture gap is read with regexes over its kept head and tail. A key only
counts when an unescaped quote opens it right after `{` or `,`: the same words
inside a JSON string (prompt text) appear as `\\"model\\"`.
"""

from __future__ import annotations

import json
import re

import orjson

__all__ = ["MAX_COUNT", "MAX_FIELD_CHARS", "count", "count_key", "field_text", "first_json_string",
           "is_text", "json_object", "last_count", "last_json_string", "last_match", "last_number",
           "number_key", "string_key", "text_value"]

MAX_FIELD_CHARS = 256  # model names and response ids are cut to this length
MAX_COUNT = 0xFFFFFFFF  # token counts are UInt32 in the row

_JSON_STRING_VALUE = rb'"((?:[^"\\\x00-\x1f]|\\.){1,256})"'


def string_key(name: bytes) -> re.Pattern:
    """A regex for `"name": "<string>"`; group 1 is the raw (still escaped) string."""
    return re.compile(rb'[{,]\s*"' + name + rb'"\s*:\s*' + _JSON_STRING_VALUE)


def count_key(name: bytes) -> re.Pattern:
    """A regex for `"name": <non-negative integer>`; group 1 is the digits."""
    return re.compile(rb'[{,]\s*"' + name + rb'"\s*:\s*([0-9]{1,12})')


def text_value(*names: bytes) -> bytes:
    """Regex source for `"name": "<non-empty string>"`, for any of the names."""
    return rb'[{,]\s*"(?:' + b"|".join(names) + rb')"\s*:\s*"(?:[^"\\]|\\.)'


def number_key(name: bytes) -> re.Pattern:
    """A regex for `"name": <non-negative JSON number>`; group 1 is the number."""
    return re.compile(rb'[{,]\s*"' + name + rb'"\s*:\s*([0-9]{1,15}(?:\.[0-9]{1,17})?(?:[eE][+-]?[0-9]{1,3})?)')


def last_number(pattern: re.Pattern, data: bytes) -> float | None:
    match = last_match(pattern, data)
    return float(match[1]) if match else None


# orjson reads an integer past 64 bits as a float (json.loads keeps it whole): a float this large or more.
_LONG_INTEGER_FLOAT = float(1 << 63)


def json_object(data: bytes) -> dict | None:
    """``data`` as a JSON object, exactly as ``json.loads`` reads it, else None.

    orjson reads the common case about twice as fast, the check of its result included; what it refuses
    (NaN, a number past a float's range, a BOM, a surrogate, other encodings) and what it may have read
    otherwise (a float as large as an integer past 64 bits) goes to ``json.loads``."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    else:
        if not _holds_long_integer_float(value):
            return value if isinstance(value, dict) else None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _holds_long_integer_float(value) -> bool:
    # A walk of the parsed values, not a scan of the bytes: a regex for long digit runs cost 20× the parse
    # on a large request body.
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is dict:
            pending.extend(item.values())
        elif kind is list:
            pending.extend(item)
        elif kind is float and not -_LONG_INTEGER_FLOAT < item < _LONG_INTEGER_FLOAT:
            return True
    return False


def field_text(value) -> str | None:
    """A non-empty JSON string value as stored (cut to MAX_FIELD_CHARS), else None."""
    return value[:MAX_FIELD_CHARS] if isinstance(value, str) and value else None


def is_text(value) -> bool:
    """A non-empty JSON string: generated text, when a field carries it."""
    return isinstance(value, str) and value != ""


def count(value) -> int | None:
    """A token count as stored: a JSON integer that fits UInt32, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


def _json_string(raw: bytes) -> str | None:
    try:
        value = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return value[:MAX_FIELD_CHARS] or None


def last_match(pattern: re.Pattern, data: bytes) -> re.Match | None:
    last = None
    for last in pattern.finditer(data):
        pass
    return last


def first_json_string(pattern: re.Pattern, data: bytes) -> str | None:
    match = pattern.search(data)
    return _json_string(match[1]) if match else None


def last_json_string(pattern: re.Pattern, data: bytes) -> str | None:
    match = last_match(pattern, data)
    return _json_string(match[1]) if match else None


def last_count(pattern: re.Pattern, tail: bytes, head: bytes) -> int | None:
    """The value of the last match in tail, else in head; None if none or too large."""
    match = last_match(pattern, tail) or last_match(pattern, head)
    if match is None:
        return None
    value = int(match[1])
    return value if value <= MAX_COUNT else None
