"""``request_figures``: every inference request's figures that no calibration changes, computed once, at insert.

Of a request's phases (``REQUEST_PHASES_COLUMNS``, ``contract/analysis.py``)
only queue, prefill and overhead depend on the prefill calibration; network in
and out, TTFT, decode, end to end, TPOT, the ITL quantiles, stalls and the
decode-rate ratio depend on the row alone, and most of a pass's cost is
theirs (the token-gap arrays). ``request_figures_mv`` computes them on every
insert into ``requests`` (a replayed batch deduplicates as there), keyed like
``request_split``, so an analysis pass only splits the TTFT and stores the
split narrow; readers join the two (``phases_select``).

Stalls and the decode-rate ratio depend on two thresholds; the view computes
them with the analytics' defaults. Every row names the definition it was
computed by (``definition``: a digest of its expressions, thresholds
included), so a pass with other thresholds, or over rows an older tokenprobe
computed otherwise, or over rows the table lacks (stored before it existed and
not back-filled), computes the figures from ``requests`` instead, with the
same expressions (``figures_select``), and stores them here under their own definition.
"""

from __future__ import annotations

import hashlib

from . import measures
from .analysis import KEY_COLUMNS, REQUEST_PHASES_COLUMNS, SPLIT_COLUMNS
from .requests import REQUESTS, REQUESTS_TABLE
from .tables import DEDUPLICATION_WINDOW_SETTING, OPAQUE_CODEC, Column, Table, View

REQUEST_FIGURES_TABLE = "request_figures"
REQUEST_FIGURES_VIEW = "request_figures_mv"

# The defaults of analytics.config.Thresholds: the thresholds the view computes with.
DEFAULT_STALL_FACTOR = 5.0
DEFAULT_LONG_STREAM_EVENTS = 16

# Copied from the request as they are: what request_phases repeats, and what the split and a pass's
# conditions over the requests (measures.ENDED_AT, IS_INFERENCE) read.
COPIED_COLUMNS = (
    "node", "server_port", "model", "conn_id", "req_seq", "req_start", "req_end", "first_token",
    "last_token", "resp_end", "response_id", "client_addr", "path", "status", "outcome",
    "inflight_at_arrival", "token_events", "method", "resp_start", "prompt_tokens", "bytes_in",
    "engine_queue_ms", "engine_prompt_ms",
)  # fmt: skip


def figure_expressions(stall_factor: float, long_stream_events: int) -> dict[str, str]:
    """The calibration-independent phase columns, as SQL over a requests row with its inter-token gaps in µs
    (``gaps``) and the same sorted (``sorted_gaps``)."""
    return {
        "network_in_ms": measures.NETWORK_IN_MS,
        "accept_wait_ms": measures.ACCEPT_WAIT_MS,
        "tls_ms": measures.TLS_MS,
        "decode_ms": measures.DECODE_MS,
        "network_out_ms": measures.NETWORK_OUT_MS,
        "ttft_server_ms": measures.TTFT_SERVER_MS,
        "ttft_client_ms": measures.TTFT_CLIENT_MS,
        "e2e_ms": measures.E2E_MS,
        "tpot_ms": measures.TPOT_MS,
        **{f"itl_{name}_ms": measures.itl_quantile_ms("sorted_gaps", level)
           for name, level in measures.ITL_LEVELS.items()},
        "itl_gaps": "length(gaps)",
        "stalls": measures.stall_count("gaps", "sorted_gaps", factor=stall_factor),
        "decode_rate_ratio": measures.decode_rate_ratio(long_stream_events),
        "output_tokens": measures.OUTPUT_TOKENS,
        "output_tokens_source": measures.OUTPUT_TOKENS_SOURCE,
    }


def _select_list(stall_factor: float, long_stream_events: int) -> list[str]:
    expressions = figure_expressions(stall_factor, long_stream_events)
    return [*COPIED_COLUMNS, *(f"{expressions[name]} AS {name}" for name in expressions)]


def figures_definition(stall_factor: float, long_stream_events: int) -> str:
    """The ``definition`` of rows computed by this tokenprobe with these thresholds."""
    return hashlib.sha256("\n".join(_select_list(stall_factor, long_stream_events)).encode()).hexdigest()[:16]


def phases_select(figures_table: str, split_table: str, condition: str, definition: str,
                  split_condition: str | None = None) -> str:
    """SELECT of the phases (``REQUEST_PHASES_COLUMNS``) of the analysed requests of ``figures_table`` that
    meet ``condition`` and were computed by ``definition``: each its figures row with its split
    (``split_table``, read ``FINAL``; an analysed request has one, its queue and prefill NULL where they
    could not be split). ``split_condition`` selects the splits read (default ``condition``, which may then
    name only the key and ``model``): a reader bounds both sides of the join.
    """
    split_columns = ", ".join((*KEY_COLUMNS, *SPLIT_COLUMNS, "finished_at", "computed_at"))
    return f"""SELECT * FROM (
    SELECT * FROM {figures_table} WHERE ({condition}) AND definition = '{definition}'
) AS figures INNER JOIN (
    SELECT {split_columns} FROM {split_table} FINAL WHERE {split_condition or condition}
) AS split USING ({", ".join(KEY_COLUMNS)})"""


def figures_select(requests: str, stall_factor: float, long_stream_events: int, condition: str | None = None) -> str:
    """SELECT of ``request_figures``' columns for the inference requests of the table ``requests`` (that meet
    ``condition``), computed with these thresholds."""
    definition = f"'{figures_definition(stall_factor, long_stream_events)}' AS definition"
    select_list = ",\n    ".join([*_select_list(stall_factor, long_stream_events), definition])
    return f"""SELECT
    {select_list}
FROM (
    SELECT *, {measures.ITL_GAPS_US} AS gaps, arraySort(gaps) AS sorted_gaps
    FROM {requests}
    WHERE {measures.IS_INFERENCE}{"" if condition is None else f" AND {condition}"}
)"""


# The definition of the rows ``request_figures_mv`` computes: what readers outside an analysis read.
DEFAULT_DEFINITION = figures_definition(DEFAULT_STALL_FACTOR, DEFAULT_LONG_STREAM_EVENTS)


def _columns() -> tuple[Column, ...]:
    # Each column as request_phases declares it, else as requests does.
    declared = {column.name: column for column in (*REQUESTS.columns, *REQUEST_PHASES_COLUMNS)}
    figures = figure_expressions(DEFAULT_STALL_FACTOR, DEFAULT_LONG_STREAM_EVENTS)
    return (*(declared[name] for name in (*COPIED_COLUMNS, *figures)),
            Column("definition", "LowCardinality(String)", OPAQUE_CODEC))


REQUEST_FIGURES = Table(
    REQUEST_FIGURES_TABLE, _columns(),
    partition_by="req_start", order_by="node, server_port, req_start, conn_id, req_seq", ttl_column="req_start",
    settings=DEDUPLICATION_WINDOW_SETTING,
)
_VIEW_SELECT = figures_select(f"{{db}}.{REQUESTS_TABLE}", DEFAULT_STALL_FACTOR, DEFAULT_LONG_STREAM_EVENTS)
REQUEST_FIGURES_MV = View(
    REQUEST_FIGURES_VIEW,
    f"CREATE MATERIALIZED VIEW IF NOT EXISTS {{db}}.{REQUEST_FIGURES_VIEW} TO {{db}}.{REQUEST_FIGURES_TABLE} AS\n"
    + _VIEW_SELECT,
    # Rows stored before the view existed: a store made by an older tokenprobe gets them once.
    backfill=f"INSERT INTO {{db}}.{REQUEST_FIGURES_TABLE}\n{_VIEW_SELECT}",
)
