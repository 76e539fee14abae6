"""``tokenprobe dashboard``: serve the Streamlit app on the given store.

The subcommand replaces itself with ``streamlit run`` on ``streamlit_app.py`` (so
signals and the exit status are Streamlit's own), handing the store URL and
the refresh interval over in environment variables (``settings``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .settings import DEFAULT_REFRESH_S, environment, parse_refresh

APP = Path(__file__).with_name("streamlit_app.py")
DEFAULT_PORT = 8501


def add_dashboard_parser(subparsers, default_store: str) -> None:
    """Register ``dashboard`` on the ``tokenprobe`` command's subparsers."""
    parser = subparsers.add_parser(
        "dashboard", help="serve the Streamlit dashboard on a store",
        description="Serve the dashboard: latency heatmaps with drill-down to single requests, the phase "
                    "breakdown, GPU state, the indicator matrix and actuator decisions. On an embedded store "
                    "that an agent owns, it reads through the agent.")
    parser.add_argument("--store", default=default_store, metavar="URL", help="default %(default)s")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s; the dashboard has no login of its own)")
    parser.add_argument("--own-store", action="store_true",
                        help="open an embedded store that no agent is running on (a finished demo's, say) and hold "
                             "it, serving it to other processes as an agent does (`tokenprobe query` and an agent "
                             "started on it meanwhile go through the dashboard). Without it the dashboard reads an "
                             "embedded store only through the agent that owns it")
    parser.add_argument("--refresh", type=parse_refresh, default=DEFAULT_REFRESH_S, metavar="S",
                        help="seconds between automatic refreshes, 0 for none (default %(default)s)")
    parser.set_defaults(func=run_dashboard)


def streamlit_command(args: argparse.Namespace) -> list[str]:
    """The ``streamlit run`` command line that serves the app as ``args`` ask."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", args.host,
        "--server.port", str(args.port),
        "--server.headless", "true",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
        # Viewers only: no Deploy button, no rerun or clear-cache (the default shows them on localhost).
        "--client.toolbarMode", "viewer",
    ]


def run_dashboard(args: argparse.Namespace) -> int:
    """Check the arguments, then become ``streamlit run`` (returns only to report bad arguments, with 2)."""
    # Imported here, not at the top: building the parser must stay cheap for every subcommand.
    from ..store.url import parse_store_url

    try:
        store = parse_store_url(args.store)
    except ValueError as error:
        print(f"tokenprobe dashboard: {error}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"tokenprobe dashboard: --port must be within 1-65535, got {args.port}", file=sys.stderr)
        return 2
    print(f"tokenprobe dashboard: serving http://{args.host}:{args.port}/ on {store.display()}", file=sys.stderr)
    command = streamlit_command(args)
    os.execve(command[0], command, {**os.environ, **environment(args.store, args.refresh, args.own_store)})
    return 0  # not reached: execve replaces this process
