"""OpenTelemetry export over OTLP/gRPC: a trace per request, GenAI latency metrics.

Each inference request (``contract/measures.is_inference``) becomes one
span from its first byte read (``req_start``) to its last byte written
(``resp_end``), named ``"{gen_ai.operation.name} {model}"`` as the GenAI
semantic conventions name inference spans, with one child span per phase:

- without the analytics: ``network_in`` (request first → last byte),
  ``server_ttft`` (request last byte → first token), ``decode`` (first →
  last token), ``network_out`` (last token → response last byte); a response
  that streamed no tokens has ``server`` (request last byte → response first
  byte) and ``network_out`` (response first → last byte) instead;
- with the analytics' queue estimate (``request_phases(row, queue_s=…)``):
  ``server_ttft`` splits into ``queue`` and ``prefill``;
- the agent's live analysis splits a request a window after its span went
  out: ``export_split`` then adds ``queue`` and ``prefill`` as children of
  that request's ``server_ttft`` span (the exporter remembers the most
  recent ``max_awaiting_split`` of them; an older request's split is dropped).

Metrics, under the GenAI semantic conventions, as histograms in seconds with
the conventions' advisory bucket bounds: ``gen_ai.server.time_to_first_token``,
``gen_ai.server.time_per_output_token``, ``gen_ai.server.request.duration``,
with ``gen_ai.operation.name``, ``gen_ai.request.model``, ``server.port`` and,
on failed requests, ``error.type``.

Spans carry sizes, counts, timings, the route, the model and the status —
never a prompt or a completion (the agent never has them in a row anyway).
Export never blocks the agent: spans queue in a bounded buffer that a
background thread drains (the oldest are dropped when the collector cannot
keep up), metrics are aggregated in memory and sent every ``export_interval_s``.
"""

from __future__ import annotations

import socket
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
)

from ...contract import measures
from ...contract.apis import operation_name
from .metrics_endpoint import (
    MAX_MODEL_LABEL_CHARS,
    LabelCap,
    RequestTimings,
)

DEFAULT_OTLP_ENDPOINT = "http://127.0.0.1:4317"
SERVICE_NAME = "tokenprobe-agent"
# A route that serves a model but that operation_name() does not know.
UNKNOWN_OPERATION = "inference"

# Advisory bucket bounds, in seconds, from the GenAI semantic conventions.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

# A failed request: the server answered 5xx, or the stream broke off.
_FAILED_OUTCOMES = ("reset", "truncated")


def error_type(row: dict) -> str | None:
    """``error.type`` for a failed request (the HTTP status, the error the server sent inside its
    response, or how the stream ended), else None."""
    status = row.get("status") or 0
    if status >= 500:
        return str(status)
    if row.get("outcome") == "error":
        return row.get("error_type") or "error"
    if row.get("outcome") in _FAILED_OUTCOMES:
        return row["outcome"]
    return None


def request_phases(row: dict, queue_s: float | None = None) -> dict[str, tuple[int, int]]:
    """The phases of one request as ``name -> (start_ns, end_ns)``, wall clock, the ones the row can tell.

    ``queue_s`` (the analytics' estimate) splits the server's time to first
    token into ``queue`` then ``prefill``; it is clamped to that time.
    """
    req_start, req_end = row["req_start"], row.get("req_end")
    resp_start, resp_end = row.get("resp_start"), row.get("resp_end")
    first, last = row.get("first_token"), row.get("last_token")
    phases: dict[str, tuple[int, int]] = {}

    def add(name: str, start: int | None, end: int | None) -> None:
        if start is not None and end is not None and end >= start:
            phases[name] = (start, end)

    add("network_in", req_start, req_end)
    if first is not None:
        if queue_s is None or req_end is None or first < req_end:
            add("server_ttft", req_end, first)
        else:
            phases.update(split_phases(req_end, first, queue_s))
        add("decode", first, last)
        add("network_out", last, resp_end)
    else:
        add("server", req_end, resp_start)
        add("network_out", resp_start, resp_end)
    return phases


def split_phases(req_end: int, first_token: int, queue_s: float) -> dict[str, tuple[int, int]]:
    """Server TTFT (``req_end`` → ``first_token``, ns) as ``queue`` then ``prefill``; queue clamped to it."""
    queue_end = min(req_end + max(int(queue_s * 1e9), 0), first_token)
    return {"queue": (req_end, queue_end), "prefill": (queue_end, first_token)}


def request_key(row: Mapping) -> tuple[str, int, int]:
    """What names one request on a node's rows and its analysed phases alike."""
    return row.get("node") or "", row.get("conn_id") or 0, row.get("req_seq") or 0


def span_attributes(row: dict) -> dict[str, str | int | bool]:
    """The request span's attributes: GenAI and HTTP conventions, then tokenprobe's own."""
    model = (row.get("model") or "")[:MAX_MODEL_LABEL_CHARS]
    attributes: dict[str, str | int | bool] = {
        "gen_ai.operation.name": operation_name(row.get("path") or "") or UNKNOWN_OPERATION,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.request.stream": bool(row.get("streamed")),
        "http.request.method": row.get("method") or "",
        "url.path": row.get("path") or "",
        "server.port": row["server_port"],
        "network.protocol.name": "http",
        "tokenprobe.node": row.get("node") or "",
        "tokenprobe.role": row.get("role") or "server",
        "tokenprobe.conn_id": row.get("conn_id") or 0,
        "tokenprobe.req_seq": row.get("req_seq") or 0,
        "tokenprobe.pid": row.get("pid") or 0,
        "tokenprobe.tls": bool(row.get("tls")),
        "tokenprobe.outcome": row.get("outcome") or "",
        "tokenprobe.token_events": row.get("token_events") or 0,
        "tokenprobe.inflight_at_arrival": row.get("inflight_at_arrival") or 0,
        "tokenprobe.bytes_in": row.get("bytes_in") or 0,
        "tokenprobe.bytes_out": row.get("bytes_out") or 0,
    }
    optional = {
        "gen_ai.response.id": row.get("response_id") or None,
        "gen_ai.usage.input_tokens": row.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": row.get("completion_tokens"),
        "http.response.status_code": row.get("status") or None,
        "client.address": row.get("client_addr") or None,
        "client.port": row.get("client_port") or None,
        "error.type": error_type(row),
        # Kubernetes, as OpenTelemetry's k8s.* and container.* resource conventions name them.
        "k8s.namespace.name": row.get("namespace") or None,
        "k8s.pod.name": row.get("pod") or None,
        "k8s.pod.uid": row.get("pod_uid") or None,
        "k8s.container.name": row.get("container") or None,
        "container.id": row.get("container_id") or None,
    }
    attributes.update({key: value for key, value in optional.items() if value is not None})
    return attributes


def check_endpoint(endpoint: str) -> bool:
    """Validate an OTLP/gRPC endpoint URL; returns whether it is plaintext (http://)."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"OTLP endpoint {endpoint!r} must be http://host:port (plaintext gRPC) or https://host:port")
    return parts.scheme == "http"


class OtelExporter:
    """Sends request spans and GenAI metrics to an OTLP/gRPC collector at ``endpoint``."""

    def __init__(self, endpoint: str = DEFAULT_OTLP_ENDPOINT, *, node: str | None = None,
                 export_interval_s: float = 10.0, timeout_s: float = 10.0,
                 max_models_per_server: int = 32, max_awaiting_split: int = 100_000) -> None:
        insecure = check_endpoint(endpoint)
        if export_interval_s <= 0 or timeout_s <= 0:
            raise ValueError("export_interval_s and timeout_s must be positive")
        resource = Resource.create({"service.name": SERVICE_NAME, "host.name": node or socket.gethostname()})
        self._tracer_provider = TracerProvider(resource=resource)
        self._tracer_provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=timeout_s),
            export_timeout_millis=timeout_s * 1000))
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint, insecure=insecure, timeout=timeout_s),
            export_interval_millis=export_interval_s * 1000, export_timeout_millis=timeout_s * 1000)
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        self._tracer = self._tracer_provider.get_tracer("tokenprobe.agent")
        meter = self._meter_provider.get_meter("tokenprobe.agent")
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate the first token, from the request's last byte",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self._tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS_S)
        self._duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="End to end: connection setup (first request on a connection) + request first byte to "
                        "response last byte",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        # The metric model label comes from clients: cap it as the Prometheus endpoint does.
        self._models = LabelCap(max_models_per_server)
        # request_key -> its server_ttft span, until the analysis splits it. Rows are exported on the
        # capture thread and splits on the analysis thread.
        self._awaiting_split: OrderedDict[tuple[str, int, int], SpanContext] = OrderedDict()
        self._max_awaiting_split = max_awaiting_split
        self._awaiting_lock = threading.Lock()

    def export_request(self, row: dict, phases: Mapping[str, tuple[int, int]] | None = None) -> bool:
        """Export one ``tokenprobe.requests`` row; False if it is not an inference request.

        ``phases`` (``name -> (start_ns, end_ns)``, wall clock) overrides the
        phases read from the row, e.g. ``request_phases(row, queue_s=…)``.
        """
        if not measures.is_inference(row):
            return False
        if phases is None:
            phases = request_phases(row)
        for name, (start, end) in phases.items():
            if not isinstance(start, int) or not isinstance(end, int) or end < start:
                raise ValueError(f"phase {name!r} must be (start_ns, end_ns) integers with end >= start")
        self._export_span(row, phases)
        self._record_metrics(row)
        return True

    def _export_span(self, row: dict, phases: Mapping[str, tuple[int, int]]) -> None:
        attributes = span_attributes(row)
        # The span ends at the last instant the row knows of (a broken-off stream has no resp_end).
        known = [row.get(name) for name in ("req_end", "resp_start", "first_token", "last_token", "resp_end")]
        end = max([row["req_start"], *(ts for ts in known if ts is not None),
                   *(phase_end for _, phase_end in phases.values())])
        kind = SpanKind.CLIENT if row.get("role") == "client" else SpanKind.SERVER
        name = f"{attributes['gen_ai.operation.name']} {attributes['gen_ai.request.model']}".rstrip()
        span = self._tracer.start_span(name, kind=kind, attributes=attributes, start_time=row["req_start"])
        if "error.type" in attributes:
            span.set_status(Status(StatusCode.ERROR, str(attributes["error.type"])))
        parent = trace.set_span_in_context(span)
        for phase, (start, phase_end) in phases.items():
            child = self._tracer.start_span(phase, context=parent, start_time=start)
            child.end(end_time=phase_end)
            if phase == "server_ttft":
                self._await_split(request_key(row), child.get_span_context())
        span.end(end_time=end)

    def _await_split(self, key: tuple[str, int, int], context: SpanContext) -> None:
        with self._awaiting_lock:
            self._awaiting_split[key] = context
            if len(self._awaiting_split) > self._max_awaiting_split:
                self._awaiting_split.popitem(last=False)

    def export_split(self, key: tuple[str, int, int], req_end: int, first_token: int, queue_s: float) -> bool:
        """Add ``queue`` and ``prefill`` under the ``server_ttft`` span of the request ``key``
        (``request_key``) exported before; False if that span is not remembered (never exported,
        split already, or forgotten)."""
        with self._awaiting_lock:
            context = self._awaiting_split.pop(key, None)
        if context is None or first_token < req_end:
            return False
        parent = trace.set_span_in_context(NonRecordingSpan(context))
        for phase, (start, phase_end) in split_phases(req_end, first_token, queue_s).items():
            self._tracer.start_span(phase, context=parent, start_time=start).end(end_time=phase_end)
        return True

    def _record_metrics(self, row: dict) -> None:
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": operation_name(row.get("path") or "") or UNKNOWN_OPERATION,
            "gen_ai.request.model": self._models.label(row["server_port"], row.get("model") or ""),
            "server.port": row["server_port"],
        }
        timings = RequestTimings.from_row(row)
        if timings.ttft_s is not None:
            self._ttft.record(timings.ttft_s, attributes)
        if timings.tpot_s is not None:
            self._tpot.record(timings.tpot_s, attributes)
        if timings.duration_s is not None:
            failure = error_type(row)
            self._duration.record(timings.duration_s,
                                  {**attributes, "error.type": failure} if failure else attributes)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Send everything buffered now; True if both spans and metrics went out in time."""
        millis = int(timeout_s * 1000)
        spans_sent = self._tracer_provider.force_flush(millis)
        metrics_sent = self._meter_provider.force_flush(millis)
        return bool(spans_sent and metrics_sent)

    def close(self) -> None:
        """Flush and stop the export threads."""
        self._tracer_provider.shutdown()
        self._meter_provider.shutdown()
