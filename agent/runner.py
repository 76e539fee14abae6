"""The agent's loop and its stages, named in one place.

    kernel records ─► tracker ─► rows ─► sink (the store, or its disk spool while the store is away)
                                     └─► exporters (Prometheus /metrics, OTLP) ─► on_row (e.g. the demo's lines)
    beside them, once the store answers: the store's services (samplers, live analysis), started by
    the caller's ``bring_up`` (cli/agent.py wires the store and the analytics, rooms above this one)

The kernel side never waits for us: if this loop falls behind, the ring buffer fills and the kernel
counts drops, which the status line reports. Stages start in the order above and stop in reverse: on
SIGINT/SIGTERM or at the end of the duration the loop drains the ring buffer, writes every request
still open (outcome 'truncated'), stops the store's services and the exporters, and closes the sink,
which flushes (or spools) the last rows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ..contract.tenant import DEFAULT_TENANT_HEADER
from .capture.inflight import inflight_snapshot
from .capture.kernel.clock import MonotonicWallClock
from .capture.kernel.loader import Probes, Targets
from .capture.kernel.procfs import target_port_sockets
from .capture.kernel.tls_libraries import skipped_files, unreadable_tls
from .capture.tracker import DEFAULT_IDLE_TIMEOUT_S, ConnectionTracker
from .export.metrics_endpoint import AgentMetrics
from .export.otel_export import OtelExporter
from .identity.resolver import IdentityResolver, PodSelection, RowNaming
from .identity.runtime import DEFAULT_SOCKETS
from .sampling.samplers import SamplerSet

log = logging.getLogger("tokenprobe.agent")

DEFAULT_KEY_FILE = Path("/var/lib/tokenprobe/fingerprint.key")
RESCAN_INTERVAL_S = 5.0
# Connections that must have gone since the last release before freed memory is handed back.
RELEASE_AFTER_CONNECTIONS = 10_000


def load_fingerprint_key(path: Path = DEFAULT_KEY_FILE) -> bytes:
    """The node's secret for request-body fingerprints, made on first use.

    Fingerprints let the analytics spot retried requests without storing
    bodies; a secret key keeps them from being reversed by guessing bodies.
    """
    env = os.environ.get("TOKENPROBE_FINGERPRINT_KEY")
    if env:
        return env.encode()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key



class RowSink(Protocol):
    """Where rows go (store/sink.py's RequestSink): never blocks, spools while the store is away."""

    rows_written: int
    rows_spooled: int
    durable_until: float  # rows taken before this Unix time are stored or spooled to disk

    def put(self, row: dict) -> None: ...
    def stats(self): ...
    def close(self) -> None: ...


class LivePasses(Protocol):
    """The live analysis (analytics/live.py): its progress, and the requests in flight it asks for."""

    passes: int
    failures: int
    watermark_ns: int
    cpu_s: float

    def inflight_wanted(self) -> bool: ...
    def offer_inflight(self, snapshot, wall_ns: int) -> None: ...


class BlindWindowLog(Protocol):
    """Where the windows the agent did not trace are noted (cli/agent.py's BlindWindows, agent/heartbeat.py)."""

    traced_until: float | None

    def start(self, durable_until: float, metrics: AgentMetrics | None) -> None: ...
    def beat(self, durable_until: float) -> None: ...
    def stop(self, durable_until: float) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


class Stoppable(Protocol):
    def stop(self) -> None: ...


@dataclass
class CaptureConfig:
    """What the loop traces and how."""

    targets: Targets
    duration_s: float | None = None
    ringbuf_pages: int = 4096
    kernel_batching: bool = True  # the kernel batches steady SSE writes (bpf/steady.c)
    status: bool = True
    on_row: Callable[[dict], None] | None = None   # e.g. the demo's live lines
    on_ready: Callable[[], None] | None = None     # called once the probes are attached
    tenant_header: str | None = DEFAULT_TENANT_HEADER  # request header naming the tenant; None: off
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # a connection with no I/O this long is forgotten
    # Kubernetes: trace the pods selected (the runner is handed the resolver that names every row's pod).
    pod_namespace: str | None = None
    pod_labels: dict[str, str] = field(default_factory=dict)


def pod_selection(cfg: CaptureConfig, identities: IdentityResolver) -> PodSelection | None:
    """The pods ``--namespace``/``--pod-selector`` name, through the runtime; a ValueError if there is none."""
    if cfg.pod_namespace is None and not cfg.pod_labels:
        return None
    if identities.runtime is None:
        raise ValueError("--namespace/--pod-selector need the container runtime's API: no socket found at "
                         f"{', '.join(DEFAULT_SOCKETS)}; give --runtime-socket")
    return PodSelection(identities.runtime, cfg.pod_namespace, cfg.pod_labels, identities)


@dataclass
class AgentSummary:
    requests: int
    events: int
    drops: int
    rows_written: int
    rows_spooled: int
    parse_errors: int
    seconds: float
    map_overflows: dict[str, int] = field(default_factory=dict)  # per kernel map, entries it could not hold
    batched_writes: int = 0


def node_name() -> str:
    """The node's name: TOKENPROBE_NODE in a pod (whose host name is the pod's), else the host name."""
    return os.environ.get("TOKENPROBE_NODE") or socket.gethostname()


class LagMeter:
    """How far behind the kernel the agent is: now − the last event's kernel time."""

    def __init__(self) -> None:
        self.last_event_ns: int | None = None

    def seconds(self) -> float:
        if self.last_event_ns is None:
            return 0.0
        lag, self.last_event_ns = (time.monotonic_ns() - self.last_event_ns) / 1e9, None
        return max(0.0, lag)


class Exporters:
    """The optional outlets besides the store: Prometheus /metrics and OTLP."""

    def __init__(self, metrics_address: tuple[str, int] | None, otlp_endpoint: str | None, node: str) -> None:
        self.metrics_address = metrics_address
        self.metrics = AgentMetrics() if metrics_address else None
        self.otel = OtelExporter(otlp_endpoint, node=node) if otlp_endpoint else None
        # Their progress is reported with the agent's own figures.
        self.live: LivePasses | None = None
        self.samplers: SamplerSet | None = None

    def export(self, row: dict) -> None:
        if self.metrics:
            self.metrics.observe_request(row)
        if self.otel:
            self.otel.export_request(row)

    def unreadable(self, server_port: int, reason: str) -> None:
        if self.metrics:
            self.metrics.count_unreadable(server_port, reason)

    def serve_metrics(self) -> None:
        if self.metrics and self.metrics_address:
            host, port = self.metrics.serve(*self.metrics_address)
            log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)

    def agent_stats(self, tracker: ConnectionTracker, drops: int, lag_s: float, rate: float,
                    sink: RowSink, map_overflows: dict[str, int], map_sizes: dict[str, int] | None = None) -> None:
        if self.metrics:
            stats = tracker.stats
            self.metrics.set_agent_stats(
                events_total=stats.events, drops_total=drops, lag_s=lag_s, events_per_s=rate,
                parse_errors_total=stats.parse_errors, open_connections=len(tracker.connections),
                inflight_requests=sum(stats.inflight.values()), sink=sink.stats(),
                idle_evicted_total=stats.idle_evicted,
                map_sizes=map_sizes, map_overflows=map_overflows,
                batched_writes_total=stats.steady_writes, lost_events_total=stats.lost_events,
                unknown_ends_total=stats.unknown_ends, own_connections_total=stats.own_connections)
            self.metrics.set_skipped_files(skipped_files())
            if self.live:
                self.metrics.set_analysis_stats(passes_total=self.live.passes, failures_total=self.live.failures,
                                                analysed_until_s=self.live.watermark_ns / 1e9,
                                                cpu_s=self.live.cpu_s)
            if self.samplers:
                self.metrics.set_sampler_stats(self.samplers.stats())

    def close(self) -> None:
        if self.otel:
            self.otel.close()
        if self.metrics:
            self.metrics.close()


class StoreServices:
    """What needs an open store beside the request sink (the schema, the GPU join view, the samplers
    and the live analysis: ``bring_up`` starts them on a store and returns them, to be stopped in
    reverse order). Started with the store when it answers at start; otherwise a background thread
    keeps trying (backing off to 30 s), so a store that was down when the agent started does not leave
    sampling and analysis off for the life of the process."""

    RETRY_MAX_S = 30.0

    def __init__(self, open_store: Callable[[], Closable | None],
                 bring_up: Callable[[Closable], list[Stoppable]]) -> None:
        self._open_store, self._bring_up_on = open_store, bring_up
        self._running: list[Stoppable] = []
        self._opened: Closable | None = None  # a store this object opened itself, closed by stop()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, store: Closable | None) -> None:
        if store is not None:
            self._bring_up(store)
            return
        self._thread = threading.Thread(target=self._wait_for_store, name="tokenprobe-store-wait", daemon=True)
        self._thread.start()

    def _bring_up(self, store: Closable) -> None:
        self._running = self._bring_up_on(store)

    def _wait_for_store(self) -> None:
        delay = 1.0
        while not self._stopping.wait(delay):
            store = self._open_store()
            if store is None:
                delay = min(delay * 2, self.RETRY_MAX_S)
                continue
            try:
                self._bring_up(store)
            except Exception as error:  # gone again between opening and creating the tables, or refused
                log.warning("the store answered but sampling and analysis could not start (%s); retrying", error)
                store.close()
                delay = min(delay * 2, self.RETRY_MAX_S)
                continue
            self._opened = store
            log.info("the store answers: GPU and engine sampling and live analysis started")
            return

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for service in reversed(self._running):
            service.stop()
        if self._opened is not None:
            self._opened.close()



class MemoryRelease:
    """Hands the memory of many ended connections back to the system. glibc keeps what
    Python frees in its heap, so after a burst of connections the agent's RSS would stay
    at the burst's peak; malloc_trim returns the free pages (a no-op where there is none)."""

    def __init__(self) -> None:
        self._trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        self._peak = 0

    def after(self, tracked: int) -> None:
        """Called now and then with the connections tracked now."""
        self._peak = max(self._peak, tracked)
        if self._trim is not None and self._peak - tracked >= RELEASE_AFTER_CONNECTIONS:
            self._trim(0)
            self._peak = tracked


class ProcessRescan:
    """Every RESCAN_INTERVAL_S, on a thread of its own, what the kernel cannot have seen: new
    copies of OpenSSL and Go executables to probe, listeners and processes of the targets. Off the
    poll loop because reading a large library that appeared since (a new process's, a container's)
    takes up to a second, which would leave the ring buffer unread meanwhile (mmap's find lets the
    GIL go). It touches the probes only (uprobes, BPF maps), never the tracker."""

    def __init__(self, probes: Probes, pods: PodSelection | None = None) -> None:
        self._probes = probes
        self._pods = pods
        self._pod_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenprobe-rescan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.select_pods()
            if self._stop.wait(RESCAN_INTERVAL_S):
                return
            try:
                for path in self._probes.attach_ssl():
                    log.info("probing OpenSSL in %s", path)
                self._probes.rescan_processes()
                for path in self._probes.attach_go_tls():
                    log.info("probing Go crypto/tls in %s", path)
            except Exception as exc:  # a vanished process or file mid-read: the next rescan tries again
                log.warning("rescan of processes failed (%s: %s); retried in %.0f s", type(exc).__name__, exc,
                            RESCAN_INTERVAL_S)

    def select_pods(self) -> None:
        """The processes of the selected pods become target processes (a pod's new ones at each rescan)."""
        if self._pods is None:
            return
        found = self._pods.pids()
        for pid in found - self._pod_pids:
            self._probes.add_target_pid(pid)
        if found - self._pod_pids:
            log.info("pods selected: tracing processes %s", sorted(found - self._pod_pids))
        self._pod_pids |= found

    def stop(self) -> None:
        """Waits for a rescan under way: the probes must not close under it."""
        self._stop.set()
        self._thread.join()


def offer_inflight(live: LivePasses | None, tracker: ConnectionTracker) -> None:
    """On the capture thread, which alone may read the tracker: the requests in flight, when a pass asks."""
    if live is not None and live.inflight_wanted():
        now = time.monotonic_ns()
        live.offer_inflight(inflight_snapshot(tracker, now), tracker.clock.to_wall_ns(now))


class StatusLine:
    """One refreshed line on a terminal; a plain line every 10 s otherwise."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last_plain = 0.0

    def show(self, text: str, *, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
        elif final or time.monotonic() - self._last_plain >= 10:
            self._last_plain = time.monotonic()
            print(text, file=self.stream, flush=True)

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class Progress:
    """Long work said while it lasts: a line when it starts and one when it ends, and between them the
    seconds so far, refreshed each second on a terminal, else logged every ``every_s`` (the probes'
    compile takes 5-60 s, with nothing else to show; a pod's log shows it too)."""

    def __init__(self, what: str, expected: str, *, live: bool, stream=sys.stderr, every_s: float = 5.0) -> None:
        self.what, self.expected, self.stream = what, expected, stream
        self.live = live and stream.isatty()
        self.every_s = 1.0 if self.live else every_s
        self._done = threading.Event()

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        log.info("%s (%s)…", self.what, self.expected)
        self._ticker = threading.Thread(target=self._tick, name="tokenprobe-progress", daemon=True)
        self._ticker.start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(self.every_s):
            so_far = f"{self.what}… {time.monotonic() - self._started:.0f} s"
            if self.live:
                self.stream.write(f"\r\x1b[2K{so_far}")
                self.stream.flush()
            else:
                log.info("%s", so_far)

    def __exit__(self, failed, *_exc_info) -> None:
        self._done.set()
        self._ticker.join()  # no tick may land after the line is cleared or the end is said
        if self.live:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
        if failed is None:
            log.info("%s: done in %.0f s", self.what, time.monotonic() - self._started)


class AgentRunner:
    """Runs the stages: the sink and exporters it is given, the store's services, the capture loop."""

    def __init__(self, config: CaptureConfig) -> None:
        self.config = config
        self._stop = False

    def stop(self, *_args) -> None:
        self._stop = True

    @contextmanager
    def stopping_on_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the run, from before the store opens or the BPF program compiles to
        the end: a stop asked for early ends the run as cleanly as one asked for later."""
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self, sink: RowSink, exporters: Exporters, services: StoreServices, store: Closable | None,
            clock: MonotonicWallClock, node: str, blind: BlindWindowLog,
            identities: IdentityResolver) -> AgentSummary:
        """Traces until stopped; then stops every stage, in reverse order of their start. ``store``: the
        store opened at start (None while it does not answer), handed to the services and closed last;
        ``blind``: where the windows this node was not traced are noted; ``identities``: each process's pod
        (the samplers name GPU memory by pod with it too)."""
        try:
            services.start(store)
            summary = self._capture(sink, clock, node, exporters, blind, identities)
        finally:
            services.stop()
            identities.stop()
            exporters.close()
            sink.close()
            blind.stop(sink.durable_until)
            if store is not None:
                store.close()
        # Counted after close(): it flushes (or spools) the last batch.
        summary.rows_written, summary.rows_spooled = sink.rows_written, sink.rows_spooled
        return summary

    def _capture(self, sink: RowSink, clock: MonotonicWallClock, node: str, exporters: Exporters,
                 blind: BlindWindowLog, identities: IdentityResolver) -> AgentSummary:
        """Probes → tracker → sink and exporters, until stopped or the duration ends."""
        cfg = self.config
        pods = pod_selection(cfg, identities)
        with Progress("compiling and loading the BPF probes", "11-60 s", live=cfg.status):
            probes = Probes(cfg.targets, ringbuf_pages=cfg.ringbuf_pages)

        def dispatch(row: dict) -> None:
            sink.put(row)
            exporters.export(row)
            if cfg.on_row:
                cfg.on_row(row)

        # Each row leaves named with its pod and container (held a moment for a container's first rows).
        naming = RowNaming(identities, dispatch)

        tracker = ConnectionTracker(
            naming.put, clock=clock, fingerprint_key=load_fingerprint_key(), node=node,
            target_ports=set(cfg.targets.ports), target_pids=set(cfg.targets.pids),
            forget_connection=probes.forget_connection, restart_connection=probes.restart_connection,
            on_unreadable=exporters.unreadable, tenant_header=cfg.tenant_header, idle_timeout_s=cfg.idle_timeout_s,
            steady=probes if cfg.kernel_batching else None, unseen_ends=probes, own_connection=probes.own_connection)
        lag = LagMeter()

        def handle(event) -> None:
            lag.last_event_ns = event.ts_ns
            tracker.handle(event)

        probes.open(handle)
        exporters.agent_stats(tracker, 0, 0.0, 0.0, sink, probes.map_overflows(), probes.map_sizes())
        exporters.serve_metrics()  # after the probes attach: readiness means tracing
        blind.start(sink.durable_until, exporters.metrics)  # tracing from here: the window since the last run ends
        t = cfg.targets
        log.info("tracing ports %s pids %s exes %s; OpenSSL probed: %s; Go crypto/tls probed: %s", t.ports or "-",
                 t.pids or "-", t.exes or "-", ", ".join(probes.attached_ssl) or "none",
                 ", ".join(probes.attached_go_tls) or "none")
        for reach in unreadable_tls([*t.pids, *(owner.pid for owner in target_port_sockets(set(t.ports))[0])]):
            log.warning("TLS of pid %d (%s) cannot be read: %s; its connections are written as unsupported "
                        "rows (tls_unprobed)", reach.pid, reach.exe, reach.library)
        if cfg.on_ready:
            cfg.on_ready()
        status = StatusLine() if cfg.status else None
        started = time.monotonic()
        deadline = started + cfg.duration_s if cfg.duration_s else None
        next_rescan = started + RESCAN_INTERVAL_S
        memory = MemoryRelease()
        last_tick, last_events = started, 0
        rescan = ProcessRescan(probes, pods)
        try:
            while not self._stop:
                probes.poll()
                naming.release()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                if now >= next_rescan:
                    next_rescan = now + RESCAN_INTERVAL_S
                    clock.maybe_refresh()
                    tracker.evict_idle(time.monotonic_ns())
                    memory.after(len(tracker.connections))
                if now - last_tick >= 1.0:
                    rate = (tracker.stats.events - last_events) / (now - last_tick)
                    last_tick, last_events = now, tracker.stats.events
                    drops = probes.drops()
                    exporters.agent_stats(tracker, drops, lag.seconds(), rate, sink, probes.map_overflows())
                    blind.beat(sink.durable_until)
                    offer_inflight(exporters.live, tracker)
                    if status:
                        status.show(self._status_text(tracker, drops, sink, rate, now - started))
            # Drain what the kernel already produced before closing connections.
            for _ in range(50):
                before = tracker.stats.events
                probes.poll(0)
                if tracker.stats.events == before:
                    break
            tracker.close_all(time.monotonic_ns())
            naming.release(everything=True)
        finally:
            rescan.stop()
            # Read before close(): the program's maps go with it.
            drops, overflows = probes.drops(), probes.map_overflows()
            probes.close()
            blind.traced_until = time.time()
            if status:
                status.show(self._status_text(tracker, drops, sink, 0.0, time.monotonic() - started),
                            final=True)
                status.end()
        return AgentSummary(
            requests=tracker.stats.requests, events=tracker.stats.events, drops=drops,
            rows_written=0, rows_spooled=0, parse_errors=tracker.stats.parse_errors,
            seconds=time.monotonic() - started, map_overflows=overflows,
            batched_writes=tracker.stats.steady_writes)

    @staticmethod
    def _status_text(tracker: ConnectionTracker, drops: int, sink: RowSink,
                     rate: float, elapsed: float) -> str:
        stats = tracker.stats
        inflight = sum(stats.inflight.values())
        text = (f"tokenprobe agent {elapsed:6.0f}s | requests {stats.requests} | {rate:7.0f} ev/s | "
                f"drops {drops} | conns {len(tracker.connections)} | in flight {inflight} | "
                f"stored {sink.rows_written}")
        if sink.rows_spooled:
            text += f" (spooled {sink.rows_spooled})"
        if stats.parse_errors:
            text += f" | parse errors {stats.parse_errors}"
        if stats.unknown_api_streams:
            text += f" | unknown API streams {stats.unknown_api_streams}"
        return text
