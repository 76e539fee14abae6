"""Every request joined to its GPU's state at arrival and at first token, and to its engine's state.

``request_gpu_state_sql()`` returns the query; the store creates it as the view
``tokenprobe.request_gpu_state`` (``store.schema``). One output row per
request and GPU device it ran on (a tensor-parallel server has several), or
one row with an empty ``device_id`` when no GPU is known for it.

How a request finds its GPU devices (``gpu_mapping`` says which way was used):

1. ``nvml``: ``server_gpus`` rows whose pid is the request's ``pid`` - the
   process, or an ancestor of the process, that NVML saw holding memory on
   the device. Over the whole table: a pid that is reused by another server
   inherits the mapping (rare, and it ages out with the TTL).
2. ``config``: otherwise, the rows configured for the request's ``server_port``.

How a request finds a sample: ASOF JOIN on the same node and device (engine:
the same node and ``server_port``), taking the latest sample whose ``ts`` is
at or before the request's ``req_start`` (``arrival_*`` columns) or its
``first_token`` (``first_token_*`` columns); never a later one. Where there is
none, the columns are NULL. ``*_sample_age_ms`` says how old the sample was:
a large age means the sampler had stopped and the state is stale. When both
NVML and dcgm-exporter sample a device, the latest sample of either is taken
and ``*_gpu_source`` says which.

``simulated`` is true when any joined sample came from the reference server's
simulated feed; such rows describe no real GPU.
"""

from __future__ import annotations

from .samples import ENGINE_SAMPLES_TABLE, GPU_SAMPLES_TABLE, SERVER_GPUS_TABLE
from .tables import DEFAULT_DATABASE

VIEW_NAME = "request_gpu_state"

_REQUEST_COLUMNS = ("node", "conn_id", "req_seq", "pid", "server_port", "req_start", "first_token")
_GPU_STATE_COLUMNS = (
    "source", "simulated", "mem_total_bytes", "mem_used_bytes", "mem_free_bytes", "mem_reserved_bytes",
    "gpu_util_pct", "mem_util_pct", "sm_clock_mhz", "power_w", "temp_c", "sm_active", "tensor_active",
    "dram_active",
)  # fmt: skip
_ENGINE_STATE_COLUMNS = (
    "engine", "model", "simulated", "requests_running", "requests_waiting", "kv_cache_usage",
    "preemptions_total", "ttft_mean_s", "queue_mean_s", "prefill_mean_s", "decode_mean_s", "e2e_mean_s",
    "itl_mean_s",
)  # fmt: skip
# ASOF JOIN cannot take a NULL time; a request with no first token gets this
# instant instead, before any sample, so it matches none.
_NO_TIME = "toDateTime64(0, 9, 'UTC')"


def _gpu_state(alias: str, prefix: str, at: str) -> list[str]:
    columns = [
        f"{alias}.ts AS {prefix}_sample_ts",
        f"dateDiff('millisecond', {alias}.ts, {at}) AS {prefix}_sample_age_ms",
    ]
    for column in _GPU_STATE_COLUMNS:
        name = f"gpu_{column}" if column in ("source", "simulated") else column
        columns.append(f"{alias}.{column} AS {prefix}_{name}")
    return columns


def request_gpu_state_sql(db: str = DEFAULT_DATABASE) -> str:
    """The join as one SELECT over ``{db}.requests``, ``gpu_samples``, ``engine_samples`` and ``server_gpus``."""
    if not db.isidentifier():
        raise ValueError(f"database name {db!r} is not a plain identifier")
    selected = [f"d.{column} AS {column}" for column in _REQUEST_COLUMNS]
    selected += ["d.device_id AS device_id", "d.gpu_mapping AS gpu_mapping"]
    selected += _gpu_state("a", "arrival", "d.req_start")
    selected += _gpu_state("f", "first_token", "d.first_token")
    selected += ["e.ts AS engine_sample_ts", "dateDiff('millisecond', e.ts, d.req_start) AS engine_sample_age_ms"]
    selected += [f"e.{column} AS engine_{column}" for column in _ENGINE_STATE_COLUMNS]
    selected.append(
        "coalesce(a.simulated, false) OR coalesce(f.simulated, false) OR coalesce(e.simulated, false) AS simulated"
    )
    select_list = ",\n    ".join(selected)
    request_columns = ", ".join(f"r.{column} AS {column}" for column in _REQUEST_COLUMNS)
    return f"""WITH
pid_devices AS (
    SELECT node, pid, groupUniqArray(device_id) AS devices
    FROM {db}.{SERVER_GPUS_TABLE} WHERE source = 'nvml' GROUP BY node, pid
),
port_devices AS (
    SELECT node, server_port, groupUniqArray(device_id) AS devices
    FROM {db}.{SERVER_GPUS_TABLE} WHERE source = 'config' GROUP BY node, server_port
),
request_devices AS (
    SELECT {request_columns},
        if(notEmpty(p.devices), p.devices, c.devices) AS devices,
        multiIf(notEmpty(p.devices), 'nvml', notEmpty(c.devices), 'config', '') AS gpu_mapping
    FROM {db}.requests AS r
    LEFT JOIN pid_devices AS p ON r.node = p.node AND r.pid = p.pid
    LEFT JOIN port_devices AS c ON r.node = c.node AND r.server_port = c.server_port
    SETTINGS join_use_nulls = 0
),
per_device AS (
    SELECT {", ".join(_REQUEST_COLUMNS)}, gpu_mapping, device_id,
        ifNull(first_token, {_NO_TIME}) AS first_token_or_never
    FROM request_devices
    LEFT ARRAY JOIN devices AS device_id
)
SELECT
    {select_list}
FROM per_device AS d
ASOF LEFT JOIN {db}.{GPU_SAMPLES_TABLE} AS a
    ON d.node = a.node AND d.device_id = a.device_id AND d.req_start >= a.ts
ASOF LEFT JOIN {db}.{GPU_SAMPLES_TABLE} AS f
    ON d.node = f.node AND d.device_id = f.device_id AND d.first_token_or_never >= f.ts
ASOF LEFT JOIN {db}.{ENGINE_SAMPLES_TABLE} AS e
    ON d.node = e.node AND d.server_port = e.server_port AND d.req_start >= e.ts
SETTINGS join_use_nulls = 1"""
