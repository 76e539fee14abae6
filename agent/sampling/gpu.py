"""GPU state read through NVML (nvidia-ml-py), and which GPUs each server process uses.

``NvmlSampler.read(ts_ns)`` returns one ``GpuReading`` per GPU, and one per MIG
device when a GPU runs in MIG mode: memory (total, used, free, reserved), GPU
and memory utilization, SM clock, power, temperature, and the processes holding
memory on it. ``ServerGpuMap`` turns those process lists (or, where NVML cannot
see the server, the operator's configuration) into "server process or port ->
GPU devices", which the ASOF join in ``gpu_join`` uses.

The sampler never stamps time itself: its caller passes the wall-clock
nanoseconds of the tick (see ``samples.SamplerSet`` for how that is mapped from
CLOCK_MONOTONIC, the clock the probes use).

Devices are keyed by ``device_id``: the GPU's UUID for a whole GPU, and
``<GPU UUID>/gi<N>`` for MIG GPU instance N. dcgm-exporter labels a MIG
instance with its parent's UUID and ``GPU_I_ID``, so both sources produce the
same key for the same device.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

log = logging.getLogger(__name__)

# MIG device names end with their profile: "NVIDIA A100-SXM4-40GB MIG 1g.5gb".
_MIG_PROFILE_IN_NAME = re.compile(r"\bMIG (\S+)$")
# Rebuild the device list this often even without errors, so MIG instances
# created at run time (no GPU reset needed for those) are picked up.
_REDISCOVER_EVERY_NS = 30_000_000_000


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None where the driver does not account it (NVML's "not available")


@dataclass(frozen=True)
class GpuReading:
    """One device's state at one instant; a row of ``tokenprobe.gpu_samples`` without the node."""

    ts_ns: int
    source: str  # "nvml" or "dcgm"
    device_id: str
    gpu_uuid: str  # the physical GPU's UUID, also for a MIG device
    gpu_index: int | None = None
    gpu_name: str = ""
    mig_profile: str = ""
    mig_gi_id: int | None = None
    mig_ci_id: int | None = None
    mig_uuid: str = ""
    mem_total_bytes: int | None = None
    mem_used_bytes: int | None = None
    mem_free_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    sm_clock_mhz: int | None = None
    power_w: float | None = None
    temp_c: float | None = None
    # DCGM profiling ratios (0..1); NVML has no equivalent.
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    processes: tuple[GpuProcess, ...] = ()
    pod: str = ""
    namespace: str = ""
    container: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    simulated: bool = False


def device_id_for(gpu_uuid: str, mig_gi_id: int | None) -> str:
    return gpu_uuid if mig_gi_id is None else f"{gpu_uuid}/gi{mig_gi_id}"


@dataclass(frozen=True)
class SamplerProblem:
    """Something a sampler could not read. ``kind`` is stable across ticks, so it is reported once."""

    kind: str
    message: str


@dataclass
class NvmlRead:
    readings: list[GpuReading]
    problems: list[SamplerProblem]


@dataclass
class _MigDevice:
    handle: object
    uuid: str
    name: str
    gi_id: int
    ci_id: int


@dataclass
class _Gpu:
    index: int
    handle: object
    uuid: str
    name: str
    mig_devices: list[_MigDevice]


def explain_nvml_start_failure(error: pynvml.NVMLError) -> str:
    """A plain sentence saying why NVML is unavailable and what the agent does about it."""
    carry_on = "GPU sampling through NVML is off; the agent carries on without it."
    if isinstance(error, pynvml.NVMLError_LibraryNotFound):
        return f"No NVIDIA driver here (libnvidia-ml.so.1 was not found). {carry_on}"
    if isinstance(error, pynvml.NVMLError_DriverNotLoaded):
        return f"The NVIDIA driver is installed but not loaded. {carry_on}"
    if isinstance(error, pynvml.NVMLError_NoPermission):
        return f"This process may not talk to the NVIDIA driver (no permission). {carry_on}"
    return f"NVML could not start: {error}. {carry_on}"


class NvmlSampler:
    """Reads every GPU and MIG device through nvidia-ml-py's ``pynvml`` module.

    Call ``start()`` once; it returns None when NVML is ready, else a plain
    sentence saying why not (no driver, no permission...). ``read()`` never
    raises NVML errors: a GPU that fails this tick is left out and reported in
    ``NvmlRead.problems``; it is looked up afresh on the next tick. A metric a
    device does not support (MIG devices have no utilization or power) reads
    as None, and is not asked for again.
    """

    def __init__(self) -> None:
        self._gpus: dict[int, _Gpu] = {}
        self._discovered_at_ns: int | None = None
        self._memory_v2 = True  # drivers before R510 lack nvmlDeviceGetMemoryInfo_v2
        self._unsupported: set[tuple[str, str]] = set()  # (uuid, metric)
        self._started = False

    def start(self) -> str | None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            return explain_nvml_start_failure(error)
        self._started = True
        return None

    def close(self) -> None:
        if self._started:
            self._started = False
            self._gpus.clear()
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as error:
                log.debug("nvmlShutdown failed: %s", error)

    def read(self, ts_ns: int) -> NvmlRead:
        if not self._started:
            raise RuntimeError("NvmlSampler.read() called before a successful start()")
        readings: list[GpuReading] = []
        problems: list[SamplerProblem] = []
        if self._discovered_at_ns is None or ts_ns - self._discovered_at_ns > _REDISCOVER_EVERY_NS:
            self._gpus.clear()
            self._discovered_at_ns = ts_ns
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as error:
            problems.append(SamplerProblem(f"nvml device count: {error}", f"NVML could not count GPUs: {error}"))
            return NvmlRead(readings, problems)
        for index in list(self._gpus):
            if index >= count:
                del self._gpus[index]
        for index in range(count):
            try:
                readings.extend(self._read_gpu(index, ts_ns))
            except pynvml.NVMLError as error:
                gpu = self._gpus.pop(index, None)
                label = f"GPU {index}" + (f" ({gpu.uuid})" if gpu else "")
                problems.append(SamplerProblem(f"nvml gpu {index}: {error}", f"NVML could not read {label}: {error}"))
        return NvmlRead(readings, problems)

    def _read_gpu(self, index: int, ts_ns: int) -> list[GpuReading]:
        gpu = self._gpus.get(index)
        if gpu is None:
            gpu = self._gpus[index] = self._discover(index)
        handle = gpu.handle
        whole_gpu = GpuReading(
            ts_ns=ts_ns,
            source="nvml",
            device_id=gpu.uuid,
            gpu_uuid=gpu.uuid,
            gpu_index=index,
            gpu_name=gpu.name,
            **self._memory(handle),
            **self._activity(gpu.uuid, handle),
            # With MIG on, processes belong to the MIG devices and are listed there.
            processes=() if gpu.mig_devices else self._processes(handle),
        )
        readings = [whole_gpu]
        for mig in gpu.mig_devices:
            profile = _MIG_PROFILE_IN_NAME.search(mig.name)
            readings.append(
                GpuReading(
                    ts_ns=ts_ns,
                    source="nvml",
                    device_id=device_id_for(gpu.uuid, mig.gi_id),
                    gpu_uuid=gpu.uuid,
                    gpu_index=index,
                    gpu_name=mig.name,
                    mig_profile=profile.group(1) if profile else "",
                    mig_gi_id=mig.gi_id,
                    mig_ci_id=mig.ci_id,
                    mig_uuid=mig.uuid,
                    **self._memory(mig.handle),
                    **self._activity(mig.uuid, mig.handle),
                    processes=self._processes(mig.handle),
                )
            )
        return readings

    def _discover(self, index: int) -> _Gpu:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        mig_devices: list[_MigDevice] = []
        if self._mig_enabled(uuid, handle):
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError_NotFound:
                    continue  # an empty slot: fewer instances than the maximum
                mig_devices.append(
                    _MigDevice(
                        handle=mig_handle,
                        uuid=pynvml.nvmlDeviceGetUUID(mig_handle),
                        name=pynvml.nvmlDeviceGetName(mig_handle),
                        gi_id=pynvml.nvmlDeviceGetGpuInstanceId(mig_handle),
                        ci_id=pynvml.nvmlDeviceGetComputeInstanceId(mig_handle),
                    )
                )
        return _Gpu(index, handle, uuid, name, mig_devices)

    def _mig_enabled(self, uuid: str, handle: object) -> bool:
        mode = self._optional(uuid, "mig mode", lambda: pynvml.nvmlDeviceGetMigMode(handle))
        return mode is not None and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE

    def _memory(self, handle: object) -> dict[str, int | None]:
        if self._memory_v2:
            try:
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                return {
                    "mem_total_bytes": memory.total,
                    "mem_used_bytes": memory.used,
                    "mem_free_bytes": memory.free,
                    "mem_reserved_bytes": memory.reserved,
                }
            except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
                log.info("this NVIDIA driver has no nvmlDeviceGetMemoryInfo_v2; reserved memory will read as empty")
                self._memory_v2 = False
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"mem_total_bytes": memory.total, "mem_used_bytes": memory.used, "mem_free_bytes": memory.free}

    def _activity(self, uuid: str, handle: object) -> dict[str, float | int | None]:
        utilization = self._optional(uuid, "utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
        power_mw = self._optional(uuid, "power", lambda: pynvml.nvmlDeviceGetPowerUsage(handle))
        return {
            "gpu_util_pct": None if utilization is None else float(utilization.gpu),
            "mem_util_pct": None if utilization is None else float(utilization.memory),
            "sm_clock_mhz": self._optional(
                uuid, "sm clock", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            ),
            "power_w": None if power_mw is None else power_mw / 1000.0,
            "temp_c": self._optional(
                uuid, "temperature", lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            ),
        }

    def _processes(self, handle: object) -> tuple[GpuProcess, ...]:
        return tuple(
            GpuProcess(pid=process.pid, used_bytes=process.usedGpuMemory)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        )

    def _optional(self, uuid: str, metric: str, call: Callable[[], Any]) -> Any:
        """``call()``, or None for good once the device says it does not support ``metric``."""
        if (uuid, metric) in self._unsupported:
            return None
        try:
            return call()
        except pynvml.NVMLError_NotSupported:
            log.info("%s does not report %s; it will read as empty", uuid, metric)
            self._unsupported.add((uuid, metric))
            return None


# --- which GPU devices a server uses -----------------------------------------------------------


@dataclass(frozen=True)
class ServerGpu:
    """One "server -> device" fact; a row of ``tokenprobe.server_gpus`` without time and node.

    From NVML, ``pid`` is a process holding memory on the device, or one of its
    ancestors (vLLM and SGLang serve HTTP in a parent of the process that holds
    the GPU), and ``server_port`` is 0. From configuration, ``server_port`` is
    the configured port and ``pid`` is 0.
    """

    pid: int
    server_port: int
    device_id: str
    gpu_uuid: str
    source: str  # "nvml" or "config"
    simulated: bool = False


def read_parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from /proc, or None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after it
    # start past the last ')'. They are: state, ppid, ...
    after_name = stat[stat.rfind(")") + 2 :].split()
    return int(after_name[1]) if len(after_name) > 1 else None


class ServerGpuMap:
    """Maps server processes and ports to the GPU devices they run on.

    ``configured`` maps a server port to GPU references: a GPU index ("0"), a
    GPU UUID, or a device_id ("GPU-.../gi3"); indexes are resolved against the
    readings seen. NVML's per-process memory is used first in the join; the
    configuration covers servers NVML cannot attribute (dcgm-only nodes, TGI,
    whose HTTP router is a sibling of the GPU shards, not their parent).
    """

    def __init__(
        self,
        configured: Mapping[int, Sequence[str]] | None = None,
        parent_pid: Callable[[int], int | None] = read_parent_pid,
    ) -> None:
        self._configured = {int(port): list(refs) for port, refs in (configured or {}).items()}
        for port in self._configured:
            if not 0 < port < 65536:
                raise ValueError(f"server port {port} in the GPU configuration is not a TCP port")
        self._parent_pid = parent_pid
        self._entries: frozenset[ServerGpu] = frozenset()
        self._unresolved: list[tuple[int, str]] = []

    def observe(self, readings: Iterable[GpuReading]) -> bool:
        """Recompute the map from one tick's readings; True when it changed."""
        readings = list(readings)
        entries = self._from_processes(readings) | self._from_configuration(readings)
        changed = entries != self._entries
        self._entries = entries
        return changed

    def unresolved(self) -> list[tuple[int, str]]:
        """Configured (port, GPU reference) pairs that matched no device in the last ``observe``."""
        return list(self._unresolved)

    def entries(self) -> list[ServerGpu]:
        return sorted(self._entries, key=lambda entry: (entry.source, entry.pid, entry.server_port, entry.device_id))

    def _from_processes(self, readings: list[GpuReading]) -> set[ServerGpu]:
        entries: set[ServerGpu] = set()
        for reading in readings:
            for process in reading.processes:
                for pid in self._self_and_ancestors(process.pid):
                    entries.add(ServerGpu(pid, 0, reading.device_id, reading.gpu_uuid, "nvml", reading.simulated))
        return entries

    def _self_and_ancestors(self, pid: int) -> list[int]:
        chain: list[int] = []
        # pid 1 (init) and 0 are everyone's ancestors: mapping them would say nothing.
        while pid > 1 and pid not in chain:
            chain.append(pid)
            parent = self._parent_pid(pid)
            if parent is None:
                break
            pid = parent
        return chain

    def _from_configuration(self, readings: list[GpuReading]) -> set[ServerGpu]:
        by_reference: dict[str, GpuReading] = {}
        for reading in readings:
            by_reference[reading.device_id] = reading
            if reading.mig_gi_id is None:
                by_reference.setdefault(reading.gpu_uuid, reading)
                if reading.gpu_index is not None:
                    by_reference.setdefault(str(reading.gpu_index), reading)
        entries: set[ServerGpu] = set()
        self._unresolved = []
        for port, references in self._configured.items():
            for reference in references:
                reading = by_reference.get(reference)
                if reading is None:
                    self._unresolved.append((port, reference))
                else:
                    entries.add(ServerGpu(0, port, reading.device_id, reading.gpu_uuid, "config", reading.simulated))
        return entries
