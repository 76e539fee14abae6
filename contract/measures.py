"""The definition of every per-request figure, once, for SQL and for Python alike.

Each figure is declared here as data (which timestamps it spans, which
counts it divides by) and rendered two ways from that one declaration: as a
ClickHouse SQL expression over ``tokenprobe.requests`` columns (``TTFT_SERVER_MS``,
``TPOT_MS``, …: the analytics, the SLOs, the controller's figures, the
dashboard) and as a function of one row dict as the agent emits it
(``ttft_server_ms(row)``, ``tpot_ms(row)``, …: the agent's /metrics, the OTLP
exporter). Both compute in float64 from integer nanoseconds in the same
order, so for the same row they agree to the bit; tests/test_figures.py checks
it through every surface.

- inference request = a POST to a route of an inference API (contract/apis.py, the
  one rule: health checks, /metrics, /v1/models and a server's other routes are not)
- network in = request first byte → last byte; for a connection's first
  request also accept → TLS done (``tls_ms``) → first byte (``accept_wait_ms``)
- server TTFT = request last byte → first generated-text event
- client TTFT = network in + server TTFT (what the server side can see of the
  client's wait: the network's own delay is not observable from here)
- decode = first → last text event; TPOT = decode / (output tokens − 1)
- network out = last text event (or first response byte) → last response byte
- end to end = connection setup (a connection's first request: accept →
  request first byte) + request first byte → last response byte
- ITL = gaps between consecutive text events (``token_offsets_us``)

Output tokens come from ``usage`` when the stream carried it, else from the
count of text events (an event may carry several tokens).

TPOT against the benchmark tools (their definitions as of their 2025
sources; they time at the client, we at the server's socket):

- vLLM ``benchmark_serving``/``vllm bench serve``: TPOT = (latency − TTFT) /
  (output tokens − 1) per request, latency ending at the last streamed chunk;
  its ITL is the list of gaps between chunks. Same as ours, except that its
  decode window ends at the last chunk (which may carry only usage), ours at
  the last text event.
- GuideLLM: ``inter_token_latency_ms`` = (last − first token) / (output
  tokens − 1) is our TPOT; its ``time_per_output_token_ms`` divides the span
  from the request's start to the last token (TTFT included, since 0.3) by
  all output tokens.
- NVIDIA AIPerf (GenAI-Perf): ``inter_token_latency`` = (request latency −
  TTFT) / (output sequence length − 1) is our TPOT (newer versions subtract
  the first chunk's token count instead of 1); its per-gap figure is
  ``inter_chunk_latency``, our ITL.

All of them count output tokens with a tokenizer or from usage; where a
stream has no usage, ours counts text events, which undercounts when an event
carries several tokens (``output_tokens_source`` says which it was).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .apis import IS_INFERENCE_SQL, is_inference_request

IS_INFERENCE = IS_INFERENCE_SQL
# Client errors (4xx) are the client's doing: no latency objective covers them.
IS_SLO_ELIGIBLE = f"{IS_INFERENCE} AND NOT (status BETWEEN 400 AND 499)"
# When a request's row is complete: its last response byte, or the latest
# moment it reached when it was cut off. Windows of ended requests (the
# controller's, the live analysis' watermark) are chosen by it.
ENDED_AT = "coalesce(resp_end, last_token, first_token, resp_start, req_end, req_start)"
# Until when a request occupied its server (the matrix's occupancy): its last response byte, else the last
# moment of its own it reached.
FINISHED_AT_COLUMNS = ("resp_end", "last_token", "first_token", "req_end", "req_start")
FINISHED_AT = f"coalesce({', '.join(FINISHED_AT_COLUMNS)})"
# The request reached no successful end: server error, no response, an error inside the response (an
# error event in a 200 stream), cut off.
FAILED = "(status >= 500 OR status = 0 OR outcome IN ('error', 'reset', 'truncated'))"


def is_inference(row: Mapping) -> bool:
    """IS_INFERENCE for one row: a call to a model, not a health check or a metrics scrape."""
    return is_inference_request(row.get("method") or "", row.get("path") or "")


def ns(timestamp: str) -> str:
    """A DateTime64(9) expression as Int64 Unix nanoseconds."""
    return f"toUnixTimestamp64Nano({timestamp})"


def ms_between(earlier: str, later: str) -> str:
    """Milliseconds from one DateTime64(9) expression to another (NULL if either is NULL), at ns precision."""
    return f"(({ns(later)} - {ns(earlier)}) / 1e6)"


def seconds(timestamp: str) -> str:
    """A DateTime64(9) expression as Float64 Unix seconds."""
    return f"(toUnixTimestamp64Nano({timestamp}) / 1e9)"


def _coalesce(columns: Sequence[str]) -> str:
    return columns[0] if len(columns) == 1 else f"coalesce({', '.join(columns)})"


def _first_known(row: Mapping, columns: Sequence[str]):
    for column in columns:  # a loop, not next() over a generator: the agent calls this for every row
        value = row.get(column)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class Span:
    """The milliseconds from the first known of ``earlier`` to the first known of ``later`` (row timestamps)."""

    earlier: tuple[str, ...]
    later: tuple[str, ...]

    @property
    def sql(self) -> str:
        return ms_between(_coalesce(self.earlier), _coalesce(self.later))

    @property
    def known_sql(self) -> str:
        """SQL: the span has both ends."""
        return f"{_coalesce(self.earlier)} IS NOT NULL AND {_coalesce(self.later)} IS NOT NULL"

    @property
    def sql_when_known(self) -> str:
        """``sql`` for rows where ``known_sql`` holds: skipping the NULL checks halves the cost."""
        return ms_between(f"assumeNotNull({_coalesce(self.earlier)})", f"assumeNotNull({_coalesce(self.later)})")

    def of(self, row: Mapping) -> float | None:
        start, end = _first_known(row, self.earlier), _first_known(row, self.later)
        return None if start is None or end is None else (end - start) / 1e6


REQUEST_BYTES = Span(("req_start",), ("req_end",))
SERVER_TTFT = Span(("req_end",), ("first_token",))
DECODE = Span(("first_token",), ("last_token",))
NETWORK_OUT = Span(("last_token", "resp_start"), ("resp_end",))
REQUEST_TO_RESPONSE_END = Span(("req_start",), ("resp_end",))
CONNECTION_SETUP = Span(("accept_ts",), ("req_start",))
OUTPUT_TOKEN_COUNTS = ("completion_tokens", "token_events")  # usage first, else counted text events

FIRST_ON_CONNECTION = "(req_seq = 0 AND accept_ts IS NOT NULL)"
TLS_MS = f"if({FIRST_ON_CONNECTION} AND tls_done_ts IS NOT NULL, {ms_between('accept_ts', 'tls_done_ts')}, NULL)"
ACCEPT_WAIT_MS = f"if({FIRST_ON_CONNECTION}, {ms_between('coalesce(tls_done_ts, accept_ts)', 'req_start')}, NULL)"
CONNECTION_SETUP_MS = f"if({FIRST_ON_CONNECTION}, {CONNECTION_SETUP.sql}, 0)"
NETWORK_IN_MS = f"({REQUEST_BYTES.sql} + {CONNECTION_SETUP_MS})"
TTFT_SERVER_MS = SERVER_TTFT.sql
TTFT_CLIENT_MS = f"({NETWORK_IN_MS} + {TTFT_SERVER_MS})"
DECODE_MS = DECODE.sql
NETWORK_OUT_MS = NETWORK_OUT.sql
OUTPUT_TOKENS = _coalesce(OUTPUT_TOKEN_COUNTS)
OUTPUT_TOKENS_SOURCE = "if(completion_tokens IS NULL, 'events', 'usage')"


def e2e_sql(*, known: bool = False) -> str:
    """End to end; ``known``: for rows where ``E2E_KNOWN`` holds (cheaper)."""
    span = REQUEST_TO_RESPONSE_END.sql_when_known if known else REQUEST_TO_RESPONSE_END.sql
    return f"({span} + {CONNECTION_SETUP_MS})"


def tpot_sql(*, known: bool = False) -> str:
    """TPOT; ``known``: for rows where ``TPOT_KNOWN`` holds (cheaper, and no NULL branch)."""
    per_token = f"{DECODE.sql_when_known if known else DECODE_MS} / ({OUTPUT_TOKENS} - 1)"
    return per_token if known else f"if({OUTPUT_TOKENS} > 1, {per_token}, NULL)"


E2E_MS = e2e_sql()
E2E_KNOWN = REQUEST_TO_RESPONSE_END.known_sql
TPOT_MS = tpot_sql()
TPOT_KNOWN = f"{OUTPUT_TOKENS} > 1 AND {DECODE.known_sql}"


def connection_setup_ms(row: Mapping) -> float:
    """CONNECTION_SETUP_MS for one row."""
    if (row.get("req_seq") or 0) == 0 and row.get("accept_ts") is not None:
        return CONNECTION_SETUP.of(row)
    return 0.0


def ttft_server_ms(row: Mapping) -> float | None:
    """TTFT_SERVER_MS for one row."""
    return SERVER_TTFT.of(row)


def e2e_ms(row: Mapping) -> float | None:
    """E2E_MS for one row."""
    span = REQUEST_TO_RESPONSE_END.of(row)
    return None if span is None else span + connection_setup_ms(row)


def output_tokens(row: Mapping) -> int:
    """OUTPUT_TOKENS for one row."""
    return _first_known(row, OUTPUT_TOKEN_COUNTS) or 0


def tpot_ms(row: Mapping) -> float | None:
    """TPOT_MS for one row."""
    tokens, decode = output_tokens(row), DECODE.of(row)
    return decode / (tokens - 1) if tokens > 1 and decode is not None else None


def itl_gaps_ms(row: Mapping) -> list[float]:
    """ITL_GAPS_US for one row, in ms."""
    offsets = row.get("token_offsets_us") or []
    return [(later - earlier) / 1000 for earlier, later in zip(offsets, offsets[1:])]


# Inter-token gaps in µs: the first offset is the first event itself (0).
ITL_GAPS_US = "arrayPopFront(arrayDifference(token_offsets_us))"
ITL_GAPS_MS = f"arrayMap(gap -> gap / 1000, {ITL_GAPS_US})"  # itl_gaps_ms(row) in SQL
HAS_ITL_GAPS = "length(token_offsets_us) > 1"


def sorted_quantile(sorted_values: str, level: float) -> str:
    """``quantileExact(level)`` of an already sorted array (its element at floor(level × n)), one sort for all."""
    return f"{sorted_values}[toUInt32(floor({float(level)} * length({sorted_values}))) + 1]"


ITL_LEVELS = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": None}  # None: the largest gap


def itl_quantile_ms(sorted_gaps: str, level: float | None) -> str:
    """A request's ITL quantile (``level``; None: the max) in ms from its sorted gaps (µs); NULL when it has none.

    Each quantile is one element of the sorted array: no array of the four is built per request."""
    element = f"{sorted_gaps}[-1]" if level is None else sorted_quantile(sorted_gaps, level)
    return f"if(empty({sorted_gaps}), NULL, {element} / 1000)"


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
