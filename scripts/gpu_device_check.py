#!/usr/bin/env python3
"""Device check: the NVML sampler on a real NVIDIA GPU, while this process allocates and frees GPU memory.

Run on a machine with an NVIDIA GPU and driver (the test suite never needs it):

    python scripts/gpu_device_check.py [--seconds 20] [--hz 10] [--gib 2]

For about 20 s it samples every GPU through ``tokenprobe.agent.sampling.gpu.NvmlSampler``
at 10 Hz while, on the first GPU, it: waits (baseline), allocates ``--gib`` GiB,
allocates as much again, then frees both. Memory is allocated with torch when
torch can see a GPU, else through the CUDA driver API (libcuda.so.1) via
ctypes; either way it is written to, so it is really resident. It prints one
line per second per device, then checks what it read:

- NVML listed at least one device and answered every tick;
- used memory rose by about the allocations and fell back after the frees;
- this process appeared in the device's process list (a warning only, not a
  failure: inside a container without the host's PID namespace NVML reports
  host pids, which differ from ours).

Exit status: 0 when the checks pass, 1 when one fails, 2 when NVML or CUDA is
not there at all.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from dataclasses import dataclass

from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.sampling.gpu import GpuReading, NvmlSampler

GIB = 1024**3
MIB = 1024**2
PHASES = ("baseline", "allocated 1x", "allocated 2x", "freed")


class CudaDriverAllocator:
    """Allocates device memory through the CUDA driver API, for machines without torch."""

    def __init__(self) -> None:
        try:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise RuntimeError(f"no CUDA driver library (libcuda.so.1): {error}") from None
        self._check(self._cuda.cuInit(0), "cuInit")
        self._device = ctypes.c_int()
        self._check(self._cuda.cuDeviceGet(ctypes.byref(self._device), 0), "cuDeviceGet")
        # The primary context: the one the runtime (and torch) would use; its API is stable across CUDA versions.
        context = ctypes.c_void_p()
        retained = self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), self._device)
        self._check(retained, "cuDevicePrimaryCtxRetain")
        self._check(self._cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        self._blocks: list[ctypes.c_uint64] = []
        self.name = "CUDA driver API (ctypes)"

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._cuda.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({result})")

    def allocate(self, size: int) -> None:
        pointer = ctypes.c_uint64()
        self._check(self._cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)), "cuMemAlloc")
        # Touch every byte so the memory is resident, and the GPU does some work.
        self._check(self._cuda.cuMemsetD8_v2(pointer, ctypes.c_ubyte(0xA5), ctypes.c_size_t(size)), "cuMemsetD8")
        self._check(self._cuda.cuCtxSynchronize(), "cuCtxSynchronize")
        self._blocks.append(pointer)

    def free_all(self) -> None:
        while self._blocks:
            self._check(self._cuda.cuMemFree_v2(self._blocks.pop()), "cuMemFree")

    def close(self) -> None:
        self.free_all()
        self._cuda.cuDevicePrimaryCtxRelease_v2(self._device)


class TorchAllocator:
    """Allocates device memory with torch; ``empty_cache`` hands freed memory back to the driver."""

    def __init__(self, torch) -> None:
        self._torch = torch
        self._tensors: list = []
        self.name = f"torch {torch.__version__}"
        torch.zeros(1, device="cuda")  # create the context before the baseline

    def allocate(self, size: int) -> None:
        self._tensors.append(self._torch.full((size,), 0xA5, dtype=self._torch.uint8, device="cuda"))
        self._torch.cuda.synchronize()

    def free_all(self) -> None:
        self._tensors.clear()
        self._torch.cuda.synchronize()
        self._torch.cuda.empty_cache()

    def close(self) -> None:
        self.free_all()


def make_allocator():
    try:
        import torch
    except ImportError:
        return CudaDriverAllocator()
    if not torch.cuda.is_available():
        return CudaDriverAllocator()
    return TorchAllocator(torch)


@dataclass
class Tick:
    elapsed_s: float
    phase: str
    readings: list[GpuReading]


def own_bytes(reading: GpuReading) -> int | None:
    for process in reading.processes:
        if process.pid == os.getpid():
            return process.used_bytes or 0
    return None


def describe(reading: GpuReading) -> str:
    def show(value, unit="", scale=1.0, digits=0):
        return "-" if value is None else f"{value / scale:.{digits}f}{unit}"

    mine = own_bytes(reading)
    return (
        f"{reading.device_id[:40]:40} used {show(reading.mem_used_bytes, ' MiB', MIB):>11}"
        f" free {show(reading.mem_free_bytes, ' MiB', MIB):>11} util {show(reading.gpu_util_pct, '%'):>4}"
        f" sm {show(reading.sm_clock_mhz, ' MHz'):>8} power {show(reading.power_w, ' W', digits=1):>8}"
        f" temp {show(reading.temp_c, ' C'):>5} procs {len(reading.processes)}"
        f" this process {'-' if mine is None else show(mine, ' MiB', MIB)}"
    )


def run(seconds: float, hz: float, allocation: int) -> int:
    sampler = NvmlSampler()
    why_not = sampler.start()
    if why_not is not None:
        print(why_not)
        return 2
    try:
        allocator = make_allocator()
    except RuntimeError as error:
        print(f"cannot allocate GPU memory: {error}")
        sampler.close()
        return 2
    print(f"allocating with {allocator.name}; sampling at {hz:g} Hz for {seconds:g} s; pid {os.getpid()}")
    clock = MonotonicWallClock()
    ticks: list[Tick] = []
    problems: list[str] = []
    phase_s = seconds / len(PHASES)
    start = time.monotonic()
    phase_done = 0
    try:
        while (elapsed := time.monotonic() - start) < seconds:
            phase = min(int(elapsed / phase_s), len(PHASES) - 1)
            while phase_done < phase:  # enter the next phase once
                phase_done += 1
                if PHASES[phase_done].startswith("allocated"):
                    allocator.allocate(allocation)
                else:
                    allocator.free_all()
            result = sampler.read(clock.to_wall_ns(time.monotonic_ns()))
            problems += [problem.message for problem in result.problems]
            ticks.append(Tick(elapsed, PHASES[phase], result.readings))
            if len(ticks) == 1 or int(elapsed) != int(ticks[-2].elapsed_s):
                for reading in result.readings:
                    print(f"{elapsed:5.1f}s {PHASES[phase]:>12}  {describe(reading)}")
            time.sleep(max(0.0, start + len(ticks) / hz - time.monotonic()))
    finally:
        allocator.close()
        sampler.close()
    return verdict(ticks, problems, allocation)


def verdict(ticks: list[Tick], problems: list[str], allocation: int) -> int:
    failures: list[str] = []
    if problems:
        failures.append(f"NVML problems: {sorted(set(problems))}")
    if not ticks or not ticks[0].readings:
        print("FAIL: NVML listed no GPU")
        return 1
    # The allocations land on the device where this process shows up; without that, on the first one.
    devices = [reading.device_id for reading in ticks[-1].readings]
    ours = {reading.device_id for tick in ticks for reading in tick.readings if own_bytes(reading) is not None}
    target = next(iter(ours)) if ours else devices[0]
    used_by_phase: dict[str, list[int]] = {phase: [] for phase in PHASES}
    for tick in ticks:
        for reading in tick.readings:
            if reading.device_id == target and reading.mem_used_bytes is not None:
                used_by_phase[tick.phase].append(reading.mem_used_bytes)
    # Each phase's settled level: its median, which ignores the ticks taken mid-allocation.
    level = {phase: sorted(values)[len(values) // 2] for phase, values in used_by_phase.items() if values}
    if len(level) < len(PHASES):
        failures.append(f"no memory readings in phases {[p for p in PHASES if p not in level]}")
    else:
        rise = level["allocated 2x"] - level["baseline"]
        fall = level["allocated 2x"] - level["freed"]
        print(
            f"\n{target}: baseline {level['baseline'] / MIB:.0f} MiB, +1x {level['allocated 1x'] / MIB:.0f} MiB,"
            f" +2x {level['allocated 2x'] / MIB:.0f} MiB, freed {level['freed'] / MIB:.0f} MiB"
            f" (allocated {2 * allocation / MIB:.0f} MiB in all)"
        )
        if rise < 0.9 * 2 * allocation:
            failures.append(f"used memory rose by {rise / MIB:.0f} MiB, expected about {2 * allocation / MIB:.0f}")
        if fall < 0.9 * 2 * allocation:
            failures.append(f"used memory fell by {fall / MIB:.0f} MiB after the frees")
    if ours:
        print(f"this process (pid {os.getpid()}) was listed on {sorted(ours)}")
    else:
        print(f"WARNING: pid {os.getpid()} never appeared in NVML's process lists (a container PID namespace?)")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("PASS" if not failures else "FAILED")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to sample (default %(default)s)")
    parser.add_argument("--hz", type=float, default=10.0, help="sampling rate (default %(default)s)")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB per allocation step (default %(default)s)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.hz <= 0 or args.gib <= 0:
        parser.error("--seconds, --hz and --gib must be positive")
    return run(args.seconds, args.hz, int(args.gib * GIB))


if __name__ == "__main__":
    sys.exit(main())
