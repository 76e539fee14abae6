"""The `tokenprobe` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..actuator.control_cli import add_control_parser
from ..agent.capture.tracker import DEFAULT_IDLE_TIMEOUT_S
from ..analytics.alerting import check_url as check_alertmanager_url
from ..analytics.cli import add_analyze_parser
from ..analytics.config import DEFAULT_CONFIG, DEFAULT_LIVE_EVERY_S
from ..analytics.config import load_config as load_analysis_config
from ..contract.tenant import DEFAULT_TENANT_HEADER, tenant_header_name
from ..dashboard.cli import add_dashboard_parser
from ..store.spool import DEFAULT_MAX_BYTES as DEFAULT_SPOOL_MAX_BYTES
from ..store.url import DEFAULT_STORE


def _positive_bytes(text: str) -> int:
    """A size in bytes, with an optional K, M or G (powers of 1024) suffix."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500M, 2G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def _add_agent_args(p: argparse.ArgumentParser) -> None:
    targets = p.add_argument_group("targets (any combination; a connection is tracked if one selects it)")
    targets.add_argument("--port", type=int, action="append", default=[], metavar="PORT",
                         help="a listening TCP port of an inference server (repeatable)")
    targets.add_argument("--pid", type=int, action="append", default=[], metavar="PID",
                         help="a server process, and the processes it forks (repeatable)")
    targets.add_argument("--exe", action="append", default=[], metavar="PATH",
                         help="an executable: every process of it, including ones started later (repeatable)")
    targets.add_argument("--namespace", metavar="NS",
                         help="the pods of a Kubernetes namespace: their processes, found through the container "
                              "runtime's API (with --pod-selector: the pods that match both)")
    targets.add_argument("--pod-selector", metavar="KEY=VALUE[,...]",
                         help="the pods carrying all these labels (as `kubectl -l`, equality only)")
    targets.add_argument("--outbound", action="store_true",
                         help="also track connections that --pid/--exe processes open (e.g. a proxy's upstreams)")
    p.add_argument("--store", default=DEFAULT_STORE, metavar="URL",
                   help="chdb:///DIR for the embedded store or http://host:8123/ "
                        "(default: $TOKENPROBE_STORE, else chdb:///var/lib/tokenprobe/store)")
    p.add_argument("--spool-max-bytes", type=_positive_bytes, default=DEFAULT_SPOOL_MAX_BYTES, metavar="BYTES",
                   help="bound of the disk spool that holds request rows while the store is unreachable; past it "
                        "the oldest are dropped and counted (tokenprobe_agent_spool_dropped_rows_total). "
                        "Accepts K, M, G suffixes (default 1G)")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="S",
                   help="forget a connection with no I/O for S seconds (its open request is written truncated; "
                        "if it speaks again it is followed afresh), so that connections whose close the "
                        "probes missed do not hold memory (default %(default)g)")
    p.add_argument("--tenant-header", default=DEFAULT_TENANT_HEADER, metavar="NAME",
                   help="request header whose value is stored as each request's tenant: an identifier, "
                        "not content; no other header is kept. The actuator's gateway hook reads the same "
                        "header by default, so its token budgets and the stored token counts name the "
                        "same tenants (default %(default)s; '' turns it off)")
    k8s = p.add_argument_group("Kubernetes (rows, metrics and spans name their pod and container)")
    k8s.add_argument("--runtime-socket", metavar="PATH",
                     help="the container runtime's API: a CRI socket (containerd, CRI-O) or the Docker Engine "
                          "API (Docker, podman); default: the first that exists of "
                          "/run/containerd/containerd.sock, /run/crio/crio.sock, /var/run/docker.sock, "
                          "/run/podman/podman.sock")
    k8s.add_argument("--no-pod-identity", dest="pod_identity", action="store_false",
                     help="do not name pods and containers (rows keep empty pod fields)")
    out = p.add_argument_group("exporters")
    out.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                     help="serve Prometheus /metrics on PORT (default 0: off; the DaemonSet uses 9464)")
    out.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default %(default)s)")
    out.add_argument("--otlp-endpoint", metavar="URL",
                     help="export a span per request and GenAI metrics over OTLP/gRPC, e.g. http://127.0.0.1:4317")
    live = p.add_argument_group("live analysis (this node's servers; `tokenprobe analyze` for a chosen range)")
    live.add_argument("--analyze-every", type=int, default=DEFAULT_LIVE_EVERY_S, metavar="S",
                      help="analyse the requests that ended every S seconds, in windows of S seconds, into the "
                           "analytics tables and the exporters (default %(default)s; 0 turns it off)")
    live.add_argument("--analysis-config", metavar="TOML",
                      help="threshold, SLO and look-back overrides, as `tokenprobe analyze --config` reads them; "
                           "[analysis] live_refit_every_s sets how often a pass fits the prefill calibration "
                           "and the knee again (default 120)")
    live.add_argument("--alertmanager", action="append", default=[], metavar="URL",
                      help="post the live analysis' lit indicators to this Alertmanager (API v2), labelled as "
                           "the Prometheus rules label them (repeatable: every member of an HA cluster)")
    p.add_argument("--no-kernel-batching", dest="kernel_batching", action="store_false",
                   help="send every write of a steady SSE stream as its own kernel event, instead of the "
                        "kernel batching their times and sizes (the rows are the same; the agent works harder)")
    ring = p.add_mutually_exclusive_group()
    ring.add_argument("--ringbuf-mb", type=int, default=16,
                      help="kernel ring buffer size in MiB, a power of two (default %(default)s)")
    ring.add_argument("--ringbuf-kb", type=int, metavar="KB",
                      help="kernel ring buffer size in KiB, a power of two of at least 4: a small one makes "
                           "the kernel drop events, to see how rows report it")
    gpu = p.add_argument_group("GPU and engine state, joined to every request")
    gpu.add_argument("--nvml-hz", type=float, default=10.0,
                     help="NVML samples per second; 0 leaves NVML out (default %(default)s)")
    gpu.add_argument("--dcgm", action="append", default=[], metavar="URL",
                     help="a dcgm-exporter /metrics URL to scrape (repeatable)")
    gpu.add_argument("--engine", action="append", default=[], metavar="[PORT=]URL",
                     help="an inference server's /metrics (vLLM, SGLang, TGI, llama.cpp); PORT= names the "
                          "port clients use when metrics are served elsewhere (repeatable)")
    gpu.add_argument("--gpu", action="append", default=[], metavar="PORT=GPU[,GPU]",
                     help="the GPUs (index, UUID or MIG device id) serving a port, where NVML cannot tell "
                          "from process memory (repeatable)")
    gpu.add_argument("--scrape-interval", type=float, default=1.0, metavar="S",
                     help="seconds between dcgm and engine scrapes (default %(default)s)")


def samplers_from_args(args: argparse.Namespace):
    """SamplerConfig from the GPU options; ValueError says which one is wrong."""
    from ..agent.sampling.prom_text import check_scrape_url
    from .agent import SamplerConfig

    for url in args.dcgm:
        check_scrape_url(url)
    engines: dict[str, int | None] = {}
    for spec in args.engine:
        port, sep, url = spec.partition("=")
        if sep and port.isdigit():
            engines[check_scrape_url(url)] = int(port)
        else:
            engines[check_scrape_url(spec)] = None
    gpus: dict[int, list[str]] = {}
    for spec in args.gpu:
        port, sep, refs = spec.partition("=")
        if not sep or not port.isdigit() or not refs:
            raise ValueError(f"--gpu {spec!r}: expected PORT=GPU[,GPU], e.g. 8000=0")
        gpus[int(port)] = refs.split(",")
    if args.nvml_hz < 0 or args.scrape_interval <= 0:
        raise ValueError("--nvml-hz must be ≥ 0 and --scrape-interval > 0")
    return SamplerConfig(nvml_hz=args.nvml_hz, dcgm_urls=args.dcgm, engine_urls=engines,
                         gpus_by_port=gpus, scrape_interval_s=args.scrape_interval)


def _cmd_agent(args: argparse.Namespace) -> int:
    from ..agent.capture.kernel.loader import ProbeError, Targets
    from ..agent.identity.resolver import parse_pod_selector
    from ..agent.identity.runtime import connect_runtime
    from .agent import Agent, AgentConfig
    from .preflight import PreflightError, check_metrics_port, warn_about_targets

    targets = Targets(ports=args.port, pids=args.pid, exes=args.exe, outbound=args.outbound,
                      pods=args.namespace is not None or args.pod_selector is not None)
    try:
        targets.validate()
        pod_labels = parse_pod_selector(args.pod_selector) if args.pod_selector is not None else {}
        if targets.pods and connect_runtime(args.runtime_socket) is None:
            raise ValueError("--namespace/--pod-selector find pods through the container runtime's API, and no "
                             "runtime socket answers here: give --runtime-socket (a CRI or Docker API socket)")
        samplers = samplers_from_args(args)
        tenant_header = tenant_header_name(args.tenant_header)
    except ValueError as exc:
        print(f"tokenprobe agent: {exc}", file=sys.stderr)
        return 2
    pages = args.ringbuf_kb // 4 if args.ringbuf_kb else args.ringbuf_mb * 256
    if pages < 1 or pages & (pages - 1) or (args.ringbuf_kb and args.ringbuf_kb % 4):
        print("tokenprobe agent: the ring buffer size must be a power of two (--ringbuf-kb: at least 4)",
              file=sys.stderr)
        return 2
    os.nice(max(0, args.nice))
    if not 0 <= args.metrics_port < 65536:
        print("tokenprobe agent: --metrics-port must be a TCP port (0: off)", file=sys.stderr)
        return 2
    if args.idle_timeout <= 0:
        print("tokenprobe agent: --idle-timeout must be a positive number of seconds", file=sys.stderr)
        return 2
    if args.analyze_every < 0:
        print("tokenprobe agent: --analyze-every must be ≥ 0 seconds (0: off)", file=sys.stderr)
        return 2
    try:
        analysis = load_analysis_config(args.analysis_config) if args.analysis_config else DEFAULT_CONFIG
    except ValueError as exc:
        print(f"tokenprobe agent: --analysis-config: {exc}", file=sys.stderr)
        return 2
    if args.alertmanager and not args.analyze_every:
        print("tokenprobe agent: --alertmanager needs the live analysis (--analyze-every > 0)", file=sys.stderr)
        return 2
    try:
        for url in args.alertmanager:
            check_alertmanager_url(url)
    except ValueError as exc:
        print(f"tokenprobe agent: --alertmanager: {exc}", file=sys.stderr)
        return 2
    try:
        if args.metrics_port:
            check_metrics_port(args.metrics_host, args.metrics_port)
    except PreflightError as exc:
        print(f"tokenprobe agent: {exc}", file=sys.stderr)
        return 1
    warn_about_targets(targets)
    config = AgentConfig(targets=targets, store_url=args.store, duration_s=args.duration,
                         ringbuf_pages=pages, kernel_batching=args.kernel_batching, status=not args.quiet,
                         samplers=samplers,
                         metrics_address=(args.metrics_host, args.metrics_port) if args.metrics_port else None,
                         otlp_endpoint=args.otlp_endpoint, tenant_header=tenant_header,
                         spool_max_bytes=args.spool_max_bytes, idle_timeout_s=args.idle_timeout,
                         analyze_every_s=args.analyze_every, analysis=analysis,
                         alertmanager_urls=args.alertmanager, pod_namespace=args.namespace, pod_labels=pod_labels,
                         pod_identity=args.pod_identity, runtime_socket=args.runtime_socket)
    try:
        if args.otlp_endpoint:
            from ..agent.export.otel_export import check_endpoint
            check_endpoint(args.otlp_endpoint)
    except ValueError as exc:
        print(f"tokenprobe agent: --otlp-endpoint: {exc}", file=sys.stderr)
        return 2
    try:
        summary = Agent(config).run()
    except ProbeError as exc:
        print(f"tokenprobe agent: {exc}\nRun 'tokenprobe doctor' for what works on this node.",
              file=sys.stderr)
        return 1
    print(f"done: {summary.requests} requests from {summary.events} kernel events "
          f"({summary.batched_writes} writes in batches) in {summary.seconds:.1f}s; {summary.rows_written} rows stored"
          + (f", {summary.rows_spooled} spooled to disk for later" if summary.rows_spooled else "")
          + f"; {summary.drops} events dropped by the kernel"
          + "".join(f"; kernel map {name} could not hold {count} entries"
                    for name, count in summary.map_overflows.items() if count))  # stdout: `| tee log` keeps it
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ..agent.doctor import FAIL, render, run_checks

    if args.wait <= 0 or (args.port is not None and not 0 < args.port < 65536):
        print("tokenprobe doctor: --port must be a TCP port and --wait a positive number of seconds",
              file=sys.stderr)
        return 2
    checks = run_checks(load=not args.no_load, port=args.port, wait_s=args.wait)
    print(render(checks))
    return 1 if any(c.state == FAIL for c in checks) else 0


def _cmd_query(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import DatabaseError

    from ..store.embedded import open_store

    store = open_store(args.store, serve=False, read_only=True)
    try:
        df = store.query_df(args.sql)
    except DatabaseError as error:  # the store's own words, not a traceback
        print(f"tokenprobe query: {error}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.format == "csv":
        df.to_csv(sys.stdout, index=False)
    else:
        with __import__("pandas").option_context("display.max_rows", args.max_rows,
                                                 "display.width", 200):
            print(df.to_string(index=False))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenprobe", fromfile_prefix_chars="@",
        description="eBPF observability for LLM serving: every streamed request's network, queue, "
                    "prefill and decode time, from the kernel, with no change to the server.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log details, and show a failure's traceback (also accepted after the command)")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.subparsers = sub  # main() reports a subcommand's usage errors with its own usage line

    p = sub.add_parser("agent", help="trace inference servers and store one row per request",
                       description="Load the probes, follow the target servers' connections and "
                                   "store one row per HTTP request in tokenprobe.requests. Stops on "
                                   "SIGINT/SIGTERM or after --duration, flushing everything.")
    _add_agent_args(p)
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--nice", type=int, default=10,
                   help="CPU niceness of the agent (default %(default)s): the served workload comes first; "
                        "events are stamped in the kernel, so a late agent loses no accuracy")
    p.add_argument("--quiet", action="store_true", help="no live status line")
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("demo", help="the reference server under load, traced, into an embedded store",
                       description="Start the reference OpenAI-compatible server, a Poisson load "
                                   "generator and the agent on an embedded store; print each request "
                                   "as it completes and totals at the end. The store stays for queries.")
    p.add_argument("--store", default="chdb:///var/lib/tokenprobe/demo-store", metavar="URL",
                   help="where to store the requests (default %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default %(default)s)")
    p.add_argument("--rate", type=float, default=6.0,
                   help="peak requests per second; the load sweeps 0.2×, 0.6×, 1.3× and 0.3× of it "
                        "(default %(default)s)")
    p.add_argument("--slots", type=int, default=4, help="the server's concurrent slots (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the server's port (default %(default)s)")
    p.add_argument("--tls", action="store_true", help="serve and load over HTTPS (without the gateway)")
    p.add_argument("--no-actuator", action="store_true",
                   help="load the server directly: no gateway, actuator or control loop "
                        "(by default they run, the gateway on --port + 1)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("doctor", help="say what works on this node and what to do about what doesn't",
                       description="Check what tracing needs here, trying it rather than inferring it: the "
                                   "capabilities in effect, a BPF load (EPERM from a missing capability or a seccomp "
                                   "filter is named), tracefs, the kernel headers, BCC, and the real probes, every "
                                   "copy of OpenSSL found included. Exits 1 if tracing cannot work.")
    p.add_argument("--no-load", action="store_true", help="skip compiling and loading the probes")
    p.add_argument("--port", type=int, metavar="PORT",
                   help="also check a server: who listens on PORT, its TLS library and whether the probes read it, "
                        "and the API of a request that arrives within --wait seconds")
    p.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="with --port, how long to wait for a request (default %(default)g)")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("query", help="run SQL on a store (also while an agent owns it)",
                       description="Run one SQL query and print the result. On an embedded store that "
                                   "an agent is writing, the query goes through the agent.")
    p.add_argument("sql", help="e.g. \"SELECT count() FROM tokenprobe.requests\"")
    p.add_argument("--store", default=DEFAULT_STORE, metavar="URL", help="default %(default)s")
    p.add_argument("--format", choices=("table", "csv"), default="table")
    p.add_argument("--max-rows", type=int, default=100)
    p.set_defaults(func=_cmd_query)

    add_analyze_parser(sub, default_store=DEFAULT_STORE)
    add_dashboard_parser(sub, DEFAULT_STORE)
    add_control_parser(sub, DEFAULT_STORE)
    for command in sub.choices.values():  # `tokenprobe query -v …` as well as `tokenprobe -v query …`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log details, and show a failure's traceback")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"tokenprobe {version('tokenprobe')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "tokenprobe (not installed: version unknown)"


def configure_logging(verbose: bool) -> None:
    """The project's own INFO lines; other libraries' only from WARNING (ERROR for the HTTP clients, whose
    retry warnings restate, at length, a failure the store's own message names in one line). -v: all."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenprobe").setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        for chatty in ("urllib3", "clickhouse_connect"):
            logging.getLogger(chatty).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Runs one command. Exit codes: 0 done, 1 failed, 2 wrong usage, 130 interrupted. A failure is one
    line naming the command; the traceback only with -v."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    if getattr(args, "store", None) is not None:
        from ..store.url import parse_store_url

        try:
            parse_store_url(args.store)
        except ValueError as error:
            parser.subparsers.choices[args.command].error(f"--store: {error}")  # exits 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"tokenprobe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the last resort: one line instead of a traceback
        if args.verbose:
            raise
        print(f"tokenprobe {args.command}: {describe_failure(error)}", file=sys.stderr)
        return 1


def describe_failure(error: BaseException) -> str:
    """A failure in one line. A store that cannot be reached or a system error says what it is; anything
    else is a fault, named by its type, with the way to see where it happened."""
    from ..store.client import StoreUnavailable

    message = " ".join(str(error).split())
    if isinstance(error, StoreUnavailable) or (isinstance(error, OSError) and error.strerror):
        return message
    return f"{type(error).__name__}{': ' + message if message else ''} (-v shows where)"
