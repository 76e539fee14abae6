"""How well the queue/prefill split matches the reference server's ground truth.

The reference server (``refserver``) logs, per request, when it was fully
read (``arrival_ns``), reached its engine after the server's own overhead (``engine_arrival_ns``), got a
slot (``slot_ns``) and finished prefill (``prefill_done_ns``): its true overhead is
``engine_arrival − arrival``, its true queue time ``slot − engine_arrival`` and its true prefill
``prefill_done − slot``. Matched to the analysed split (``request_split``) by response id,
each request's error is |estimate − truth|, also relative to its TTFT (the
quantity being split).

``run_levels`` and ``sweep_concurrency`` drive a reference server through
load levels (open loop) and concurrency levels (closed loop) and say which
request belonged to which level, for the kernel tests and the accuracy
benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd

from ..contract.analysis import KEY_COLUMNS, REQUEST_SPLIT_TABLE
from ..contract.figures import DEFAULT_DEFINITION, REQUEST_FIGURES_TABLE, phases_select
from ..store.client import Store
from .loadgen import LoadConfig, burst, run_load

# Pause between levels, so each starts from a drained server.
DRAIN_S = 0.5


def phase_errors(store: Store, truth: Iterable[Mapping]) -> pd.DataFrame:
    """One row per request present in both the truth log and the analysed split (``request_split``).

    Columns: response_id, ttft_ms (measured server TTFT), queue_ms, prefill_ms, overhead_ms
    (estimated; overhead 0 where the split books none), true_queue_ms, true_prefill_ms, true_overhead_ms,
    queue_error (|error| / TTFT), prefill_error and overhead_error (likewise), inflight_at_arrival.
    """
    true_times = {
        entry["id"]: ((entry["slot_ns"] - _engine_arrival_ns(entry)) / 1e6,
                      (entry["prefill_done_ns"] - entry["slot_ns"]) / 1e6,
                      (_engine_arrival_ns(entry) - entry["arrival_ns"]) / 1e6)
        for entry in truth
        if entry.get("id") and entry.get("slot_ns") and entry.get("prefill_done_ns") and entry.get("arrival_ns")
    }
    if not true_times:
        raise ValueError("the truth log has no request that reached prefill")
    figures, key = store.table(REQUEST_FIGURES_TABLE), ", ".join(KEY_COLUMNS)
    in_truth = "response_id IN {ids:Array(String)}"
    phases = phases_select(figures, store.table(REQUEST_SPLIT_TABLE), in_truth, DEFAULT_DEFINITION,
                           split_condition=f"({key}) IN (SELECT {key} FROM {figures} WHERE {in_truth})")
    measured = store.query_df(
        f"""SELECT response_id, ttft_server_ms AS ttft_ms, queue_ms, prefill_ms, ifNull(overhead_ms, 0) AS overhead_ms,
                   inflight_at_arrival
            FROM ({phases}) WHERE queue_ms IS NOT NULL""",
        {"ids": sorted(true_times)},
    )
    if measured.empty:
        raise ValueError("no request of the truth log has a queue/prefill split in request_split")
    measured["true_queue_ms"] = [true_times[i][0] for i in measured["response_id"]]
    measured["true_prefill_ms"] = [true_times[i][1] for i in measured["response_id"]]
    measured["true_overhead_ms"] = [true_times[i][2] for i in measured["response_id"]]
    measured["queue_error"] = (measured["queue_ms"] - measured["true_queue_ms"]).abs() / measured["ttft_ms"]
    measured["prefill_error"] = (measured["prefill_ms"] - measured["true_prefill_ms"]).abs() / measured["ttft_ms"]
    measured["overhead_error"] = (measured["overhead_ms"] - measured["true_overhead_ms"]).abs() / measured["ttft_ms"]
    return measured


def _engine_arrival_ns(entry: Mapping) -> int:
    """When the request reached the engine's queue (truth logs from before the server's overhead lack it)."""
    return entry.get("engine_arrival_ns") or entry["arrival_ns"]


def errors_by_level(errors: pd.DataFrame, level_of: Mapping[str, str]) -> pd.DataFrame:
    """Per load level (``level_of``: response id → level name, in the order given): requests, median TTFT and
    true queue and overhead (ms), median and p90 of the relative queue and prefill errors, median of the
    overhead's, and the queue's and prefill's in aggregate (``*_error_aggregate``)."""
    levels = list(dict.fromkeys(level_of.values()))
    labelled = errors.assign(level=[level_of.get(i) for i in errors["response_id"]]).dropna(subset=["level"])
    summary = labelled.groupby("level").agg(
        requests=("response_id", "count"),
        ttft_ms=("ttft_ms", "median"),
        true_queue_ms=("true_queue_ms", "median"),
        true_overhead_ms=("true_overhead_ms", "median"),
        queue_error_median=("queue_error", "median"),
        queue_error_p90=("queue_error", lambda e: e.quantile(0.9)),
        prefill_error_median=("prefill_error", "median"),
        prefill_error_p90=("prefill_error", lambda e: e.quantile(0.9)),
        overhead_error_median=("overhead_error", "median"),
    )
    # In aggregate, as the engine's histograms would show it: |sum of estimates - sum of truths| / sum of TTFTs.
    sums = labelled.groupby("level")[["ttft_ms", "queue_ms", "true_queue_ms", "prefill_ms", "true_prefill_ms"]].sum()
    summary["queue_error_aggregate"] = (sums["queue_ms"] - sums["true_queue_ms"]).abs() / sums["ttft_ms"]
    summary["prefill_error_aggregate"] = (sums["prefill_ms"] - sums["true_prefill_ms"]).abs() / sums["ttft_ms"]
    return summary.reindex([level for level in levels if level in summary.index])


@dataclass(frozen=True)
class LoadLevel:
    name: str
    rate: float  # Poisson arrivals per second
    seconds: float


@dataclass
class LevelRun:
    level_of: dict[str, str] = field(default_factory=dict)  # response id -> level name
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # level -> wall ns of its first and last send


def run_levels(port: int, levels: Sequence[LoadLevel], **load_options) -> LevelRun:
    """Open-loop Poisson load at each level in turn; ``load_options`` go to ``LoadConfig``."""
    run = LevelRun()
    for seed, level in enumerate(levels):
        result = run_load(LoadConfig(port=port, rate=level.rate, duration_s=level.seconds, seed=seed,
                                     **load_options))
        if result.errors:
            raise RuntimeError(f"level {level.name}: {len(result.errors)} requests failed, e.g. "
                               f"{result.errors[0].error}")
        run.level_of.update({record.response_id: level.name for record in result.records})
        sends = [record.send_ns for record in result.records]
        run.spans[level.name] = (min(sends) + result.wall_offset_ns, max(sends) + result.wall_offset_ns)
        time.sleep(DRAIN_S)
    return run


def sweep_concurrency(port: int, max_concurrency: int, requests_per_worker: int, **load_options) -> None:
    """Closed loop at 1 .. ``max_concurrency`` clients, each sending ``requests_per_worker`` requests on one
    connection; ``load_options`` go to ``LoadConfig``."""
    for concurrency in range(1, max_concurrency + 1):
        n = requests_per_worker * concurrency
        result = burst(LoadConfig(port=port, requests=n, duration_s=None, seed=concurrency, **load_options),
                       n=n, concurrency=concurrency, per_connection=requests_per_worker)
        if result.errors:
            raise RuntimeError(f"concurrency {concurrency}: {len(result.errors)} requests failed, e.g. "
                               f"{result.errors[0].error}")
