"""The control loop on the indicator matrix, through a real store and a real actuator.

Live analysis (``analytics/live.py``) analyses simulated traffic and the
engine's samples, and judges the requests the agent offers as in flight; it
stores the matrix and the samples. The control loop reads them into its
window figures, the controller decides, the decisions reach a real actuator
over gRPC and are recorded in ``tokenprobe.decisions`` with their evidence.
"""

from __future__ import annotations

import time

import pytest
from tokenprobe.actuator.auth import ClientAuth, ServerAuth
from tokenprobe.actuator.controller import TTFT_SIGNALS, Controller, ControllerPolicy
from tokenprobe.actuator.engine import Enforcer
from tokenprobe.actuator.loop import ControlLoop
from tokenprobe.actuator.publisher import DecisionPublisher
from tokenprobe.actuator.server import ActuatorServer
from tokenprobe.agent.sampling.engine_metrics import EngineReading
from tokenprobe.agent.sampling.samplers import engine_samples_arrow
from tokenprobe.analytics.figures import default_upstream, window_figures
from tokenprobe.analytics.inflight import store_samples
from tokenprobe.analytics.live import LiveAnalysis
from tokenprobe.analytics.timerange import NS_PER_S
from tokenprobe.contract.decisions import QueueSample
from tokenprobe.contract.inflight import STREAMING, WAITING
from tokenprobe.store.embedded import open_store

from tests.actuator_support import TOKEN
from tests.support.slot_simulation import LoadPhase, SlotServer, simulate

NODE = "ctl-node"
KV_PORT, JAM_PORT, STREAM_PORT = 8300, 8301, 8302
WINDOW_S = 5
WINDOW_NS = WINDOW_S * NS_PER_S
# Three clients of four are the heavy tenant's: the one a demand cut budgets.
TENANT_OF = {"10.0.0.1": "heavy", "10.0.0.2": "heavy", "10.0.0.3": "heavy", "10.0.0.4": "light"}


@pytest.fixture
def store(tmp_path):
    opened = open_store(f"chdb://{tmp_path / 'store'}", serve=False)
    opened.ensure_schema()
    yield opened
    opened.close()


@pytest.fixture
def end_ns() -> int:
    """The window boundary just behind the clock: decisions on it are still live when the actuator sees them."""
    return time.time_ns() // WINDOW_NS * WINDOW_NS


@pytest.fixture
def actuator():
    with ActuatorServer(ServerAuth(bearer_tokens=frozenset({TOKEN})), enforcer=Enforcer(min_dwell_s=0.0)) as server:
        yield server


def control_loop(store, actuator, **policy) -> ControlLoop:
    publisher = DecisionPublisher(f"127.0.0.1:{actuator.port}", ClientAuth(bearer_token=TOKEN))
    return ControlLoop(store, publisher, Controller(ControllerPolicy(window_s=WINDOW_S, **policy)), settle_s=0)


def healthy_traffic_with_a_full_kv_cache(store, end_ns: int) -> None:
    """Two minutes at a gentle 2 requests/s whose engine reports its KV cache 97% used for the last one."""
    start_ns = end_ns - 120 * NS_PER_S
    requests = simulate(SlotServer(), [LoadPhase(120, 2.0)], start_ns=start_ns, node=NODE, port=KV_PORT,
                        clients=tuple(TENANT_OF), seed=11)
    rows = [{**r.row, "tenant": TENANT_OF[r.row["client_addr"]]} for r in requests if r.row["resp_end"] < end_ns]
    store.insert_rows("requests", rows)
    readings = [EngineReading(start_ns + second * NS_PER_S, f"http://127.0.0.1:{KV_PORT}/metrics", KV_PORT, "vllm",
                              "sim-model", requests_running=2.0, requests_waiting=0.0,
                              kv_cache_usage=0.97 if second >= 60 else 0.4)
                for second in range(120)]
    store.insert_arrow("engine_samples", engine_samples_arrow(readings, NODE))


def waiting(count: int, sampled_ns: int, silent_s: float) -> list[dict]:
    """`count` requests on JAM_PORT waiting for a first token, silent for `silent_s`, as the agent samples them."""
    return [{"sampled_at": sampled_ns, "node": NODE, "server_port": JAM_PORT, "role": "server", "tenant": "acme",
             "model": "m", "conn_id": 500 + index, "req_seq": 0, "req_start": sampled_ns - int(silent_s * NS_PER_S),
             "first_token": None, "stage": WAITING, "token_events": 0, "bytes_in": 300, "age_ms": silent_s * 1000,
             "since_progress_ms": silent_s * 1000} for index in range(count)]


def test_the_loop_acts_on_what_live_analysis_stored_and_records_its_evidence(store, actuator, end_ns):
    healthy_traffic_with_a_full_kv_cache(store, end_ns)
    now = [end_ns - 2 * WINDOW_NS - NS_PER_S]
    live = LiveAnalysis(store, NODE, every_s=WINDOW_S, settle_s=0, samples_inflight=True, clock_ns=lambda: now[0])
    live.watermark_ns = end_ns - 130 * NS_PER_S
    # The jammed server: requests wait and nothing ends; the queue grows from one pass to the next.
    live.offer_inflight(waiting(3, now[0], 35.0), now[0])
    assert live.run_once() is not None
    now[0] = end_ns - NS_PER_S  # a pass within the window the loop decides next
    live.offer_inflight(waiting(12, now[0], 40.0), now[0])
    assert live.run_once() is not None

    ttft_only = control_loop(store, actuator, signals=TTFT_SIGNALS)
    assert ttft_only.step(end_ns / NS_PER_S) == [], "rate and TTFT are healthy, and the jam ends nothing"
    loop = control_loop(store, actuator)
    outcomes = loop.step(end_ns / NS_PER_S)
    assert not loop.errors and {o.outcome for o in outcomes} == {"applied"}, outcomes

    recorded = {(kind, tenant): (state, dict(zip(names, zip(values, thresholds, strict=True))), reason)
                for kind, tenant, upstream, state, names, values, thresholds, reason in store.query_rows(
                    "SELECT kind, tenant, upstream, breaker_state, evidence_name, evidence_value, "
                    "evidence_threshold, reason FROM tokenprobe.decisions")}
    kv_upstream, jam_upstream = default_upstream(NODE, KV_PORT), default_upstream(NODE, JAM_PORT)
    assert set(recorded) == {("token_budget", "heavy"), ("token_budget", "acme"), ("breaker", "")}
    # The KV cache filled while TTFT was fine: the heavy tenant is budgeted, on that evidence.
    _, evidence, reason = recorded[("token_budget", "heavy")]
    assert evidence["kv_cache_usage"] == (pytest.approx(0.97), 0.95) and "kv_cache_usage" in reason
    budget = next(s for s in actuator.enforcer.status() if s.decision.target.tenant == "heavy")
    assert budget.decision.target.upstream == kv_upstream
    # The jammed server: its stall opened the breaker; the queue's growth is in the evidence too.
    state, evidence, reason = recorded[("breaker", "")]
    assert state == "OPEN" and "inflight_stall crit" in reason
    assert evidence["inflight_stall"] == (40.0, 30.0)
    assert evidence["inflight_queue_growth"][0] == 9
    breaker = next(s for s in actuator.enforcer.status() if s.decision.kind == "breaker")
    assert breaker.decision.target.upstream == jam_upstream
    # Its queued requests were charged their prompts as they waited: the growing queue cuts their tenant too.
    _, evidence, reason = recorded[("token_budget", "acme")]
    assert "inflight_queue_growth" in reason and evidence["tenant_tokens_per_s"][0] > 0


def stream_sample(end_ns: int, sampled_ns: int, events: int, bytes_in: int) -> dict:
    start_ns = end_ns - 40 * NS_PER_S
    return {"sampled_at": sampled_ns, "node": NODE, "server_port": STREAM_PORT, "role": "server", "tenant": "long",
            "model": "m", "conn_id": 77, "req_seq": 2, "req_start": start_ns, "first_token": start_ns + NS_PER_S,
            "stage": STREAMING, "token_events": events, "bytes_in": bytes_in, "age_ms": (sampled_ns - start_ns) / 1e6,
            "since_progress_ms": 20.0}


def test_a_long_stream_is_charged_to_its_tenant_from_its_first_sample(store, end_ns):
    """Sampled with 300 events streamed, then 700, then ended with 1000 completion and 200 prompt tokens:
    each window is charged what left in it, its prompt (from the request's size) in the first, and the
    three add up to the request's count."""
    simulated = simulate(SlotServer(), [LoadPhase(10, 2.0)], start_ns=end_ns - 41 * NS_PER_S, seed=1,
                         node=NODE, port=STREAM_PORT)[0]
    first_sample, second_sample = end_ns - 3 * WINDOW_NS + NS_PER_S, end_ns - 2 * WINDOW_NS + NS_PER_S
    # The server's bytes per prompt token, learnt from this row's usage, make its request's 200 prompt tokens.
    ended = {**simulated.row, "conn_id": 77, "req_seq": 2, "tenant": "long", "req_start": end_ns - 40 * NS_PER_S,
             "resp_end": end_ns - 2 * NS_PER_S, "last_token": end_ns - 2 * NS_PER_S - NS_PER_S // 2,
             "prompt_tokens": 200, "completion_tokens": 1000, "bytes_in": 1000}
    store.insert_rows("requests", [ended])
    store_samples(store, [stream_sample(end_ns, first_sample, 300, 1000),
                          stream_sample(end_ns, second_sample, 700, 1000)])

    def window(index: int):
        until = end_ns - index * WINDOW_NS
        (figures,) = window_figures(store, (until - WINDOW_NS) / NS_PER_S, until / NS_PER_S)
        return figures

    streaming, still_streaming, finished = window(2), window(1), window(0)
    assert streaming.request_rate == 0 and streaming.tenant_tokens == {"long": 200 + 300}
    assert streaming.queue is None  # one sample: nothing to compare it with
    assert still_streaming.tenant_tokens == {"long": 400}
    assert still_streaming.queue == QueueSample(before=0, after=0, span_s=WINDOW_S)
    assert finished.tenant_tokens == {"long": 1200 - 200 - 700} and finished.tokens_per_request == 1200


def test_a_queued_request_is_charged_its_prompt_and_corrected_when_it_ends(store, end_ns):
    """Sampled while it waits for a slot, a request is charged its request's size at the default 4 bytes
    a token (no request with usage yet); it ends with fewer prompt tokens, and the overcharge comes back."""
    sampled_ns = end_ns - WINDOW_NS - NS_PER_S
    queued = {**waiting(1, sampled_ns, silent_s=2.0)[0], "server_port": STREAM_PORT, "bytes_in": 4000}
    store_samples(store, [queued])
    simulated = simulate(SlotServer(), [LoadPhase(10, 2.0)], start_ns=end_ns - 12 * NS_PER_S, seed=1,
                         node=NODE, port=STREAM_PORT)[0]
    ended = {**simulated.row, "conn_id": queued["conn_id"], "req_seq": 0, "tenant": "acme", "prompt_tokens": None,
             "bytes_in": 2000, "completion_tokens": 50, "req_start": queued["req_start"],
             "resp_end": end_ns - 2 * NS_PER_S, "last_token": end_ns - 2 * NS_PER_S - NS_PER_S // 2}
    store.insert_rows("requests", [ended])
    (seen,) = window_figures(store, (end_ns - 2 * WINDOW_NS) / NS_PER_S, (end_ns - WINDOW_NS) / NS_PER_S)
    (ending,) = window_figures(store, (end_ns - WINDOW_NS) / NS_PER_S, end_ns / NS_PER_S)
    assert seen.tenant_tokens == {"acme": 1000}, "charged its prompt while it waited, before any token"
    # It ended with 500 prompt and 50 completion tokens: 450 come back, nothing is charged.
    assert ending.tenant_tokens == {} and ending.tokens_per_request == 550
