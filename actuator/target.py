"""One canonical form of an HTTP request's path, to decide on and to forward.

A gateway that decides on one spelling of a path and forwards another can
be walked past: `/v1/chat/completions%3F` is not the completions route to a
string comparison, but an upstream that decodes it, or an HTTP client that
re-parses the URL, serves it as one. So the gateway computes one canonical
path (RFC 3986 §6.2.2), refuses what has none, and uses that same string to
look up the route and to build the upstream request:

- percent-encoded unreserved characters are decoded (once), other escapes
  keep an upper-case hex form;
- an escape that would change how the path splits or ends — `/`, `?`, `#`,
  `%` (double encoding), `\\`, `;`, space, NUL and other control bytes — is
  refused, as are those bytes raw, bytes outside ASCII, and malformed
  escapes. Servers differ on `;` (some cut a segment's parameters off, as
  `/v1/chat/completions;x=1` → `/v1/chat/completions`) and on spaces (some
  trim them): no LLM API has either in a route, so a path holding one is
  refused rather than judged in one reading and served in another;
- empty segments (`//`) collapse and dot segments are removed (§5.2.4), so
  nothing climbs above the root, or above an upstream's base path.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

MAX_PATH_BYTES = 8192

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# Escapes refused: they would split, end or re-encode the path, or are control
# bytes. Any other escape (space, quotes, UTF-8, ...) stays escaped, upper-cased.
_REFUSED_DECODED = frozenset(b"/?#%\\; ") | frozenset(range(0x20)) | {0x7F}
# Bytes allowed unescaped in a path: unreserved, sub-delims but ';', ':' '@', '/', '%' (escapes).
_RAW_PATH = re.compile(rb"^/[A-Za-z0-9\-._~!$&'()*+,=:@/%]*$")
_ESCAPE = re.compile(rb"%(.{0,2})", re.DOTALL)
_HEX = re.compile(rb"^[0-9A-Fa-f]{2}$")


class BadTarget(ValueError):
    """A request target with no canonical form: answer 400."""


def canonical_path(raw_path: bytes) -> str:
    """The canonical form of a request's path (without its query); raises BadTarget."""
    if len(raw_path) > MAX_PATH_BYTES:
        raise BadTarget(f"path longer than {MAX_PATH_BYTES} bytes")
    if not _RAW_PATH.match(raw_path):
        raise BadTarget("the path must start with '/' and hold only URI path characters")
    decoded = _ESCAPE.sub(_normalise_escape, raw_path).decode("ascii")
    return remove_dot_segments(decoded)


def _normalise_escape(match: re.Match) -> bytes:
    digits = match.group(1)
    if not _HEX.match(digits):
        raise BadTarget("malformed percent-escape in the path")
    value = int(digits, 16)
    if value in _UNRESERVED:
        return bytes((value,))
    if value in _REFUSED_DECODED:
        raise BadTarget(f"the path holds an escaped %{value:02X}, which cannot be canonicalised")
    return b"%" + digits.upper()


def remove_dot_segments(path: str) -> str:
    """`path` with empty, `.` and `..` segments resolved (a `..` at the root stays at the root)."""
    segments: list[str] = []
    parts = path.split("/")[1:]
    for part in parts:
        if part == "..":
            if segments:
                segments.pop()
        elif part not in ("", "."):
            segments.append(part)
    # A trailing slash (or dot segment) is part of the path: /a/ and /a may be different routes.
    trailing = "/" if segments and parts[-1] in ("", ".", "..") else ""
    return "/" + "/".join(segments) + trailing


def scope_raw_path(scope) -> bytes:
    """The path as the client sent it: ASGI's raw_path, else the decoded path re-escaped."""
    raw = scope.get("raw_path")
    if raw:
        return raw.split(b"?", 1)[0]  # some servers leave the query in raw_path
    return quote(scope.get("path", ""), safe="/-._~!$&'()*+,;=:@").encode("ascii")


def check_framing(headers) -> None:
    """Refuse message framing that two HTTP parsers could read differently (RFC 9112 §6.3).

    Content-Length together with Transfer-Encoding is how requests are
    smuggled past a gateway; so are several differing Content-Lengths.
    """
    lengths = {value.strip() for name, value in headers if name.lower() == b"content-length"}
    if any(name.lower() == b"transfer-encoding" for name, _ in headers) and lengths:
        raise BadTarget("Content-Length together with Transfer-Encoding")
    if len(lengths) > 1 or any(not value.isdigit() for value in lengths):
        raise BadTarget("invalid or conflicting Content-Length")


def canonical_scope(scope) -> dict:
    """`scope` with its path in canonical form (path decoded, raw_path escaped); raises BadTarget."""
    check_framing(scope.get("headers", ()))
    path = canonical_path(scope_raw_path(scope))
    if scope.get("raw_path") == path.encode("ascii") and scope.get("path") == unquote(path):
        return scope
    return {**scope, "path": unquote(path), "raw_path": path.encode("ascii")}
