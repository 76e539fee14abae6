"""The NVML sampler, driven through nvidia-ml-py by a replay of recorded NVML readings.

There is no GPU here. ``NvmlReplay`` stands where libnvidia-ml.so.1 would be:
installed as ``pynvml.nvmlLib``, it answers the C functions pynvml looks up,
so the sampler's calls run through nvidia-ml-py's own wrappers unchanged -
the same ctypes structures filled in (c_nvmlMemory_v2_t, c_nvmlUtilization_t,
arrays of c_nvmlProcessInfo_v3_t), the same return codes turned into the same
NVMLError subclasses, the same two-call dance for process lists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pynvml
import pytest
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.sampling.engine_metrics import EngineScraper
from tokenprobe.agent.sampling.gpu import (
    GpuProcess,
    GpuReading,
    NvmlSampler,
    ServerGpuMap,
    read_parent_pid,
)
from tokenprobe.agent.sampling.samplers import SamplerSet
from tokenprobe.refserver.harness import served_pages
from tokenprobe.store.embedded import open_store

from tests.support import free_port

GIB = 1024**3
MIB = 1024**2
H100_TOTAL, H100_RESERVED = 85_520_809_984, 552 * MIB
A100_TOTAL, A100_RESERVED = 85_899_345_920, 617 * MIB
WAIT_S = 60.0  # generous: the machine is shared and small


# --------------------------------------------------------------------------- the replay


@dataclass
class RecordedDevice:
    """What NVML said about one device at one tick. None means NVML answered NOT_SUPPORTED."""

    uuid: str
    name: str
    used: int
    total: int
    reserved: int
    utilization: tuple[int, int] | None = (0, 0)  # (gpu %, memory %)
    sm_clock_mhz: int | None = 1980
    power_mw: int | None = 70_000
    temperature_c: int | None = 30
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes or None = N/A)
    mig_mode: bool | None = False  # None: the GPU cannot do MIG at all
    mig_devices: list[RecordedMigDevice] = field(default_factory=list)
    lost: bool = False  # every call answers GPU_IS_LOST (fell off the bus)


@dataclass
class RecordedMigDevice(RecordedDevice):
    slot: int = 0
    gpu_instance_id: int = 0
    compute_instance_id: int = 0


@dataclass
class RecordedTick:
    gpus: list[RecordedDevice]
    count_error: int | None = None  # nvmlDeviceGetCount's return code, if it failed


def mig_device(slot: int, gi: int, profile: str, used: int, processes=()) -> RecordedMigDevice:
    return RecordedMigDevice(
        uuid=f"MIG-7b9f0c2e-4d1a-5e8b-9c3f-0a6d2e8b41{gi:02d}",
        name=f"NVIDIA A100-SXM4-80GB MIG {profile}",
        used=used,
        total=40_262 * MIB,
        reserved=0,
        utilization=None,
        sm_clock_mhz=None,
        power_mw=None,
        temperature_c=None,
        processes=list(processes),
        mig_mode=None,
        slot=slot,
        gpu_instance_id=gi,
        compute_instance_id=0,
    )


class NvmlReplay:
    """A replay of recorded NVML readings, not a GPU.

    Each ``RecordedTick`` is what NVML said during one sampler tick; ``advance()``
    moves to the next (or, with ``advance_each_read``, every nvmlDeviceGetCount
    call does, for a sampler running on its own thread). After the last tick
    the replay stays there. ``missing_functions`` makes those C symbols absent,
    as on an older driver. ``calls`` counts C calls by name.
    """

    HANDLE_BASE = 0x7F00_0000

    def __init__(self, ticks: list[RecordedTick], missing_functions=(), advance_each_read=False):
        self._ticks = ticks
        self._tick = 0
        self._missing = set(missing_functions)
        self._advance_each_read = advance_each_read
        self._reads = 0
        self.calls: Counter[str] = Counter()
        uuids = []
        for tick in ticks:
            for gpu in tick.gpus:
                uuids += [gpu.uuid] + [mig.uuid for mig in gpu.mig_devices]
        self._handle_of = {uuid: self.HANDLE_BASE + 0x100 * n for n, uuid in enumerate(dict.fromkeys(uuids))}

    def install(self, monkeypatch) -> NvmlReplay:
        monkeypatch.setattr(pynvml, "nvmlLib", self)
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
        return self

    def advance(self) -> None:
        self._tick = min(self._tick + 1, len(self._ticks) - 1)

    # How pynvml finds a C function: getattr(nvmlLib, name); AttributeError means "not in this driver".
    def __getattr__(self, name: str):
        implementation = getattr(type(self), f"_c_{name}", None)
        if implementation is None or name in self._missing:
            raise AttributeError(name)

        def c_function(*args):  # a plain function: pynvml may set .restype on it
            self.calls[name] += 1
            return implementation(self, *args)

        return c_function

    # -- helpers

    @property
    def _now(self) -> RecordedTick:
        return self._ticks[self._tick]

    def _devices(self):
        for gpu in self._now.gpus:
            yield gpu
            yield from gpu.mig_devices

    def _set_handle(self, device_ref, device: RecordedDevice) -> int:
        ctypes.c_void_p.from_buffer(device_ref._obj).value = self._handle_of[device.uuid]
        return pynvml.NVML_SUCCESS

    def _resolve(self, handle) -> RecordedDevice | int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        for device in self._devices():
            if self._handle_of[device.uuid] == address:
                return pynvml.NVML_ERROR_GPU_IS_LOST if device.lost else device
        return pynvml.NVML_ERROR_GPU_IS_LOST  # not in this tick: the device is gone

    def _answer(self, handle, read) -> int:
        device = self._resolve(handle)
        if isinstance(device, int):
            return device
        return read(device)

    @staticmethod
    def _store(ref, value) -> int:
        if value is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        ref._obj.value = value
        return pynvml.NVML_SUCCESS

    # -- the C functions the sampler reaches through pynvml

    def _c_nvmlInitWithFlags(self, flags):
        return pynvml.NVML_SUCCESS

    def _c_nvmlShutdown(self):
        return pynvml.NVML_SUCCESS

    def _c_nvmlErrorString(self, code):
        return f"replayed NVML error {code}".encode()

    def _c_nvmlDeviceGetCount_v2(self, count_ref):
        if self._advance_each_read and self._reads:
            self.advance()
        self._reads += 1
        if self._now.count_error is not None:
            return self._now.count_error
        return self._store(count_ref, len(self._now.gpus))

    def _c_nvmlDeviceGetHandleByIndex_v2(self, index, device_ref):
        if index.value >= len(self._now.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        gpu = self._now.gpus[index.value]
        return pynvml.NVML_ERROR_GPU_IS_LOST if gpu.lost else self._set_handle(device_ref, gpu)

    def _c_nvmlDeviceGetUUID(self, handle, buffer, size):
        return self._answer(handle, lambda device: setattr(buffer, "value", device.uuid.encode()) or 0)

    def _c_nvmlDeviceGetName(self, handle, buffer, size):
        return self._answer(handle, lambda device: setattr(buffer, "value", device.name.encode()) or 0)

    def _c_nvmlDeviceGetMigMode(self, handle, current_ref, pending_ref):
        def read(device):
            if device.mig_mode is None:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            current_ref._obj.value = pending_ref._obj.value = int(device.mig_mode)
            return pynvml.NVML_SUCCESS

        return self._answer(handle, read)

    def _c_nvmlDeviceGetMaxMigDeviceCount(self, handle, count_ref):
        return self._answer(handle, lambda device: self._store(count_ref, 7))

    def _c_nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index, mig_ref):
        def read(device):
            for mig in device.mig_devices:
                if mig.slot == index.value:
                    return self._set_handle(mig_ref, mig)
            return pynvml.NVML_ERROR_NOT_FOUND

        return self._answer(handle, read)

    def _c_nvmlDeviceGetGpuInstanceId(self, handle, id_ref):
        return self._answer(handle, lambda device: self._store(id_ref, device.gpu_instance_id))

    def _c_nvmlDeviceGetComputeInstanceId(self, handle, id_ref):
        return self._answer(handle, lambda device: self._store(id_ref, device.compute_instance_id))

    def _c_nvmlDeviceGetMemoryInfo(self, handle, memory_ref):
        def read(device):
            memory = memory_ref._obj  # c_nvmlMemory_t; v1 counts reserved memory as used
            memory.total, memory.used = device.total, device.used + device.reserved
            memory.free = device.total - memory.used
            return pynvml.NVML_SUCCESS

        return self._answer(handle, read)

    def _c_nvmlDeviceGetMemoryInfo_v2(self, handle, memory_ref):
        def read(device):
            memory = memory_ref._obj  # c_nvmlMemory_v2_t
            if memory.version != pynvml.nvmlMemory_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            memory.total, memory.reserved, memory.used = device.total, device.reserved, device.used
            memory.free = device.total - device.reserved - device.used
            return pynvml.NVML_SUCCESS

        return self._answer(handle, read)

    def _c_nvmlDeviceGetUtilizationRates(self, handle, utilization_ref):
        def read(device):
            if device.utilization is None:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            utilization_ref._obj.gpu, utilization_ref._obj.memory = device.utilization
            return pynvml.NVML_SUCCESS

        return self._answer(handle, read)

    def _c_nvmlDeviceGetClockInfo(self, handle, clock_type, clock_ref):
        if clock_type.value != pynvml.NVML_CLOCK_SM:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        return self._answer(handle, lambda device: self._store(clock_ref, device.sm_clock_mhz))

    def _c_nvmlDeviceGetPowerUsage(self, handle, power_ref):
        return self._answer(handle, lambda device: self._store(power_ref, device.power_mw))

    def _c_nvmlDeviceGetTemperature(self, handle, sensor, temperature_ref):
        return self._answer(handle, lambda device: self._store(temperature_ref, device.temperature_c))

    def _c_nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count_ref, processes):
        def read(device):
            wanted = len(device.processes)
            if processes is None or count_ref._obj.value < wanted:
                count_ref._obj.value = wanted
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE if wanted else pynvml.NVML_SUCCESS
            for slot, (pid, used) in enumerate(device.processes):
                processes[slot].pid = pid
                not_available = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                processes[slot].usedGpuMemory = not_available if used is None else used
                processes[slot].gpuInstanceId = getattr(device, "gpu_instance_id", 0xFFFFFFFF)
                processes[slot].computeInstanceId = getattr(device, "compute_instance_id", 0xFFFFFFFF)
            count_ref._obj.value = wanted
            return pynvml.NVML_SUCCESS

        return self._answer(handle, read)


# --------------------------------------------------------------------------- recorded readings

GPU0 = "GPU-5d3e5f8a-9c1b-7a42-e0f3-2b6c8d1e4a90"
GPU1 = "GPU-a17c2e94-3b5d-6f08-1e9a-c4d7b2f5e381"
GPU2 = "GPU-0c8b7d2e-61f4-4a9d-b3e5-7f21a6c9d048"
GHOST_PID = 4_194_000  # above any pid this machine hands out: /proc has no such process


def h100(uuid: str, used: int, processes=(), **readings) -> RecordedDevice:
    return RecordedDevice(
        uuid, "NVIDIA H100 80GB HBM3", used, H100_TOTAL, H100_RESERVED, processes=list(processes), **readings
    )


def a100_with_mig(gi1_processes=(), gi1_used=2 * GIB) -> RecordedDevice:
    return RecordedDevice(
        GPU2, "NVIDIA A100-SXM4-80GB", 40 * GIB, A100_TOTAL, A100_RESERVED,
        utilization=None,  # not reported for a GPU in MIG mode
        mig_mode=True,
        mig_devices=[
            mig_device(slot=0, gi=1, profile="3g.40gb", used=gi1_used, processes=gi1_processes),
            mig_device(slot=1, gi=2, profile="3g.40gb", used=13 * MIB),
        ],
    )  # fmt: skip


def recorded_run(server_pid: int) -> list[RecordedTick]:
    """Six ticks of a three-GPU node: a server comes and goes, a GPU falls off the bus, NVML stumbles."""
    return [
        # 0: idle node.
        RecordedTick([h100(GPU0, 512 * MIB), h100(GPU1, 0), a100_with_mig()]),
        # 1: a server loads on GPU 0; a process on MIG instance 1 whose memory NVML cannot account.
        RecordedTick([
            h100(GPU0, 70 * GIB, [(server_pid, 70 * GIB - 512 * MIB)], utilization=(87, 41), power_mw=412_647),
            h100(GPU1, 0),
            a100_with_mig(gi1_processes=[(GHOST_PID, None)], gi1_used=30 * GIB),
        ]),
        # 2: GPU 1 falls off the bus; a second process joins GPU 0.
        RecordedTick([
            h100(GPU0, 72 * GIB, [(server_pid, 70 * GIB - 512 * MIB), (GHOST_PID + 1, 2 * GIB)]),
            h100(GPU1, 0, lost=True),
            a100_with_mig(gi1_processes=[(GHOST_PID, None)], gi1_used=30 * GIB),
        ]),
        # 3: GPU 1 is back after a reset; the server leaves GPU 0.
        RecordedTick([h100(GPU0, 2 * GIB, [(GHOST_PID + 1, 2 * GIB)]), h100(GPU1, 0), a100_with_mig()]),
        # 4: NVML cannot even count the GPUs.
        RecordedTick([h100(GPU0, 2 * GIB), h100(GPU1, 0), a100_with_mig()], count_error=pynvml.NVML_ERROR_UNKNOWN),
        # 5: all well again.
        RecordedTick([h100(GPU0, 512 * MIB), h100(GPU1, 0), a100_with_mig()]),
    ]  # fmt: skip


@pytest.fixture
def server_process():
    """A real child process, standing for an engine process that holds GPU memory."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.kill()
    child.wait(timeout=30)


def by_device(readings: list[GpuReading]) -> dict[str, GpuReading]:
    return {reading.device_id: reading for reading in readings}


# --------------------------------------------------------------------------- the sampler, tick by tick


def test_replayed_run_through_pynvml(monkeypatch, server_process):
    replay = NvmlReplay(recorded_run(server_process.pid)).install(monkeypatch)
    sampler = NvmlSampler()
    assert sampler.start() is None
    ticks = []
    for tick in range(6):
        ticks.append(sampler.read(ts_ns=1_000 + tick))
        replay.advance()
    sampler.close()

    # Tick 0: three GPUs, the A100 as its parent plus two MIG instances.
    idle = by_device(ticks[0].readings)
    assert ticks[0].problems == []
    assert set(idle) == {GPU0, GPU1, GPU2, f"{GPU2}/gi1", f"{GPU2}/gi2"}
    gpu0 = idle[GPU0]
    assert (gpu0.ts_ns, gpu0.source, gpu0.gpu_index, gpu0.gpu_name) == (1_000, "nvml", 0, "NVIDIA H100 80GB HBM3")
    assert (gpu0.mem_total_bytes, gpu0.mem_reserved_bytes) == (H100_TOTAL, H100_RESERVED)
    assert gpu0.mem_used_bytes == 512 * MIB
    assert gpu0.mem_free_bytes == H100_TOTAL - H100_RESERVED - 512 * MIB
    assert (gpu0.sm_clock_mhz, gpu0.power_w, gpu0.temp_c) == (1980, 70.0, 30)
    assert gpu0.processes == () and gpu0.mig_gi_id is None

    parent, instance = idle[GPU2], idle[f"{GPU2}/gi1"]
    assert parent.gpu_util_pct is None and parent.sm_clock_mhz == 1980 and parent.gpu_index == 2
    assert (instance.gpu_uuid, instance.gpu_index, instance.mig_gi_id, instance.mig_ci_id) == (GPU2, 2, 1, 0)
    assert instance.mig_profile == "3g.40gb" and instance.mig_uuid.startswith("MIG-")
    assert instance.gpu_name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert instance.mem_total_bytes == 40_262 * MIB and instance.mem_used_bytes == 2 * GIB
    assert (instance.gpu_util_pct, instance.power_w, instance.temp_c, instance.sm_clock_mhz) == (None,) * 4

    # Tick 1: the server appears on GPU 0, a process on MIG instance 1 with memory NVML cannot account.
    loaded = by_device(ticks[1].readings)
    assert loaded[GPU0].processes == (GpuProcess(server_process.pid, 70 * GIB - 512 * MIB),)
    assert (loaded[GPU0].gpu_util_pct, loaded[GPU0].mem_util_pct, loaded[GPU0].power_w) == (87.0, 41.0, 412.647)
    assert loaded[f"{GPU2}/gi1"].processes == (GpuProcess(GHOST_PID, None),)
    assert loaded[GPU2].processes == ()  # with MIG on, processes are listed on their instance

    # Tick 2: GPU 1 is lost; the others still report, and a second process joined GPU 0.
    assert GPU1 not in by_device(ticks[2].readings)
    (lost,) = ticks[2].problems
    assert "GPU 1" in lost.message and GPU1 in lost.message and "GPU is lost" in lost.message
    assert [p.pid for p in by_device(ticks[2].readings)[GPU0].processes] == [server_process.pid, GHOST_PID + 1]

    # Tick 3: GPU 1 is looked up afresh and reports again; the server has left GPU 0.
    recovered = by_device(ticks[3].readings)
    assert GPU1 in recovered and ticks[3].problems == []
    assert recovered[GPU0].processes == (GpuProcess(GHOST_PID + 1, 2 * GIB),)

    # Tick 4: no count, no readings, one problem; tick 5: all back.
    assert ticks[4].readings == [] and len(ticks[4].problems) == 1
    assert "could not count GPUs" in ticks[4].problems[0].message
    assert len(ticks[5].readings) == 5 and ticks[5].problems == []

    # Unsupported metrics were asked once per device, not on every tick.
    assert replay.calls["nvmlDeviceGetUtilizationRates"] == (
        6 - 1  # GPU 0 at every tick but the failed count
        + 6 - 2  # GPU 1, minus the failed count and the tick it was lost
        + 1 + 2  # the A100 parent and its two instances, once each
    )  # fmt: skip


def test_old_driver_without_memory_info_v2(monkeypatch):
    replay = NvmlReplay([RecordedTick([h100(GPU0, 4 * GIB)])], missing_functions={"nvmlDeviceGetMemoryInfo_v2"})
    replay.install(monkeypatch)
    sampler = NvmlSampler()
    assert sampler.start() is None
    first = sampler.read(ts_ns=1).readings[0]
    second = sampler.read(ts_ns=2).readings[0]
    assert first.mem_reserved_bytes is None and first.mem_total_bytes == H100_TOTAL
    assert first.mem_used_bytes == 4 * GIB + H100_RESERVED  # v1 counts reserved as used
    assert second.mem_used_bytes == first.mem_used_bytes
    assert replay.calls["nvmlDeviceGetMemoryInfo"] == 2  # v2 was not asked for again


def test_read_before_start_is_a_programming_error():
    with pytest.raises(RuntimeError, match="before a successful start"):
        NvmlSampler().read(ts_ns=0)


nvml_library_present = ctypes.util.find_library("nvidia-ml") is not None


@pytest.mark.skipif(nvml_library_present, reason="this machine has an NVIDIA driver")
def test_without_a_driver_start_says_so_plainly():
    assert NvmlSampler().start() == (
        "No NVIDIA driver here (libnvidia-ml.so.1 was not found)."
        " GPU sampling through NVML is off; the agent carries on without it."
    )


# --------------------------------------------------------------------------- server -> GPU mapping


def test_server_map_follows_processes_and_their_ancestors(server_process):
    gpu_map = ServerGpuMap()
    reading = GpuReading(0, "nvml", GPU0, GPU0, 0, processes=(GpuProcess(server_process.pid, GIB),))
    assert gpu_map.observe([reading])
    pids = {entry.pid for entry in gpu_map.entries()}
    # The engine process and its parent - this test process, standing for the HTTP front end.
    assert {server_process.pid, os.getpid()} <= pids
    assert 1 not in pids
    assert read_parent_pid(server_process.pid) == os.getpid()
    assert not gpu_map.observe([reading])  # unchanged
    assert gpu_map.observe([]) and gpu_map.entries() == []  # the process left


def test_server_map_from_configuration_by_index_uuid_or_mig_device():
    readings = [
        GpuReading(0, "dcgm", GPU0, GPU0, 0),
        GpuReading(0, "dcgm", f"{GPU2}/gi1", GPU2, 2, mig_gi_id=1),
        GpuReading(0, "dcgm", "GPU-sim", "GPU-sim", 7, simulated=True),
    ]
    gpu_map = ServerGpuMap({8000: ["0"], 8001: [f"{GPU2}/gi1", "9"], 8002: ["GPU-sim"]}, parent_pid=lambda pid: None)
    assert gpu_map.observe(readings)
    entries = {(entry.server_port, entry.device_id, entry.source, entry.simulated) for entry in gpu_map.entries()}
    assert entries == {
        (8000, GPU0, "config", False),
        (8001, f"{GPU2}/gi1", "config", False),  # GPU index 9 is not on this node: nothing
        (8002, "GPU-sim", "config", True),
    }
    assert gpu_map.unresolved() == [(8001, "9")]
    with pytest.raises(ValueError, match="not a TCP port"):
        ServerGpuMap({0: ["0"]})


# --------------------------------------------------------------------------- SamplerSet into a real store


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {WAIT_S} s")
        time.sleep(0.1)


@pytest.fixture
def store(tmp_path):
    with open_store(f"chdb://{tmp_path / 'store'}", serve=False) as opened:
        opened.ensure_schema()
        yield opened


def test_sampler_set_writes_replayed_samples_and_mapping_and_survives_errors(
    monkeypatch, store, server_process, caplog
):
    NvmlReplay(recorded_run(server_process.pid), advance_each_read=True).install(monkeypatch)
    clock = MonotonicWallClock()
    samplers = SamplerSet(store, "node-a", clock, nvml=NvmlSampler(), nvml_hz=20, flush_interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="tokenprobe.agent.sampling.samplers"):
        started_mono = time.monotonic_ns()
        samplers.start()
        # The replay stays on its last tick: wait until the sampler has read well past it.
        wait_for(lambda: samplers.stats()["rows_written"].get("gpu_samples", 0) >= 5 * 6 + 5, "sampling the replay")
        samplers.stop()

    stats = samplers.stats()
    assert stats["nvml"] == "sampling"
    assert stats["errors"]["nvml gpu 1: GPU is lost"] == 1
    assert stats["errors"]["nvml device count: Unknown Error"] == 1
    lost_warnings = [record for record in caplog.records if "GPU is lost" in record.getMessage()]
    assert len(lost_warnings) == 1

    frame = store.query_df(
        "SELECT device_id, toUnixTimestamp64Nano(min(ts)) AS first_ns, count() AS samples,"
        " countIf(isNull(gpu_util_pct)) AS without_util, max(length(process_pids)) AS most_processes"
        f" FROM {store.table('gpu_samples')} WHERE node = 'node-a' GROUP BY device_id"
    )
    devices = {row["device_id"]: row for row in frame.to_dict("records")}
    assert set(devices) == {GPU0, GPU1, GPU2, f"{GPU2}/gi1", f"{GPU2}/gi2"}
    assert devices[GPU0]["most_processes"] == 2  # tick 2
    mig = devices[f"{GPU2}/gi1"]
    assert mig["without_util"] == mig["samples"]  # a MIG device never reports utilization
    assert devices[GPU1]["samples"] == devices[GPU0]["samples"] - 1  # GPU 1 missed the tick it was lost
    # Stamped through the clock (monotonic time plus its offset), kept to the nanosecond.
    first_ns = min(row["first_ns"] for row in devices.values())
    assert 0 <= first_ns - clock.to_wall_ns(started_mono) < WAIT_S * 1e9

    mapped = store.query_rows(f"SELECT DISTINCT pid, device_id, source FROM {store.table('server_gpus')}")
    assert (server_process.pid, GPU0, "nvml") in mapped
    assert (os.getpid(), GPU0, "nvml") in mapped  # the server process's parent
    assert (GHOST_PID, f"{GPU2}/gi1", "nvml") in mapped


@pytest.mark.skipif(nvml_library_present, reason="this machine has an NVIDIA driver")
def test_sampler_set_without_nvml_says_so_once_and_runs_the_rest(store, caplog):
    unreachable_port = free_port()
    with served_pages({"/metrics": b'vllm:num_requests_running{engine="0",model_name="small"} 1.0\n'}) as base:
        url = f"{base}/metrics"
        samplers = SamplerSet(
            store,
            "node-b",
            MonotonicWallClock(),
            nvml=NvmlSampler(),
            engines=[EngineScraper(url), EngineScraper(f"http://127.0.0.1:{unreachable_port}/metrics", timeout_s=5)],
            scrape_interval_s=0.05,
            flush_interval_s=0.2,
        )
        with caplog.at_level(logging.WARNING, logger="tokenprobe.agent.sampling.samplers"):
            samplers.start()
            wait_for(lambda: samplers.stats()["rows_written"].get("engine_samples", 0) >= 3, "engine rows")
            wait_for(lambda: sum(samplers.stats()["errors"].values()) >= 3, "repeated scrape failures")
            samplers.stop()

    stats = samplers.stats()
    assert stats["nvml"].startswith("No NVIDIA driver here")
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings.count(stats["nvml"]) == 1
    assert sum(f"127.0.0.1:{unreachable_port}" in message for message in warnings) == 1
    ports = store.query_rows(f"SELECT DISTINCT server_port, engine FROM {store.table('engine_samples')}")
    assert ports == [(urlsplit(url).port, "vllm")]
