"""`tokenprobe analyze`: phases, indicator matrix, knee and SLOs over a time range, as text or JSON.

Registered on the main parser by ``add_analyze_parser(subparsers, default_store)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_analyze_parser(subparsers, default_store: str) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = subparsers.add_parser(
        "analyze", help="where requests spent their time, which warning signs are lit, SLO burn",
        description="Split every inference request's time into network, queue, prefill and decode; judge each "
                    "server per window (GPU memory, fragmentation, batch fill, queue wait, KV cache, token-rate "
                    "decay, TPOT trend, stalls, retries, closeness to the capacity knee); evaluate SLO burn rates. "
                    "Results are also written to the store's request_split, prefill_calibration, knee, "
                    "indicator_matrix and slo_status tables. Without --since/--until: the last hour of data.",
    )
    parser.add_argument("--store", default=default_store, metavar="URL", help="default %(default)s")
    parser.add_argument("--since", metavar="TIME",
                        help="start: 'now', a span ago (15m, 2h, 1d), Unix seconds or ISO 8601 (UTC if no zone)")
    parser.add_argument("--until", metavar="TIME", help="end, same forms (default: now, if --since is given)")
    parser.add_argument("--window", type=int, metavar="S",
                        help="indicator window in seconds (default: at most 12 windows over the range)")
    parser.add_argument("--server", action="append", default=[], metavar="PORT|NODE:PORT",
                        help="only this server (repeatable)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME", help="only this model (repeatable)")
    parser.add_argument("--config", metavar="TOML", help="threshold, SLO and look-back overrides")
    parser.add_argument("--json", action="store_true", help="print JSON for machines instead of tables")
    parser.set_defaults(func=run_analyze)
    return parser


def run_analyze(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import DatabaseError

    from ..store.client import StoreUnavailable
    from ..store.embedded import open_store
    from .config import AnalyticsConfig, load_config
    from .pipeline import analyze, default_range
    from .report import render_text, to_json
    from .scope import Scope, Server

    try:
        scope = Scope(tuple(Server.parse(text) for text in args.server), tuple(args.model))
        config = load_config(args.config) if args.config else AnalyticsConfig()
        if args.window is not None and args.window < 1:
            raise ValueError("--window must be at least 1 second")
    except ValueError as error:
        print(f"tokenprobe analyze: {error}", file=sys.stderr)
        return 2
    try:
        store = open_store(args.store, serve=False, create=False)  # a mistyped path is said, not created
    except (StoreUnavailable, ValueError) as error:
        print(f"tokenprobe analyze: {error}", file=sys.stderr)
        return 1
    try:
        store.ensure_schema()
        analysed = _time_range(args) or default_range(store, scope)
        if analysed is None:
            print(f"tokenprobe analyze: no inference requests in {store.url}"
                  + (f" for {', '.join(map(str, scope.servers))}" if scope.servers else "")
                  + (f" and model(s) {', '.join(scope.models)}" if scope.models else ""), file=sys.stderr)
            return 1
        report = analyze(store, analysed, window_s=args.window, scope=scope, config=config)
    except ValueError as error:  # a time that cannot be read, too many windows for the range
        print(f"tokenprobe analyze: {error}", file=sys.stderr)
        return 2
    except (StoreUnavailable, DatabaseError) as error:
        print(f"tokenprobe analyze: {error}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.json:
        json.dump(to_json(report, store.url), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(report, store.url))
    return 0


def _time_range(args: argparse.Namespace):
    """The range --since/--until name, or None when neither is given."""
    from .pipeline import DEFAULT_SPAN_S
    from .timerange import NS_PER_S, TimeRange, parse_time

    if args.since is None and args.until is None:
        return None
    now_ns = time.time_ns()
    end_ns = parse_time(args.until, now_ns) if args.until else now_ns
    start_ns = parse_time(args.since, now_ns) if args.since else end_ns - DEFAULT_SPAN_S * NS_PER_S
    return TimeRange(start_ns, end_ns)
