"""Synthetic fleet traffic generated inside ClickHouse, to try the dashboard and to benchmark it.

``fill_requests`` writes ``count`` request rows spread evenly over a span with
one ``INSERT ... SELECT FROM numbers(count)``: ClickHouse computes every column
itself, so ten million rows take well under a minute, not the hours Python rows would.
The traffic tells a small story the panels should show: three servers, two
models, two routes; TTFT grows with a queue during an overload episode in the
middle of the span (60–70 %), and decode slows a little with it.
``fill_gpus`` writes matching GPU samples (memory climbs and utilization
saturates during the episode) and which GPU each server uses;
``fill_decisions`` the actuator decisions a controller would have taken in the
episode. Randomness comes from hashing the row number with a seed, so the same
arguments always produce the same rows.

Synthetic rows are marked: ``comm`` is ``synthetic`` on requests, ``simulated``
is true on GPU rows and ``issuer`` is ``synthetic`` on decisions.
"""

from __future__ import annotations

from collections import Counter

from ..actuator.publisher import PushOutcome, decision_row
from ..contract.decisions import (
    DECISIONS_TABLE,
    BreakerAction,
    BreakerState,
    Decision,
    Evidence,
    Target,
    TokenBudgetAction,
)
from ..contract.requests import REQUEST_COLUMNS, REQUESTS_TABLE
from ..contract.samples import GPU_SAMPLES_TABLE, SERVER_GPUS_TABLE
from ..store.client import Store

SERVERS = (("node-a", 8000), ("node-a", 8001), ("node-b", 8000))
MODELS = ("llama-3.1-8b", "qwen2.5-7b")
ROUTES = ("/v1/chat/completions", "/v1/completions")
GPUS_PER_NODE = 2
GPU_MEMORY_BYTES = 80 * 2**30
# The overload episode, as fractions of the span.
EPISODE = (0.60, 0.70)


def _uniform(salt: int, seed: int) -> str:
    """SQL for a pseudo-random number in [0, 1) fixed by the row number, the seed and a salt."""
    return f"(cityHash64(number, {seed}, {salt}) % 1000003) / 1000003.0"


def _normal(salt: int, seed: int) -> str:
    """SQL for an approximately standard-normal number (the sum of four uniforms, rescaled)."""
    terms = " + ".join(_uniform(salt * 10 + k, seed) for k in range(4))
    return f"(({terms}) - 2.0) * sqrt(3.0)"


def _pick(values: tuple, salt: int, seed: int) -> str:
    literals = ", ".join(f"'{value}'" for value in values)
    return f"[{literals}][1 + cityHash64(number, {seed}, {salt}) % {len(values)}]"


def fill_requests(store: Store, *, count: int, start_ns: int, span_s: float, seed: int = 1,
                  token_offsets: bool = True) -> None:
    """Insert ``count`` synthetic requests starting evenly over [start_ns, start_ns + span_s).

    ``token_offsets=False`` leaves ``token_offsets_us`` empty: only the ITL
    heatmap and the stall and decode-rate figures read it, and for ten million
    rows its billions of elements would dominate the time to generate them.
    """
    if count < 1 or span_s <= 0:
        raise ValueError("count must be >= 1 and span_s > 0")
    server_index = f"(1 + cityHash64(number, {seed}, 1) % {len(SERVERS)})"
    nodes = ", ".join(f"'{node}'" for node, _ in SERVERS)
    ports = ", ".join(str(port) for _, port in SERVERS)
    step_ns = span_s * 1e9 / count
    offsets = "arrayMap(i -> toUInt32(i * tpot_us), range(token_events))" if token_offsets else "[]"
    # Times in µs relative to req_start; each stage's alias feeds the next.
    select = f"""
SELECT
    [{nodes}][{server_index}] AS node,
    number AS conn_id,
    toUInt32(0) AS req_seq,
    'server' AS role,
    toUInt32(1000 + {server_index}) AS pid,
    'synthetic' AS comm,
    toUInt16([{ports}][{server_index}]) AS server_port,
    '127.0.0.1' AS client_addr,
    toUInt16(30000 + number % 30000) AS client_port,
    '' AS tenant,
    false AS tls,
    req_start - toIntervalMicrosecond(200) AS accept_ts,
    NULL AS tls_done_ts,
    fromUnixTimestamp64Nano(toInt64({start_ns} + number * {step_ns}), 'UTC') AS req_start,
    req_start + toIntervalMicrosecond(toUInt64(network_in_us)) AS req_end,
    req_end + toIntervalMicrosecond(toUInt64(queue_us)) AS resp_start,
    resp_start + toIntervalMicrosecond(toUInt64(prefill_us)) AS first_token,
    first_token + toIntervalMicrosecond(toUInt64(tpot_us * (token_events - 1))) AS last_token,
    last_token + toIntervalMicrosecond(300) AS resp_end,
    'POST' AS method,
    {_pick(ROUTES, 2, seed)} AS path,
    toUInt16(200) AS status,
    {_pick(MODELS, 3, seed)} AS model,
    concat('chatcmpl-', hex(cityHash64(number, {seed}, 4))) AS response_id,
    true AS streamed,
    toUInt32(16 + 240 * {_uniform(5, seed)}) AS token_events,
    token_events + 2 AS sse_events,
    {offsets} AS token_offsets_us,
    toUInt32(prompt_tokens_value) AS prompt_tokens,
    token_events AS completion_tokens,
    toUInt32(in_episode * (4 + 12 * {_uniform(6, seed)}) + 2 * {_uniform(7, seed)}) AS inflight_at_arrival,
    toUInt64(400 + prompt_tokens_value * 4) AS bytes_in,
    toUInt64(200 + token_events * 140) AS bytes_out,
    cityHash64(number, {seed}, 8) AS body_fp,
    'complete' AS outcome,
    '' AS error,
    'openai.chat' AS api,
    first_token AS first_content_token,
    toUInt16(1) AS choices,
    token_events AS choice_events,
    NULL AS engine_prompt_ms,
    NULL AS engine_decode_ms,
    'exact' AS capture,
    toUInt64(0) AS bytes_unseen,
    'http/1.1' AS protocol,
    toUInt32(0) AS stream_id,
    NULL AS grpc_status,
    '' AS unreadable_reason,
    toUInt32(0) AS request_messages,
    toUInt64(0) AS request_message_bytes,
    toUInt64(0) AS response_message_bytes,
    toUInt32(0) AS largest_response_message_bytes,
    '' AS error_type, NULL AS engine_queue_ms,
    '' AS namespace, '' AS pod, '' AS container, '' AS pod_uid, '' AS container_id
FROM (
    SELECT
        number,
        (number / {count}) BETWEEN {EPISODE[0]} AND {EPISODE[1]} AS in_episode,
        50 + 3950 * pow({_uniform(9, seed)}, 2) AS prompt_tokens_value,
        (200 + 1800 * {_uniform(10, seed)}) AS network_in_us,
        -- A queue only under overload: exponential, around 1.5 s.
        in_episode * (-1500000 * log(1 - {_uniform(11, seed)} * 0.999)) AS queue_us,
        (15000 + prompt_tokens_value * 40) * exp(0.15 * {_normal(12, seed)}) AS prefill_us,
        18000 * (1 + 0.6 * in_episode) * exp(0.2 * {_normal(13, seed)}) AS tpot_us
    FROM numbers({count})
)"""
    store.insert_select(REQUESTS_TABLE, select, columns=REQUEST_COLUMNS)


def _device_id(node: str, gpu_index: int) -> str:
    return f"GPU-synthetic-{node}-{gpu_index}"


def fill_gpus(store: Store, *, start_ns: int, span_s: float, every_s: float = 1.0) -> None:
    """Insert one sample per GPU of each synthetic node every ``every_s`` seconds over the span, and
    map each server to a GPU of its node (``server_gpus``, as configured mappings are written)."""
    if span_s <= 0 or every_s <= 0:
        raise ValueError("span_s and every_s must be > 0")
    nodes = sorted({node for node, _ in SERVERS})
    devices = [(node, index) for node in nodes for index in range(GPUS_PER_NODE)]
    ticks = int(span_s / every_s)
    device_nodes = ", ".join(f"'{node}'" for node, _ in devices)
    device_indexes = ", ".join(str(index) for _, index in devices)
    device_ids = ", ".join(f"'{_device_id(node, index)}'" for node, index in devices)
    sql = f"""
INSERT INTO {store.table(GPU_SAMPLES_TABLE)}
    (ts, node, source, simulated, device_id, gpu_uuid, gpu_index, gpu_name,
     mem_total_bytes, mem_used_bytes, mem_free_bytes, gpu_util_pct)
SELECT
    fromUnixTimestamp64Nano(toInt64({start_ns} + tick * {every_s * 1e9}), 'UTC') AS ts,
    [{device_nodes}][device + 1] AS node,
    'nvml' AS source,
    true AS simulated,
    [{device_ids}][device + 1] AS device_id,
    device_id AS gpu_uuid,
    toUInt16([{device_indexes}][device + 1]) AS gpu_index,
    'Synthetic H100 80GB' AS gpu_name,
    toUInt64({GPU_MEMORY_BYTES}) AS mem_total_bytes,
    toUInt64(mem_total_bytes * least(0.97, 0.62 + 0.3 * in_episode + 0.04 * sin(tick / 97.0))) AS mem_used_bytes,
    mem_total_bytes - mem_used_bytes AS mem_free_bytes,
    toFloat32(least(100, 55 + 44 * in_episode + 10 * sin(tick / 53.0 + device))) AS gpu_util_pct
FROM (
    SELECT
        intDiv(number, {len(devices)}) AS tick,
        number % {len(devices)} AS device,
        (tick / {ticks}) BETWEEN {EPISODE[0]} AND {EPISODE[1]} AS in_episode
    FROM numbers({ticks * len(devices)})
)"""
    store.command(sql)
    servers_placed = Counter()  # each server of a node gets the node's next GPU
    mappings = []
    for node, port in SERVERS:
        gpu_index = servers_placed[node]
        servers_placed[node] += 1
        mappings.append({"ts": start_ns, "node": node, "pid": 0, "server_port": port,
                         "device_id": _device_id(node, gpu_index), "gpu_uuid": _device_id(node, gpu_index),
                         "source": "config", "simulated": True})
    store.insert_rows(SERVER_GPUS_TABLE, mappings)


def fill_decisions(store: Store, *, start_ns: int, span_s: float) -> None:
    """Insert the decisions a controller would take in the overload episode: the first server's
    breaker opens, half-opens and closes again; a heavy tenant gets a token budget meanwhile."""
    episode_start_s = start_ns / 1e9 + EPISODE[0] * span_s
    episode_s = (EPISODE[1] - EPISODE[0]) * span_s
    node, port = SERVERS[0]
    upstream = Target(upstream=f"{node}:{port}")
    overload = (Evidence("ttft_p99_ms", 4200.0, 1500.0, "ms"), Evidence("rate_over_capacity", 1.3, 0.8))
    steps = [
        (0.0, 0.5, upstream, BreakerAction(BreakerState.OPEN, cooldown_s=episode_s / 2, probe_share=0.1),
         "overloaded: p99 TTFT 2.8x baseline at 1.3x capacity for 3 windows"),
        (0.5, 0.8, upstream, BreakerAction(BreakerState.HALF_OPEN, admitted_share=0.5),
         "recovering: admitting half the traffic"),
        (0.8, 1.2, upstream, BreakerAction(BreakerState.CLOSED), "recovered: breaker closed"),
        (0.1, 0.9, Target(tenant="batch-jobs"), TokenBudgetAction(tokens_per_second=2000.0, burst_tokens=4000.0),
         "over capacity: heavy tenant held to its fair share"),
    ]
    rows = []
    for begins, ends, target, action, reason in steps:
        issued_s = episode_start_s + begins * episode_s
        decision = Decision(target=target, action=action, issued_at=issued_s,
                            expires_at=episode_start_s + ends * episode_s, reason=reason,
                            evidence=overload, issuer="synthetic")
        rows.append(decision_row(PushOutcome(decision, "applied"), recorded_at=issued_s))
    store.insert_rows(DECISIONS_TABLE, rows)
