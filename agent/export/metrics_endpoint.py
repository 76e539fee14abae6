"""The agent's Prometheus endpoint: ``/metrics`` for the latencies it measures and for its own health.

What is exposed (every request metric is labelled ``server_port``, ``model`` and
``role`` — ``server`` for an accepted connection, ``client`` for an outbound
one followed with ``--outbound``):

- ``tokenprobe_request_ttft_seconds`` — server TTFT, ``first_token − req_end``.
- ``tokenprobe_request_tpot_seconds`` — time per output token,
  ``(last_token − first_token) / (tokens − 1)``, tokens from ``usage`` when the
  stream carried it, else the counted text events.
- ``tokenprobe_request_duration_seconds`` — end to end, ``resp_end − req_start``
  plus, for a connection's first request, its setup (accept → first byte).

Each figure is the one ``contract/measures.py`` defines for the analytics' SQL
too, computed from the row the same way.
- ``tokenprobe_request_queue_seconds`` and ``tokenprobe_request_prefill_seconds``
  — the server TTFT split into waiting for a slot and prefill. The agent
  cannot tell them apart when a row is made; its live analysis
  (``analytics/live.py``) splits each request a window later and reports the
  split through ``AgentMetrics.observe_splits``.
- ``tokenprobe_requests_total`` — every finished request, also by
  ``status_class`` (``2xx`` … ``5xx``, ``none`` when no response was seen) and
  ``outcome`` (``complete``, ``error``, ``client_closed``, ``reset``, ``truncated``).
- ``tokenprobe_request_errors_total`` — requests the server failed inside its
  response (outcome ``error``: an error event in a 200 stream), also by
  ``tenant`` and the API's ``error_type`` (``overloaded_error``, …); both
  capped per server port like ``model``.
- ``tokenprobe_indicator_value`` / ``tokenprobe_indicator_state`` — the
  analytics' indicator matrix, one series per server port, model and
  indicator (and ``node`` and GPU ``device`` where the analytics give them);
  the state is -1 no data, 0 ok, 1 warn, 2 crit (``INDICATOR_STATES``). A cell the
  analytics stop refreshing disappears after ``indicator_ttl_s``, so a stale
  verdict never keeps an alert firing (or silent).
- ``tokenprobe_agent_*`` — kernel events handled and dropped, processing lag,
  events per second, parse errors, the store's health (rows written, rows
  waiting in the disk spool, rows rejected or lost), connections forgotten
  after the idle timeout, and per kernel map (label ``map``)
  its size (``tokenprobe_agent_map_size``) and the entries it could not hold
  (``tokenprobe_agent_map_overflows_total``; see docs/operations.md, "Bounded state"); plus the standard
  ``process_*`` series (the agent's own CPU and memory).

Only inference requests (``measures.is_inference``: POSTs) feed the latency
histograms; health checks and the engine's own /metrics on the same port are
counted in ``tokenprobe_requests_total`` only. The ``model`` label comes from traffic, so its
cardinality is capped per server port (``max_models_per_server``): further
names are counted under ``OVERFLOW_MODEL``.

Nothing of a request's content is exposed: only timings, counts, the model
name, the port and the status.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ...contract import measures
from ...contract.indicators import INDICATOR_STATES

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9464  # the port OpenTelemetry's Prometheus exporter also defaults to


class SinkCounters(Protocol):
    """The request sink's counters (``store.sink.SinkStats`` is one), for the store's health."""

    rows_written: int
    rows_rejected: int
    rows_lost: int
    rows_pending: int
    rows_spooled: int
    spool_bytes: int
    spool_dropped_rows: int
    cpu_s: float


# Bucket bounds in seconds, fitted to LLM serving: TTFT from tens of ms (a
# short prompt on an idle GPU) to over a minute (a long queue); TPOT around
# 10–100 ms; whole requests up to many minutes of decode. The alert rules'
# SLO thresholds (deploy/prometheus/tokenprobe-rules.yml) must be bounds here:
# a burn-rate rule reads the bucket at its threshold.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
DURATION_BUCKETS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)

OVERFLOW_MODEL = "(other)"
MAX_MODEL_LABEL_CHARS = 128

_REQUEST_LABELS = ("server_port", "model", "role", "namespace", "pod", "container")
# Pods and containers a server port is seen in, each (namespace, pod, container) a set of label values.
MAX_PODS_PER_SERVER = 64
# An empty label is no label to Prometheus: node and device vanish where not given.
_INDICATOR_LABELS = ("server_port", "model", "indicator", "node", "device")

def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status <= 599 else "none"


def _seconds(ms: float | None) -> float | None:
    """A figure in ms as seconds; None when unknown or negative (an impossible order: a clock step)."""
    return None if ms is None or ms < 0 else ms / 1000


@dataclass(frozen=True)
class RequestTimings:
    """The latencies one ``tokenprobe.requests`` row yields (``contract/measures.py``); None where it cannot tell."""

    ttft_s: float | None
    tpot_s: float | None
    duration_s: float | None

    @classmethod
    def from_row(cls, row: dict) -> RequestTimings:
        return cls(ttft_s=_seconds(measures.ttft_server_ms(row)), tpot_s=_seconds(measures.tpot_ms(row)),
                   duration_s=_seconds(measures.e2e_ms(row)))


class LabelCap:
    """Caps distinct values of a label per server port: model names, tenants and error types come from
    traffic, and pods come and go for the life of the agent. Past the cap, a value is counted as
    OVERFLOW_MODEL, "(other)" (each part of a tuple of values)."""

    def __init__(self, max_per_server: int, what: str = "model names") -> None:
        self.max_per_server = max_per_server
        self.what = what
        self._seen: dict[int, set] = {}
        self._overflowed: set[int] = set()
        self._lock = threading.Lock()

    def label(self, server_port: int, value):
        if isinstance(value, str):
            value = value[:MAX_MODEL_LABEL_CHARS]
        with self._lock:
            seen = self._seen.setdefault(server_port, set())
            if value in seen:
                return value
            if len(seen) < self.max_per_server:
                seen.add(value)
                return value
            first_overflow = server_port not in self._overflowed
            self._overflowed.add(server_port)
        if first_overflow:
            log.warning("port %d: more than %d %s; further ones are counted as %r",
                        server_port, self.max_per_server, self.what, OVERFLOW_MODEL)
        return OVERFLOW_MODEL if isinstance(value, str) else (OVERFLOW_MODEL,) * len(value)


@dataclass(frozen=True)
class _IndicatorCell:
    value: float
    state: int
    updated_monotonic: float


class _IndicatorCollector(Collector):
    """The analytics' indicator matrix; cells not refreshed within the TTL are left out."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._cells: dict[tuple[str, ...], _IndicatorCell] = {}
        self._lock = threading.Lock()

    def set(self, key: tuple[str, ...], value: float, state: int) -> None:
        with self._lock:
            self._cells[key] = _IndicatorCell(value, state, time.monotonic())

    def collect(self):
        values = GaugeMetricFamily("tokenprobe_indicator_value", "Latest value of an analytics indicator",
                                   labels=_INDICATOR_LABELS)
        states = GaugeMetricFamily("tokenprobe_indicator_state",
                                   "Indicator verdict: -1 no data, 0 ok, 1 warn, 2 crit", labels=_INDICATOR_LABELS)
        oldest = time.monotonic() - self.ttl_s
        with self._lock:
            for key in [key for key, cell in self._cells.items() if cell.updated_monotonic < oldest]:
                del self._cells[key]
            cells = list(self._cells.items())
        for key, cell in cells:
            values.add_metric(list(key), cell.value)
            states.add_metric(list(key), cell.state)
        yield values
        yield states


class _SplitHistograms(Collector):
    """The queue / prefill split of requests as two histograms, fed a pass's requests at once.

    A live pass splits tens of thousands of requests (30,000 a pass at 1,000 requests/s); observing each in
    a ``prometheus_client.Histogram`` took about 6 µs a request, 180 ms a pass. Here each pass's values of a
    server and model are binned in one ``np.searchsorted`` (``le`` is inclusive, as Prometheus has it).
    """

    def __init__(self, series: tuple[tuple[str, str, tuple[float, ...]], ...]) -> None:
        self.series = series  # (name, help, bucket bounds), in the order observe() gets their values
        self._counts: dict[tuple[str, str], list[np.ndarray]] = {}  # per label set, per series: per bucket, +Inf last
        self._sums: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()

    def observe(self, labels: tuple[str, str], *values: np.ndarray) -> None:
        binned = [np.bincount(np.searchsorted(bounds, seconds, side="left"), minlength=len(bounds) + 1)
                  for (_, _, bounds), seconds in zip(self.series, values, strict=True)]
        with self._lock:
            counts = self._counts.setdefault(labels, [np.zeros(len(b) + 1, np.int64) for _, _, b in self.series])
            sums = self._sums.setdefault(labels, [0.0] * len(self.series))
            for index, (added, seconds) in enumerate(zip(binned, values, strict=True)):
                counts[index] += added
                sums[index] += float(seconds.sum())

    def collect(self):
        with self._lock:
            snapshot = [(labels, [c.copy() for c in counts], list(self._sums[labels]))
                        for labels, counts in self._counts.items()]
        for index, (name, documentation, bounds) in enumerate(self.series):
            family = HistogramMetricFamily(name, documentation, labels=("server_port", "model"))
            for labels, counts, sums in snapshot:
                cumulative = np.cumsum(counts[index]).tolist()
                family.add_metric(list(labels), [*((floatToGoString(bound), count) for bound, count
                                                   in zip(bounds, cumulative, strict=False)),
                                                 ("+Inf", cumulative[-1])], sums[index])
            yield family


# name -> (metric kind, help). The runner passes what it knows; None leaves a series out.
_AGENT_STATS = {
    "events_total": ("counter", "Kernel events the agent handled"),
    "drops_total": ("counter", "Kernel events lost because the ring buffer was full"),
    "parse_errors_total": ("counter", "Connections whose bytes could not be parsed as HTTP"),
    "batched_writes_total": ("counter", ("Writes of steady SSE streams the kernel sent in batch records "
                                         "(each one token event), not as kernel events of their own")),
    "lost_events_total": ("counter", ("Data events (batched writes included) the kernel numbered and the agent "
                                      "never received")),
    "unknown_ends_total": ("counter", ("Connections found gone (their fd reused) with no close record and no end "
                                       "the kernel kept: their open exchanges are marked dropped")),
    "own_connections_total": ("counter", ("Connections to a traced port whose client was the agent itself (its "
                                          "scrapes of the engine's /metrics, store and exporter clients): not "
                                          "recorded")),
    "lag_seconds": ("gauge", "Kernel timestamp of the latest handled event to its handling, in seconds"),
    "events_per_second": ("gauge", "Kernel events handled per second, over the last status interval"),
    "open_connections": ("gauge", "Connections the agent is following"),
    "inflight_requests": ("gauge", "Requests started and not yet finished, all ports"),
    "idle_evicted_connections_total": ("counter", "Connections forgotten after the idle timeout with no I/O"),
    # From the request sink (SinkCounters).
    "rows_written_total": ("counter", "Request rows written to the store"),
    "rows_rejected_total": ("counter", "Request rows the store refused outright (kept in the spool's rejected/)"),
    "rows_lost_total": ("counter", "Request rows lost: the store hung past the sink's close timeout"),
    "pending_rows": ("gauge", "Request rows queued in memory for the next insert"),
    "spooled_rows": ("gauge", "Request rows on disk waiting for the store to answer"),
    "spool_bytes": ("gauge", "Bytes the disk spool holds (bounded by --spool-max-bytes)"),
    "spool_dropped_rows_total": ("counter", "Request rows the full spool dropped, oldest first, across restarts"),
    "store_write_cpu_seconds_total": ("counter", ("CPU the request sink's writer thread took: Arrow conversion and "
                                                  "inserts, an embedded store's work on them included")),
    # From the GPU and engine samplers (agent/sampling/samplers.py), all their tables together.
    "sample_rows_written_total": ("counter", "GPU and engine sample rows written to the store"),
    "sample_rows_dropped_total": ("counter", ("GPU and engine sample rows dropped: not fitting their table, or the "
                                              "oldest of a buffer the store did not take in time")),
    "sampler_write_cpu_seconds_total": ("counter", "CPU the samplers' inserts took, an embedded store's work included"),
    # From the agent's heartbeat (agent/heartbeat.py), counted across the agent's restarts.
    "blind_windows_total": ("counter", ("Windows in which no agent traced this node (a stop, a crash, a restart's "
                                        "start-up), found at each start; each is a row of agent_gaps")),
    "blind_seconds_total": ("counter", "Seconds of those windows: nothing was traced in them"),
    # From the live analysis (analytics/live.py).
    "analysis_passes_total": ("counter", "Live analysis passes that completed"),
    "analysis_failures_total": ("counter", "Live analysis passes that failed (retried at the next window)"),
    "analysed_until_seconds": ("gauge", "Unix time up to which ended requests have been analysed"),
    "analysis_cpu_seconds_total": ("counter", "CPU the live analysis passes took on their own thread"),
}

# name -> (label, help): counters the runner keeps per label value.
_LABELLED_STATS = {
    "skipped_files": ("reason", ("Files mapped by the node's processes that the agent's TLS scans skipped, by "
                                 "reason (unreadable, not_elf, malformed_elf, too_many_files): each once")),
}


class _AgentStatsCollector(Collector):
    """Mirrors the runner's own counters: the runner keeps the totals, this only reports them."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._map_sizes: dict[str, int] = {}
        self._map_overflows: dict[str, int] = {}
        self._labelled: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def update_labelled(self, name: str, counts: Mapping[str, int]) -> None:
        _LABELLED_STATS[name]
        with self._lock:
            self._labelled[name] = dict(counts)

    def update(self, values: dict[str, float], map_sizes: dict[str, int] | None = None,
               map_overflows: dict[str, int] | None = None) -> None:
        with self._lock:
            self._values.update(values)
            self._map_sizes.update(map_sizes or {})
            self._map_overflows.update(map_overflows or {})

    def collect(self):
        with self._lock:
            values, sizes, overflows = dict(self._values), dict(self._map_sizes), dict(self._map_overflows)
            labelled = dict(self._labelled)
        for name, counts in labelled.items():
            label, help_text = _LABELLED_STATS[name]
            family = CounterMetricFamily(f"tokenprobe_agent_{name}", help_text, labels=(label,))
            for value, count in sorted(counts.items()):
                family.add_metric([value], count)
            yield family
        if sizes:
            size = GaugeMetricFamily("tokenprobe_agent_map_size", "Entries a kernel map holds at most (the ring "
                                     "buffer: bytes)", labels=("map",))
            for name, value in sorted(sizes.items()):
                size.add_metric([name], value)
            yield size
        if overflows:
            overflow = CounterMetricFamily("tokenprobe_agent_map_overflows", "Entries a kernel map could not hold: "
                                           "inserts a full hash refused, live connections the conns LRU evicted",
                                           labels=("map",))
            for name, value in sorted(overflows.items()):
                overflow.add_metric([name], value)
            yield overflow
        for name, value in values.items():
            kind, help_text = _AGENT_STATS[name]
            if kind == "counter":
                # CounterMetricFamily appends _total itself.
                yield CounterMetricFamily(f"tokenprobe_agent_{name.removesuffix('_total')}", help_text,
                                          value=value)
            else:
                yield GaugeMetricFamily(f"tokenprobe_agent_{name}", help_text, value=value)


def _check_number(name: str, value: float, *, allow_nan: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) and not allow_nan:
        raise ValueError(f"{name} must not be NaN")
    return float(value)


class AgentMetrics:
    """The metrics the agent serves on ``/metrics``, in a registry of their own.

    Thread-safe: the agent loop calls ``observe_request`` and
    ``set_agent_stats``, the live analysis ``observe_splits`` and ``set_indicator``,
    and the HTTP server thread reads, all at once.
    """

    def __init__(self, *, max_models_per_server: int = 32, indicator_ttl_s: float = 300.0,
                 registry: CollectorRegistry | None = None) -> None:
        if max_models_per_server < 1:
            raise ValueError("max_models_per_server must be at least 1")
        if indicator_ttl_s <= 0:
            raise ValueError("indicator_ttl_s must be positive")
        self.registry = registry or CollectorRegistry()
        self._models = LabelCap(max_models_per_server)
        self._pods = LabelCap(MAX_PODS_PER_SERVER, "pods")
        self._ttft = Histogram("tokenprobe_request_ttft_seconds",
                              "Server time to first token: first generated-text event − request last byte",
                              _REQUEST_LABELS, buckets=TTFT_BUCKETS_S, registry=self.registry)
        self._tpot = Histogram("tokenprobe_request_tpot_seconds",
                              "Time per output token after the first: decode time / (output tokens − 1)",
                              _REQUEST_LABELS, buckets=TPOT_BUCKETS_S, registry=self.registry)
        self._duration = Histogram("tokenprobe_request_duration_seconds",
                                  "End to end: connection setup (first request on a connection) + request first "
                                  "byte to response last byte",
                                  _REQUEST_LABELS, buckets=DURATION_BUCKETS_S, registry=self.registry)
        self._splits = _SplitHistograms((
            ("tokenprobe_request_queue_seconds",
             "Time waiting for a slot before prefill, as estimated by the analytics", QUEUE_BUCKETS_S),
            ("tokenprobe_request_prefill_seconds",
             "Prefill time, the rest of the server TTFT after the queue, as estimated by the analytics",
             TTFT_BUCKETS_S)))
        self.registry.register(self._splits)
        self._requests = Counter("tokenprobe_requests", "Requests finished, by status class and outcome",
                                (*_REQUEST_LABELS, "status_class", "outcome"), registry=self.registry)
        self._errors = Counter("tokenprobe_request_errors", "Requests the server failed inside its response (an "
                               "error event in a 200 stream), by tenant and the API's error type",
                               (*_REQUEST_LABELS, "tenant", "error_type"), registry=self.registry)
        self._tenants = LabelCap(max_models_per_server, "tenants")
        self._error_types = LabelCap(max_models_per_server, "error types")
        # Blind spots: connections found unreadable (each later one `unsupported` row), by why.
        # The series observe_request feeds, by their labels.
        self._request_counts: dict[tuple[str, ...], Counter] = {}
        self._latency_histograms = (self._ttft, self._tpot, self._duration)
        self._request_latencies: dict[tuple[str, ...], list[Histogram | None]] = {}
        self._unreadable = Counter("tokenprobe_agent_unreadable_connections",
                                   "Connections the agent could not read, by server port and reason",
                                   ("server_port", "reason"), registry=self.registry)
        self._indicators = _IndicatorCollector(indicator_ttl_s)
        self._agent_stats = _AgentStatsCollector()
        self.registry.register(self._indicators)
        self.registry.register(self._agent_stats)
        ProcessCollector(registry=self.registry)
        self._server: WSGIServer | None = None
        self._server_thread: threading.Thread | None = None

    # -- fed by the agent ---------------------------------------------------------------------
    def observe_request(self, row: dict) -> None:
        """Count one finished ``tokenprobe.requests`` row and observe its latencies."""
        # Each labels' series looked up once (the model label is capped, and so are they); a latency's
        # series only once a request has that latency: an empty one would still be served.
        port = row["server_port"]
        labels = (str(port), self._models.label(port, row.get("model") or ""), row.get("role") or "server",
                  *self._pods.label(port, (row.get("namespace") or "", row.get("pod") or "", row.get("container") or "")))
        counted = (*labels, status_class(row.get("status") or 0), row.get("outcome") or "")
        requests = self._request_counts.get(counted)
        if requests is None:
            requests = self._request_counts[counted] = self._requests.labels(*counted)
        requests.inc()
        if row.get("outcome") == "error":
            port = row["server_port"]
            self._errors.labels(*labels, self._tenants.label(port, row.get("tenant") or ""),
                                self._error_types.label(port, row.get("error_type") or "")).inc()
        if not measures.is_inference(row):
            return
        latencies = self._request_latencies.get(labels)
        if latencies is None:
            latencies = self._request_latencies[labels] = [None, None, None]
        timings = RequestTimings.from_row(row)
        for index, seconds in enumerate((timings.ttft_s, timings.tpot_s, timings.duration_s)):
            if seconds is not None:
                series = latencies[index]
                if series is None:
                    series = latencies[index] = self._latency_histograms[index].labels(*labels)
                series.observe(seconds)

    def count_unreadable(self, server_port: int, reason: str) -> None:
        """One connection found unreadable, when it is found (its `unsupported` row comes at its close)."""
        self._unreadable.labels(str(server_port), reason).inc()

    def set_agent_stats(self, *, events_total: int, drops_total: int, lag_s: float, events_per_s: float,
                        parse_errors_total: int | None = None, open_connections: int | None = None,
                        inflight_requests: int | None = None, sink: SinkCounters | None = None,
                        idle_evicted_total: int | None = None,
                        map_sizes: dict[str, int] | None = None,
                        map_overflows: dict[str, int] | None = None,
                        batched_writes_total: int | None = None, lost_events_total: int | None = None,
                        unknown_ends_total: int | None = None, own_connections_total: int | None = None) -> None:
        """Publish the runner's figures; totals are cumulative since the agent started.

        ``lag_s``: for the latest event handled, the time it was handled minus
        the kernel's timestamp on it (both CLOCK_MONOTONIC), 0 when no event
        was waiting — how far behind the kernel the agent runs. ``sink``: the
        request sink's ``stats()``, for the store's health. ``map_sizes`` and
        ``map_overflows``: per kernel map, its size and the entries it could not hold.
        """
        given = {
            "events_total": events_total, "drops_total": drops_total, "lag_seconds": lag_s,
            "events_per_second": events_per_s, "parse_errors_total": parse_errors_total,
            "open_connections": open_connections, "inflight_requests": inflight_requests,
            "idle_evicted_connections_total": idle_evicted_total,
            "batched_writes_total": batched_writes_total, "lost_events_total": lost_events_total,
            "unknown_ends_total": unknown_ends_total, "own_connections_total": own_connections_total,
        }  # fmt: skip
        if sink is not None:
            given.update(rows_written_total=sink.rows_written, rows_rejected_total=sink.rows_rejected,
                         rows_lost_total=sink.rows_lost, pending_rows=sink.rows_pending,
                         spooled_rows=sink.rows_spooled, spool_bytes=sink.spool_bytes,
                         spool_dropped_rows_total=sink.spool_dropped_rows, store_write_cpu_seconds_total=sink.cpu_s)
        self._agent_stats.update(
            {name: _check_number(name, value) for name, value in given.items() if value is not None},
            map_sizes, map_overflows)

    def set_blind_windows(self, windows_total: int, seconds_total: float) -> None:
        """The windows no agent traced this node in, and their seconds, since the heartbeat file began."""
        self._agent_stats.update({"blind_windows_total": _check_number("blind_windows_total", windows_total),
                                  "blind_seconds_total": _check_number("blind_seconds_total", seconds_total)})

    def set_skipped_files(self, by_reason: Mapping[str, int]) -> None:
        """Files the TLS scans skipped since the agent started, by reason (``tls_libraries.skipped_files``)."""
        self._agent_stats.update_labelled("skipped_files", by_reason)

    # -- fed by the analytics -----------------------------------------------------------------
    def set_analysis_stats(self, *, passes_total: int, failures_total: int, analysed_until_s: float,
                           cpu_s: float) -> None:
        """The live analysis' progress: how far it got, how often it failed, and what it cost."""
        self._agent_stats.update({
            "analysis_passes_total": _check_number("passes_total", passes_total),
            "analysis_failures_total": _check_number("failures_total", failures_total),
            "analysed_until_seconds": _check_number("analysed_until_s", analysed_until_s),
            "analysis_cpu_seconds_total": _check_number("cpu_s", cpu_s)})

    def set_sampler_stats(self, stats: Mapping) -> None:
        """The GPU and engine samplers' ``SamplerSet.stats()``: what they wrote, dropped, and what writing cost."""
        self._agent_stats.update({
            "sample_rows_written_total": _check_number("rows_written", sum(stats["rows_written"].values())),
            "sample_rows_dropped_total": _check_number("rows_dropped", sum(stats["rows_dropped"].values())),
            "sampler_write_cpu_seconds_total": _check_number("write_cpu_s", stats["write_cpu_s"])})

    def observe_splits(self, server_port: int, model: str, *, queue_s: Sequence[float],
                       prefill_s: Sequence[float]) -> None:
        """Requests' server TTFT split into queue and prefill (seconds, request by request), all of one
        server and model. A negative estimate (the prefill model predicted more than the whole TTFT)
        means none of it and counts as 0."""
        values = []
        for name, seconds in (("queue_s", queue_s), ("prefill_s", prefill_s)):
            seconds = np.asarray(seconds, dtype=np.float64)
            if np.isnan(seconds).any():
                raise ValueError(f"{name} must not be NaN")
            values.append(np.maximum(seconds, 0.0))
        if len(values[0]) != len(values[1]):
            raise ValueError("queue_s and prefill_s must have one value per request each")
        if len(values[0]):
            self._splits.observe((str(server_port), self._models.label(server_port, model)), *values)

    def set_indicator(self, server_port: int, model: str, indicator: str, value: float | None, state: str, *,
                      node: str = "", device: str = "") -> None:
        """One cell of the indicator matrix: its latest value (None or NaN if unknown) and verdict.

        ``node`` and ``device`` (a GPU) tell cells apart where the analytics
        judge several nodes or GPUs from one process; leave them empty otherwise.
        """
        if state not in INDICATOR_STATES:
            raise ValueError(f"indicator state must be one of {sorted(INDICATOR_STATES)}, got {state!r}")
        if not indicator:
            raise ValueError("indicator name must not be empty")
        value = math.nan if value is None else _check_number("value", value, allow_nan=True)
        key = (str(server_port), self._models.label(server_port, model), indicator, node, device)
        self._indicators.set(key, value, INDICATOR_STATES[state])

    # -- the HTTP endpoint --------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = DEFAULT_METRICS_PORT) -> tuple[str, int]:
        """Serve ``/metrics`` from a daemon thread; returns the address bound (port 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("the metrics endpoint is already serving")
        try:
            self._server, self._server_thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            raise OSError(f"cannot serve metrics on {host}:{port}: {error.strerror or error}") from None
        log.info("serving Prometheus metrics on http://%s:%d/metrics", *self.address)
        return self.address

    @property
    def address(self) -> tuple[str, int] | None:
        """The (host, port) being served, or None before ``serve``."""
        return None if self._server is None else self._server.server_address[:2]

    def close(self) -> None:
        """Stop the HTTP endpoint, if serving."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server_thread.join(timeout=5)
        self._server = self._server_thread = None
