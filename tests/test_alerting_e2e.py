"""Alerts end to end on loopback: agent /metrics → real Prometheus → real Alertmanager; and the
analytics posting to the real Alertmanager's API v2.

Prometheus and Alertmanager are Debian's (`prometheus`, `prometheus-alertmanager`),
run as subprocesses on 127.0.0.1 with their state in a temporary folder.
Prometheus loads deploy/prometheus/tokenprobe-rules.yml with each rule's
`for:` shortened to 2 s and evaluates every second, so an alert travels in
seconds instead of minutes; the expressions are the shipped ones. The agent's
live analysis of a really overloaded reference server (kernel capture) lights
an indicator that reaches Alertmanager both through Prometheus and posted
directly, with the same labels.
"""

from __future__ import annotations

import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from tokenprobe.agent.export.metrics_endpoint import AgentMetrics
from tokenprobe.agent.runner import node_name
from tokenprobe.analytics.alerting import (
    Alert,
    AlertmanagerClient,
    AlertmanagerError,
    finding,
)
from tokenprobe.cli.stack import stop_process
from tokenprobe.refserver.overload import DECODE_MS, SLOTS, load_together

from tests.kernel_harness import agent, reference_server, require_kernel
from tests.support import free_port, wait_until
from tests.test_alert_rules import RULES, require_binary

# Generous: a loaded 2-core CI machine starts Prometheus slowly; the alert itself needs seconds.
ALERT_TIMEOUT_S = 90
STARTUP_TIMEOUT_S = 60


@contextmanager
def running(command: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """A subprocess with its output in ``log_path``, stopped (then killed) on exit."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield process
        finally:
            stop_process(process, timeout_s=15)


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def poll(condition: Callable[[], object], timeout_s: float, what: str, log_path: Path) -> object:
    """Wait for ``condition()`` to be truthy and return it; on timeout fail with the server's log."""
    result = None

    def holds() -> object:
        nonlocal result
        result = condition()
        return result

    try:
        wait_until(holds, timeout_s)
    except AssertionError:
        pytest.fail(f"{what} after {timeout_s}s; last lines of {log_path.name}:\n{log_tail(log_path)}")
    return result


def answers_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory) -> Iterator[AlertmanagerClient]:
    """A real Alertmanager on loopback that notifies no one: alerts are only held."""
    binary = require_binary("prometheus-alertmanager", "prometheus-alertmanager")
    folder = tmp_path_factory.mktemp("alertmanager")
    config = folder / "alertmanager.yml"
    config.write_text(yaml.safe_dump({
        "route": {"receiver": "hold", "group_by": ["alertname"], "group_wait": "1s"},
        "receivers": [{"name": "hold"}],
    }))  # fmt: skip
    port = free_port()
    command = [binary, f"--config.file={config}", f"--storage.path={folder / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    log_path = folder / "alertmanager.log"
    with running(command, log_path):
        poll(lambda: answers_ready(port), STARTUP_TIMEOUT_S, "Alertmanager is not ready", log_path)
        yield AlertmanagerClient(f"http://127.0.0.1:{port}", timeout_s=10)


def fast_rules(path: Path) -> Path:
    """The shipped rules with every `for:` cut to 2 s."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


@contextmanager
def prometheus(folder: Path, agent_port: int, alertmanager_url: str) -> Iterator[Path]:
    binary = require_binary("prometheus", "prometheus")
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(fast_rules(folder / "rules.yml"))],
        "alerting": {"alertmanagers": [
            {"static_configs": [{"targets": [alertmanager_url.removeprefix("http://")]}]}]},
        "scrape_configs": [
            {"job_name": "tokenprobe-agent", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
    }))  # fmt: skip
    port = free_port()
    command = [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}"]
    log_path = folder / "prometheus.log"
    with running(command, log_path):
        poll(lambda: answers_ready(port), STARTUP_TIMEOUT_S, "Prometheus is not ready", log_path)
        yield log_path


def test_an_alert_travels_from_the_agent_through_prometheus_to_alertmanager(alertmanager, tmp_path):
    metrics = AgentMetrics()
    _, agent_port = metrics.serve("127.0.0.1", 0)
    # The analytics' verdict: KV-cache pressure critical on one server.
    metrics.set_indicator(8000, "llama-3-8b", "kv_cache_pressure", 0.98, "crit")
    metrics.set_indicator(8000, "llama-3-8b", "queue_depth", 1.0, "ok")
    # The kernel drops 5% of events, and keeps dropping.
    stop = threading.Event()

    def kernel_dropping() -> None:
        events = drops = 0
        while not stop.wait(0.25):
            events, drops = events + 950, drops + 50
            metrics.set_agent_stats(events_total=events, drops_total=drops, lag_s=0.01, events_per_s=3800.0)

    feeder = threading.Thread(target=kernel_dropping, daemon=True)
    feeder.start()
    try:
        with prometheus(tmp_path, agent_port, alertmanager.urls[0]) as log_path:
            def held(alertname: str) -> list[dict]:
                return alertmanager.alerts({"alertname": alertname})

            (critical,) = poll(lambda: held("TokenprobeIndicatorCritical"), ALERT_TIMEOUT_S,
                                     "Alertmanager holds no TokenprobeIndicatorCritical", log_path)
            (drops,) = poll(lambda: held("TokenprobeKernelDrops"), ALERT_TIMEOUT_S,
                                  "Alertmanager holds no TokenprobeKernelDrops", log_path)
    finally:
        stop.set()
        feeder.join()
        metrics.close()
    assert critical["labels"] == {
        "alertname": "TokenprobeIndicatorCritical", "severity": "critical", "job": "tokenprobe-agent",
        "instance": f"127.0.0.1:{agent_port}", "server_port": "8000", "model": "llama-3-8b",
        "indicator": "kv_cache_pressure",
    }  # fmt: skip
    assert critical["annotations"]["summary"] == (
        f"kv_cache_pressure is critical on port 8000 (127.0.0.1:{agent_port}, llama-3-8b)")
    assert critical["status"]["state"] == "active"
    assert drops["labels"]["instance"] == f"127.0.0.1:{agent_port}"
    assert "5% of kernel events" in drops["annotations"]["summary"]
    # The indicator that is ok raised nothing.
    assert not alertmanager.alerts({"alertname": "TokenprobeIndicatorCritical", "indicator": "queue_depth"})


@pytest.mark.kernel
def test_live_traffic_fires_the_same_indicator_alert_through_prometheus_and_directly(alertmanager, tmp_path):
    """An overloaded reference server and only ``tokenprobe agent --port P --metrics-port M`` (its live
    analysis on a short window, posting to Alertmanager too): no analyse step, no hand-made rows. The
    queue the overload builds lights ``queue_wait_p95``, whose alert reaches Alertmanager both through
    the rule files and posted by the agent, with the same labels."""
    require_kernel()
    metrics_port = free_port()
    with reference_server(tmp_path, slots=SLOTS, decode_ms=DECODE_MS) as (port, _), \
            agent(tmp_path, "--metrics-port", str(metrics_port), "--analyze-every", "5",
                  "--alertmanager", alertmanager.urls[0], ports=[port]) as running_agent, \
            prometheus(tmp_path, metrics_port, alertmanager.urls[0]):
        # Below the knee first: idle arrivals calibrate prefill, so queueing can be told from it.
        load_together(port, 20, {"steady": 1.0}, seed=1)
        overload = threading.Thread(target=load_together, args=(port, 45, {"steady": 1.0, "heavy": 12.0}, 2))
        overload.start()
        try:
            def both() -> list[dict] | None:
                held = alertmanager.alerts({"alertname": "TokenprobeIndicatorCritical", "server_port": str(port),
                                            "indicator": "queue_wait_p95"})
                return held if len(held) == 2 else None

            held = poll(both, ALERT_TIMEOUT_S, "Alertmanager does not hold both queue_wait_p95 alerts",
                        running_agent.log_path)
        finally:
            overload.join()
    by_source = {alert["labels"].get("source", "prometheus"): alert["labels"] for alert in held}
    direct, ruled = by_source.pop("tokenprobe-analytics"), by_source.pop("prometheus")
    assert ruled["instance"] == f"127.0.0.1:{metrics_port}"
    assert {k: v for k, v in ruled.items() if k not in ("job", "instance")} == \
        {k: v for k, v in direct.items() if k != "source"} == {
            "alertname": "TokenprobeIndicatorCritical", "severity": "critical", "server_port": str(port),
            "node": node_name(), "indicator": "queue_wait_p95"}


def test_the_analytics_post_a_finding_and_resolve_it(alertmanager):
    knee = finding("TokenprobeKneeReached", "warning", 8001, "qwen-7b",
                   summary="load is past the knee: 14 req/s offered, capacity about 11 req/s",
                   labels={"node": "gpu-node-1"})
    alertmanager.post([knee])
    (held,) = alertmanager.alerts({"alertname": "TokenprobeKneeReached"})
    assert held["labels"] == {"alertname": "TokenprobeKneeReached", "severity": "warning", "server_port": "8001",
                              "model": "qwen-7b", "source": "tokenprobe-analytics", "node": "gpu-node-1"}
    assert held["annotations"] == {"summary": "load is past the knee: 14 req/s offered, capacity about 11 req/s"}
    assert held["status"]["state"] == "active"
    # Posting it again refreshes the same alert rather than adding one.
    alertmanager.post([knee])
    assert len(alertmanager.alerts({"alertname": "TokenprobeKneeReached"})) == 1
    alertmanager.resolve([knee])
    assert alertmanager.alerts({"alertname": "TokenprobeKneeReached"}) == []


def test_one_member_of_an_ha_pair_down_still_delivers_and_all_down_is_an_error(alertmanager):
    dead = f"http://127.0.0.1:{free_port()}"
    alert = Alert("TokenprobeHaCheck", {"severity": "info"}, {"summary": "posted to a pair"})
    AlertmanagerClient([dead, alertmanager.urls[0]], timeout_s=5).post([alert])
    assert alertmanager.alerts({"alertname": "TokenprobeHaCheck"})
    with pytest.raises(AlertmanagerError, match=f"POST {dead}/api/v2/alerts failed"):
        AlertmanagerClient(dead, timeout_s=5).post([alert])


def test_alertmanager_refusals_come_back_as_clear_errors(alertmanager):
    now = datetime.now(timezone.utc)
    backwards = Alert("TokenprobeBackwards", {"severity": "info"}, starts_at=now, ends_at=now - timedelta(hours=1))
    with pytest.raises(AlertmanagerError, match="HTTP 400") as refused:
        alertmanager.post([backwards])
    assert "start time must be before end time" in str(refused.value)


def test_bad_alerts_are_refused_before_sending():
    with pytest.raises(ValueError, match="label name"):
        Alert("X", {"bad-name": "v"})
    with pytest.raises(TypeError, match="string or a number"):
        Alert("X", {"tags": ["a"]})
    with pytest.raises(ValueError, match="timezone-aware"):
        Alert("X", starts_at=datetime(2025, 1, 1))
    with pytest.raises(ValueError, match="severity"):
        finding("X", "page", 8000, "m", summary="s")
    with pytest.raises(ValueError, match="http://"):
        AlertmanagerClient("alertmanager:9093")
    assert Alert("X", {"server_port": 8000}).labels == {"server_port": "8000"}
