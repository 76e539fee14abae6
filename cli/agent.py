"""The agent's main loop: probes → tracker → store, with a live status line.

The kernel side never waits for us: if this loop falls behind, the ring
buffer fills and the kernel counts drops, which the status line reports. On
SIGINT/SIGTERM or at the end of --duration the loop drains the ring buffer,
writes every request still open (outcome 'truncated'), flushes the store and
returns.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..agent.capture.clock import MonotonicWallClock
from ..agent.capture.inflight import inflight_snapshot
from ..agent.capture.probes import Probes, Targets
from ..agent.capture.procfs import target_port_sockets
from ..agent.capture.tls_libraries import unreadable_tls
from ..agent.capture.tracker import DEFAULT_IDLE_TIMEOUT_S, ConnectionTracker
from ..agent.export.metrics_endpoint import AgentMetrics
from ..agent.export.otel_export import OtelExporter
from ..agent.sampling.dcgm import DcgmScraper
from ..agent.sampling.engine_metrics import EngineScraper
from ..agent.sampling.gpu import NvmlSampler, ServerGpuMap
from ..agent.sampling.samplers import SamplerSet
from ..analytics.alerting import AlertmanagerClient
from ..analytics.config import DEFAULT_CONFIG, DEFAULT_LIVE_EVERY_S, AnalyticsConfig
from ..analytics.live import LiveAnalysis
from ..analytics.outlets import AlertmanagerOutlet, MetricsOutlet, OtelOutlet
from ..contract.tenant import DEFAULT_TENANT_HEADER
from ..store.client import Store, StoreUnavailable
from ..store.embedded import open_store
from ..store.schema import create_request_gpu_state_view
from ..store.sink import RequestSink
from ..store.spool import DEFAULT_MAX_BYTES as DEFAULT_SPOOL_MAX_BYTES

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


@dataclass
class SamplerConfig:
    """GPU and engine sources joined to the requests (agent/sampling/samplers.py)."""

    nvml_hz: float = 10.0                 # 0: leave NVML out
    dcgm_urls: list[str] = field(default_factory=list)
    engine_urls: dict[str, int | None] = field(default_factory=dict)  # URL → server port (None: the URL's)
    gpus_by_port: dict[int, list[str]] = field(default_factory=dict)  # configured server → GPU mapping
    scrape_interval_s: float = 1.0

    def build(self, store: Store, node: str, clock: MonotonicWallClock) -> SamplerSet:
        return SamplerSet(
            store, node, clock,
            nvml=NvmlSampler() if self.nvml_hz > 0 else None,
            nvml_hz=self.nvml_hz if self.nvml_hz > 0 else 1.0,
            dcgm=[DcgmScraper(url) for url in self.dcgm_urls],
            engines=[EngineScraper(url, server_port=port) for url, port in self.engine_urls.items()],
            scrape_interval_s=self.scrape_interval_s,
            gpu_map=ServerGpuMap(self.gpus_by_port))


@dataclass
class AgentConfig:
    targets: Targets
    store_url: str
    duration_s: float | None = None
    ringbuf_pages: int = 4096
    kernel_batching: bool = True  # the kernel batches steady SSE writes (bpf/tokenprobe.c)
    status: bool = True
    on_row: Callable[[dict], None] | None = None   # e.g. the demo's live lines
    on_ready: Callable[[], None] | None = None     # called once the probes are attached
    samplers: SamplerConfig = field(default_factory=SamplerConfig)
    metrics_address: tuple[str, int] | None = None  # serve Prometheus /metrics here
    otlp_endpoint: str | None = None                # export spans and GenAI metrics here
    tenant_header: str | None = DEFAULT_TENANT_HEADER  # request header naming the tenant; None: off
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES  # the disk spool's bound while the store is away
    analyze_every_s: int = DEFAULT_LIVE_EVERY_S     # live analysis window; 0: off
    analysis: AnalyticsConfig = DEFAULT_CONFIG      # its thresholds, SLOs and look-backs
    alertmanager_urls: list[str] = field(default_factory=list)  # post the live analysis' findings here
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # a connection with no I/O this long is forgotten


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

    def __init__(self, cfg: AgentConfig, node: str) -> None:
        self.metrics_address = cfg.metrics_address
        self.metrics = AgentMetrics() if cfg.metrics_address else None
        self.otel = OtelExporter(cfg.otlp_endpoint, node=node) if cfg.otlp_endpoint else None
        # Their progress is reported with the agent's own figures.
        self.live: LiveAnalysis | None = None
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
                    sink: RequestSink, map_overflows: dict[str, int], map_sizes: dict[str, int] | None = None) -> None:
        if self.metrics:
            stats = tracker.stats
            self.metrics.set_agent_stats(
                events_total=stats.events, drops_total=drops, lag_s=lag_s, events_per_s=rate,
                parse_errors_total=stats.parse_errors, open_connections=len(tracker.connections),
                inflight_requests=sum(stats.inflight.values()), sink=sink.stats(),
                idle_evicted_total=stats.idle_evicted,
                map_sizes=map_sizes, map_overflows=map_overflows,
                batched_writes_total=stats.steady_writes, lost_events_total=stats.lost_events,
                unknown_ends_total=stats.unknown_ends)
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


def before_each_pass(sink: RequestSink, samplers: SamplerSet | None) -> Callable[[], None]:
    """What a live pass must find stored, done first: the GPU and engine samples taken since the samplers'
    last insert, and the store's views fed the request rows the sink inserted without them."""
    def store_what_is_held() -> None:
        if samplers is not None:
            samplers.flush()
        sink.feed_views()
    return store_what_is_held


def start_live_analysis(cfg: AgentConfig, store: Store, node: str, exporters: Exporters,
                        sink: RequestSink, samplers: SamplerSet | None = None) -> LiveAnalysis | None:
    """The node's own analysis every ``cfg.analyze_every_s``, on its thread, into every outlet configured
    (``before_each_pass`` first)."""
    if not cfg.analyze_every_s:
        return None
    outlets = []
    if exporters.metrics:
        outlets.append(MetricsOutlet(exporters.metrics))
    if exporters.otel:
        outlets.append(OtelOutlet(exporters.otel))
    if cfg.alertmanager_urls:
        outlets.append(AlertmanagerOutlet(AlertmanagerClient(cfg.alertmanager_urls)))
    live = LiveAnalysis(store, node, every_s=cfg.analyze_every_s, config=cfg.analysis, outlets=outlets,
                        samples_inflight=True, before_pass=before_each_pass(sink, samplers), hold_requests=True)
    sink.watch(live.held.add)  # its passes take the requests the agent produced from memory
    live.start()
    exporters.live = live
    log.info("analysing this node's servers every %d s (%s)", cfg.analyze_every_s,
             ", ".join(["store", *(outlet.name for outlet in outlets)]))
    return live


class StoreServices:
    """What needs an open store beside the request sink: the schema, the GPU join view, the samplers
    and the live analysis. Started with the store when it answers at start; otherwise a background
    thread keeps trying (backing off to 30 s), so a store that was down when the agent started does not
    leave sampling and analysis off for the life of the process."""

    RETRY_MAX_S = 30.0

    def __init__(self, cfg: AgentConfig, node: str, clock: MonotonicWallClock, exporters: Exporters,
                 sink: RequestSink) -> None:
        self._cfg, self._node, self._clock, self._exporters, self._sink = cfg, node, clock, exporters, sink
        self._samplers: SamplerSet | None = None
        self._live: LiveAnalysis | None = None
        self._opened: Store | None = None  # a store this object opened itself, closed by stop()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, store: Store | None) -> None:
        if store is not None:
            self._bring_up(store)
            return
        self._thread = threading.Thread(target=self._wait_for_store, name="tokenprobe-store-wait", daemon=True)
        self._thread.start()

    def _bring_up(self, store: Store) -> None:
        store.ensure_schema()
        create_request_gpu_state_view(store)
        self._samplers = self._cfg.samplers.build(store, self._node, self._clock)
        self._samplers.start()
        self._exporters.samplers = self._samplers
        self._live = start_live_analysis(self._cfg, store, self._node, self._exporters, self._sink, self._samplers)

    def _wait_for_store(self) -> None:
        delay = 1.0
        while not self._stopping.wait(delay):
            try:
                store = open_store(self._cfg.store_url)
            except StoreUnavailable:
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
        if self._live is not None:
            self._live.stop()
        if self._samplers is not None:
            self._samplers.stop()
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

    def __init__(self, probes: Probes) -> None:
        self._probes = probes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenprobe-rescan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(RESCAN_INTERVAL_S):
            try:
                for path in self._probes.attach_ssl():
                    log.info("probing OpenSSL in %s", path)
                self._probes.rescan_processes()
                for path in self._probes.attach_go_tls():
                    log.info("probing Go crypto/tls in %s", path)
            except Exception as exc:  # a vanished process or file mid-read: the next rescan tries again
                log.warning("rescan of processes failed (%s: %s); retried in %.0f s", type(exc).__name__, exc,
                            RESCAN_INTERVAL_S)

    def stop(self) -> None:
        """Waits for a rescan under way: the probes must not close under it."""
        self._stop.set()
        self._thread.join()


def offer_inflight(live: LiveAnalysis | None, tracker: ConnectionTracker) -> None:
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


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._stop = False

    def stop(self, *_args) -> None:
        self._stop = True

    def run(self) -> AgentSummary:
        # Handlers first: a stop asked for while the store opens or the BPF
        # program compiles ends the run as cleanly as one asked for later.
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> AgentSummary:
        cfg = self.config
        clock = MonotonicWallClock()
        node = node_name()
        try:
            store = open_store(cfg.store_url)
        except StoreUnavailable as exc:
            # Tracing must not wait for a database: rows go to the disk spool
            # and the sink creates the tables once the store answers.
            log.warning("%s; tracing anyway: requests are spooled to disk, and sampling and analysis start "
                        "once it answers", exc)
            store = None
        sink = RequestSink(store or cfg.store_url, spool_max_bytes=cfg.spool_max_bytes)
        exporters = Exporters(cfg, node)
        services = StoreServices(cfg, node, clock, exporters, sink)
        try:
            services.start(store)
            summary = self._run_probes(sink, clock, node, exporters)
        finally:
            services.stop()
            exporters.close()
            sink.close()
            if store is not None:
                store.close()
        # Counted after close(): it flushes (or spools) the last batch.
        summary.rows_written, summary.rows_spooled = sink.rows_written, sink.rows_spooled
        return summary

    def _run_probes(self, sink: RequestSink, clock: MonotonicWallClock, node: str,
                    exporters: Exporters) -> AgentSummary:
        cfg = self.config
        probes = Probes(cfg.targets, ringbuf_pages=cfg.ringbuf_pages)

        def emit(row: dict) -> None:
            sink.put(row)
            exporters.export(row)
            if cfg.on_row:
                cfg.on_row(row)

        tracker = ConnectionTracker(
            emit, clock=clock, fingerprint_key=load_fingerprint_key(), node=node,
            target_ports=set(cfg.targets.ports), target_pids=set(cfg.targets.pids),
            forget_connection=probes.forget_connection, restart_connection=probes.restart_connection,
            on_unreadable=exporters.unreadable, tenant_header=cfg.tenant_header, idle_timeout_s=cfg.idle_timeout_s,
            steady=probes if cfg.kernel_batching else None, unseen_ends=probes)
        lag = LagMeter()

        def handle(event) -> None:
            lag.last_event_ns = event.ts_ns
            tracker.handle(event)

        probes.open(handle)
        exporters.agent_stats(tracker, 0, 0.0, 0.0, sink, probes.map_overflows(), probes.map_sizes())
        exporters.serve_metrics()  # after the probes attach: readiness means tracing
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
        rescan = ProcessRescan(probes)
        try:
            while not self._stop:
                probes.poll()
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
        finally:
            rescan.stop()
            # Read before close(): the program's maps go with it.
            drops, overflows = probes.drops(), probes.map_overflows()
            probes.close()
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
    def _status_text(tracker: ConnectionTracker, drops: int, sink: RequestSink,
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
