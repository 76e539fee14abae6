"""Simulated GPU and engine metrics for the reference server, for demos on machines without a GPU.

The reference server has slots and a queue but no GPU. So that the demo can
show requests joined to GPU and engine state, it can publish:

- ``render_dcgm_text``: a dcgm-exporter page for one simulated GPU, in the
  exporter's exact format and label set, and
- ``render_vllm_text``: a vLLM-style ``/metrics`` page (``vllm:*`` series),

both computed from a snapshot of the server's state through a deliberately
simple model (``SimulatedKvCache``, ``SimulatedGpu``). Nothing here is
measured. Every series carries the label ``simulated="true"``; tokenprobe's
scrapers store rows with that label as ``simulated = true``, and the join view
carries the flag on, so no chart can pass these numbers off as a real GPU's.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from typing import Protocol

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MIB = 1024 * 1024


class ServerSnapshot(Protocol):
    """What the model needs from the server (``refserver.engine.EngineSnapshot`` has it)."""

    running: int  # requests holding a slot
    waiting: int  # requests queued for a slot
    slots: int
    completed: int
    prompt_tokens_total: int
    generation_tokens_total: int
    kv_blocks_total: int | None  # the engine's own KV cache, when bounded (None: unbounded)
    kv_blocks_used: int
    preemptions_total: int


@dataclass(frozen=True)
class SimulatedKvCache:
    """The KV cache the pages report. An engine with a bounded cache reports its blocks in use exactly;
    for an unbounded one, a coarse model: each running request holds as many tokens as the average
    request so far.

    ``capacity_tokens`` plays vLLM's ``num_gpu_blocks * block_size``. Usage is
    the fraction of it held, capped at 1.
    """

    block_size: int = 16
    num_blocks: int = 512
    tokens_per_request_before_any: int = 256  # assumed until a request has been counted

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def usage(self, snapshot: ServerSnapshot) -> float:
        if snapshot.kv_blocks_total is not None:
            return snapshot.kv_blocks_used / snapshot.kv_blocks_total
        requests_seen = snapshot.completed + snapshot.running
        tokens_seen = snapshot.prompt_tokens_total + snapshot.generation_tokens_total
        per_request = (
            tokens_seen / requests_seen if requests_seen and tokens_seen else self.tokens_per_request_before_any
        )
        return min(1.0, snapshot.running * per_request / self.capacity_tokens)


@dataclass(frozen=True)
class SimulatedGpu:
    """One H100-sized GPU whose numbers follow the server's load.

    Memory behaves like a server that grows its KV cache on demand: weights,
    plus the used share of the KV pool, plus a small activation workspace per
    running request. (vLLM reserves the whole pool at start instead, which
    would pin the memory-pressure indicator at its warn level and hide load.) Utilization, clock, power and temperature rise with
    the share of busy slots.
    """

    hostname: str
    port: int
    index: int = 0
    model_name: str = "Simulated GPU (H100-like)"
    total_mib: int = 81559
    reserved_mib: int = 552
    weights_mib: int = 15_300
    kv_pool_mib: int = 55_000
    workspace_mib_per_request: int = 256
    driver_version: str = "0.0-simulated"

    @property
    def uuid(self) -> str:
        # Stable per server, so restarts keep one device in the store.
        return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"tokenprobe-simulated-gpu.{self.hostname}.{self.port}"))

    def fields(self, snapshot: ServerSnapshot, kv_usage: float) -> dict[str, float]:
        """dcgm-exporter field name -> value, in the exporter's units (MiB, %, MHz, W, C, ratios)."""
        busy = snapshot.running / snapshot.slots if snapshot.slots else 0.0
        util = 0.0 if snapshot.running == 0 else min(100.0, 35.0 + 65.0 * busy)
        used_mib = round(self.weights_mib + self.kv_pool_mib * kv_usage
                         + self.workspace_mib_per_request * snapshot.running)
        used_mib = min(used_mib, self.total_mib - self.reserved_mib)
        return {
            "DCGM_FI_DEV_SM_CLOCK": 1980 if snapshot.running else 345,
            "DCGM_FI_DEV_GPU_TEMP": round(32 + 0.35 * util),
            "DCGM_FI_DEV_POWER_USAGE": 70.0 + 6.3 * util,
            "DCGM_FI_DEV_GPU_UTIL": round(util),
            "DCGM_FI_DEV_MEM_COPY_UTIL": round(0.6 * util),
            "DCGM_FI_DEV_FB_FREE": self.total_mib - self.reserved_mib - used_mib,
            "DCGM_FI_DEV_FB_USED": used_mib,
            "DCGM_FI_DEV_FB_RESERVED": self.reserved_mib,
            "DCGM_FI_PROF_SM_ACTIVE": 0.85 * util / 100,
            "DCGM_FI_PROF_SM_OCCUPANCY": 0.30 * util / 100,
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.40 * util / 100,
            "DCGM_FI_PROF_DRAM_ACTIVE": (0.35 + 0.4 * kv_usage) * util / 100,
        }


# dcgm-exporter's HELP text and type for each field rendered.
_DCGM_FIELDS: dict[str, tuple[str, str]] = {
    "DCGM_FI_DEV_SM_CLOCK": ("gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("gauge", "Memory utilization (in %)."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Frame buffer memory free (in MB)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Frame buffer memory used (in MB)."),
    "DCGM_FI_DEV_FB_RESERVED": ("gauge", "Frame buffer memory reserved (in MB)."),
    "DCGM_FI_PROF_SM_ACTIVE": ("gauge", "The ratio of cycles an SM has at least 1 warp assigned."),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("gauge", "The ratio of number of warps resident on an SM."),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
    "DCGM_FI_PROF_DRAM_ACTIVE": (
        "gauge", "Ratio of cycles the device memory interface is active sending or receiving data."
    ),
}  # fmt: skip


def render_dcgm_text(snapshot: ServerSnapshot, gpu: SimulatedGpu, kv_cache: SimulatedKvCache) -> str:
    """A dcgm-exporter ``/metrics`` page for ``gpu`` in the state ``snapshot`` implies."""
    labels = _labels(
        gpu=str(gpu.index),
        UUID=gpu.uuid,
        pci_bus_id=f"00000000:{0x18 + gpu.index:02X}:00.0",
        device=f"nvidia{gpu.index}",
        modelName=gpu.model_name,
        Hostname=gpu.hostname,
        DCGM_FI_DRIVER_VERSION=gpu.driver_version,
        container="",
        namespace="",
        pod="",
        simulated="true",
    )
    lines: list[str] = []
    for name, value in gpu.fields(snapshot, kv_cache.usage(snapshot)).items():
        kind, help_text = _DCGM_FIELDS[name]
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {_dcgm_value(value)}"]
    return "\n".join(lines) + "\n"


def render_vllm_text(snapshot: ServerSnapshot, kv_cache: SimulatedKvCache, model_name: str) -> str:
    """A vLLM-style ``/metrics`` page: the scheduler gauges and token counters vLLM exports."""
    labels = _labels(engine="0", model_name=model_name, simulated="true")
    families = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", snapshot.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", snapshot.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", kv_cache.usage(snapshot)),
        # Only an engine with a bounded KV cache preempts; otherwise the counter exists, as in vLLM, and stays 0.
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
         snapshot.preemptions_total),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", snapshot.prompt_tokens_total),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         snapshot.generation_tokens_total),
    ]  # fmt: skip
    lines: list[str] = []
    for name, kind, help_text, value in families:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)!r}"]
    success = _labels(engine="0", finished_reason="stop", model_name=model_name, simulated="true")
    lines += [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f"vllm:request_success_total{success} {float(snapshot.completed)!r}",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        "vllm:cache_config_info"
        + _labels(block_size=str(kv_cache.block_size), num_gpu_blocks=str(kv_cache.num_blocks), simulated="true")
        + " 1.0",
    ]
    return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for value in labels.values())
    return "{" + ",".join(f'{name}="{value}"' for name, value in zip(labels, escaped)) + "}"


def _dcgm_value(value: float) -> str:
    # dcgm-exporter prints integer fields bare and float fields with six decimals.
    return str(value) if isinstance(value, int) else f"{value:.6f}"


VLLM_METRICS_PATH = "/metrics"
DCGM_METRICS_PATH = "/sim/dcgm"
SIMULATED_METRICS_PATHS = (VLLM_METRICS_PATH, DCGM_METRICS_PATH)


class SimulatedMetrics:
    """The reference server's simulated pages: vLLM-style at /metrics, a
    dcgm-exporter page at /sim/dcgm, both following the live engine state."""

    def __init__(self, port: int, model_name: str, hostname: str | None = None,
                 kv_cache: SimulatedKvCache = SimulatedKvCache()) -> None:
        self.gpu = SimulatedGpu(hostname=hostname or socket.gethostname(), port=port)
        self.kv_cache = kv_cache
        self.model_name = model_name

    def render(self, path: str, snapshot: ServerSnapshot) -> str:
        if path == DCGM_METRICS_PATH:
            return render_dcgm_text(snapshot, self.gpu, self.kv_cache)
        return render_vllm_text(snapshot, self.kv_cache, self.model_name)
