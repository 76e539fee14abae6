"""The latencies the heatmaps show, as SQL over ``tokenprobe.requests``, and their log-spaced bands.

TTFT, TPOT and end-to-end have one value per request; ITL has one per gap
between a request's consecutive text events (``Metric.per_gap``), so an ITL
heatmap cell counts gaps, each request contributing all of its own.

A band is ``floor(log10(ms) * bands_per_decade)``: band ``b`` holds latencies
in [10^(b/k), 10^((b+1)/k)) ms. The heatmap queries and the per-minute rollup
(``rollup``) compute bands with these same expressions, so both count every
request in the same cell.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import measures

DEFAULT_BANDS_PER_DECADE = 10
# Latencies below this (clock granularity, or a token before the request's
# last byte was seen) land in the lowest band instead of log10 of zero.
MIN_LATENCY_MS = 0.01


def band_sql(latency_sql: str, bands_per_decade_sql: str) -> str:
    """SQL for the band of a latency in ms, ``bands_per_decade_sql`` bands per decade (a literal or a
    bound parameter)."""
    return f"toInt32(floor(log10(greatest({latency_sql}, {MIN_LATENCY_MS})) * {bands_per_decade_sql}))"


def band_bounds_ms(band, bands_per_decade: int = DEFAULT_BANDS_PER_DECADE):
    """The latency range [low, high) in ms that a band (an int, or a Series of them) covers."""
    return 10 ** (band / bands_per_decade), 10 ** ((band + 1) / bands_per_decade)


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    description: str
    sql: str  # milliseconds, valid where `condition` holds; with `per_gap`, an array of them per request
    condition: str  # the requests that have this latency
    per_gap: bool = False

    @property
    def counted(self) -> str:
        """What a heatmap cell of this metric counts."""
        return "inter-token gaps" if self.per_gap else "requests"

    def bands_sql(self, bands_per_decade_sql: str) -> str:
        """SQL for the array of a per-gap metric's bands, one per gap."""
        return f"arrayMap(gap_ms -> {band_sql('gap_ms', bands_per_decade_sql)}, {self.sql})"


# The figures are contract/measures.py's, so a heatmap cell and the analytics count a request alike.
METRICS: dict[str, Metric] = {
    metric.key: metric
    for metric in (
        Metric("ttft", "TTFT", "server time to first token: first generated token − request's last byte",
               measures.SERVER_TTFT.sql_when_known, measures.SERVER_TTFT.known_sql),
        Metric("tpot", "TPOT", "time per output token: (last token − first token) / (output tokens − 1), "
               "tokens from usage, else counted text events", measures.tpot_sql(known=True), measures.TPOT_KNOWN),
        Metric("e2e", "end-to-end", "end to end: connection setup (a connection's first request) + request's "
               "first byte → response's last byte", measures.e2e_sql(known=True), measures.E2E_KNOWN),
        Metric("itl", "ITL", "inter-token latency: every gap between consecutive generated-text events",
               measures.ITL_GAPS_MS, measures.HAS_ITL_GAPS, per_gap=True),
    )
}


def metric(key: str) -> Metric:
    try:
        return METRICS[key]
    except KeyError:
        raise ValueError(f"unknown latency metric {key!r}; choose one of {sorted(METRICS)}") from None
