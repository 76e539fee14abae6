"""OpenTelemetry export: spans and GenAI metrics received by a real OTLP/gRPC receiver on loopback."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from tokenprobe.agent.export.otel_export import (
    OtelExporter,
    request_key,
    request_phases,
)
from tokenprobe.analytics.live import EndedPhases, LivePass
from tokenprobe.analytics.outlets import OtelOutlet

T0 = 1_760_000_000_000_000_000  # a wall-clock instant, ns
MS = 1_000_000


def streamed_row(**overrides) -> dict:
    """A finished streamed chat request as the tracker emits it: 11 tokens, 300 ms TTFT, 50 ms TPOT."""
    row = {
        "node": "gpu-node-1", "conn_id": 77, "req_seq": 0, "role": "server", "pid": 4242, "comm": "vllm",
        "server_port": 8000, "client_addr": "127.0.0.1", "client_port": 51000, "tls": False,
        "accept_ts": T0 - 5 * MS, "tls_done_ts": None,
        "req_start": T0, "req_end": T0 + 2 * MS, "resp_start": T0 + 20 * MS,
        "first_token": T0 + 302 * MS, "last_token": T0 + 802 * MS, "resp_end": T0 + 805 * MS,
        "method": "POST", "path": "/v1/chat/completions", "status": 200, "model": "llama-3-8b",
        "response_id": "chatcmpl-abc123", "streamed": True, "token_events": 11, "sse_events": 14,
        "token_offsets_us": [i * 50_000 for i in range(11)], "prompt_tokens": 42, "completion_tokens": 11,
        "inflight_at_arrival": 3, "bytes_in": 900, "bytes_out": 4000, "body_fp": 123, "outcome": "complete",
        "error": "",
    }  # fmt: skip
    row.update(overrides)
    return row


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """A minimal OTLP/gRPC collector: keeps every export request it receives."""

    def __init__(self) -> None:
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        with self._lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self.trace_requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metric_requests.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return [span for request in self.trace_requests for resource_spans in request.resource_spans
                    for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]

    def metrics(self) -> dict[str, list]:
        """Metric name -> histogram data points, over every export received."""
        found: dict[str, list] = {}
        with self._lock:
            for request in self.metric_requests:
                for resource_metrics in request.resource_metrics:
                    for scope_metrics in resource_metrics.scope_metrics:
                        for metric in scope_metrics.metrics:
                            found.setdefault(metric.name, []).extend(metric.histogram.data_points)
        return found

    def resource_attributes(self) -> dict:
        with self._lock:
            return attributes_of(self.trace_requests[0].resource_spans[0].resource)


def plain(value: AnyValue):
    return getattr(value, value.WhichOneof("value"))


def attributes_of(message) -> dict:
    return {kv.key: plain(kv.value) for kv in message.attributes}


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    receiver.server.start()
    yield receiver
    receiver.server.stop(grace=None)


@pytest.fixture
def exporter(receiver):
    exporter = OtelExporter(f"http://127.0.0.1:{receiver.port}", node="gpu-node-1", export_interval_s=60)
    yield exporter
    exporter.close()


def exported(receiver: OtlpReceiver, exporter: OtelExporter) -> list[Span]:
    assert exporter.flush(timeout_s=30), "the OTLP export did not complete"
    return receiver.spans()


def test_a_streamed_request_is_one_span_with_its_phases_as_children(receiver, exporter):
    assert exporter.export_request(streamed_row())
    spans = exported(receiver, exporter)
    (root,) = [span for span in spans if not span.parent_span_id]
    assert root.name == "chat llama-3-8b"
    assert root.kind == Span.SPAN_KIND_SERVER
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (T0, T0 + 805 * MS)
    children = {span.name: span for span in spans if span.parent_span_id}
    assert set(children) == {"network_in", "server_ttft", "decode", "network_out"}
    for child in children.values():
        assert child.parent_span_id == root.span_id and child.trace_id == root.trace_id
    phase_times = {name: (s.start_time_unix_nano, s.end_time_unix_nano) for name, s in children.items()}
    assert phase_times == {
        "network_in": (T0, T0 + 2 * MS), "server_ttft": (T0 + 2 * MS, T0 + 302 * MS),
        "decode": (T0 + 302 * MS, T0 + 802 * MS), "network_out": (T0 + 802 * MS, T0 + 805 * MS),
    }  # fmt: skip
    attributes = attributes_of(root)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "llama-3-8b"
    assert attributes["gen_ai.usage.input_tokens"] == 42 and attributes["gen_ai.usage.output_tokens"] == 11
    assert attributes["http.response.status_code"] == 200 and attributes["server.port"] == 8000
    assert "error.type" not in attributes and root.status.code != Status.STATUS_CODE_ERROR
    assert receiver.resource_attributes()["service.name"] == "tokenprobe-agent"
    assert receiver.resource_attributes()["host.name"] == "gpu-node-1"


def test_span_attributes_are_an_allowed_set_and_carry_no_content(receiver, exporter):
    # Every attribute the exporter may send: identifiers, sizes, counts, timings — never text.
    allowed = {
        "gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model", "gen_ai.request.stream",
        "gen_ai.response.id", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
        "http.request.method", "url.path", "http.response.status_code", "server.port", "client.address",
        "client.port", "network.protocol.name", "error.type",
        "tokenprobe.node", "tokenprobe.role", "tokenprobe.conn_id", "tokenprobe.req_seq", "tokenprobe.pid",
        "tokenprobe.tls", "tokenprobe.outcome", "tokenprobe.token_events", "tokenprobe.inflight_at_arrival",
        "tokenprobe.bytes_in", "tokenprobe.bytes_out",
    }  # fmt: skip
    # A row carrying text where none belongs (a future column, a bug upstream) must not leak it.
    exporter.export_request(streamed_row(prompt="tell me a secret", completion="the secret is 42"))
    for span in exported(receiver, exporter):
        keys = set(attributes_of(span))
        assert keys <= allowed, keys - allowed
        assert not any("secret" in str(value) for value in attributes_of(span).values())
    for points in receiver.metrics().values():
        for point in points:
            assert set(attributes_of(point)) <= {"gen_ai.operation.name", "gen_ai.request.model", "server.port",
                                                 "error.type"}


def test_queue_estimate_splits_server_ttft_into_queue_and_prefill(receiver, exporter):
    row = streamed_row()
    exporter.export_request(row, request_phases(row, queue_s=0.1))
    children = {s.name: (s.start_time_unix_nano, s.end_time_unix_nano) for s in exported(receiver, exporter)
                if s.parent_span_id}
    assert children["queue"] == (T0 + 2 * MS, T0 + 102 * MS)
    assert children["prefill"] == (T0 + 102 * MS, T0 + 302 * MS)
    assert "server_ttft" not in children


def test_the_live_analysis_split_arrives_later_under_the_server_ttft_span(receiver, exporter):
    row = streamed_row()
    exporter.export_request(row)
    assert exporter.export_split(request_key(row), row["req_end"], row["first_token"], queue_s=0.1)
    assert not exporter.export_split(request_key(row), row["req_end"], row["first_token"], queue_s=0.1), \
        "a request is split once"
    assert not exporter.export_split(("gpu-node-1", 999, 0), T0, T0 + MS, queue_s=0.0), "never exported"
    # The live analysis' outlet: a request it split, and one it could not (no calibration yet).
    later, unsplit = streamed_row(conn_id=78), streamed_row(conn_id=79)
    exporter.export_request(later)
    exporter.export_request(unsplit)
    OtelOutlet(exporter).publish(LivePass(None, None, [], EndedPhases.from_rows([
        {**later, "queue_ms": 50.0, "prefill_ms": 250.0}, {**unsplit, "queue_ms": None, "prefill_ms": None}])))
    spans = exported(receiver, exporter)
    parents = {s.span_id: s for s in spans}
    split_conns = {attributes_of(parents[parents[s.parent_span_id].parent_span_id])["tokenprobe.conn_id"]
                   for s in spans if s.name == "queue"}
    assert split_conns == {77, 78}
    (first,) = [s for s in spans if not s.parent_span_id and attributes_of(s)["tokenprobe.conn_id"] == 77]
    spans = {s.name: s for s in spans if s.trace_id == first.trace_id}
    assert spans["queue"].parent_span_id == spans["prefill"].parent_span_id == spans["server_ttft"].span_id
    assert spans["queue"].trace_id == spans["server_ttft"].trace_id
    assert (spans["queue"].start_time_unix_nano, spans["queue"].end_time_unix_nano) == (T0 + 2 * MS, T0 + 102 * MS)
    assert (spans["prefill"].start_time_unix_nano, spans["prefill"].end_time_unix_nano) == (T0 + 102 * MS,
                                                                                            T0 + 302 * MS)


def test_failed_and_unstreamed_requests_and_health_checks(receiver, exporter):
    reset = streamed_row(conn_id=1, outcome="reset", resp_end=None, completion_tokens=None)
    unstreamed = streamed_row(conn_id=2, path="/v1/completions", streamed=False, first_token=None,
                              last_token=None, token_events=0, status=503, resp_start=T0 + 400 * MS)
    health = streamed_row(conn_id=3, path="/health", model="", token_events=0, method="GET")
    assert exporter.export_request(reset) and exporter.export_request(unstreamed)
    assert not exporter.export_request(health), "a health check is not an inference request"
    spans = exported(receiver, exporter)
    roots = {attributes_of(s)["tokenprobe.conn_id"]: s for s in spans if not s.parent_span_id}
    assert set(roots) == {1, 2}
    assert attributes_of(roots[1])["error.type"] == "reset"
    assert roots[1].status.code == Status.STATUS_CODE_ERROR
    # No resp_end: the span ends at the last token, the latest instant known.
    assert roots[1].end_time_unix_nano == T0 + 802 * MS
    assert attributes_of(roots[2])["error.type"] == "503" and roots[2].name == "text_completion llama-3-8b"
    children_of_2 = {s.name for s in spans if s.parent_span_id == roots[2].span_id}
    assert children_of_2 == {"network_in", "server", "network_out"}


def test_genai_metrics_are_received_with_their_attributes(receiver, exporter):
    for conn_id in range(3):
        exporter.export_request(streamed_row(conn_id=conn_id))
    exporter.export_request(streamed_row(conn_id=9, outcome="truncated", model="other-model"))
    assert exporter.flush(timeout_s=30)
    metrics = receiver.metrics()
    ttft = metrics["gen_ai.server.time_to_first_token"]
    by_model = {attributes_of(p)["gen_ai.request.model"]: p for p in ttft}
    llama = by_model["llama-3-8b"]
    assert llama.count == 3 and llama.sum == pytest.approx(0.9)
    assert attributes_of(llama) == {"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-3-8b",
                                    "server.port": 8000}
    assert list(llama.explicit_bounds)[:3] == [0.001, 0.005, 0.01]
    (tpot,) = [p for p in metrics["gen_ai.server.time_per_output_token"]
               if attributes_of(p)["gen_ai.request.model"] == "llama-3-8b"]
    assert tpot.count == 3 and tpot.sum == pytest.approx(3 * 0.05)
    durations = {attributes_of(p).get("error.type"): p for p in metrics["gen_ai.server.request.duration"]}
    assert durations[None].count == 3 and durations["truncated"].count == 1


def test_bad_endpoints_and_phases_are_refused_clearly(exporter):
    with pytest.raises(ValueError, match="must be http://"):
        OtelExporter("127.0.0.1:4317")
    with pytest.raises(ValueError, match="phase 'decode'"):
        exporter.export_request(streamed_row(), {"decode": (T0 + 10, T0)})


def test_an_unreachable_collector_does_not_block_the_caller():
    exporter = OtelExporter("http://127.0.0.1:9", export_interval_s=60, timeout_s=1)
    try:
        started = time.monotonic()
        for conn_id in range(200):
            exporter.export_request(streamed_row(conn_id=conn_id))
        enqueue_s = time.monotonic() - started
    finally:
        exporter.close()
    # Generous: queuing 200 spans is milliseconds; a blocking export would take the timeout per span.
    assert enqueue_s < 20, enqueue_s
