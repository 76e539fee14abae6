"""Command line: `python -m tokenprobe.refserver serve ...` and `... load ...`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence

from .engine import EngineTiming
from .loadgen import LoadConfig, burst, run_load
from .server import ReferenceServer, ServerConfig
from .tls import make_self_signed_cert


def _serve_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults, timing = ServerConfig(), EngineTiming()
    p = subparsers.add_parser(
        "serve",
        help="run the reference OpenAI-compatible streaming server",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models and /health with a simulated "
        "engine (decode slots, FIFO queue, prefill and decode timing), logging ground truth per request.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=defaults.host, help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    p.add_argument(
        "--slots", type=int, default=timing.slots, help="concurrent decode slots; more requests wait in a FIFO queue"
    )
    p.add_argument(
        "--prefill-base-ms", type=float, default=timing.prefill_base_ms, help="fixed prefill time per request"
    )
    p.add_argument(
        "--prefill-ms-per-token", type=float, default=timing.prefill_ms_per_token, help="prefill time per prompt token"
    )
    p.add_argument("--decode-ms", type=float, default=timing.decode_ms, help="time between generated tokens")
    p.add_argument(
        "--simulated-metrics",
        action="store_true",
        help="serve a simulated vLLM-style /metrics and dcgm-exporter page at /sim/dcgm (no GPU needed; "
        'every series is labelled simulated="true")',
    )
    p.add_argument(
        "--kv-cache-blocks", type=int, default=defaults.kv_cache_blocks,
        help="blocks of 16 tokens in the simulated KV-cache gauge of an unbounded engine cache "
        "(default: 512); sized to what the slots hold, it fills with load",
    )
    p.add_argument(
        "--engine-kv-blocks", type=int, default=timing.kv_cache_blocks,
        help="bound the engine by a KV cache of this many blocks of 16 tokens, as vLLM's: a request is admitted "
        "when its blocks are free, a full cache preempts the request admitted last (it requeues and recomputes), "
        "and the simulated gauge reports the cache's real use",
    )
    p.add_argument("--slowdown", type=float, default=timing.slowdown, help="multiplier on prefill and decode times")
    p.add_argument(
        "--model", default=defaults.model, help="served model name (requests may name any model; it is echoed)"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=defaults.default_max_tokens,
        help="max_tokens when a request gives none",
    )
    p.add_argument(
        "--max-tokens-limit", type=int, default=defaults.max_tokens_limit, help="largest max_tokens accepted"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="open connections served; beyond this, 503",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        help="seconds a keep-alive connection may idle or a write may stall",
    )
    p.add_argument(
        "--send-buffer",
        type=int,
        metavar="BYTES",
        help="SO_SNDBUF of each accepted socket (default: the kernel's autotuning); small, a slow client pushes back",
    )
    p.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="as vLLM's flag: the last usage chunk and whole bodies carry each request's own `metrics`",
    )
    p.add_argument("--fail-streams-every", type=int, default=defaults.fail_streams_every, metavar="N",
                   help="every Nth streamed request fails after its first token with an error event in its 200 stream")
    p.add_argument("--overhead-ms", type=float, default=defaults.overhead_ms,
                   help="the API server's own time on a request before its engine sees it (handling, tokenising)")
    p.add_argument("--overhead-ms-per-request", type=float, default=defaults.overhead_ms_per_request,
                   help="more overhead for every other request the server holds: it grows with load")
    p.add_argument("--truth-log", metavar="PATH", help="append one JSON line of ground truth per request to PATH")
    p.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (needs --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="private key for --tls-cert")
    p.add_argument(
        "--tls-self-signed",
        action="store_true",
        help="serve HTTPS with a fresh self-signed certificate (made with the openssl command)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _load_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = LoadConfig()
    p = subparsers.add_parser(
        "load",
        help="generate load against an OpenAI-compatible server",
        description="Open loop (default): Poisson arrivals at --rate for --duration seconds or --requests requests, "
        "whichever ends first. Closed loop (--closed-loop): exactly --requests requests from --concurrency workers. "
        "Exits 1 if any request failed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--tls", action="store_true", help="use HTTPS (certificates are not verified)")
    p.add_argument("--rate", type=float, default=defaults.rate, help="open loop: mean requests per second")
    p.add_argument("--duration", type=float, default=defaults.duration_s, help="open loop: seconds of arrivals")
    p.add_argument("--requests", type=int, help="number of requests (required with --closed-loop)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=defaults.prompt_tokens)
    p.add_argument("--max-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=defaults.max_tokens)
    p.add_argument(
        "--chat-fraction",
        type=float,
        default=defaults.chat_fraction,
        help="share of /v1/chat/completions (rest: /v1/completions)",
    )
    p.add_argument("--stream-fraction", type=float, default=defaults.stream_fraction, help="share of streamed requests")
    p.add_argument(
        "--usage-fraction",
        type=float,
        default=defaults.include_usage_fraction,
        help="share of streams asking for stream_options.include_usage",
    )
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--tenant", default=defaults.tenant, help="send this tenant id in the x-tenant-id header")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seeds the request mix and the arrival times")
    p.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="keep-alive pool size, and the bound on requests in flight",
    )
    p.add_argument("--timeout", type=float, default=defaults.timeout_s, help="seconds per socket operation")
    p.add_argument(
        "--closed-loop", action="store_true", help="send exactly --requests requests with --concurrency workers"
    )
    p.add_argument("--concurrency", type=int, default=4, help="closed loop: concurrent workers")
    p.add_argument(
        "--per-connection", type=int, default=1, help="closed loop: requests per connection before a new one"
    )
    p.add_argument("--json", metavar="PATH", help="write the summary and every request record to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tls_self_signed and (args.tls_cert or args.tls_key):
        raise SystemExit("give either --tls-self-signed or --tls-cert/--tls-key, not both")
    with tempfile.TemporaryDirectory(prefix="refserver-tls-") as cert_dir:
        cert, key = args.tls_cert, args.tls_key
        if args.tls_self_signed:
            cert, key = make_self_signed_cert(cert_dir, args.host)
        try:
            timing = EngineTiming(
                args.slots, args.prefill_base_ms, args.prefill_ms_per_token, args.decode_ms, args.slowdown,
                kv_cache_blocks=args.engine_kv_blocks,
            )
            config = ServerConfig(
                host=args.host,
                port=args.port,
                engine=timing,
                model=args.model,
                default_max_tokens=args.default_max_tokens,
                max_tokens_limit=args.max_tokens_limit,
                max_connections=args.max_connections,
                idle_timeout_s=args.idle_timeout,
                send_buffer=args.send_buffer,
                truth_log=args.truth_log,
                tls_cert=cert,
                tls_key=key,
                simulated_metrics=args.simulated_metrics,
                kv_cache_blocks=args.kv_cache_blocks,
                per_request_metrics=args.enable_per_request_metrics,
                fail_streams_every=args.fail_streams_every,
                overhead_ms=args.overhead_ms,
                overhead_ms_per_request=args.overhead_ms_per_request,
            )
        except ValueError as exc:
            raise SystemExit(f"invalid setting: {exc}") from None
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        with ReferenceServer(config) as server:
            print(f"serving on {server.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
            stop.wait()
    return 0


def _load(args: argparse.Namespace) -> int:
    if args.closed_loop and args.requests is None:
        raise SystemExit("--closed-loop needs --requests")
    try:
        config = LoadConfig(
            host=args.host,
            port=args.port,
            tls=args.tls,
            rate=args.rate,
            duration_s=None if args.closed_loop else args.duration,
            requests=args.requests,
            prompt_tokens=tuple(args.prompt_tokens),
            tenant=args.tenant,
            max_tokens=tuple(args.max_tokens),
            chat_fraction=args.chat_fraction,
            stream_fraction=args.stream_fraction,
            include_usage_fraction=args.usage_fraction,
            model=args.model,
            seed=args.seed,
            max_connections=args.max_connections,
            timeout_s=args.timeout,
            progress=not args.quiet,
        )
        if args.closed_loop:
            result = burst(config, args.requests, args.concurrency, args.per_connection)
        else:
            result = run_load(config)
    except ValueError as exc:
        raise SystemExit(f"invalid setting: {exc}") from None
    print(result.summary().describe())
    for record in result.errors[:5]:
        print(f"  request {record.index} {record.path}: {record.error}", file=sys.stderr)
    if args.json:
        result.write_json(args.json)
    return 1 if result.errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenprobe.refserver", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _serve_parser(subparsers)
    _load_parser(subparsers)
    args = parser.parse_args(argv)
    return _serve(args) if args.command == "serve" else _load(args)


if __name__ == "__main__":
    raise SystemExit(main())
