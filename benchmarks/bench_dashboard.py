"""How fast the dashboard's heatmaps come out of ClickHouse: a day of 10 million requests.

Generates the requests inside an embedded store (``INSERT ... SELECT FROM
numbers()``, see ``refserver.fleet``); the store's materialized view fills
the per-minute latency rollup as they arrive. Then times each latency heatmap
over the whole day at the bin width the dashboard uses for a 24-hour window,
both as the dashboard serves it (from the rollup, its completeness check
included) and by scanning the requests, plus the drill-down into the busiest
cell. Each query runs several times; the best and the median are printed.
Figures only: nothing is asserted.

    .venv/bin/python benchmarks/bench_dashboard.py [--requests N] [--repeat R] [--store DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from tokenprobe.contract.latency import METRICS
from tokenprobe.dashboard.queries import DashboardQueries, Filters, choose_bin_seconds
from tokenprobe.refserver import fleet as synthetic
from tokenprobe.store.embedded import open_store

DAY_S = 86400


def timed(repeat: int, run) -> list[float]:
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return seconds


def report(name: str, seconds: list[float], rows: int) -> None:
    best, median = min(seconds), statistics.median(seconds)
    print(f"{name:<40} best {best:6.3f} s  median {median:6.3f} s  ({rows / best / 1e6:7.1f} M requests/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--store", help="directory for the embedded store (default: a temporary one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tokenprobe-bench-") as scratch:
        store = open_store(f"chdb://{args.store or scratch}", serve=False)
        try:
            store.ensure_schema()  # the requests table, the rollup and its view (imported with the queries)
            start_ns = (time.time_ns() // 10**9 // 60 * 60 - DAY_S) * 10**9  # whole minutes, as the app's windows
            started = time.perf_counter()
            synthetic.fill_requests(store, count=args.requests, start_ns=start_ns, span_s=DAY_S,
                                    token_offsets=False)
            print(f"generated {args.requests:,} requests over a day in {time.perf_counter() - started:.1f} s")

            day = Filters(start_ns, start_ns + DAY_S * 10**9)
            bin_s = choose_bin_seconds(DAY_S)
            queries = DashboardQueries(store)
            print(f"heatmaps over the day in {bin_s} s bins (the dashboard's source: "
                  f"{queries.heatmap_source(day, bin_s)}), best and median of {args.repeat}:")
            for key, metric in METRICS.items():
                cells = queries.latency_heatmap(key, day, bin_s)
                # A fresh DashboardQueries each time: the dashboard checks the rollup once per page run.
                served = timed(args.repeat, lambda key=key: DashboardQueries(store).latency_heatmap(key, day, bin_s))
                report(f"{metric.title}, as served ({len(cells)} cells)", served, args.requests)
                scanned = timed(args.repeat, lambda key=key: queries.latency_heatmap(key, day, bin_s,
                                                                                     source="requests"))
                report(f"{metric.title}, scanning the requests", scanned, args.requests)
            busiest = cells.sort_values("requests").iloc[-1]
            drill = timed(args.repeat, lambda: queries.cell_requests(
                "e2e", day, int(busiest["bin_start_s"]), bin_s, int(busiest["band"])))
            report(f"drill-down into a cell ({int(busiest['requests'])} requests)", drill, args.requests)
        finally:
            store.close()


if __name__ == "__main__":
    main()
