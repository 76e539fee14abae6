"""`tokenprobe control`: the control loop as a service, next to the store and the actuator."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from ..analytics.figures import default_upstream
from ..store.client import StoreUnavailable
from ..store.embedded import open_store
from .auth import ClientAuth
from .controller import MATRIX_SIGNALS, TTFT_SIGNALS, Controller, ControllerPolicy
from .loop import DEFAULT_SETTLE_S, ControlLoop
from .publisher import DecisionPublisher

log = logging.getLogger(__name__)


def add_control_parser(sub, default_store: str) -> None:
    p = sub.add_parser(
        "control", help="run the control loop: stored figures -> breaker and token-budget decisions",
        description="Every --window seconds, read the window that just ended from the store, decide "
                    "(breakers per upstream, token budgets per tenant) and push the decisions to the "
                    "actuator; every decision is recorded in tokenprobe.decisions. Stops on SIGINT/SIGTERM; "
                    "the decisions in force then lapse at their expiry, returning gateways to normal.")
    p.add_argument("--store", default=default_store, metavar="URL", help="default %(default)s")
    p.add_argument("--actuator", required=True, metavar="HOST:PORT", help="the actuator's gRPC address")
    p.add_argument("--token-file", type=Path, metavar="FILE", help="a bearer token for the actuator")
    p.add_argument("--ca", type=Path, metavar="PEM", help="CA of the actuator's certificate: use TLS")
    p.add_argument("--cert", type=Path, metavar="PEM", help="client certificate, for mutual TLS (with --key)")
    p.add_argument("--key", type=Path, metavar="PEM", help="client private key, for mutual TLS")
    defaults = ControllerPolicy()
    p.add_argument("--window", type=float, default=defaults.window_s, metavar="S",
                   help="seconds per decision window (default %(default)s)")
    p.add_argument("--settle", type=float, default=DEFAULT_SETTLE_S, metavar="S",
                   help="how far behind the clock windows are read, so their rows have landed "
                        "(default %(default)s)")
    p.add_argument("--upstream", action="append", default=[], metavar="PORT=NAME",
                   help="the name gateways give the server on PORT (default NODE:PORT); repeatable")
    p.add_argument("--signals", choices=(MATRIX_SIGNALS, TTFT_SIGNALS), default=defaults.signals,
                   help="act on the indicator matrix and the in-flight queue too, or on rate and TTFT alone "
                        "(default %(default)s)")
    p.set_defaults(func=run_control)


def _client_auth(args: argparse.Namespace) -> ClientAuth:
    if bool(args.cert) != bool(args.key):
        raise ValueError("--cert and --key go together")
    if args.cert and not args.ca:
        raise ValueError("--cert needs --ca")
    if not (args.token_file or args.cert):
        raise ValueError("the actuator needs credentials: --token-file, or --ca with --cert and --key")
    return ClientAuth(
        bearer_token=args.token_file.read_text().strip() if args.token_file else None,
        root_certificates=args.ca.read_bytes() if args.ca else None,
        certificate_chain=args.cert.read_bytes() if args.cert else None,
        private_key=args.key.read_bytes() if args.key else None)


def _upstream_names(pairs: list[str]) -> dict[int, str]:
    names = {}
    for pair in pairs:
        port, sep, name = pair.partition("=")
        if not sep or not port.isdigit() or not name:
            raise ValueError(f"--upstream takes PORT=NAME, got {pair!r}")
        names[int(port)] = name
    return names


def run_control(args: argparse.Namespace) -> int:
    try:
        auth = _client_auth(args)
        names = _upstream_names(args.upstream)
        policy = ControllerPolicy(window_s=args.window, signals=args.signals)
        store = open_store(args.store, serve=False)
    except (OSError, ValueError, StoreUnavailable) as error:
        print(f"control: {error}", file=sys.stderr)
        return 2
    try:
        store.ensure_schema()  # tokenprobe.decisions is this loop's table
    except Exception as error:  # noqa: BLE001 - the store's client raises its own error types
        store.close()
        print(f"control: {error}", file=sys.stderr)
        return 2
    publisher = DecisionPublisher(args.actuator, auth)
    loop = ControlLoop(store, publisher, Controller(policy), settle_s=args.settle,
                       upstream_of=lambda node, port: names.get(port) or default_upstream(node, port))
    previous = {sig: signal.signal(sig, lambda *_: loop.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    log.info("deciding every %g s from %s, pushing to %s", args.window, args.store, args.actuator)
    try:
        loop.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        publisher.close()
        store.close()
    log.info("stopped after %d windows and %d decisions; failures: %s", loop.windows, len(loop.decisions),
             dict(loop.errors) or "none")
    return 0
