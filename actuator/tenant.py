"""Who a request's tenant is, as the gateway names it for budgets.

A budget is only as good as the identity it is charged to: a tenant named
by a header the client writes can be anyone, and can drain anyone else's
budget by naming them. So by default the tenant is derived from the
credential the client authenticates with — its API key (`Authorization:
Bearer`, or Anthropic's `x-api-key`) — as `key-` and the first 12 hex digits
of its SHA-256 (the key itself is never kept). The client-chosen tenant
header is believed only where the operator says it can be (a trusted front
proxy sets it). A request with neither is the default tenant's, whose budget
applies like any other: leaving the credential out never escapes a budget.
"""

from __future__ import annotations

import hashlib

from ..contract.tenant import tenant_id

DEFAULT_TENANT = "anonymous"
KEY_PREFIX = "key-"
KEY_DIGEST_HEX = 12
_API_KEY_HEADER = b"x-api-key"


def tenant_of_key(api_key: str) -> str:
    return KEY_PREFIX + hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:KEY_DIGEST_HEX]


class TenantIdentity:
    """Names the tenant of a request from its (ASGI, lower-case byte) headers."""

    def __init__(self, tenant_header: str, *, trust_header: bool = False):
        self._header = tenant_header.lower().encode("latin-1")
        self._trust_header = trust_header and bool(tenant_header)

    def __call__(self, headers) -> str:
        api_key = ""
        for name, value in headers:
            name = name.lower()
            if self._trust_header and name == self._header:
                named = tenant_id(value.decode("latin-1"))
                if named:
                    return named
            elif name == b"authorization" and not api_key:
                scheme, _, credential = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    api_key = credential.strip()
            elif name == _API_KEY_HEADER and not api_key:
                api_key = value.decode("latin-1").strip()
        return tenant_of_key(api_key) if api_key else DEFAULT_TENANT
