"""The indicators the analytics judge every window by: their names, column headings, units, which side
of their thresholds is bad, and the states a verdict takes. The analytics compute them
(analytics/indicators.py), the controller and the alert rules act on them, the dashboard draws them."""

from __future__ import annotations

from dataclasses import dataclass

ABOVE, BELOW = "above", "below"
OK, WARN, CRIT, NO_DATA = "ok", "warn", "crit", "n/a"
# The verdicts as numbers alert rules can compare.
INDICATOR_STATES = {NO_DATA: -1, OK: 0, WARN: 1, CRIT: 2}
# Requests in flight with no output for too long (analytics/inflight.py).
INFLIGHT_STALL = "inflight_stall"


@dataclass(frozen=True)
class Indicator:
    name: str
    label: str  # a column heading
    unit: str
    comparison: str  # which side of the thresholds is bad
    per_gpu: bool = False


INDICATORS: tuple[Indicator, ...] = (
    Indicator("gpu_memory_pressure", "GPU mem", "ratio", ABOVE, per_gpu=True),
    Indicator("fragmentation", "frag", "s", ABOVE, per_gpu=True),
    Indicator("batch_fill", "batch", "ratio", BELOW),
    Indicator("queue_wait_p95", "queue p95", "ms", ABOVE),
    Indicator("kv_cache_usage", "KV", "ratio", ABOVE),
    Indicator("token_rate_decay", "decay", "ratio", BELOW),
    Indicator("tpot_trend", "TPOT trend", "ratio", ABOVE),
    Indicator("stall_rate", "stalls", "ratio", ABOVE),
    Indicator("retry_storm", "retries", "ratio", ABOVE),
    Indicator("knee_proximity", "knee", "ratio", ABOVE),
    # From the agent's samples of requests in flight (analytics/inflight.py), not from ended requests.
    Indicator(INFLIGHT_STALL, "stalled", "s", ABOVE),
)
INDICATORS_BY_NAME = {indicator.name: indicator for indicator in INDICATORS}
