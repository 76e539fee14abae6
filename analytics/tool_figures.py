"""The figures a user's benchmark tool prints, per server and model, from the agent's rows.

vLLM bench (``vllm bench serve``), GuideLLM and AIPerf report TTFT, TPOT, ITL and end-to-end latency as
percentiles over a run's successful requests, and vLLM bench a goodput under SLOs. Their definitions
differ (``contract/measures.py`` says how); each figure here follows one definition and names the tools
whose figure it is, so a user can hold ours beside the one their tool printed:

- TTFT: network in + server TTFT (``TTFT_CLIENT_MS``): what a client waits, less the network's own delay,
  which the server side cannot see.
- TPOT: decode / (output tokens − 1), the same request's figure in all three (GuideLLM calls it
  ``inter_token_latency_ms``, AIPerf ``inter_token_latency``).
- time per output token: (TTFT + decode) / output tokens, GuideLLM's ``time_per_output_token_ms`` (since
  0.3 its span starts at the request, not at the first token).
- ITL: every gap between streamed text events, pooled over the requests before the percentiles are
  taken (vLLM bench ``itl``, AIPerf ``inter_chunk_latency``).
- end to end: ``E2E_MS`` (vLLM bench ``e2el``, GuideLLM and AIPerf ``request_latency``).
- goodput: requests per second meeting every SLO objective at once (vLLM bench ``--goodput``), over the
  span from the first request's start to the last one's end.

Percentiles interpolate linearly between the two nearest values, as ``numpy.percentile`` does in the tools.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..contract import measures
from ..contract.requests import REQUESTS_TABLE
from ..store.client import Store
from .config import Objective
from .scope import Scope
from .slo import good_condition
from .timerange import TimeRange, range_condition

LEVELS = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
SUMMARIES = ("mean", *(name for name, _ in LEVELS))  # the tools print a mean beside their percentiles


@dataclass(frozen=True)
class ToolFigure:
    name: str  # the key in JSON: {name}_p50 …
    label: str  # the row's name in the table
    follows: str  # the tools whose definition it follows, with their name for it
    sql: str  # a per-request value, or an array of values pooled across requests (``pooled``)
    pooled: bool = False


FIGURES = (
    ToolFigure("ttft_ms", "TTFT", "vLLM bench ttft; GuideLLM time_to_first_token_ms; AIPerf time_to_first_token",
               f"if(first_token IS NULL, NULL, {measures.TTFT_CLIENT_MS})"),
    ToolFigure("tpot_ms", "TPOT", "vLLM bench tpot; GuideLLM inter_token_latency_ms; AIPerf inter_token_latency",
               measures.TPOT_MS),
    ToolFigure("time_per_output_token_ms", "time per token", "GuideLLM time_per_output_token_ms (TTFT included)",
               f"if({measures.OUTPUT_TOKENS} > 0, ({measures.TTFT_CLIENT_MS} + {measures.DECODE_MS})"
               f" / {measures.OUTPUT_TOKENS}, NULL)"),
    ToolFigure("itl_ms", "ITL", "vLLM bench itl; AIPerf inter_chunk_latency (every gap, pooled)",
               measures.ITL_GAPS_MS, pooled=True),
    ToolFigure("e2e_ms", "end to end", "vLLM bench e2el; GuideLLM request_latency; AIPerf request_latency",
               measures.E2E_MS),
)  # fmt: skip
GOODPUT_FOLLOWS = "vLLM bench request_goodput (req/s meeting every SLO)"


def tool_figures(store: Store, analysed: TimeRange, scope: Scope, objectives: Sequence[Objective]) -> list[dict]:
    """One dict per server and model with successful inference requests starting in ``analysed``: ``requests``,
    ``{figure}_{mean,p50,p90,p99}`` for every ``FIGURES`` entry, ``goodput_rps`` and ``duration_s``."""
    in_range, range_parameters = range_condition("req_start", "analysed", analysed)
    in_scope, scope_parameters = scope.condition()
    levels = ", ".join(str(level) for _, level in LEVELS)
    columns = []
    for figure in FIGURES:
        pooled = "Array" if figure.pooled else ""
        columns.append(f"avg{pooled}({figure.sql}) AS {figure.name}_mean, "
                       f"quantilesExactInclusive{pooled}({levels})({figure.sql}) AS {figure.name}")
    every_objective = " AND ".join(good_condition(objective) for objective in objectives) or "1"
    duration = measures.ms_between("min(req_start)", f"max({measures.ENDED_AT})")
    rows = store.query_df(
        f"""SELECT node, server_port, model, count() AS requests, {', '.join(columns)},
                   countIf({every_objective}) AS good, {duration} / 1000 AS duration_s
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND NOT {measures.FAILED} AND first_token IS NOT NULL
              AND {in_range} AND {in_scope}
            GROUP BY node, server_port, model ORDER BY node, server_port, model""",
        {**range_parameters, **scope_parameters},
    ).to_dict("records")
    figures = []
    for row in rows:
        entry = {"node": row["node"], "server_port": int(row["server_port"]), "model": row["model"],
                 "requests": int(row["requests"]), "duration_s": float(row["duration_s"])}
        for figure in FIGURES:
            values = [row[f"{figure.name}_mean"], *(list(row[figure.name]) or [None] * len(LEVELS))]
            for summary, value in zip(SUMMARIES, values, strict=True):
                entry[f"{figure.name}_{summary}"] = None if value is None or math.isnan(value) else float(value)
        entry["goodput_rps"] = int(row["good"]) / entry["duration_s"] if entry["duration_s"] > 0 else None
        figures.append(entry)
    return figures
