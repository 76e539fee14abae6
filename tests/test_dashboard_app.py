"""The dashboard's queries and its Streamlit app (driven by AppTest) on stores of known rows.

The main store is owned by a separate process that serves it, as an agent
would: the tests and the app reach it over the owner's HTTP interface, so the
embedded engine is never opened in the test process. One test opens a store
that nobody owns, which the app then owns itself, and releases it afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest
from tokenprobe.analytics.indicators import Cell
from tokenprobe.contract import requests as schema
from tokenprobe.contract.latency import METRICS, band_bounds_ms
from tokenprobe.contract.rollup import ROLLUP_TABLE
from tokenprobe.contract.apis import inference_request_sql, is_inference_request
from tokenprobe.contract.tables import DEFAULT_TTL_DAYS
from tokenprobe.dashboard import queries as dashboard_queries
from tokenprobe.dashboard.charts import (
    budget_steps,
    cell_key,
    in_force_until,
    request_spans,
    time_format,
)
from tokenprobe.dashboard.cli import add_dashboard_parser, streamlit_command
from tokenprobe.dashboard.queries import (
    DashboardQueries,
    Filters,
    choose_bin_seconds,
    fitting_span_s,
)
from tokenprobe.dashboard.settings import (
    OWN_STORE_ENV,
    REFRESH_ENV,
    STORE_ENV,
    parse_refresh,
)
from tokenprobe.store.embedded import open_store

APP = Path(dashboard_queries.__file__).with_name("streamlit_app.py")
MS = 1_000_000
S = 1_000_000_000
# Generous: other engineers run tests on the same 2-core machine.
APP_TIMEOUT_S = 120
OWNER_READY_S = 120

# A whole hour, one to two hours ago: recent enough for the tables' TTL, and
# aligned so that 30 s bins (those of the 1-hour window) start at T0.
T0_S = (int(time.time()) // 3600 - 1) * 3600
T0 = T0_S * S
OLD = T0 - 3 * 86400 * S  # a day outside every window the app offers, for analysed data

# The owner: creates every table the dashboard reads (the latency rollup and
# its view included), serves the store, and keeps it until its stdin closes.
OWNER_SCRIPT = """
import sys
from tokenprobe.store import open_store
store = open_store(sys.argv[1])
store.ensure_schema()
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


def request_row(conn_id: int, start_ns: int, *, ttft_ms: float | None, tpot_ms: float = 20.0, tokens: int = 4,
                node: str = "node-a", port: int = 8000, model: str = "m1", path: str = "/v1/chat/completions",
                tls: bool = False, outcome: str = "complete", method: str = "POST") -> dict:
    """A request row whose TTFT, TPOT and end-to-end latency are exactly as asked."""
    req_end = start_ns + 1 * MS
    accept = start_ns - 2 * MS
    if ttft_ms is None:  # the client gave up before the first token
        first_token = last_token = None
        offsets, tokens = [], 0
        resp_end = req_end + 5 * MS
    else:
        first_token = req_end + int(ttft_ms * MS)
        offsets = [int(index * tpot_ms * 1000) for index in range(tokens)]
        last_token = first_token + offsets[-1] * 1000
        resp_end = last_token + 1 * MS
    return {
        "node": node, "conn_id": conn_id, "req_seq": 0, "role": "server", "pid": 4242, "comm": "vllm",
        "server_port": port, "client_addr": "127.0.0.1", "client_port": 40000 + conn_id, "tenant": "", "tls": tls,
        "accept_ts": accept, "tls_done_ts": accept + 1 * MS if tls else None, "req_start": start_ns,
        "req_end": req_end, "resp_start": req_end + 1 * MS, "first_token": first_token, "last_token": last_token,
        "resp_end": resp_end, "method": method, "path": path, "status": 200, "model": model,
        "response_id": f"chatcmpl-{conn_id}", "streamed": True, "token_events": tokens, "sse_events": tokens + 2,
        "token_offsets_us": offsets, "prompt_tokens": 10, "completion_tokens": tokens, "inflight_at_arrival": 0,
        "bytes_in": 500, "bytes_out": 1000, "body_fp": conn_id, "outcome": outcome, "error": "",
        "capture": "exact", "bytes_unseen": 0, "protocol": "http/1.1", "stream_id": 0, "unreadable_reason": "",
    }


# Bands at 10 per decade: 50 ms -> 16, 500 ms -> 26, 2000 ms -> 33 (each well inside its band).
FAST = [request_row(100 + i, T0 + (10 + i) * S, ttft_ms=50, tls=(i == 0)) for i in range(5)]
SLOW_COMPLETIONS = [request_row(200 + i, T0 + (100 + i) * S, ttft_ms=500, path="/v1/completions")
                    for i in range(3)]
OTHER_SERVER = [request_row(300 + i, T0 + (10 + i) * S, ttft_ms=2000, node="node-b", port=8001, model="m2")
                for i in range(2)]
GAVE_UP = [request_row(400, T0 + 20 * S, ttft_ms=None, outcome="client_closed")]
# The agent's metrics scrape and a health check: no inference, shown only when asked for (end to end 8 ms, band 9).
SCRAPES = [request_row(600 + i, T0 + (30 + i) * S, ttft_ms=None, method="GET", path=path, model="")
           for i, path in enumerate(("/metrics", "/health"))]
ANALYSED = request_row(500, OLD + 10 * S, ttft_ms=80)


def split_row(request: dict, *, queue_ms: float, prefill_ms: float) -> dict:
    """A request_split row for ``request``, as `tokenprobe analyze` writes one (its other phases are the
    figures the store computed when the request was inserted)."""
    return {
        **{column: request[column] for column in ("node", "server_port", "model", "conn_id", "req_seq",
                                                  "req_start")},
        "queue_ms": queue_ms, "prefill_ms": prefill_ms, "prompt_size": 10, "prompt_size_source": "usage",
        "calibration_id": "cal-1", "split_method": "calibration", "req_end": request["req_end"],
        "last_token": request["last_token"], "finished_at": request["resp_end"], "computed_at": OLD + 3600 * S,
    }


def indicator_cell(window_end_s: int, indicator: str, state: str, value: float | None, *, node: str = "node-a",
                   port: int = 8000, device_id: str = "", explanation: str = "") -> dict:
    return Cell(window_end_s * S - 300 * S, window_end_s * S, node, port, device_id, indicator, value, state,
                None, None, explanation).row(computed_at_ns=window_end_s * S)


INDICATOR_CELLS = [
    indicator_cell(T0_S + 60, "queue_wait_p95", "ok", 20.0),  # superseded by the next window's
    indicator_cell(T0_S + 120, "queue_wait_p95", "crit", 2500.0, explanation="p95 queue wait 2.5 s"),
    indicator_cell(T0_S + 120, "batch_fill", "ok", 0.8),
    indicator_cell(T0_S + 120, "gpu_memory_pressure", "warn", 0.91, device_id="GPU-0"),
    # An overload that is over: crit in the first window, ok in the latest.
    indicator_cell(T0_S + 60, "knee_proximity", "crit", 1.4, explanation="1.4x the knee's concurrency"),
    indicator_cell(T0_S + 120, "knee_proximity", "ok", 0.3),
    indicator_cell(T0_S + 120, "kv_cache_usage", "n/a", None),  # no engine metrics: named, not drawn
]
FIRST_WINDOW_S = (T0_S + 60 - 300, T0_S + 60)  # the analysed windows of INDICATOR_CELLS
LATEST_WINDOW_S = (T0_S + 120 - 300, T0_S + 120)
DECISION = {
    "issued_at": T0 + 30 * S, "recorded_at": T0 + 30 * S, "decision_id": "d-1", "kind": "breaker",
    "upstream": "node-a:8000", "model": "", "tenant": "", "breaker_state": "OPEN", "admitted_share": 1.0,
    "cooldown_s": 60.0, "tokens_per_second": 0.0, "burst_tokens": 0.0, "reason": "overloaded",
    "evidence_name": [], "evidence_value": [], "evidence_threshold": [], "evidence_unit": [],
    "expires_at": T0 + 90 * S, "issuer": "test", "outcome": "applied", "outcome_detail": "",
}

# The breaker closes at T0 + 60 s, which ends the OPEN one early; a tenant's budget is raised at T0 + 40 s,
# lapses at T0 + 50 s and comes back at T0 + 70 s.
DECISIONS = [
    DECISION,
    {**DECISION, "decision_id": "d-2", "issued_at": T0 + 60 * S, "recorded_at": T0 + 60 * S, "breaker_state": "CLOSED",
     "reason": "recovered", "expires_at": T0 + 100 * S},
    *({**DECISION, "decision_id": f"b-{index}", "kind": "token_budget", "tenant": "t1", "breaker_state": "",
       "tokens_per_second": budget, "issued_at": T0 + issued_s * S, "recorded_at": T0 + issued_s * S,
       "expires_at": T0 + (issued_s + 15) * S, "reason": "over capacity"}
      for index, (issued_s, budget) in enumerate(((30, 1000.0), (40, 1500.0), (70, 800.0)))),
]


def slo_row(objective: str, threshold_ms: float, target: float) -> dict:
    """An slo_status row as the analysis writes one for node-a:8000 (its counts zero)."""
    counts = {f"{count}_{window}": 0 for count in ("requests", "good") for window in ("5m", "30m", "1h", "6h")}
    return {"evaluated_at": T0 + 60 * S, "node": "node-a", "server_port": 8000, "model": "m1",
            "objective": objective, "threshold_ms": threshold_ms, "target": target, "alert": "ok", "explanation": "",
            **counts}


def gpu_samples() -> pa.Table:
    """A minute of samples of one GPU on each node, 60 GiB used on node-a and 20 GiB on node-b (the table's
    other columns keep their defaults; its Map column rules out insert_rows)."""
    samples = [(T0 + second * S, node, used_gib * 2**30)
               for second in range(0, 60, 5) for node, used_gib in (("node-a", 60), ("node-b", 20))]
    return pa.table({
        "ts": pa.array([ts for ts, _, _ in samples], pa.timestamp("ns", tz="UTC")),
        "node": [node for _, node, _ in samples],
        "source": ["nvml"] * len(samples),
        "device_id": ["GPU-0"] * len(samples),
        "gpu_index": pa.array([0] * len(samples), pa.uint16()),
        "mem_total_bytes": pa.array([80 * 2**30] * len(samples), pa.uint64()),
        "mem_used_bytes": pa.array([used for _, _, used in samples], pa.uint64()),
        "gpu_util_pct": pa.array([50.0] * len(samples), pa.float32()),
    })


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    url = f"chdb://{tmp_path_factory.mktemp('dashboard') / 'store'}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, url], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready", "the store's owner did not start"
        with open_store(url, owner_wait_s=OWNER_READY_S) as store:
            assert store.mode == "embedded-via-owner"
            store.insert_rows("requests", FAST + SLOW_COMPLETIONS + OTHER_SERVER + GAVE_UP + SCRAPES + [ANALYSED])
            store.insert_rows("request_split", [split_row(ANALYSED, queue_ms=10.0, prefill_ms=40.0)])
            store.insert_rows("indicator_matrix", INDICATOR_CELLS)
            store.insert_rows("decisions", DECISIONS)
            store.insert_rows("slo_status", [slo_row("tpot", 50.0, 0.95)])
            store.insert_arrow("gpu_samples", gpu_samples())
        yield url
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)


@pytest.fixture
def queries(store_url):
    with open_store(store_url) as store:
        yield DashboardQueries(store)


def window(**filters) -> Filters:
    """The 1-hour window the app shows for this data (it ends at the bin after the latest request)."""
    return Filters(T0 + 120 * S - 3600 * S, T0 + 120 * S, **{k: tuple(v) for k, v in filters.items()})


def cells(frame: pd.DataFrame) -> dict[tuple[int, int], int]:
    return {(int(row.bin_start_s), int(row.band)): int(row.requests) for row in frame.itertuples()}


# --------------------------------------------------------------------------- the queries


def test_bins_and_bands():
    assert choose_bin_seconds(3600) == 30
    assert choose_bin_seconds(86400) == 900
    assert choose_bin_seconds(10 * 365 * 86400) == 86400


def test_a_fitted_window_holds_the_traffic_in_whole_bins():
    # A demo's minute and a half fits in 1 s bins, an hour of traffic in 1-minute bins, one request in a minute.
    assert fitting_span_s(T0, T0 + 92 * S + 5) == 94
    assert fitting_span_s(T0, T0 + 3600 * S) == 3660
    assert fitting_span_s(T0, T0) == 61
    for first, latest in ((T0 + 7 * S + 123, T0 + 95 * S + 999_999_999), (T0 - 3599 * S, T0 + 1)):
        span_s = fitting_span_s(first, latest)
        bin_ns = choose_bin_seconds(span_s) * S
        end_ns = -(-(latest + 1) // bin_ns) * bin_ns  # the app rounds the end up to a whole bin
        assert end_ns - span_s * S <= first < latest < end_ns
        assert span_s * S < 2 * max(latest - first, 60 * S)  # no sliver: the traffic fills most of it
    low, high = band_bounds_ms(16)
    assert low <= 50 < high
    with pytest.raises(ValueError, match="empty"):
        Filters(T0, T0)


def test_heatmap_counts_each_cell_and_filters_narrow_them(queries):
    expected = {(T0_S, 16): 5, (T0_S, 33): 2, (T0_S + 90, 26): 3}
    assert cells(queries.latency_heatmap("ttft", window(), 30)) == expected
    assert cells(queries.latency_heatmap("ttft", window(servers=["node-a:8000"]), 30)) == {
        (T0_S, 16): 5, (T0_S + 90, 26): 3}
    assert cells(queries.latency_heatmap("ttft", window(models=["m2"]), 30)) == {(T0_S, 33): 2}
    assert cells(queries.latency_heatmap("ttft", window(routes=["/v1/completions"]), 30)) == {(T0_S + 90, 26): 3}
    # TPOT is 20 ms for every streamed request; the one that gave up has none.
    assert cells(queries.latency_heatmap("tpot", window(), 30)) == {(T0_S, 13): 7, (T0_S + 90, 13): 3}
    # End to end counts the request that gave up too: 2 ms connection setup + 1 ms in + 5 ms = 8 ms, band 9.
    assert cells(queries.latency_heatmap("e2e", window(), 30))[(T0_S, 9)] == 1
    # ITL counts gaps: every request streamed 4 events 20 ms apart, 3 gaps each (band 13).
    assert cells(queries.latency_heatmap("itl", window(), 30)) == {(T0_S, 13): 3 * 7, (T0_S + 90, 13): 3 * 3}
    with pytest.raises(ValueError, match="unknown latency metric"):
        queries.latency_heatmap("nope", window(), 30)


def test_heatmaps_come_from_the_rollup_where_it_is_complete(queries):
    six_hours = Filters(T0 + 120 * S - 6 * 3600 * S, T0 + 120 * S)  # whole minutes, as the app's windows
    bin_s = choose_bin_seconds(6 * 3600)
    for filters in (six_hours, replace(six_hours, servers=("node-a:8000",), routes=("/v1/completions",))):
        assert queries.heatmap_source(filters, bin_s) == "rollup"
        for key in METRICS:
            assert cells(queries.latency_heatmap(key, filters, bin_s)) == cells(
                queries.latency_heatmap(key, filters, bin_s, source="requests"))
    assert cells(queries.latency_heatmap("ttft", six_hours, bin_s)) == {
        (T0_S - T0_S % bin_s, 16): 5, (T0_S - T0_S % bin_s, 33): 2, (T0_S + 90 - (T0_S + 90) % bin_s, 26): 3}
    assert queries.filter_options(six_hours) == queries.filter_options(window()) == {
        "servers": ["node-a:8000", "node-b:8001"], "models": ["m1", "m2"],
        "routes": ["/v1/chat/completions", "/v1/completions"]}
    # Bins finer than the rollup's minutes, or bands it does not keep, are counted from the requests.
    assert queries.heatmap_source(window(), 30) == "requests"
    assert queries.heatmap_source(six_hours, bin_s, bands_per_decade=5) == "requests"
    # So is a window the rollup does not fully count (rows stored before its view existed, say).
    queries.store.command(
        f"INSERT INTO {queries.store.table(ROLLUP_TABLE)} (minute, node, server_port, model, path, metric, requests)"
        " VALUES (toDateTime({minute:Int64}, 'UTC'), 'node-a', 8000, 'm1', '/', 'all', 1)",
        {"minute": OLD // S - 86400})
    before_old = Filters(OLD - 2 * 86400 * S, OLD - 3600 * S)
    assert queries.heatmap_source(before_old, bin_s) == "requests"


def test_a_cell_lists_exactly_its_requests(queries):
    listed = queries.cell_requests("ttft", window(), T0_S, 30, 16)
    assert sorted(listed["response_id"]) == sorted(row["response_id"] for row in FAST)
    assert listed["latency_ms"].round(6).eq(50.0).all()
    assert len(queries.cell_requests("ttft", window(), T0_S, 30, 16, limit=2)) == 2
    assert queries.cell_requests("ttft", window(models=["m2"]), T0_S, 30, 16).empty
    gaps = queries.cell_requests("itl", window(), T0_S, 30, 13)
    assert sorted(gaps["response_id"]) == sorted(row["response_id"] for row in FAST + OTHER_SERVER)
    assert gaps["in_cell"].eq(3).all() and gaps["latency_ms"].round(6).eq(20.0).all()
    assert queries.cell_requests("itl", window(), T0_S, 30, 16).empty


def test_an_indicator_window_lists_its_servers_requests(queries):
    listed = queries.window_requests("node-a", 8000, T0 + 5 * S, T0 + 101 * S)
    assert sorted(listed["response_id"]) == sorted(row["response_id"] for row in FAST + GAVE_UP + SLOW_COMPLETIONS[:1])
    assert listed["in_window"].eq(7).all()
    assert listed["response_id"].iloc[0] == SLOW_COMPLETIONS[0]["response_id"]  # the slowest end to end first
    assert listed["e2e_ms"].is_monotonic_decreasing
    cut = queries.window_requests("node-a", 8000, T0 + 5 * S, T0 + 101 * S, limit=2)
    assert len(cut) == 2 and cut["in_window"].eq(7).all()
    assert queries.window_requests("node-b", 8001, T0 + 100 * S, T0 + 200 * S).empty


def test_request_timeline_has_every_event_and_token(queries):
    tls_request = FAST[0]
    timeline = queries.request_timeline("node-a", 8000, tls_request["conn_id"], 0, tls_request["req_start"])
    at = dict(zip(timeline["event"], timeline["at_ms"], strict=True))
    assert at["accept"] == pytest.approx(-2.0)
    assert at["TLS handshake done"] == pytest.approx(-1.0)
    assert at["request last byte in"] == pytest.approx(1.0)
    tokens = timeline[timeline["kind"] == "token"]["at_ms"].tolist()
    assert tokens == pytest.approx([51.0, 71.0, 91.0, 111.0])
    assert at["response last byte out (complete)"] == pytest.approx(112.0)
    assert timeline["at_ms"].is_monotonic_increasing
    # Queue and prefill appear once analytics has split them.
    analysed = queries.request_timeline("node-a", 8000, ANALYSED["conn_id"], 0, ANALYSED["req_start"])
    at = dict(zip(analysed["event"], analysed["at_ms"], strict=True))
    assert at["queue end (prefill starts)"] == pytest.approx(11.0)
    assert at["prefill end"] == pytest.approx(51.0)
    assert queries.request_timeline("node-a", 8000, 999, 0, T0).empty


def test_phase_breakdown_splits_queue_and_prefill_once_analysed(queries):
    raw, analysed = queries.phase_breakdown(window(servers=["node-a:8000"], routes=["/v1/completions"]), 30)
    assert not analysed
    by_phase = raw.groupby("phase")["mean_ms"].sum()
    assert by_phase["server TTFT"] == pytest.approx(500.0)
    assert by_phase["decode"] == pytest.approx(60.0)
    split, analysed = queries.phase_breakdown(Filters(OLD, OLD + 3600 * S), 30)
    assert analysed
    by_phase = split.groupby("phase")["mean_ms"].sum()
    assert (by_phase["queue"], by_phase["prefill"], by_phase["server TTFT"]) == pytest.approx((10.0, 40.0, 0.0))


def test_indicator_history_holds_every_analysed_cell_of_the_window(queries):
    history = queries.indicator_history(window(), 30)
    states = {(row.server, row.device_id, row.indicator, row.window_start_ns // S): row.state
              for row in history.itertuples()}
    first, latest = FIRST_WINDOW_S[0], LATEST_WINDOW_S[0]
    assert states == {
        ("node-a:8000", "", "queue_wait_p95", first): "ok", ("node-a:8000", "", "queue_wait_p95", latest): "crit",
        ("node-a:8000", "", "knee_proximity", first): "crit", ("node-a:8000", "", "knee_proximity", latest): "ok",
        ("node-a:8000", "", "batch_fill", latest): "ok", ("node-a:8000", "", "kv_cache_usage", latest): "n/a",
        ("node-a:8000", "GPU-0", "gpu_memory_pressure", latest): "warn"}
    # A window that overlaps analysed ones shows them, though they started before it.
    overlapping = queries.indicator_history(Filters(T0 + 10 * S, T0 + 103 * S), 30)
    assert sorted(overlapping["window_start_ns"]) == sorted(history["window_start_ns"])


def test_indicator_history_keeps_an_overload_that_ended(queries):
    """The knee was crit in the first window and is ok in the latest: the history keeps both."""
    history = queries.indicator_history(window(), 30)
    knee = history[history["indicator"] == "knee_proximity"].sort_values("bin_start_s")
    assert knee["state"].tolist() == ["crit", "ok"]
    assert knee["window_start_ns"].tolist() == [FIRST_WINDOW_S[0] * S, LATEST_WINDOW_S[0] * S]
    assert knee["explanation"].iloc[0] == "1.4x the knee's concurrency"
    assert knee["crit_windows"].tolist() == [1, 0]
    assert knee["from"].iloc[0] == pd.Timestamp(FIRST_WINDOW_S[0], unit="s", tz="UTC")
    # One bin holding both windows shows the worst of them, and that window's bounds.
    whole = queries.indicator_history(window(), 3600)
    (knee,) = whole[whole["indicator"] == "knee_proximity"].itertuples()
    assert (knee.state, knee.windows, knee.crit_windows, knee.window_end_ns) == ("crit", 2, 1, FIRST_WINDOW_S[1] * S)
    assert knee.to == pd.Timestamp(LATEST_WINDOW_S[1], unit="s", tz="UTC")
    assert queries.indicator_history(window(servers=["node-b:8001"]), 30).empty


def test_scrapes_and_health_checks_only_when_asked_for(queries):
    everything = replace(window(), inference_only=False)
    assert cells(queries.latency_heatmap("e2e", window(), 30))[(T0_S, 9)] == 1  # the request that gave up
    assert cells(queries.latency_heatmap("e2e", everything, 30))[(T0_S + 30, 9)] == len(SCRAPES)
    assert (T0_S + 30, 9) not in cells(queries.latency_heatmap("e2e", window(), 30))
    assert "/metrics" in queries.filter_options(everything)["routes"]
    assert "/metrics" not in queries.filter_options(window())["routes"]
    listed = queries.window_requests("node-a", 8000, T0 + 30 * S, T0 + 32 * S, inference_only=False)
    assert sorted(listed["route"]) == ["/health", "/metrics"]
    assert queries.window_requests("node-a", 8000, T0 + 30 * S, T0 + 32 * S).empty
    # Over six hours the rollup counts them apart by route (it keeps no method), as the scan does.
    six_hours = Filters(T0 + 120 * S - 6 * 3600 * S, T0 + 120 * S)
    bin_s = choose_bin_seconds(6 * 3600)
    for filters in (six_hours, replace(six_hours, inference_only=False)):
        assert queries.heatmap_source(filters, bin_s, metric_key="e2e") == "rollup"
        assert cells(queries.latency_heatmap("e2e", filters, bin_s)) == cells(
            queries.latency_heatmap("e2e", filters, bin_s, source="requests"))


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/chat/completions"), ("post", "/V1/Chat/Completions/"), ("POST", "/"), ("POST", "//"),
    ("GET", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/health"), ("POST", "/v1/models"),
    ("POST", "/v2/models/llama/versions/2/generate_stream"), ("POST", "/v2/models/llama/ready"),
    ("POST", "/api/chat"), ("POST", "/tokenize"),
])
def test_inference_requests_are_the_same_in_sql(queries, method, path):
    (in_sql,), = queries.store.query_rows(
        f"SELECT {inference_request_sql('m', 'p')} FROM (SELECT {{m:String}} AS m, {{p:String}} AS p)",
        {"m": method, "p": path})
    assert bool(in_sql) == is_inference_request(method, path)


def test_gpu_usage_and_decisions(queries):
    gpus = queries.gpu_usage(window(), 30)
    assert gpus.groupby("gpu")["mem_used_gib"].mean().round(6).to_dict() == {
        "node-a GPU 0": 60.0, "node-b GPU 0": 20.0}
    assert set(queries.gpu_usage(window(servers=["node-b:8001"]), 30)["gpu"]) == {"node-b GPU 0"}
    decisions = queries.decisions(window())
    assert decisions[["target", "action", "outcome"]].values.tolist() == [
        ["upstream=node-a:8000", "breaker OPEN", "applied"], ["upstream=node-a:8000,tenant=t1", "budget 1000 tok/s", "applied"],
        ["upstream=node-a:8000,tenant=t1", "budget 1500 tok/s", "applied"],
        ["upstream=node-a:8000", "breaker CLOSED", "applied"], ["upstream=node-a:8000,tenant=t1", "budget 800 tok/s", "applied"]]
    assert queries.decisions(Filters(T0 + 100 * S, T0 + 120 * S)).empty  # expired before this window


def test_budgets_step_and_breakers_band_until_replaced_or_expired(queries):
    decisions = queries.decisions(window())
    until = in_force_until(decisions).dt.as_unit("ns").astype("int64") // S - T0_S
    # The OPEN breaker ends when CLOSED replaces it; the first budget when the second does; the rest expire.
    assert dict(zip(decisions["decision_id"], until, strict=True)) == {
        "d-1": 60, "d-2": 100, "b-0": 40, "b-1": 55, "b-2": 85}
    steps = budget_steps(decisions)
    at = (steps["at"].dt.as_unit("ns").astype("int64") // S - T0_S).tolist()
    assert list(zip(at, steps["tokens_per_second"], steps["run"].str[-2:], strict=True)) == [
        (30, 1000.0, "#0"), (40, 1000.0, "#0"), (40, 1500.0, "#0"), (55, 1500.0, "#0"),  # a step up at 40 s
        (70, 800.0, "#1"), (85, 800.0, "#1")]  # lapsed from 55 s to 70 s: no line across the gap


def test_slo_thresholds_come_from_the_analysis_else_the_defaults(queries):
    objectives = queries.slo_thresholds(window())
    by_objective = {row.objective: (row.threshold_ms, row.target, row.source) for row in objectives.itertuples()}
    assert by_objective == {"tpot": (50.0, 0.95, "store"), "ttft": (1000.0, 0.99, "default"),
                            "e2e": (30_000.0, 0.99, "default")}
    # Another server's window has no evaluation: the defaults.
    assert set(queries.slo_thresholds(window(servers=["node-b:8001"]))["source"]) == {"default"}


def test_a_request_timeline_is_drawn_as_its_phases(queries):
    analysed = request_spans(queries.request_timeline("node-a", 8000, ANALYSED["conn_id"], 0, ANALYSED["req_start"]))
    spans = {row.span: (round(row.start_ms, 6), round(row.end_ms, 6)) for row in analysed.itertuples()}
    assert spans == {"connection setup": (-2.0, 0.0), "network in": (0.0, 1.0), "queue": (1.0, 11.0),
                     "prefill": (11.0, 51.0), "decode": (81.0, 141.0), "response tail": (141.0, 142.0)}
    assert analysed.loc[analysed["span"] == "prefill", "label"].item() == "40.00 ms"
    unsplit = request_spans(queries.request_timeline("node-a", 8000, FAST[1]["conn_id"], 0, FAST[1]["req_start"]))
    assert unsplit["span"].tolist() == ["connection setup", "network in", "server TTFT (queue + prefill, not split)",
                                        "decode", "response tail"]
    assert unsplit["ms"].round(6).tolist() == [2.0, 1.0, 50.0, 60.0, 1.0]


def test_time_axes_fit_the_window():
    assert time_format(94) == "%H:%M:%S"
    assert time_format(3600) == "%H:%M"
    assert time_format(7 * 86400) == "%b %d %H:%M"


# --------------------------------------------------------------------------- the app


@pytest.fixture
def fitted_app(store_url, monkeypatch) -> AppTest:
    """The app as it opens: its window fits the recent traffic."""
    monkeypatch.setenv(STORE_ENV, store_url)
    monkeypatch.setenv(REFRESH_ENV, "0")
    return AppTest.from_file(str(APP), default_timeout=APP_TIMEOUT_S).run()


@pytest.fixture
def app(fitted_app) -> AppTest:
    """The app over the last hour (30 s bins)."""
    return fitted_app.sidebar.selectbox(key="window").set_value("1 hour").run()


def chart_data(element) -> pd.DataFrame:
    """The rows a chart was drawn from (Streamlit ships them to the browser as Arrow)."""
    return pa.ipc.open_stream(element.proto.datasets[0].data.data).read_all().to_pandas()


def chart_frames(element) -> list[pd.DataFrame]:
    """Every dataset a (layered) chart was drawn from."""
    return [pa.ipc.open_stream(dataset.data.data).read_all().to_pandas() for dataset in element.proto.datasets]


def chart_spec(element) -> dict:
    return json.loads(element.proto.spec)


def heatmap_chart_element(app: AppTest, tab: int):
    (chart,) = [element for element in app.tabs[tab] if element.type == "vega_lite_chart"]
    return chart


def heatmap_cells(app: AppTest, tab: int) -> dict[tuple[int, int], int]:
    (frame,) = [frame for frame in chart_frames(heatmap_chart_element(app, tab)) if "requests" in frame.columns]
    return cells(frame)


def slo_lines(app: AppTest, tab: int) -> list[tuple[float, str]]:
    """The objective lines drawn on a heatmap: (threshold ms, label)."""
    frames = [frame for frame in chart_frames(heatmap_chart_element(app, tab)) if "threshold_ms" in frame.columns]
    return [(row.threshold_ms, row.label) for frame in frames for row in frame.itertuples()]


def strip(app: AppTest) -> pd.DataFrame:
    """The rows the indicator strip was drawn from."""
    (frame,) = [frame for element in app.get("vega_lite_chart") for frame in chart_frames(element)
                if "cell_key" in frame.columns]
    return frame


def strip_states(app: AppTest, row: str) -> list[tuple[int, str]]:
    """One strip's cells, in time order: (start of the analysed window in epoch s, state)."""
    cells_of_row = strip(app)[lambda frame: frame["row"] == row].sort_values("window_start_ns")
    return [(int(start) // S, state) for start, state in zip(cells_of_row["window_start_ns"], cells_of_row["state"],
                                                              strict=True)]


def test_app_draws_heatmaps_matrix_and_panels(app):
    assert not app.exception
    assert not app.error
    assert [tab.label for tab in app.tabs] == ["TTFT", "TPOT", "end-to-end", "ITL"]
    assert heatmap_cells(app, 0) == {(T0_S, 16): 5, (T0_S, 33): 2, (T0_S + 90, 26): 3}
    assert heatmap_cells(app, 3) == {(T0_S, 13): 21, (T0_S + 90, 13): 9}
    assert strip_states(app, "node-a:8000 · queue wait (p95)") == [(FIRST_WINDOW_S[0], "ok"),
                                                                     (LATEST_WINDOW_S[0], "crit")]
    warned = strip(app)[lambda frame: frame["row"] == "node-a:8000 · GPU-0 · GPU memory used"]
    assert warned[["state_words", "value_text"]].values.tolist() == [["warning", "91.00%"]]
    # Time labels as precise as an hour's window needs.
    assert chart_spec(heatmap_chart_element(app, 0))["layer"][0]["encoding"]["x"]["axis"]["format"] == "%H:%M"
    assert any("embedded-via-owner" in caption.value for caption in app.sidebar.caption)
    assert any("Queue and prefill show together" in caption.value for caption in app.caption)


def test_app_filters_narrow_the_heatmap(app):
    app.sidebar.multiselect(key="servers").set_value(["node-a:8000"]).run()
    assert heatmap_cells(app, 0) == {(T0_S, 16): 5, (T0_S + 90, 26): 3}
    app.sidebar.multiselect(key="routes").set_value(["/v1/completions"]).run()
    assert heatmap_cells(app, 0) == {(T0_S + 90, 26): 3}


def test_app_drills_from_a_cell_to_a_request_timeline(app):
    app.selectbox(key="drill_metric").set_value("ttft").run()
    app.selectbox(key="drill_bin").set_value(T0_S).run()
    band = app.selectbox(key="drill_band")
    assert band.options == [
        f"{low} – {high} ({count} requests)" for low, high, count in (("39.81 ms", "50.12 ms", 5),
                                                                      ("2.00 s", "2.51 s", 2))]
    band.set_value(16).run()
    listed = app.dataframe[0].value
    assert sorted(listed["response_id"]) == sorted(row["response_id"] for row in FAST)
    app.selectbox(key="drill_request").select_index(0).run()
    timeline = app.dataframe[1].value
    assert (timeline["kind"] == "token").sum() == 4
    assert {"accept", "request first byte in", "response first byte out"} <= set(timeline["event"])
    assert not app.exception
    # The timeline is drawn as its labelled phases, and its tokens.
    frames = [frame for element in app.get("vega_lite_chart") for frame in chart_frames(element)]
    (spans,) = [frame for frame in frames if "span" in frame.columns and "label" in frame.columns]
    assert spans["label"][spans["span"] == "decode"].tolist() == ["60.00 ms"]
    # Fractional figures print with two decimals.
    assert '"%.2f"' in app.dataframe[1].proto.columns


def test_app_opens_on_a_window_that_fits_the_recent_traffic(fitted_app):
    assert not fitted_app.exception
    (window,) = [caption.value for caption in fitted_app.caption if caption.value.endswith(" UTC")]
    start, end = (time.mktime(time.strptime(moment, "%Y-%m-%d %H:%M:%S UTC")) - time.timezone
                  for moment in window.split(" → "))
    # The requests of the last hour (T0 + 10 s to T0 + 102 s; not the one days older) fill the window.
    assert start <= T0_S + 10 and end > T0_S + 102 and end - start < 120, window
    assert sum(heatmap_cells(fitted_app, 0).values()) == len(FAST + SLOW_COMPLETIONS + OTHER_SERVER)
    assert strip_states(fitted_app, "node-a:8000 · queue wait (p95)")[-1] == (LATEST_WINDOW_S[0], "crit")
    # Two minutes: the axis labels seconds, or "HH:MM" would repeat along it.
    axis = chart_spec(heatmap_chart_element(fitted_app, 0))["layer"][0]["encoding"]["x"]["axis"]
    assert axis["format"] == "%H:%M:%S"


def test_app_shows_an_overload_after_it_ended(app):
    """The knee was crit in the first analysed window only: the latest is ok, the strip still shows it."""
    assert strip_states(app, "node-a:8000 · load vs. capacity knee") == [(FIRST_WINDOW_S[0], "crit"),
                                                                          (LATEST_WINDOW_S[0], "ok")]
    overload = strip(app)[lambda frame: (frame["row"] == "node-a:8000 · load vs. capacity knee")
                          & (frame["state"] == "crit")]
    assert overload["explanation"].item() == "1.4x the knee's concurrency"
    assert overload["value_text"].item() == "140.00%"
    # The rows are named in words, with a legend; an indicator without data is named, not drawn.
    assert not strip(app)["row"].str.contains("KV cache").any()
    assert any(caption.value == "No data for: node-a:8000 KV cache used" for caption in app.caption)
    assert any(caption.value.startswith("**load vs. capacity knee**: ") for caption in app.caption)
    # The overload's cell is offered in the drill-down, and lists the requests of its window.
    cell = app.selectbox(key="indicator_cell")
    assert "node-a:8000 · load vs. capacity knee · critical · " + " → ".join(
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(moment)) for moment in FIRST_WINDOW_S) in cell.options
    cell.set_value(overload["cell_key"].item()).run()
    assert not app.exception
    assert any("requests of node-a:8000 started in this window" in caption.value for caption in app.caption)


def test_app_draws_objectives_on_the_heatmaps(app):
    assert slo_lines(app, 0) == [(1000.0, "SLO (client TTFT): 99% within 1,000.00 ms, the default")]
    assert slo_lines(app, 1) == [(50.0, "SLO: 95% within 50.00 ms")]  # the one the analysis judged by
    assert slo_lines(app, 3) == []  # ITL has no objective


def test_app_counts_scrapes_only_when_asked_to(app):
    assert (T0_S + 30, 9) not in heatmap_cells(app, 2)
    app.sidebar.toggle(key="all_requests").set_value(True).run()
    assert heatmap_cells(app, 2)[(T0_S + 30, 9)] == len(SCRAPES)
    assert "/metrics" in app.sidebar.multiselect(key="routes").options
    assert any(caption.value.startswith("Requests of every kind") for caption in app.caption)


def test_app_draws_breakers_as_bands_and_budgets_as_steps(app):
    frames = [frame for element in app.get("vega_lite_chart") for frame in chart_frames(element)]
    (band,) = [frame for frame in frames if "until" in frame.columns]
    assert band["breaker_state"].tolist() == ["OPEN", "CLOSED"]
    (steps,) = [frame for frame in frames if "run" in frame.columns]
    assert steps["tokens_per_second"].tolist() == [1000.0, 1000.0, 1500.0, 1500.0, 800.0, 800.0]


def test_app_goes_from_an_indicator_cell_to_the_requests_of_its_window(app):
    cell = app.selectbox(key="indicator_cell")
    chosen = cell_key("node-a", 8000, "", "queue_wait_p95", T0 - 180 * S, T0 + 120 * S)
    assert any(option.startswith("node-a:8000 · queue wait (p95) · critical · ")
               for option in cell.options), cell.options
    cell.set_value(chosen).run()
    assert not app.exception
    (listed,) = [frame.value for frame in app.dataframe if "e2e_ms" in frame.value.columns]
    assert sorted(listed["response_id"]) == sorted(row["response_id"] for row in FAST + SLOW_COMPLETIONS + GAVE_UP)
    assert any("9 requests of node-a:8000 started in this window" in caption.value for caption in app.caption)


def test_app_never_takes_a_store_nobody_owns_unless_told_to(tmp_path, monkeypatch):
    """Started before the agent, the dashboard must not hold the directory the agent is to own."""
    url = f"chdb://{tmp_path / 'bare'}"
    with open_store(url, serve=False) as store:  # a store whose agent has stopped
        store.ensure_schema()
    monkeypatch.setenv(STORE_ENV, url)
    monkeypatch.setenv(REFRESH_ENV, "0")
    try:
        app = AppTest.from_file(str(APP), default_timeout=APP_TIMEOUT_S).run()
        assert not app.exception
        # It says what to run: an agent on the store, or the dashboard holding it.
        assert any("no process owns the embedded store" in error.value and "--own-store" in error.value
                   for error in app.error), [error.value for error in app.error]
        with open_store(url, serve=False) as agent_side:  # the directory is free for its owner
            assert agent_side.mode == "embedded-owner"
    finally:
        st.cache_resource.clear()


def test_app_told_to_own_a_store_nobody_serves_says_what_is_missing(tmp_path, monkeypatch):
    url = f"chdb://{tmp_path / 'bare'}"
    with open_store(url, serve=False) as store:  # only the requests table: no GPU samples, no analytics
        store.command(f"CREATE DATABASE {store.database}")
        store.command(schema.REQUESTS_DDL.format(db=store.database, ttl_days=DEFAULT_TTL_DAYS))
    monkeypatch.setenv(STORE_ENV, url)
    monkeypatch.setenv(REFRESH_ENV, "0")
    monkeypatch.setenv(OWN_STORE_ENV, "1")
    try:
        app = AppTest.from_file(str(APP), default_timeout=APP_TIMEOUT_S).run()
        assert not app.exception
        assert "No requests in" in app.info[0].value
        st.cache_resource.clear()  # the app owned the store: release it to add a request
        with open_store(url, serve=False) as store:
            store.insert_rows("requests", [request_row(1, T0, ttft_ms=50)])
        app = AppTest.from_file(str(APP), default_timeout=APP_TIMEOUT_S).run()
        assert not app.exception
        assert any("(embedded-owner)" in caption.value for caption in app.sidebar.caption)
        assert heatmap_cells(app, 0) == {(T0_S, 16): 1}
        messages = [info.value for info in app.info]
        assert any(message.startswith("No indicator data in this window yet") for message in messages)
        assert any("No GPU samples table" in message for message in messages)
        assert any("No decisions table" in message for message in messages)
        # Holding the store, the dashboard serves it to another process, as an agent would.
        beside = subprocess.run([sys.executable, "-m", "tokenprobe", "query", "--store", url,
                                 "SELECT count() AS n FROM tokenprobe.requests"], capture_output=True, text=True,
                                timeout=120)
        assert (beside.returncode, beside.stdout.split()) == (0, ["n", "1"]), beside.stderr
    finally:
        st.cache_resource.clear()  # closes the store the app opened, releasing the directory


def test_app_reports_an_unreachable_store(monkeypatch):
    monkeypatch.setenv(STORE_ENV, "http://127.0.0.1:9/")
    monkeypatch.setenv(REFRESH_ENV, "0")
    app = AppTest.from_file(str(APP), default_timeout=APP_TIMEOUT_S).run()
    assert not app.exception
    assert any("cannot be reached" in error.value or "Cannot open" in error.value for error in app.error)


def test_cli_rejects_bad_arguments(capsys):
    parser = argparse.ArgumentParser(prog="tokenprobe")
    add_dashboard_parser(parser.add_subparsers(), default_store="chdb:///var/lib/tokenprobe/store")
    args = parser.parse_args(["dashboard", "--store", "ftp://nowhere/"])
    assert args.func(args) == 2
    assert "unsupported store URL scheme" in capsys.readouterr().err
    args = parser.parse_args(["dashboard", "--port", "70000"])
    assert args.func(args) == 2
    assert "--port must be within 1-65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["dashboard", "--refresh", "-5"])


def test_cli_serves_viewers_without_the_deploy_menu():
    parser = argparse.ArgumentParser(prog="tokenprobe")
    add_dashboard_parser(parser.add_subparsers(), default_store="chdb:///var/lib/tokenprobe/store")
    command = streamlit_command(parser.parse_args(["dashboard"]))
    assert command[command.index("--client.toolbarMode") + 1] == "viewer"


def test_bad_settings_are_explained(monkeypatch):
    monkeypatch.setenv(STORE_ENV, "ftp://nowhere/")
    app = AppTest.from_file(str(APP), default_timeout=APP_TIMEOUT_S).run()
    assert "unsupported store URL scheme" in app.error[0].value
    with pytest.raises(ValueError, match=">= 0"):
        parse_refresh("-1")
    with pytest.raises(ValueError, match="number of seconds"):
        parse_refresh("soon")
