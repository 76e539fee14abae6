"""Run the actuator server: ``python -m tokenprobe.actuator --listen 127.0.0.1:50051 --token-file FILE``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from .auth import ServerAuth, ServerTls
from .engine import Enforcer
from .envoy_rls import DEFAULT_DOMAIN
from .server import DEFAULT_MAX_WATCHERS, ActuatorServer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenprobe.actuator", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="host:port (plaintext only on loopback)")
    parser.add_argument("--token-file", type=Path,
                        help="bearer tokens accepted, one per line (at least 16 characters each)")
    parser.add_argument("--tls-cert", type=Path, help="server certificate chain (PEM)")
    parser.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    parser.add_argument("--client-ca", type=Path, help="CA of client certificates: enables mutual TLS")
    parser.add_argument("--allow-identity", action="append", default=[],
                        help="client certificate identity (SAN or CN) admitted without a token; repeatable")
    parser.add_argument("--min-dwell", type=float, default=3.0, help="seconds before a target may be loosened again")
    parser.add_argument("--max-lifetime", type=float, default=600.0, help="cap on any decision's lifetime, seconds")
    parser.add_argument("--envoy-domain", default=DEFAULT_DOMAIN, help="rate limit domain served to Envoy")
    parser.add_argument("--max-watchers", type=int, default=DEFAULT_MAX_WATCHERS,
                        help="decision streams served at once, one per watching gateway (default %(default)s)")
    return parser


def _auth(args: argparse.Namespace) -> ServerAuth:
    tokens = frozenset()
    if args.token_file is not None:
        tokens = frozenset(line.strip() for line in args.token_file.read_text().splitlines() if line.strip())
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = ServerTls(args.tls_cert.read_bytes(), args.tls_key.read_bytes(),
                        args.client_ca.read_bytes() if args.client_ca else None,
                        frozenset(args.allow_identity))
    elif args.client_ca:
        raise ValueError("--client-ca needs --tls-cert and --tls-key")
    return ServerAuth(bearer_tokens=tokens, tls=tls)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = ActuatorServer(_auth(args), listen=args.listen,
                                enforcer=Enforcer(min_dwell_s=args.min_dwell, max_lifetime_s=args.max_lifetime),
                                envoy_domain=args.envoy_domain, max_watchers=args.max_watchers)
        server.start()
    except (OSError, ValueError) as error:
        print(f"actuator: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
