"""Envoy's rate limit service (envoy.service.ratelimit.v3) over the same buckets.

Envoy and Istio gateways enforce tokenprobe's decisions with configuration
only: their global rate limit filter calls ``ShouldRateLimit`` with
descriptors, and this adapter answers from the same ``Enforcer`` that serves
``Check``. A descriptor is read by its entry keys:

- ``upstream``, ``model``, ``tenant``: the request's labels (any may be
  missing; other keys, such as Envoy's ``generic_key``, are ignored);
- tokens: the descriptor's ``hits_addend``, else the request's, else 1 —
  Envoy's own rule for an unset addend.

Token-aware gateways send the real usage with ``apply_on_stream_done`` and
``hits_addend`` taken from the response, so the buckets are charged what the
server counted. An open breaker or a spent budget answers OVER_LIMIT with a
``retry-after`` header; Envoy replies 429 (``rate_limited_status`` can make
it 503). A request Check would delay is let through here (Envoy cannot
wait); its tokens are reserved all the same. A domain other than the
adapter's has no limits, as in Envoy's reference service.

The messages are Envoy's published ones, as generated in the ``xds-protos``
package.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from .engine import Enforcer, VerdictKind, retry_after_header
from .wire import seconds_to_duration

DEFAULT_DOMAIN = "tokenprobe"
_OK = rls_pb2.RateLimitResponse.OK
_OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT


class RateLimitAdapter(rls_pb2_grpc.RateLimitServiceServicer):
    def __init__(self, enforcer: Enforcer, domain: str = DEFAULT_DOMAIN):
        self._enforcer = enforcer
        self._domain = domain

    def ShouldRateLimit(self, request: rls_pb2.RateLimitRequest, context) -> rls_pb2.RateLimitResponse:
        response = rls_pb2.RateLimitResponse(overall_code=_OK)
        longest_retry_s = 0.0
        for descriptor in request.descriptors:
            status = response.statuses.add(code=_OK)
            if request.domain != self._domain:
                continue
            labels = {entry.key: entry.value for entry in descriptor.entries}
            if descriptor.HasField("hits_addend"):
                tokens = descriptor.hits_addend.value
            else:
                tokens = request.hits_addend or 1
            verdict = self._enforcer.check(labels.get("upstream", ""), labels.get("model", ""),
                                           labels.get("tenant", ""), tokens)
            if verdict.kind == VerdictKind.REJECT:
                status.code = _OVER_LIMIT
                status.duration_until_reset.CopyFrom(seconds_to_duration(verdict.retry_after_s))
                response.overall_code = _OVER_LIMIT
                longest_retry_s = max(longest_retry_s, verdict.retry_after_s)
        if response.overall_code == _OVER_LIMIT:
            response.response_headers_to_add.append(
                base_pb2.HeaderValue(key="retry-after", value=retry_after_header(longest_retry_s)))
        return response
