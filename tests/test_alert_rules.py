"""The Prometheus rules in deploy/prometheus: promtool's check and unit tests, and agreement with the agent.

promtool comes with Debian's `prometheus` package. Where it is missing these
tests skip, except in CI (CI=true or TOKENPROBE_REQUIRE_KERNEL=1), where a
missing tool fails them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from tokenprobe.actuator.auth import ClientAuth
from tokenprobe.actuator.gateway import GatewayGuard
from tokenprobe.agent.export.metrics_endpoint import AgentMetrics
from tokenprobe.agent.sampling.prom_text import parse_exposition
from tokenprobe.store.sink import SinkStats

from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "tokenprobe-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "tokenprobe-rules.test.yml"

TOOLS_REQUIRED = os.environ.get("CI") == "true" or os.environ.get("TOKENPROBE_REQUIRE_KERNEL") == "1"


def require_binary(name: str, package: str) -> str:
    """The path of an executable; skips without it, or fails where CI requires it."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (apt-get install {package})"
        if TOOLS_REQUIRED:
            pytest.fail(f"{reason}, and CI requires it")
        pytest.skip(reason)
    return path


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool", "prometheus"), *args], capture_output=True, text=True,
                          timeout=120)


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def agent_exposition():
    """Everything the agent can expose, each series present once."""
    metrics = AgentMetrics()
    t0 = 1_760_000_000_000_000_000
    metrics.observe_request({
        "server_port": 8000, "role": "server", "model": "m", "method": "POST", "path": "/v1/chat/completions",
        "status": 200,
        "outcome": "complete", "token_events": 5, "completion_tokens": 5, "req_start": t0, "req_end": t0 + 1,
        "first_token": t0 + 10**8, "last_token": t0 + 5 * 10**8, "resp_end": t0 + 6 * 10**8,
    })  # fmt: skip
    metrics.observe_splits(8000, "m", queue_s=[0.1], prefill_s=[0.05])
    metrics.set_indicator(8000, "m", "kv_cache_pressure", 0.5, "ok")
    sink = SinkStats(rows_written=1, rows_pending=0, rows_spooled=0, rows_rejected=0, rows_lost=0, inserts=1,
                     last_error=None)
    metrics.set_agent_stats(events_total=1, drops_total=0, lag_s=0, events_per_s=0, parse_errors_total=0,
                            open_connections=0, inflight_requests=0, sink=sink)
    return parse_exposition(generate_latest(metrics.registry).decode())


def test_rules_pass_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_pass_their_promtool_unit_tests():
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_catch_a_changed_threshold(tmp_path):
    # The same tests against rules whose TTFT threshold moved from 2 s to 5 s must fail.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tokenprobe-rules.yml").write_text(RULES.read_text().replace('le="2.0"', 'le="5.0"'))
    shutil.copy(RULE_TESTS, tmp_path / "tests" / RULE_TESTS.name)
    result = promtool("test", "rules", str(tmp_path / "tests" / RULE_TESTS.name))
    assert result.returncode != 0
    assert "TokenprobeTTFTBudgetBurnFast" in result.stdout + result.stderr


def gateway_exposition():
    """What a gateway hook exposes once it has failed open (its actuator is not there)."""
    guard = GatewayGuard(f"127.0.0.1:{free_port()}", ClientAuth(bearer_token="t" * 32), deadline_s=0.2)
    try:
        guard.check("upstream", "m", "tenant", 10)
        return parse_exposition(generate_latest(guard.metrics).decode())
    finally:
        guard.close()


def test_every_metric_the_rules_read_is_one_the_agent_or_the_gateway_exposes():
    exposed = {sample.name for sample in agent_exposition().samples + gateway_exposition().samples}
    referenced = {name for expr in rule_expressions() for name in re.findall(r"\btokenprobe_[a-z_]+\b", expr)}
    assert referenced, "no agent metric found in the rules"
    assert referenced <= exposed, referenced - exposed


def test_every_slo_threshold_is_a_bucket_bound_of_its_histogram():
    bounds: dict[str, set[str]] = {}
    for sample in agent_exposition().samples:
        if sample.name.endswith("_bucket"):
            bounds.setdefault(sample.name, set()).add(sample.labels["le"])
    thresholds = [(name, le) for expr in rule_expressions()
                  for name, le in re.findall(r'(tokenprobe_\w+_bucket)\{[^}]*le="([^"]+)"', expr)]
    assert {name for name, _ in thresholds} == {"tokenprobe_request_ttft_seconds_bucket",
                                                "tokenprobe_request_tpot_seconds_bucket"}
    for name, le in thresholds:
        assert le in bounds[name], f"{name} has no bucket le={le!r}: the SLO rule would read nothing"
