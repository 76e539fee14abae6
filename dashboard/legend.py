"""What the dashboard calls each indicator, in words, and what it measures: the indicator strip's
rows and its legend. The thresholds are the analysis' (``analytics.config.Thresholds``), not restated here."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.indicators import CRIT, INDICATORS, NO_DATA, OK, WARN


@dataclass(frozen=True)
class Words:
    title: str  # a row of the strip
    meaning: str  # the legend's line, and the strip's tooltip


INDICATOR_WORDS: dict[str, Words] = {
    "gpu_memory_pressure": Words("GPU memory used", "share of the GPU's memory in use"),
    "fragmentation": Words("memory fragmentation",
                           "how long memory has been nearly full while requests queue and the GPU idles"),
    "batch_fill": Words("batch fill", "requests holding a slot over the server's slots; low only matters while "
                                      "requests queue"),
    "queue_wait_p95": Words("queue wait (p95)", "95th percentile of the time requests waited before prefill"),
    "kv_cache_usage": Words("KV cache used", "the engine's own KV-cache usage, where it exports it"),
    "token_rate_decay": Words("token-rate decay", "decode rate at the end of long streams over their start"),
    "tpot_trend": Words("time-per-token trend", "how much median TPOT rose across the last windows"),
    "stall_rate": Words("token stalls", "share of inter-token gaps over 5x their stream's median"),
    "retry_storm": Words("retries", "share of requests repeating one the same client sent shortly before"),
    "knee_proximity": Words("load vs. capacity knee",
                            "requests in flight over the concurrency past which TTFT climbs (the knee)"),
    "inflight_stall": Words("stalled in flight", "longest a request still in flight went without progress"),
}

STATE_WORDS = {CRIT: "critical", WARN: "warning", OK: "ok", NO_DATA: "no data"}
STATE_COLOURS = {CRIT: "#d32f2f", WARN: "#ffb300", OK: "#66bb6a", NO_DATA: "#e0e0e0"}


def indicator_title(name: str) -> str:
    """An indicator's name in words (its stored name if it is newer than this table)."""
    return INDICATOR_WORDS[name].title if name in INDICATOR_WORDS else name


def indicator_meaning(name: str) -> str:
    return INDICATOR_WORDS[name].meaning if name in INDICATOR_WORDS else ""


def indicator_order() -> list[str]:
    """The analysis' own order of its indicators."""
    return [indicator.name for indicator in INDICATORS]
