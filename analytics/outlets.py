"""Where each live analysis pass goes besides the store: the agent's /metrics, OTLP, Alertmanager.

- ``MetricsOutlet``: every cell of each server's newest window as
  ``tokenprobe_indicator_value`` / ``tokenprobe_indicator_state``, and the
  queue / prefill split of every request that ended as
  ``tokenprobe_request_queue_seconds`` / ``tokenprobe_request_prefill_seconds``.
- ``OtelOutlet``: the split as ``queue`` and ``prefill`` child spans of the
  request's ``server_ttft`` span, exported when its row was made.
- ``AlertmanagerOutlet``: each lit cell of the newest window as the alert
  the Prometheus rules raise from the same series
  (deploy/prometheus/tokenprobe-rules.yml: ``TokenprobeIndicatorCritical``,
  ``TokenprobeIndicatorWarning``, with ``indicator``, ``server_port``,
  ``node``, ``device`` and ``severity``), refreshed every pass and resolved
  once the cell is no longer lit.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..agent.export.metrics_endpoint import AgentMetrics
from ..agent.export.otel_export import OtelExporter, request_key
from ..contract.indicators import CRIT, WARN
from .alerting import Alert, AlertmanagerClient, finding
from .indicators import Cell
from .live import LivePass

# The rule files' indicator alerts, by the state that raises them: (alertname, severity).
INDICATOR_ALERTS = {CRIT: ("TokenprobeIndicatorCritical", "critical"),
                    WARN: ("TokenprobeIndicatorWarning", "warning")}
# Cells carry no model: a server normally serves one, and the matrix judges servers.
SERVER_WIDE_MODEL = ""


def _splits(result: LivePass, *names: str) -> Iterator[tuple]:
    """The columns ``names`` of each request of the pass that the analysis could split, then its queue and
    prefill in seconds."""
    phases = result.phases
    for *values, queue_ms, prefill_ms in zip(*(phases.column(name) for name in (*names, "queue_ms", "prefill_ms")),
                                             strict=True):
        if queue_ms is not None and prefill_ms is not None:
            yield *values, queue_ms / 1000, prefill_ms / 1000


class MetricsOutlet:
    name = "metrics"

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def publish(self, result: LivePass) -> None:
        for cell in result.latest_cells:
            self.metrics.set_indicator(cell.server_port, SERVER_WIDE_MODEL, cell.indicator, cell.value, cell.state,
                                       node=cell.node, device=cell.device_id)
        phases = result.phases
        # A request the analysis could not split (NULL: NaN here) is left out.
        queue_ms, prefill_ms = phases.floats("queue_ms"), phases.floats("prefill_ms")
        split = np.flatnonzero(~(np.isnan(queue_ms) | np.isnan(prefill_ms)))
        servers = phases.frame.iloc[split].groupby(["server_port", "model"], sort=False, dropna=False).indices
        for (port, model), positions in servers.items():  # per server and model, its split requests
            indices = split[positions]
            self.metrics.observe_splits(int(port), model, queue_s=queue_ms[indices] / 1000,
                                        prefill_s=prefill_ms[indices] / 1000)


class OtelOutlet:
    name = "otlp"

    def __init__(self, exporter: OtelExporter) -> None:
        self.exporter = exporter

    def publish(self, result: LivePass) -> None:
        for node, conn_id, req_seq, req_end, first_token, queue_s, _ in _splits(
                result, "node", "conn_id", "req_seq", "req_end", "first_token"):
            if req_end is not None and first_token is not None:
                key = request_key({"node": node, "conn_id": conn_id, "req_seq": req_seq})
                self.exporter.export_split(key, req_end, first_token, queue_s)


def indicator_alert(cell: Cell) -> Alert:
    """The alert the rule files raise for a lit cell, labelled as Prometheus labels it."""
    name, severity = INDICATOR_ALERTS[cell.state]
    device = f", GPU {cell.device_id}" if cell.device_id else ""
    return finding(name, severity, cell.server_port, SERVER_WIDE_MODEL,
                   summary=f"{cell.indicator} is {cell.state} on port {cell.server_port} ({cell.node}{device})",
                   description=cell.explanation,
                   labels={"indicator": cell.indicator, "node": cell.node, "device": cell.device_id})


class AlertmanagerOutlet:
    name = "alertmanager"

    def __init__(self, client: AlertmanagerClient) -> None:
        self.client = client
        self._firing: dict[tuple, Alert] = {}  # by name and labels: what the last pass posted

    def publish(self, result: LivePass) -> None:
        alerts = [indicator_alert(cell) for cell in result.latest_cells if cell.state in INDICATOR_ALERTS]
        firing = {_identity(alert): alert for alert in alerts}
        ended = [alert for key, alert in self._firing.items() if key not in firing]
        # A server absent from this pass had no request end: its verdict stands until it is judged again.
        judged = {(cell.node, str(cell.server_port)) for cell in result.latest_cells}
        ended = [alert for alert in ended if (alert.labels.get("node", ""), alert.labels["server_port"]) in judged]
        self.client.post(alerts)
        self.client.resolve(ended)
        for alert in ended:
            del self._firing[_identity(alert)]
        self._firing.update(firing)


def _identity(alert: Alert) -> tuple:
    return alert.name, tuple(sorted(alert.labels.items()))
