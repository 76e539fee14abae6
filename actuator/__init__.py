"""Closing the loop: circuit breakers and token throttles that gateways enforce.

- ``decisions``: what the controller decides (breaker states, token budgets),
  with the evidence behind each decision and its expiry.
- ``breaker``: the breaker state machine that turns window figures into states.
- ``engine``: the enforcement core shared by the server and gateway caches.
- ``server``: the gRPC API (tokenprobe.actuator.v1.Actuator) plus Envoy's
  rate limit service, health and reflection.
- ``gateway`` and ``asgi``: the per-request hook a Python gateway calls.
- ``controller``: from per-window figures to decisions, recorded in ClickHouse.
"""
