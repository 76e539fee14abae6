"""Who a request's tenant is, as the gateway names it for budgets.

A budget is only as good as the identity it is charged to: a tenant named
by a header the client writes can be anyone, and can drain anyone else's
budget by naming them. So by default the tenant is derived from the
credential the client authenticates with — its API key (`Authorization:
Bearer`, or Anthropic's `x-api-key`) — as `key-` and the first 12 hex digits
of its SHA-256 (the key itself is never kept). The client-chosen tenant
header is believed only where the operator says it can be (a trusted front
proxy sets it).

A key is anyone's to make up, so a key is its own tenant only once the
gateway has seen the upstream accept it (a 2xx answer to an inference
request that carried it). Until then, and for a request with no key at all, the request
is the default tenant's: keys the gateway has not seen share one bucket,
and a new random key escapes no budget. The gateway remembers at most
`max_known_keys` keys (the least recently used are forgotten, and share the
default bucket again until they are accepted once more). An upstream that
accepts any key cannot tell keys apart: there, name tenants at a front proxy
that authenticates and pass `--trust-tenant-header`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from ..contract.tenant import tenant_id

DEFAULT_TENANT = "anonymous"
KEY_PREFIX = "key-"
KEY_DIGEST_HEX = 12
DEFAULT_MAX_KNOWN_KEYS = 100_000
_API_KEY_HEADER = b"x-api-key"


def tenant_of_key(api_key: str) -> str:
    return KEY_PREFIX + hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:KEY_DIGEST_HEX]


@dataclass(frozen=True)
class RequestTenant:
    tenant: str  # the tenant charged
    key_tenant: str = ""  # the tenant of the request's API key, to learn once the upstream accepts it


class TenantIdentity:
    """Names the tenant of a request from its (ASGI, lower-case byte) headers."""

    def __init__(self, tenant_header: str, *, trust_header: bool = False,
                 max_known_keys: int = DEFAULT_MAX_KNOWN_KEYS):
        self._header = tenant_header.lower().encode("latin-1")
        self._trust_header = trust_header and bool(tenant_header)
        self._known: OrderedDict[str, None] = OrderedDict()  # key tenants the upstream accepted, oldest first
        self._max_known = max_known_keys

    def __call__(self, headers) -> RequestTenant:
        api_key = ""
        for name, value in headers:
            name = name.lower()
            if self._trust_header and name == self._header:
                named = tenant_id(value.decode("latin-1"))
                if named:
                    return RequestTenant(named)
            elif name == b"authorization" and not api_key:
                scheme, _, credential = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    api_key = credential.strip()
            elif name == _API_KEY_HEADER and not api_key:
                api_key = value.decode("latin-1").strip()
        if not api_key:
            return RequestTenant(DEFAULT_TENANT)
        key_tenant = tenant_of_key(api_key)
        if key_tenant in self._known:
            self._known.move_to_end(key_tenant)
            return RequestTenant(key_tenant, key_tenant)
        return RequestTenant(DEFAULT_TENANT, key_tenant)

    def accepted(self, request: RequestTenant, status: int) -> None:
        """The upstream answered a request of `request`'s with `status`: a 2xx makes its key known."""
        if not request.key_tenant or not 200 <= status < 300 or request.key_tenant in self._known:
            return
        self._known[request.key_tenant] = None
        if len(self._known) > self._max_known:
            self._known.popitem(last=False)
