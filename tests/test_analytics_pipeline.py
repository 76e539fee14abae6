"""The analytics end to end on known traffic, in a real embedded store.

Simulated slot servers (``tests.support.slot_simulation``) play one scenario per port,
with their ground truth; GPU and engine samples are inserted beside them.
One analysis runs over all of it, and each test checks one finding against
what the scenario was built to show.

| port | scenario |
|------|----------|
| 8000 | 4 slots taken from idle to 1.4x capacity, 2 minutes per level |
| 8001 | clients retrying 30% of their requests |
| 8002 | GPU memory filling up, then fragmentation; engine KV cache full |
| 8003 | 1 request running while requests queue on a server the engine says has 8 slots |
| 8004 | long streams slowing down, stalling, and TPOT rising over time |
| 8005 | never idle: no prefill calibration possible |
| 8006 | TTFT failing for the last 20 minutes: page |
| 8007 | 10% of TTFT failing for 6 hours: ticket |
| 8008 | the engine reports twice the prefill the idle arrivals show |
| 8009 | TTFT unrelated to prompt size (a random 0-300 ms): a prefill fit too poor to split with |
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pandas as pd
import pytest
from tokenprobe.agent.sampling.engine_metrics import EngineReading
from tokenprobe.agent.sampling.gpu import GpuReading, ServerGpu
from tokenprobe.agent.sampling.samplers import (
    engine_samples_arrow,
    gpu_samples_arrow,
    server_gpus_arrow,
)
from tokenprobe.analytics import indicators
from tokenprobe.analytics.calibration import BYTES, MIN_R2, TOKENS
from tokenprobe.analytics.cli import add_analyze_parser
from tokenprobe.analytics.config import AnalysisSpans, AnalyticsConfig
from tokenprobe.analytics.figures import window_figures
from tokenprobe.analytics.indicators import Windows
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.phases import POOR_FIT
from tokenprobe.analytics.scope import EVERYTHING, Scope, Server
from tokenprobe.analytics.split import split_requests
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange
from tokenprobe.contract import measures
from tokenprobe.contract.indicators import CRIT, NO_DATA, OK, WARN
from tokenprobe.store.embedded import open_store

from tests.support.phases import phases_of
from tests.support.slot_simulation import MS, LoadPhase, SlotServer, simulate

NODE = "sim-node"
MINUTE = 60 * NS_PER_S
# A multiple of 10 minutes, so 60 s and 120 s windows line up with the scenarios' phases.
END_NS = (time.time_ns() // (10 * MINUTE) - 1) * 10 * MINUTE
START_NS = END_NS - 8 * MINUTE
WINDOW_S = 60
SERVER = SlotServer()  # 4 slots; a request holds one for about 236 ms
CAPACITY_RPS = SERVER.slots / 0.236
LOAD_LEVELS = (0.1, 0.5, 0.9, 1.4)  # x capacity, 2 minutes each, on port 8000
GPU = "GPU-5f1e-test"
GIB = 1 << 30


def rows_of(requests) -> list[dict]:
    return [request.row for request in requests]


def with_ttft_shift(row: dict, shift_ns: int) -> dict:
    """The row as if its first token (and everything after) came ``shift_ns`` later."""
    return {**row, **{k: row[k] + shift_ns for k in ("first_token", "last_token", "resp_end")}}


def with_gaps(row: dict, gaps_us: list[int]) -> dict:
    offsets = [0, *np.cumsum(gaps_us).tolist()]
    last = row["first_token"] + offsets[-1] * 1000
    return {**row, "token_offsets_us": offsets, "token_events": len(offsets), "last_token": last,
            "resp_end": last + 300_000, "completion_tokens": None}


def slowing_streams(requests) -> list[dict]:
    """Streams whose last quarter decodes at 40% of the first quarter's rate, with 3 stalls each,
    and whose base token interval grows by 2x over the 8 minutes."""
    rows = []
    for request in requests:
        row = request.row
        base_us = 10_000 * (1 + (row["req_start"] - START_NS) / (8 * MINUTE))
        gaps = [int(base_us)] * 47
        for position in range(36, 47):  # the last quarter
            gaps[position] = int(base_us * 2.5)
        for position in (15, 20, 25):  # mid-stream, clear of the quarters compared for decay
            gaps[position] = int(base_us * 12)
        rows.append(with_gaps(row, gaps))
    return rows


def gpu_readings() -> list[GpuReading]:
    readings = []
    for second in range(8 * 60):
        if second < 120:
            used, util = 0.5, 50.0
        elif second < 240:
            used, util = 0.8, 50.0
        elif second < 300:
            used, util = 0.95, 50.0
        else:
            used, util = 0.95, 10.0  # memory held, GPU idle
        readings.append(GpuReading(START_NS + second * NS_PER_S, "nvml", GPU, GPU, 0, "H100",
                                   mem_total_bytes=80 * GIB, mem_used_bytes=int(used * 80 * GIB),
                                   mem_free_bytes=int((1 - used) * 80 * GIB), gpu_util_pct=util))
    return readings


def engine_readings() -> list[EngineReading]:
    readings = []
    for second in range(0, 8 * 60, 2):
        ts = START_NS + second * NS_PER_S
        late = second >= 240
        readings.append(EngineReading(ts, "http://127.0.0.1:8002/metrics", 8002, "vllm", "sim-model",
                                      requests_running=4.0, requests_waiting=20.0 if second >= 300 else 0.0,
                                      kv_cache_usage=0.97 if late else 0.5,
                                      preemptions_total=float(second // 10 if late else 0)))
        # port 8003: the engine ran 8 requests at once at some point while others waited
        readings.append(EngineReading(ts, "http://127.0.0.1:8003/metrics", 8003, "vllm", "sim-model",
                                      requests_running=8.0 if second < 20 else 1.0, requests_waiting=3.0))
        # port 8008: the engine's prefill is twice what an idle-arrival fit of this traffic predicts
        readings.append(EngineReading(ts, "http://127.0.0.1:8008/metrics", 8008, "vllm", "sim-model",
                                      prefill_mean_s=2 * (SERVER.prefill_base_ms + SERVER.prefill_ms_per_token
                                                          * 264) / 1000))
    return readings


def build_scenarios(store) -> dict[str, list]:
    load = simulate(SERVER, [LoadPhase(120, CAPACITY_RPS * share) for share in LOAD_LEVELS],
                    start_ns=START_NS, node=NODE, port=8000, seed=1)
    retries = simulate(SERVER, [LoadPhase(480, 5.0)], start_ns=START_NS, node=NODE, port=8001, seed=2,
                       retry_fraction=0.3)
    gpu = simulate(SERVER, [LoadPhase(480, 3.0)], start_ns=START_NS, node=NODE, port=8002, seed=3)
    one_slot = SlotServer(slots=1)
    starved = simulate(one_slot, [LoadPhase(120, 0.8), LoadPhase(360, 5.5)], start_ns=START_NS, node=NODE,
                       port=8003, seed=4)
    streams = simulate(SERVER, [LoadPhase(480, 2.0)], start_ns=START_NS, node=NODE, port=8004, seed=5)
    busy = simulate(SERVER, [LoadPhase(480, 3.0)], start_ns=START_NS, node=NODE, port=8005, seed=6)
    page = simulate(SERVER, [LoadPhase(3600, 0.2)], start_ns=END_NS - 60 * MINUTE, node=NODE, port=8006, seed=7)
    ticket = simulate(SERVER, [LoadPhase(6 * 3600, 1 / 30)], start_ns=END_NS - 360 * MINUTE, node=NODE,
                      port=8007, seed=8)
    engine = simulate(SERVER, [LoadPhase(480, 3.0)], start_ns=START_NS, node=NODE, port=8008, seed=9)
    unrelated = simulate(SERVER, [LoadPhase(480, 1.0)], start_ns=START_NS, node=NODE, port=8009, seed=10)
    noise_ms = np.random.default_rng(10).uniform(0, 300, len(unrelated))

    rows = rows_of(load) + rows_of(retries) + rows_of(gpu) + rows_of(starved) + rows_of(engine)
    rows += slowing_streams(streams)
    rows += [{**row, "inflight_at_arrival": max(1, row["inflight_at_arrival"])} for row in rows_of(busy)]
    failing_from = END_NS - 20 * MINUTE
    rows += [with_ttft_shift(row, 1500 * MS) if row["req_start"] >= failing_from and index % 2 else row
             for index, row in enumerate(rows_of(page))]
    rows += [with_ttft_shift(row, 1500 * MS) if index % 10 == 0 else row for index, row in enumerate(rows_of(ticket))]
    rows += [with_ttft_shift(row, int(shift * MS)) for row, shift in zip(rows_of(unrelated), noise_ms, strict=True)]
    store.insert_rows("requests", rows)
    store.insert_arrow("gpu_samples", gpu_samples_arrow(gpu_readings(), NODE))
    store.insert_arrow("server_gpus", server_gpus_arrow([ServerGpu(0, 8002, GPU, GPU, "config")], START_NS, NODE))
    store.insert_arrow("engine_samples", engine_samples_arrow(engine_readings(), NODE))
    return {"load": load, "retries": retries, "starved": starved}


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    url = f"chdb://{tmp_path_factory.mktemp('analytics') / 'store'}"
    # Serving: the CLI tests reach this store through its owner, as they would an agent's.
    store = open_store(url, serve=True)
    try:
        store.ensure_schema()
        truth = build_scenarios(store)
        report = analyze(store, TimeRange(START_NS, END_NS), window_s=WINDOW_S, now_ns=END_NS + MINUTE)
        yield store, report, truth, url
    finally:
        store.close()


def cells_of(report, port: int, indicator: str, *, minutes: tuple[int, int] = (0, 8), device: str = "") -> list:
    """The cells of one indicator of one server in windows within [START + m0, START + m1) minutes."""
    first, last = START_NS + minutes[0] * MINUTE, START_NS + minutes[1] * MINUTE
    return [cell for cell in report.cells
            if cell.server_port == port and cell.indicator == indicator and cell.device_id == device
            and first <= cell.window_start_ns < last]


def states(cells) -> list[str]:
    return [cell.state for cell in cells]


# -- phases ------------------------------------------------------------------------


def test_phases_recover_the_simulated_truth(analysed):
    store, _, truth, _ = analysed
    frame = store.query_df(
        "SELECT response_id, queue_ms, prefill_ms, network_in_ms, accept_wait_ms, decode_ms, tpot_ms, itl_p50_ms, "
        "itl_max_ms, stalls, prompt_size_source, output_tokens_source, calibration_id, split_method "
        f"FROM {phases_of(store)} WHERE server_port = 8000")
    assert len(frame) == len(truth["load"])
    assert max(r.queue_ms for r in truth["load"] if r.phase == len(LOAD_LEVELS) - 1) > 1000  # overload queued
    expected = {request.row["response_id"]: request for request in truth["load"]}
    queue_error = np.abs(frame["queue_ms"] - [expected[i].queue_ms for i in frame["response_id"]])
    prefill_error = np.abs(frame["prefill_ms"] - [expected[i].prefill_ms for i in frame["response_id"]])
    assert queue_error.max() < 0.5 and prefill_error.max() < 0.5  # float32 storage; the model is exact
    assert frame["network_in_ms"].round(3).eq(SERVER.network_in_ms + 1.0).all()  # + 1 ms accept wait
    assert frame["accept_wait_ms"].round(3).eq(1.0).all()
    assert frame["tpot_ms"].round(3).eq(SERVER.decode_ms).all() and frame["itl_p50_ms"].eq(10.0).all()
    assert frame["stalls"].eq(0).all()
    assert set(frame["prompt_size_source"]) == {"usage", "bytes"}
    assert set(frame["output_tokens_source"]) == {"usage", "events"}
    assert frame["calibration_id"].nunique() == 1 and set(frame["split_method"]) == {"calibration"}


def test_calibration_is_stored_with_its_fit_quality(analysed):
    store, report, _, _ = analysed
    calibration = report.calibrations[(NODE, 8000, "sim-model")]
    assert calibration.fresh and set(calibration.fits) == {TOKENS, BYTES}
    assert calibration.fits[TOKENS].fit.slope == pytest.approx(SERVER.prefill_ms_per_token, rel=1e-6)
    assert calibration.fits[TOKENS].fit.intercept == pytest.approx(SERVER.prefill_base_ms, abs=1e-6)
    assert calibration.fits[BYTES].fit.slope == pytest.approx(SERVER.prefill_ms_per_token / SERVER.bytes_per_token)
    rows = store.query_rows(
        "SELECT size_unit, slope_ms, r2, mad_ms, n FROM tokenprobe.prefill_calibration "
        "WHERE calibration_id = {id:String} ORDER BY size_unit", {"id": calibration.calibration_id})
    assert [row[0] for row in rows] == [BYTES, TOKENS]
    assert all(row[2] > 0.999 and row[3] < 0.01 and row[4] >= 8 for row in rows)


def test_without_idle_arrivals_queue_and_prefill_stay_unsplit(analysed):
    _, report, _, _ = analysed
    assert (NODE, 8005, "sim-model") not in report.calibrations
    phases = report.phases.set_index("server_port").loc[8005]
    assert phases["unsplit"] == phases["requests"]
    queue = cells_of(report, 8005, "queue_wait_p95")
    assert queue and set(states(queue)) == {NO_DATA}
    assert "no prefill calibration" in queue[0].explanation


def test_without_recent_idle_arrivals_the_stored_calibration_is_kept(analysed):
    store, report, _, _ = analysed
    first = report.calibrations[(NODE, 8003, "sim-model")]
    # The last minute of port 8003 is overloaded: no idle arrival to refit from.
    config = AnalyticsConfig(spans=AnalysisSpans(calibration_lookback_s=60))
    again = analyze(store, TimeRange(END_NS - 2 * MINUTE, END_NS), window_s=WINDOW_S, scope=Scope((Server(8003),)),
                    config=config, now_ns=END_NS + 3 * MINUTE)
    kept = again.calibrations[(NODE, 8003, "sim-model")]
    assert not kept.fresh and kept.calibration_id == first.calibration_id
    assert kept.fits[BYTES].fit == first.fits[BYTES].fit


def test_engine_prefill_corrects_the_calibration(analysed):
    store, report, _, _ = analysed
    calibration = report.calibrations[(NODE, 8008, "sim-model")]
    assert calibration.engine_samples > 100
    assert calibration.engine_scale == pytest.approx(2.0, rel=0.1)
    split = store.query_rows("SELECT DISTINCT split_method FROM tokenprobe.request_split FINAL "
                             "WHERE server_port = 8008")
    assert split == [("calibration+engine",)]


def test_a_prefill_fit_too_poor_is_not_used_and_the_rows_say_so(analysed, capsys):
    store, report, _, url = analysed
    calibration = report.calibrations[(NODE, 8009, "sim-model")]
    assert calibration.fits[BYTES].fit.r2 < MIN_R2 and calibration.usable_units == []
    rows = store.query_rows("SELECT count(), countIf(queue_ms IS NULL AND prefill_ms IS NULL), "
                            "groupUniqArray(split_method), groupUniqArray(calibration_id) "
                            "FROM tokenprobe.request_split FINAL WHERE server_port = 8009")
    assert rows[0][0] > 100 and rows[0][1] == rows[0][0] and rows[0][2:] == (["poor fit"], [""])
    # the report names the rejected line instead of printing it as a result
    assert run_cli("--store", url, *range_args(), "--window", "60", "--server", "8009") == 0
    printed = capsys.readouterr().out
    assert "8009 sim-model: queue and prefill not split; not used, too poor to split with: the per-token line (R2" \
        in printed and "; the per-byte line (R2 0.05 < 0.5 and MAD" in printed


def test_the_in_memory_split_equals_the_stores(analysed):
    """The live pass's engine (numpy, analytics/split.py) and the SQL one split the same rows alike: every
    scenario (idle, overload, retry storm, a one-slot jam, never idle, the engine's scale, a poor fit)."""
    store, _, _, _ = analysed
    report = analyze(store, TimeRange(START_NS, END_NS), window_s=WINDOW_S, now_ns=END_NS + 5 * MINUTE)
    key = ["node", "server_port", "req_start", "conn_id", "req_seq"]
    in_store = store.query_df(
        "SELECT node, server_port, toUnixTimestamp64Nano(req_start) AS req_start, conn_id, req_seq, model, "
        "queue_ms, prefill_ms, overhead_ms, prompt_size, prompt_size_source, calibration_id, split_method, "
        "ifNull(toUnixTimestamp64Nano(req_end), -1) AS req_end, ifNull(toUnixTimestamp64Nano(last_token), -1) AS "
        "last_token, toUnixTimestamp64Nano(finished_at) AS finished_at FROM tokenprobe.request_split FINAL")
    requests = store.query_df(
        "SELECT node, server_port, model, conn_id, req_seq, toUnixTimestamp64Nano(req_start) AS req_start, "
        "ifNull(toUnixTimestamp64Nano(req_end), -1) AS req_end, "
        "ifNull(toUnixTimestamp64Nano(first_token), -1) AS first_token, "
        "ifNull(toUnixTimestamp64Nano(last_token), -1) AS last_token, "
        "ifNull(toUnixTimestamp64Nano(resp_end), -1) AS resp_end, "
        "toFloat64(prompt_tokens) AS prompt_tokens, bytes_in, toFloat64(engine_queue_ms) AS engine_queue_ms, "
        "toFloat64(engine_prompt_ms) AS engine_prompt_ms FROM tokenprobe.requests WHERE method = 'POST'")
    in_memory = split_requests(requests, report.calibrations)
    both = in_store.merge(in_memory, on=key, suffixes=("_sql", "_numpy"), validate="one_to_one")
    assert len(both) == len(in_store) > 5000
    assert set(both["split_method_sql"]) >= {"", "calibration", "calibration+engine", POOR_FIT}
    for name in ("model", "prompt_size_source", "calibration_id", "split_method", "req_end", "last_token",
                 "finished_at"):
        assert (both[f"{name}_sql"] == both[f"{name}_numpy"]).all(), name
    assert (both["prompt_size_sql"].astype(float) == both["prompt_size_numpy"]).all()
    for name in ("queue_ms", "prefill_ms", "overhead_ms"):
        sql, numpy = both[f"{name}_sql"].to_numpy(float), both[f"{name}_numpy"].to_numpy(float)
        assert (np.isnan(sql) == np.isnan(numpy)).all(), name
        # both Float32 from the same float64 arithmetic: equal within one Float32 step of a second
        assert np.allclose(sql[~np.isnan(sql)], numpy[~np.isnan(numpy)], rtol=1e-6, atol=1e-4), name


# -- knee and matrix ---------------------------------------------------------------


def test_knee_lands_at_the_slot_count(analysed):
    store, report, _, _ = analysed
    knee = report.knees[(NODE, 8000, "sim-model")]
    assert knee.knee_concurrency == SERVER.slots and knee.confidence > 0.5
    stored = store.query_rows("SELECT knee_concurrency, method FROM tokenprobe.knee WHERE server_port = 8000")
    assert stored[0][0] == SERVER.slots and "TTFT p50" in stored[0][1]


def test_matrix_states_follow_the_load(analysed):
    store, report, _, _ = analysed
    for level, share in enumerate(LOAD_LEVELS):
        minutes = (2 * level, 2 * level + 2)
        queue = states(cells_of(report, 8000, "queue_wait_p95", minutes=minutes))
        knee = states(cells_of(report, 8000, "knee_proximity", minutes=minutes))
        if share < 0.2:  # idle: nothing lit (at half load a p95 queue wait may already warn)
            lit = [cell for cell in report.cells if cell.server_port == 8000 and cell.state in (WARN, CRIT)
                   and START_NS + minutes[0] * MINUTE <= cell.window_start_ns < START_NS + minutes[1] * MINUTE]
            assert not lit, [(c.indicator, c.explanation) for c in lit]
        if share > 1:
            assert set(queue) == {CRIT} and set(knee) == {CRIT}, (queue, knee)
    stored = store.query_rows("SELECT count() FROM tokenprobe.indicator_matrix FINAL WHERE server_port = 8000")
    assert stored[0][0] == len([cell for cell in report.cells if cell.server_port == 8000])


def test_retry_storm_is_lit_by_repeated_fingerprints(analysed):
    _, report, _, _ = analysed
    storm = cells_of(report, 8001, "retry_storm", minutes=(1, 8))
    assert storm and set(states(storm)) == {CRIT}, [(c.value, c.explanation) for c in storm]
    assert all(0.2 < cell.value < 0.4 for cell in storm)
    assert set(states(cells_of(report, 8000, "retry_storm"))) == {OK}


def test_retry_counts_are_each_window_s_requests_that_repeat_one_within_the_retry_window(analysed):
    store, _, _, _ = analysed
    retry_window_s = AnalyticsConfig().thresholds.retry_window_s
    windows = Windows(TimeRange(START_NS + 2 * MINUTE, END_NS), WINDOW_S, 0)  # earlier requests count as previous
    counted = indicators._retries(store, windows, EVERYTHING, retry_window_s)
    got = {(port, window): (fingerprinted, retries) for port, window, fingerprinted, retries in zip(
        counted["server_port"], counted["window"], counted["fingerprinted"], counted["retries"], strict=True)}
    expected: dict[tuple[int, int], list[int]] = {}
    previous: dict[tuple, int] = {}
    for port, start_ns, *fingerprint in sorted(store.query_rows(
            "SELECT server_port, toUnixTimestamp64Nano(req_start), client_addr, method, path, body_fp"
            " FROM tokenprobe.requests WHERE method = 'POST' AND body_fp != 0")):
        key, last_ns = (port, *fingerprint), previous.get((port, *fingerprint))
        previous[key] = start_ns
        if windows.origin_ns <= start_ns < END_NS:
            counts = expected.setdefault((port, (start_ns - windows.origin_ns) // (WINDOW_S * NS_PER_S)), [0, 0])
            counts[0] += 1
            counts[1] += last_ns is not None and start_ns - last_ns <= retry_window_s * NS_PER_S
    assert any(retries for _, retries in expected.values())
    assert got == {key: tuple(counts) for key, counts in expected.items()}


def test_gpu_memory_pressure_and_fragmentation(analysed):
    _, report, _, _ = analysed
    memory = cells_of(report, 8002, "gpu_memory_pressure", device=GPU)
    assert states(memory) == [OK, OK, WARN, WARN, CRIT, CRIT, CRIT, CRIT]
    fragmentation = cells_of(report, 8002, "fragmentation", device=GPU)
    # memory full, GPU idle and 20 queued (engine) from minute 5: warn at once, crit after 2 minutes
    assert states(fragmentation) == [OK, OK, OK, OK, OK, WARN, CRIT, CRIT]
    assert "fragmented" in fragmentation[-1].explanation
    assert set(states(cells_of(report, 8000, "gpu_memory_pressure"))) == {NO_DATA}


def test_kv_cache_from_the_engine(analysed):
    _, report, _, _ = analysed
    kv = cells_of(report, 8002, "kv_cache_usage")
    assert states(kv) == [OK] * 4 + [CRIT] * 4
    assert "preemptions" in kv[-1].explanation


def test_batch_fill_warns_when_slots_sit_idle_while_requests_queue(analysed):
    _, report, _, _ = analysed
    assert report.capacities[(NODE, 8003)].engine_slots == 8
    fill = cells_of(report, 8003, "batch_fill", minutes=(3, 8))
    assert fill and set(states(fill)) == {WARN}, [(c.value, c.explanation) for c in fill]
    assert all(cell.value < 0.2 for cell in fill)
    assert set(states(cells_of(report, 8000, "batch_fill"))) == {OK}


def test_decay_stalls_and_tpot_trend_of_slowing_streams(analysed):
    _, report, _, _ = analysed
    decay = cells_of(report, 8004, "token_rate_decay")
    assert set(states(decay)) == {CRIT} and all(cell.value == pytest.approx(0.4, abs=0.02) for cell in decay)
    stalls = cells_of(report, 8004, "stall_rate")
    assert set(states(stalls)) == {CRIT} and all(cell.value == pytest.approx(3 / 47, abs=0.005) for cell in stalls)
    trend = cells_of(report, 8004, "tpot_trend")
    assert states(trend)[:2] == [NO_DATA, NO_DATA] and states(trend)[-1] == CRIT
    steady = cells_of(report, 8000, "tpot_trend", minutes=(2, 8))
    assert set(states(steady)) == {OK}


# -- SLOs --------------------------------------------------------------------------


def slo(report, port: int, objective: str):
    return next(s for s in report.slos if s.server_port == port and s.objective == objective)


def test_slo_pages_when_both_short_and_long_windows_burn_fast(analysed):
    _, report, _, _ = analysed
    ttft = slo(report, 8006, "ttft")
    assert ttft.alert == "page", ttft.explanation
    assert ttft.burn("5m") == pytest.approx(50, rel=0.3) and ttft.burn("1h") > 14.4
    assert slo(report, 8006, "tpot").alert == "ok"
    goodput = slo(report, 8006, "goodput")
    assert goodput.share_good("1h") == pytest.approx(1 - ttft.burn("1h") / 100, abs=0.01)


def test_slo_tickets_a_slow_steady_burn(analysed):
    _, report, _, _ = analysed
    ttft = slo(report, 8007, "ttft")
    assert ttft.alert == "ticket", ttft.explanation
    assert 6 < ttft.burn("6h") < 14.4


def test_slo_is_quiet_at_light_load(analysed):
    _, report, _, _ = analysed
    assert {s.alert for s in report.slos if s.server_port == 8001} == {"ok"}


# -- what the controller reads ------------------------------------------------------


def test_window_figures_follow_the_load(analysed):
    store, _, _, _ = analysed
    start_s = START_NS / NS_PER_S
    idle = {f.upstream: f for f in window_figures(store, start_s + 60, start_s + 90)}
    overloaded = {f.upstream: f for f in window_figures(store, start_s + 450, start_s + 480)}
    quiet, busy = idle[f"{NODE}:8000"], overloaded[f"{NODE}:8000"]
    assert quiet.request_rate == pytest.approx(0.1 * CAPACITY_RPS, rel=0.5)
    # Windows hold the requests that ended in them: a saturated server ends them at its capacity,
    # past the breaker's 0.8 × capacity, however many more arrive.
    assert busy.request_rate == pytest.approx(CAPACITY_RPS, rel=0.2)
    assert busy.knee_capacity_rps == pytest.approx(CAPACITY_RPS, rel=0.2)
    assert busy.request_rate > 0.8 * busy.knee_capacity_rps
    # the p99 at healthy load: normal queueing in it, far from the overload's
    assert quiet.p99_ttft_s <= busy.baseline_p99_s < 0.5 < 5 < busy.p99_ttft_s
    assert quiet.p99_ttft_s < 0.1 and quiet.arrived_p99_ttft_s < 0.1 < 1 < busy.arrived_p99_ttft_s
    assert set(busy.tenant_tokens) == {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
    assert all(tokens > 0 for tokens in busy.tenant_tokens.values())
    renamed = window_figures(store, start_s + 450, start_s + 480, scope=Scope((Server(8000),)),
                             upstream_of=lambda node, port: f"vllm-{port}")
    assert [f.upstream for f in renamed] == ["vllm-8000"]


def test_control_loop_survives_an_unreachable_actuator_and_a_closed_store(analysed):
    """Over the overload's windows the loop decides; the actuator is down, so every decision is
    recorded as unreachable (gateways fail open) and the loop goes on; a store gone is a skipped window."""
    from tokenprobe.actuator.auth import ClientAuth
    from tokenprobe.actuator.breaker import BreakerPolicy
    from tokenprobe.actuator.controller import Controller, ControllerPolicy
    from tokenprobe.actuator.loop import ControlLoop
    from tokenprobe.actuator.publisher import DecisionPublisher

    from tests.support import free_port

    store, _, _, url = analysed
    policy = ControllerPolicy(window_s=30.0, breaker=BreakerPolicy(trip_windows=2))
    publisher = DecisionPublisher(f"127.0.0.1:{free_port()}", ClientAuth(bearer_token="t" * 20))
    loop = ControlLoop(store, publisher, Controller(policy), scope=Scope((Server(8000),)),
                       upstream_of=lambda node, port: f"loop-test-{port}")
    try:
        start_s = START_NS / NS_PER_S
        for end in range(420, 540, 30):
            loop.step(start_s + end)
    finally:
        publisher.close()
    assert loop.windows == 4 and loop.decisions
    assert {o.outcome for o in loop.decisions} == {"unreachable"}
    assert loop.errors["actuator"] == len(loop.decisions) and not loop.errors["figures"]
    recorded = store.query_rows("SELECT kind, outcome FROM tokenprobe.decisions WHERE upstream = 'loop-test-8000'")
    assert {kind for kind, _ in recorded} == {"breaker", "token_budget"}
    assert len(recorded) == len(loop.decisions) and {outcome for _, outcome in recorded} == {"unreachable"}

    gone = open_store(url, serve=False)  # through the owner, as the loop reads an agent's store
    gone.close()
    loop_on_nothing = ControlLoop(gone, DecisionPublisher("127.0.0.1:1", ClientAuth(bearer_token="t" * 20)),
                                  Controller(policy))
    assert loop_on_nothing.step(start_s + 600) == [] and loop_on_nothing.errors["figures"] == 1


def test_analysing_again_replaces_results_instead_of_adding_to_them(analysed):
    store, report, _, _ = analysed
    scope = Scope((Server(8001),))
    counts = "SELECT (SELECT count() FROM tokenprobe.request_split FINAL WHERE server_port = 8001), " \
             "(SELECT count() FROM tokenprobe.indicator_matrix FINAL WHERE server_port = 8001)"
    before = store.query_rows(counts)
    again = analyze(store, TimeRange(START_NS, END_NS), window_s=WINDOW_S, scope=scope, now_ns=END_NS + 2 * MINUTE)
    assert store.query_rows(counts) == before
    assert {c.server_port for c in again.cells} == {8001}
    # refitted from the same data: a new calibration, the same line
    old, new = report.calibrations[(NODE, 8001, "sim-model")], again.calibrations[(NODE, 8001, "sim-model")]
    assert new.calibration_id != old.calibration_id
    assert new.fits[BYTES].fit.slope == pytest.approx(old.fits[BYTES].fit.slope)


# -- the command -------------------------------------------------------------------


def test_figures_as_the_benchmark_tools_define_them(analysed):
    """Each tool figure is numpy's percentile of that tool's definition, applied row by row to the stored rows."""
    store, report, _, _ = analysed
    [entry] = [e for e in report.tool_figures if e["server_port"] == 8000]
    columns = ("req_seq", "accept_ts", "req_start", "req_end", "first_token", "last_token", "resp_end")
    rows = store.query_df(
        f"SELECT {', '.join(f'toUnixTimestamp64Nano({c}) AS {c}_ns' if c != 'req_seq' else c for c in columns)},"
        " completion_tokens, token_events, token_offsets_us FROM tokenprobe.requests"
        f" WHERE server_port = 8000 AND req_start >= fromUnixTimestamp64Nano({START_NS})"
        f" AND req_start < fromUnixTimestamp64Nano({END_NS}) AND first_token IS NOT NULL"
        f" AND NOT {measures.FAILED}").to_dict("records")
    rows = [{key.removesuffix("_ns"): list(value) if isinstance(value, (list, np.ndarray)) else None if pd.isna(value) else value
             for key, value in row.items()} for row in rows]
    assert entry["requests"] == len(rows) > 100

    def connection_ms(row):
        return (row["req_start"] - row["accept_ts"]) / 1e6 if row["req_seq"] == 0 and row["accept_ts"] else 0.0

    def tokens(row):
        return row["completion_tokens"] if row["completion_tokens"] is not None else row["token_events"]

    definitions = {
        "ttft_ms": [(row["first_token"] - row["req_start"]) / 1e6 + connection_ms(row) for row in rows],
        "tpot_ms": [(row["last_token"] - row["first_token"]) / 1e6 / (tokens(row) - 1) for row in rows
                    if tokens(row) > 1],
        "time_per_output_token_ms": [((row["last_token"] - row["req_start"]) / 1e6 + connection_ms(row)) / tokens(row)
                                     for row in rows],
        "itl_ms": [(later - earlier) / 1000 for row in rows
                   for earlier, later in zip(row["token_offsets_us"], row["token_offsets_us"][1:])],
        "e2e_ms": [(row["resp_end"] - row["req_start"]) / 1e6 + connection_ms(row) for row in rows],
    }
    for name, values in definitions.items():
        expected = [np.mean(values), *np.percentile(values, [50, 90, 99])]
        got = [entry[f"{name}_{summary}"] for summary in ("mean", "p50", "p90", "p99")]
        assert got == pytest.approx(expected, rel=1e-9), name
    # goodput: requests meeting every default objective (client TTFT <= 1 s, TPOT <= 100 ms, e2e <= 30 s) per s
    good = sum(ttft <= 1000 and e2e <= 30_000 and (tokens(row) < 2 or tpot <= 100) for row, ttft, e2e, tpot in zip(
        rows, definitions["ttft_ms"], definitions["e2e_ms"],
        [(r["last_token"] - r["first_token"]) / 1e6 / max(tokens(r) - 1, 1) for r in rows], strict=True))
    span_s = (max(row["resp_end"] for row in rows) - min(row["req_start"] for row in rows)) / 1e9
    assert entry["goodput_rps"] == pytest.approx(good / span_s, rel=1e-9)
    assert 0 < good < len(rows)  # the overload past the knee misses the TTFT objective


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tokenprobe")
    add_analyze_parser(parser.add_subparsers(dest="command", required=True), default_store="chdb:///nonexistent")
    args = parser.parse_args(["analyze", *argv])
    return args.func(args)


def range_args() -> list[str]:
    return ["--since", str(START_NS // NS_PER_S), "--until", str(END_NS // NS_PER_S)]


def test_cli_prints_phases_matrix_and_slos(analysed, capsys):
    _, _, _, url = analysed
    assert run_cli("--store", url, *range_args(), "--window", "60", "--server", "8000") == 0
    out = capsys.readouterr().out
    assert "PHASES" in out and "INDICATORS sim-node:8000" in out and "SLO at" in out
    assert "prefill = 20.0 ms + 0.1 ms/token" in out
    assert "knee 4.0 concurrent requests" in out
    assert "CRIT queue_wait_p95" in out and "CRIT knee_proximity" in out
    assert "sim-node:8001" not in out  # filtered
    assert "AS THE BENCHMARK TOOLS PRINT THEM" in out
    assert "vLLM bench tpot; GuideLLM inter_token_latency_ms; AIPerf inter_token_latency" in out


def test_cli_json_for_machines(analysed, capsys):
    _, _, _, url = analysed
    assert run_cli("--store", url, *range_args(), "--window", "120", "--server", "8002", "--json") == 0
    document = json.loads(capsys.readouterr().out)
    assert document["window_s"] == 120
    assert {row["server_port"] for row in document["phases"]} == {8002}
    cells = [cell for cell in document["matrix"] if cell["indicator"] == "gpu_memory_pressure"]
    assert [cell["state"] for cell in cells] == [OK, WARN, CRIT, CRIT]
    assert {s["objective"] for s in document["slo"]} == {"ttft", "tpot", "e2e", "goodput"}
    [as_tools] = document["benchmark_figures"]
    assert as_tools["server_port"] == 8002 and as_tools["figures"]["itl_ms"]["follows"].startswith("vLLM bench itl")
    assert as_tools["figures"]["e2e_ms"]["p50"] <= as_tools["figures"]["e2e_ms"]["p99"]
    assert as_tools["goodput"]["requests_per_s"] > 0


@pytest.mark.parametrize("argv, code, message", [
    (["--since", "yesterday"], 2, "cannot read the time"),
    (["--server", "http"], 2, "give a port"),
    (["--server", "9999"], 1, "no inference requests"),
    (["--window", "0"], 2, "--window"),
])
def test_cli_says_what_is_wrong(analysed, capsys, argv, code, message):
    _, _, _, url = analysed
    assert run_cli("--store", url, *argv) == code
    assert message in capsys.readouterr().err


def test_cli_says_a_path_holds_no_store_and_creates_none(tmp_path, capsys):
    typo = tmp_path / "typo"
    assert run_cli("--store", f"chdb://{typo}") == 1
    assert f"no store at {typo}: no such directory" in capsys.readouterr().err
    assert not typo.exists()
