"""Per-request measures as ClickHouse SQL expressions over ``tokenprobe.requests`` columns.

One definition of each measure, used by every query that needs it (phases,
SLOs, the controller's figures, the knee), so they can never disagree:

- network in = request first byte → last byte; for a connection's first
  request also accept → TLS done (``tls_ms``) → first byte (``accept_wait_ms``)
- server TTFT = request last byte → first generated-text event
- client TTFT = network in + server TTFT (what the server side can see of the
  client's wait: the network's own delay is not observable from here)
- decode = first → last text event; TPOT = decode / (output tokens − 1)
- network out = last text event (or first response byte) → last response byte
- end to end = network in + request last byte → last response byte
- ITL = gaps between consecutive text events (``token_offsets_us``)

Output tokens come from ``usage`` when the stream carried it, else from the
count of text events (an event may carry several tokens).
"""

from __future__ import annotations

# Only inference calls are analysed: OpenAI-style, TGI and llama.cpp APIs are
# all POST, while health checks, /metrics and /v1/models are GETs.
IS_INFERENCE = "method = 'POST'"
# Client errors (4xx) are the client's doing: no latency objective covers them.
IS_SLO_ELIGIBLE = f"{IS_INFERENCE} AND NOT (status BETWEEN 400 AND 499)"
# When a request's row is complete: its last response byte, or the latest
# moment it reached when it was cut off. Windows of ended requests (the
# controller's, the live analysis' watermark) are chosen by it.
ENDED_AT = "coalesce(resp_end, last_token, first_token, resp_start, req_end, req_start)"
# The request reached no successful end: server error, no response, cut off.
FAILED = "(status >= 500 OR status = 0 OR outcome IN ('reset', 'truncated'))"


def ms_between(earlier: str, later: str) -> str:
    """Milliseconds from one DateTime64(9) expression to another (NULL if either is NULL), at ns precision."""
    return f"((toUnixTimestamp64Nano({later}) - toUnixTimestamp64Nano({earlier})) / 1e6)"


def seconds(timestamp: str) -> str:
    """A DateTime64(9) expression as Float64 Unix seconds."""
    return f"(toUnixTimestamp64Nano({timestamp}) / 1e9)"


FIRST_ON_CONNECTION = "(req_seq = 0 AND accept_ts IS NOT NULL)"
TLS_MS = f"if({FIRST_ON_CONNECTION} AND tls_done_ts IS NOT NULL, {ms_between('accept_ts', 'tls_done_ts')}, NULL)"
ACCEPT_WAIT_MS = f"if({FIRST_ON_CONNECTION}, {ms_between('coalesce(tls_done_ts, accept_ts)', 'req_start')}, NULL)"
CONNECTION_SETUP_MS = f"if({FIRST_ON_CONNECTION}, {ms_between('accept_ts', 'req_start')}, 0)"
NETWORK_IN_MS = f"({ms_between('req_start', 'req_end')} + {CONNECTION_SETUP_MS})"
TTFT_SERVER_MS = ms_between("req_end", "first_token")
TTFT_CLIENT_MS = f"({NETWORK_IN_MS} + {TTFT_SERVER_MS})"
DECODE_MS = ms_between("first_token", "last_token")
NETWORK_OUT_MS = ms_between("coalesce(last_token, resp_start)", "resp_end")
E2E_MS = f"({ms_between('req_start', 'resp_end')} + {CONNECTION_SETUP_MS})"
OUTPUT_TOKENS = "coalesce(completion_tokens, token_events)"
OUTPUT_TOKENS_SOURCE = "if(completion_tokens IS NULL, 'events', 'usage')"
TPOT_MS = f"if({OUTPUT_TOKENS} > 1, {DECODE_MS} / ({OUTPUT_TOKENS} - 1), NULL)"

# Inter-token gaps in µs: the first offset is the first event itself (0).
ITL_GAPS_US = "arrayPopFront(arrayDifference(token_offsets_us))"


def sorted_quantile(sorted_values: str, level: float) -> str:
    """``quantileExact(level)`` of an already sorted array (its element at floor(level × n)), one sort for all."""
    return f"{sorted_values}[toUInt32(floor({float(level)} * length({sorted_values}))) + 1]"


def itl_quantiles_ms(sorted_gaps: str) -> str:
    """[p50, p90, p99, max] of a request's gaps in ms, from its sorted gaps (µs); empty when it has none."""
    quantiles = ", ".join(sorted_quantile(sorted_gaps, level) for level in (0.5, 0.9, 0.99))
    return (f"if(empty({sorted_gaps}), CAST([] AS Array(Float64)), "
            f"arrayMap(g -> g / 1000, [{quantiles}, arrayMax({sorted_gaps})]))")


def stall_count(gaps: str, sorted_gaps: str, factor: float = 5.0) -> str:
    """Gaps longer than ``factor`` × the stream's own median gap."""
    return f"arrayCount(g -> g > {float(factor)} * {sorted_quantile(sorted_gaps, 0.5)}, {gaps})"


def decode_rate_ratio(min_events: int) -> str:
    """For streams of at least ``min_events`` text events: decode rate in the last quarter over the first.

    Each quarter spans the same number of gaps, so the ratio of rates is the
    first quarter's duration over the last's. Below 1: the stream slowed down.
    """
    quarter = "intDiv(length(token_offsets_us) - 1, 4)"
    first = f"(token_offsets_us[1 + {quarter}] - token_offsets_us[1])"
    last = f"(token_offsets_us[length(token_offsets_us)] - token_offsets_us[length(token_offsets_us) - {quarter}])"
    return (f"if(length(token_offsets_us) >= {int(min_events)} AND {last} > 0, "
            f"toFloat64({first}) / {last}, NULL)")


# Prompt size: the usage count of prompt tokens where the stream carried one,
# else the request's size on the wire (headers and body).
PROMPT_SIZE = "if(prompt_tokens IS NOT NULL, toUInt64(prompt_tokens), bytes_in)"
PROMPT_SIZE_SOURCE = "if(prompt_tokens IS NOT NULL, 'usage', 'bytes')"
