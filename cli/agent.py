"""`tokenprobe agent`: wires the agent's runner (agent/runner.py) to the store and the analytics.

The runner traces and names its stages; this module only builds them from the command's settings:
the store and its sink, the exporters, and what starts once the store answers (the schema, the GPU
join view, the samplers and the live analysis), since those rooms sit above the agent's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..agent.capture.kernel.clock import MonotonicWallClock
from ..agent.heartbeat import HEARTBEAT_FILE, Heartbeat
from ..agent.identity.resolver import IdentityResolver
from ..agent.identity.runtime import connect_runtime
from ..agent.runner import (
    AgentRunner,
    AgentSummary,
    CaptureConfig,
    Exporters,
    StoreServices,
    node_name,
)
from ..agent.sampling.dcgm import DcgmScraper
from ..agent.sampling.engine_metrics import EngineScraper
from ..agent.sampling.gpu import NvmlSampler, ServerGpuMap
from ..agent.sampling.samplers import PodOf, SamplerSet
from ..analytics.alerting import AlertmanagerClient
from ..analytics.config import DEFAULT_CONFIG, DEFAULT_LIVE_EVERY_S, AnalyticsConfig
from ..analytics.live import LiveAnalysis
from ..analytics.outlets import AlertmanagerOutlet, MetricsOutlet, OtelOutlet
from ..contract.gaps import AGENT_GAPS
from ..store.client import Store, StoreUnavailable
from ..store.embedded import open_store
from ..store.schema import create_request_gpu_state_view
from ..store.sink import RequestSink, default_spool_dir
from ..store.spool import DEFAULT_MAX_BYTES as DEFAULT_SPOOL_MAX_BYTES
from ..store.url import DEFAULT_STORE, parse_store_url

__all__ = ["Agent", "AgentConfig", "AgentSummary", "SamplerConfig", "before_each_pass"]

log = logging.getLogger("tokenprobe.agent")


@dataclass
class SamplerConfig:
    """GPU and engine sources joined to the requests (agent/sampling/samplers.py)."""

    nvml_hz: float = 10.0                 # 0: leave NVML out
    dcgm_urls: list[str] = field(default_factory=list)
    engine_urls: dict[str, int | None] = field(default_factory=dict)  # URL → server port (None: the URL's)
    gpus_by_port: dict[int, list[str]] = field(default_factory=dict)  # configured server → GPU mapping
    scrape_interval_s: float = 1.0

    def build(self, store: Store, node: str, clock: MonotonicWallClock, pod_of: PodOf | None = None) -> SamplerSet:
        return SamplerSet(
            store, node, clock,
            nvml=NvmlSampler() if self.nvml_hz > 0 else None,
            nvml_hz=self.nvml_hz if self.nvml_hz > 0 else 1.0,
            dcgm=[DcgmScraper(url) for url in self.dcgm_urls],
            engines=[EngineScraper(url, server_port=port) for url, port in self.engine_urls.items()],
            scrape_interval_s=self.scrape_interval_s,
            gpu_map=ServerGpuMap(self.gpus_by_port), pod_of=pod_of)


@dataclass
class AgentConfig(CaptureConfig):
    """The agent as the command runs it: what it traces (CaptureConfig) and where its rows, samples and
    findings go."""

    store_url: str = DEFAULT_STORE
    samplers: SamplerConfig = field(default_factory=SamplerConfig)
    metrics_address: tuple[str, int] | None = None  # serve Prometheus /metrics here
    otlp_endpoint: str | None = None                # export spans and GenAI metrics here
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES  # the disk spool's bound while the store is away
    analyze_every_s: int = DEFAULT_LIVE_EVERY_S     # live analysis window; 0: off
    analysis: AnalyticsConfig = DEFAULT_CONFIG      # its thresholds, SLOs and look-backs
    alertmanager_urls: list[str] = field(default_factory=list)  # post the live analysis' findings here
    pod_identity: bool = True                       # name each row's pod and container (agent/identity/)
    runtime_socket: str | None = None               # the container runtime's API; None: the usual sockets
    heartbeat_file: Path | None = None  # where the agent notes it traces; None: beside the store's spool


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


class BlindWindows:
    """The windows in which no agent traced this node (agent/heartbeat.py): found at start from the last
    run's heartbeat, stored in agent_gaps through a sink of their own (spooled while the store is down)
    and counted in the metrics."""

    def __init__(self, path: Path, store: Store | str, node: str) -> None:
        self.heartbeat, self.node = Heartbeat(path), node
        self.sink = RequestSink(store, table=AGENT_GAPS.name, flush_interval=0.5,
                                column_types={column.name: column.type for column in AGENT_GAPS.columns})
        self.traced_until: float | None = None  # when the probes closed

    def start(self, durable_until: float, metrics) -> None:
        window = self.heartbeat.start(durable_until)
        if window:
            self.sink.put(window.row(self.node))
        if metrics:
            metrics.set_blind_windows(self.heartbeat.windows_total, self.heartbeat.blind_seconds_total)

    def beat(self, durable_until: float) -> None:
        self.heartbeat.beat(durable_until)

    def stop(self, durable_until: float) -> None:
        """After the request sink closed: what it could not make durable starts the next window."""
        self.sink.close()
        self.heartbeat.stop(durable_until, self.traced_until)


class Agent:
    """The agent as `tokenprobe agent` and the demo run it."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._runner = AgentRunner(config)
        self._store_refusal = ""  # the last reason the store gave for not answering, said once

    def stop(self, *_args) -> None:
        self._runner.stop()

    def run(self) -> AgentSummary:
        cfg = self.config
        clock = MonotonicWallClock()
        node = node_name()
        with self._runner.stopping_on_signals():
            store = self._open_store()
            if store is None:
                # Tracing must not wait for a database: rows go to the disk spool
                # and the sink creates the tables once the store answers.
                log.warning("tracing anyway: requests are spooled to disk, and sampling and analysis start "
                            "once the store answers")
            sink = RequestSink(store or cfg.store_url, spool_max_bytes=cfg.spool_max_bytes)
            exporters = Exporters(cfg.metrics_address, cfg.otlp_endpoint, node)
            identities = IdentityResolver(connect_runtime(cfg.runtime_socket) if cfg.pod_identity else None)

            def bring_up(store: Store) -> list:
                """The store's services, in their order of start: the samplers, then the live analysis."""
                store.ensure_schema()
                create_request_gpu_state_view(store)
                samplers = cfg.samplers.build(store, node, clock, pod_of=lambda pid: identities.of(pid).fields())
                samplers.start()
                exporters.samplers = samplers
                live = start_live_analysis(cfg, store, node, exporters, sink, samplers)
                return [samplers, *([live] if live else [])]

            services = StoreServices(self._open_store, bring_up)
            blind = BlindWindows(cfg.heartbeat_file or default_spool_dir(parse_store_url(cfg.store_url))
                                 / HEARTBEAT_FILE, store or cfg.store_url, node)
            return self._runner.run(sink, exporters, services, store, clock, node, blind, identities)

    def _open_store(self) -> Store | None:
        """The store, or None while it does not answer (said in the log once per reason, not at every retry)."""
        try:
            return open_store(self.config.store_url)
        except StoreUnavailable as exc:
            log.log(logging.DEBUG if str(exc) == self._store_refusal else logging.WARNING, "%s", exc)
            self._store_refusal = str(exc)
            return None
