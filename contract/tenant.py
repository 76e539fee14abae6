"""The tenant rule: which request header names the tenant, and how its value is stored.

The agent (reading requests off the wire) and the actuator's gateway hook (throttling
them) both name a tenant with these functions, so token budgets and stored token
counts agree on who a tenant is. Only the header's value is kept, as an identifier.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_TENANT_HEADER", "FRAMING_HEADERS", "MAX_TENANT_CHARS", "printable",
           "tenant_header_name", "tenant_id"]

DEFAULT_TENANT_HEADER = "x-tenant-id"
MAX_TENANT_CHARS = 128  # tenant ids are short; a longer value is cut, not refused
# Header fields an HTTP/1.x reader interprets (framing, body reading): never a tenant.
FRAMING_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "content-type", "content-encoding", "upgrade"})

_FIELD_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token


def printable(text: str, max_chars: int = 40) -> str:
    """text reduced to printable ASCII and cut to max_chars: safe in a row or a log line."""
    return "".join(ch for ch in text if "!" <= ch <= "~" or ch == " ")[:max_chars].strip()


def tenant_id(header_value: str) -> str:
    """The tenant id a header value names, as stored: printable ASCII, at most MAX_TENANT_CHARS.
    Gateways normalise with this too, so both sides name a tenant alike."""
    return printable(header_value, MAX_TENANT_CHARS)


def tenant_header_name(name: str | None) -> str | None:
    """The lower-case header name that carries the tenant, or None when None or "" turns it off.

    Raises ValueError for a name that is not an HTTP field name, or names a header
    that frames the message (its value is read differently)."""
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name.encode("ascii", "replace")):
        raise ValueError(f"tenant header {name!r} is not an HTTP header name")
    name = name.lower()
    if name in FRAMING_HEADERS:
        raise ValueError(f"tenant header {name!r} is a header that frames the message, not a tenant")
    return name
