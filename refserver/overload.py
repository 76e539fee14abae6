"""The overload scenario shared by the closed-loop test and its benchmark.

A reference server with 2 slots at 20 ms a token (about 24 tokens a request:
~0.5 s a slot, so it sustains ~4 requests/s), tenants sending open-loop
Poisson load with their id in the x-tenant-id header (``TenantLoad``: a rate,
ramping or not, a request shape, retries), and a controller policy
on short windows so the scenario fits in a couple of minutes. Its simulated
KV cache holds about what the two slots do (``KV_CACHE_BLOCKS``), so the
engine's gauge fills with the batch as a vLLM's would, and the agent's live
analysis runs every ``ANALYZE_EVERY_S`` so the indicator matrix keeps pace
with the control windows.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..actuator.breaker import BreakerPolicy
from ..actuator.controller import ControllerPolicy
from .loadgen import LoadConfig, LoadResult, run_load

SLOTS = 2
DECODE_MS = 20.0
# The server sustains about 4 requests/s; uncontained, 13 requests/s grow its queue by 9 requests a
# second, so a request sent 45 s into the overload waits about 100 s for a slot.
TTFT_OBJECTIVE_S = 5.0
# 7 blocks of 16 tokens: a full batch of two requests of ~64 tokens (prompt and output) fills the cache.
KV_CACHE_BLOCKS = 7
ANALYZE_EVERY_S = 3
OVERLOAD_POLICY = ControllerPolicy(window_s=3.0, decision_ttl_windows=3,
                                   breaker=BreakerPolicy(trip_windows=3, cooldown_s=6.0, recovery_shares=(0.25, 0.5)))


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's open-loop load: the rate (ramping to ``ramp_to_rate`` if given) and the request shape."""

    rate: float
    ramp_to_rate: float | None = None
    prompt_tokens: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (16, 32)
    retries: int = 0  # resent at once on a 429/5xx or a failure (see refserver.loadgen)
    timeout_s: float = 60.0  # the client gives up on a socket read after this long (and retries, if it does)


def load(port: int, tenant: str, shape: TenantLoad, seconds: float, seed: int) -> LoadResult:
    return run_load(LoadConfig(port=port, tenant=tenant, rate=shape.rate, ramp_to_rate=shape.ramp_to_rate,
                               duration_s=seconds, seed=seed, prompt_tokens=shape.prompt_tokens,
                               max_tokens=shape.max_tokens, retries=shape.retries, timeout_s=shape.timeout_s,
                               max_connections=256))


def load_together(port: int, seconds: float, tenants: dict[str, float | TenantLoad],
                  seed: int) -> dict[str, LoadResult]:
    """Each tenant's open-loop load at once, for `seconds`; a bare number is a rate of the default shape."""
    shapes = {tenant: shape if isinstance(shape, TenantLoad) else TenantLoad(shape)
              for tenant, shape in tenants.items()}
    with ThreadPoolExecutor(len(shapes)) as pool:
        futures = {tenant: pool.submit(load, port, tenant, shape, seconds, seed + i)
                   for i, (tenant, shape) in enumerate(sorted(shapes.items()))}
        return {tenant: future.result() for tenant, future in futures.items()}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
