"""GPU and engine samples, as the agent's samplers store them.

- ``gpu_samples``: one row per device per tick, from NVML or dcgm-exporter.
- ``engine_samples``: one row per scrape of an inference server's /metrics.
- ``server_gpus``: which GPU devices a server process (NVML) or port
  (configuration) uses; written when the mapping changes and re-written every
  minute, so it survives TTL and a reader of any recent window sees it.
"""

from __future__ import annotations

from .tables import (
    GAUGE_CODEC,
    INTEGER_CODEC,
    OPAQUE_CODEC,
    SORTED_TIMESTAMP_CODEC,
    TIMESTAMP_TYPE,
    Column,
    Table,
)

GPU_SAMPLES_TABLE = "gpu_samples"
ENGINE_SAMPLES_TABLE = "engine_samples"
SERVER_GPUS_TABLE = "server_gpus"

# Codecs (contract/tables.py): sample timestamps are the sort key's last column
# and near-regular, which DoubleDelta reduces to almost nothing.

GPU_SAMPLES_COLUMNS: tuple[Column, ...] = (
    Column("ts", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
    Column("node", "LowCardinality(String)", OPAQUE_CODEC),
    Column("source", "LowCardinality(String)", OPAQUE_CODEC),  # nvml | dcgm
    Column("simulated", "Bool", OPAQUE_CODEC),
    Column("device_id", "LowCardinality(String)", OPAQUE_CODEC),  # GPU UUID, or '<GPU UUID>/gi<N>' for MIG
    Column("gpu_uuid", "LowCardinality(String)", OPAQUE_CODEC),
    Column("gpu_index", "Nullable(UInt16)", INTEGER_CODEC),
    Column("gpu_name", "LowCardinality(String)", OPAQUE_CODEC),
    Column("mig_profile", "LowCardinality(String)", OPAQUE_CODEC),
    Column("mig_gi_id", "Nullable(UInt32)", INTEGER_CODEC),
    Column("mig_ci_id", "Nullable(UInt32)", INTEGER_CODEC),
    Column("mig_uuid", "LowCardinality(String)", OPAQUE_CODEC),
    Column("mem_total_bytes", "Nullable(UInt64)", INTEGER_CODEC),
    Column("mem_used_bytes", "Nullable(UInt64)", INTEGER_CODEC),
    Column("mem_free_bytes", "Nullable(UInt64)", INTEGER_CODEC),
    Column("mem_reserved_bytes", "Nullable(UInt64)", INTEGER_CODEC),
    Column("gpu_util_pct", "Nullable(Float32)", GAUGE_CODEC),
    Column("mem_util_pct", "Nullable(Float32)", GAUGE_CODEC),
    Column("sm_clock_mhz", "Nullable(UInt32)", INTEGER_CODEC),
    Column("power_w", "Nullable(Float32)", GAUGE_CODEC),
    Column("temp_c", "Nullable(Float32)", GAUGE_CODEC),
    Column("sm_active", "Nullable(Float32)", GAUGE_CODEC),
    Column("sm_occupancy", "Nullable(Float32)", GAUGE_CODEC),
    Column("tensor_active", "Nullable(Float32)", GAUGE_CODEC),
    Column("dram_active", "Nullable(Float32)", GAUGE_CODEC),
    Column("process_pids", "Array(UInt32)", OPAQUE_CODEC),
    Column("process_mem_bytes", "Array(Nullable(UInt64))", OPAQUE_CODEC),  # same order as process_pids
    Column("pod", "LowCardinality(String)", OPAQUE_CODEC),
    Column("namespace", "LowCardinality(String)", OPAQUE_CODEC),
    Column("container", "LowCardinality(String)", OPAQUE_CODEC),
    Column("extra", "Map(LowCardinality(String), Float64)", OPAQUE_CODEC),
)

ENGINE_SAMPLES_COLUMNS: tuple[Column, ...] = (
    Column("ts", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
    Column("node", "LowCardinality(String)", OPAQUE_CODEC),
    Column("server_url", "LowCardinality(String)", OPAQUE_CODEC),
    Column("server_port", "UInt16", INTEGER_CODEC),
    Column("engine", "LowCardinality(String)", OPAQUE_CODEC),  # vllm | sglang | tgi | llamacpp | unknown
    Column("model", "LowCardinality(String)", OPAQUE_CODEC),
    Column("simulated", "Bool", OPAQUE_CODEC),
    Column("requests_running", "Nullable(Float32)", GAUGE_CODEC),
    Column("requests_waiting", "Nullable(Float32)", GAUGE_CODEC),
    Column("kv_cache_usage", "Nullable(Float32)", GAUGE_CODEC),
    Column("preemptions_total", "Nullable(Float64)", GAUGE_CODEC),
    Column("prompt_tokens_total", "Nullable(Float64)", GAUGE_CODEC),
    Column("generation_tokens_total", "Nullable(Float64)", GAUGE_CODEC),
    Column("ttft_mean_s", "Nullable(Float64)", GAUGE_CODEC),
    Column("queue_mean_s", "Nullable(Float64)", GAUGE_CODEC),
    Column("prefill_mean_s", "Nullable(Float64)", GAUGE_CODEC),
    Column("decode_mean_s", "Nullable(Float64)", GAUGE_CODEC),
    Column("e2e_mean_s", "Nullable(Float64)", GAUGE_CODEC),
    Column("itl_mean_s", "Nullable(Float64)", GAUGE_CODEC),
    Column("raw", "Map(LowCardinality(String), Float64)", OPAQUE_CODEC),
)

SERVER_GPUS_COLUMNS: tuple[Column, ...] = (
    Column("ts", TIMESTAMP_TYPE, SORTED_TIMESTAMP_CODEC),
    Column("node", "LowCardinality(String)", OPAQUE_CODEC),
    Column("pid", "UInt32", INTEGER_CODEC),  # 0 for a configured port
    Column("server_port", "UInt16", INTEGER_CODEC),  # 0 for an NVML-seen process
    Column("device_id", "LowCardinality(String)", OPAQUE_CODEC),
    Column("gpu_uuid", "LowCardinality(String)", OPAQUE_CODEC),
    Column("source", "LowCardinality(String)", OPAQUE_CODEC),  # nvml | config
    Column("simulated", "Bool", OPAQUE_CODEC),
    # The process's pod and container (agent/identity/): a GPU's memory named by pod. Empty for a configured
    # port and outside containers.
    Column("namespace", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("pod", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
    Column("container", "LowCardinality(String)", OPAQUE_CODEC, default="''"),
)


def _sample_table(name: str, columns: tuple[Column, ...], order_by: str) -> Table:
    return Table(name, columns, order_by=order_by, partition_by="ts", ttl_column="ts")


GPU_SAMPLES = _sample_table(GPU_SAMPLES_TABLE, GPU_SAMPLES_COLUMNS, "node, device_id, ts")
ENGINE_SAMPLES = _sample_table(ENGINE_SAMPLES_TABLE, ENGINE_SAMPLES_COLUMNS, "node, server_port, ts")
SERVER_GPUS = _sample_table(SERVER_GPUS_TABLE, SERVER_GPUS_COLUMNS, "node, pid, server_port, device_id, ts")
