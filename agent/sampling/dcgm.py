"""GPU state from a dcgm-exporter ``/metrics`` page, as the same ``GpuReading`` rows NVML gives.

dcgm-exporter (3.x and 4.x) writes one series per field and device, labelled::

    DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-...",pci_bus_id="00000000:18:00.0",device="nvidia0",
        modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="node-1",
        DCGM_FI_DRIVER_VERSION="550.90.07",container="vllm",namespace="llm",pod="vllm-0"} 1234

``GPU_I_PROFILE``/``GPU_I_ID`` appear only for MIG instances (whose ``UUID`` is
the parent GPU's), ``pod``/``namespace``/``container`` only with Kubernetes
pod mapping, and ``DCGM_FI_*`` attribute labels as configured. Memory fields
are MiB; utilization is percent; profiling fields (``DCGM_FI_PROF_*``) are
ratios 0..1. Fields without a column of their own are kept in
``GpuReading.extra`` under their DCGM name. A series labelled
``simulated="true"`` (the reference server's stand-in feed) makes its device's
reading simulated.

Whatever a page holds, every reading fits the ``gpu_samples`` columns: an
integer field that is negative, not finite or too large for its column is left
empty and reported, so one bad value never costs the whole batch its insert.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .gpu import GpuReading, SamplerProblem, device_id_for
from .prom_text import Exposition, Sample, check_scrape_url, parse_exposition, scrape

MIB = 1024 * 1024

# DCGM field -> (GpuReading attribute, factor to the attribute's unit).
_COLUMNS: dict[str, tuple[str, int]] = {
    "DCGM_FI_DEV_FB_TOTAL": ("mem_total_bytes", MIB),
    "DCGM_FI_DEV_FB_USED": ("mem_used_bytes", MIB),
    "DCGM_FI_DEV_FB_FREE": ("mem_free_bytes", MIB),
    "DCGM_FI_DEV_FB_RESERVED": ("mem_reserved_bytes", MIB),
    "DCGM_FI_DEV_GPU_UTIL": ("gpu_util_pct", 1),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_util_pct", 1),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active", 1),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy", 1),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active", 1),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active", 1),
}
# Integer columns -> one past the largest value their gpu_samples column type holds.
_UINT16, _UINT32, _UINT64 = 2**16, 2**32, 2**64
_INTEGER_COLUMNS = {
    "mem_total_bytes": _UINT64, "mem_used_bytes": _UINT64, "mem_free_bytes": _UINT64, "mem_reserved_bytes": _UINT64,
    "sm_clock_mhz": _UINT32,
}  # fmt: skip
# ASCII digits only: str.isdigit() also takes "²", which int() refuses, and any length, which int() may too.
_LABEL_INTEGER = re.compile(r"[0-9]{1,10}")

# Labels that say which device (and which pod) a series is about, rather than
# what it measures. Every "DCGM_FI_*" label is a device attribute too.
_IDENTITY_LABELS = frozenset(
    {
        "gpu", "UUID", "uuid", "pci_bus_id", "device", "modelName", "Hostname",
        "GPU_I_PROFILE", "GPU_I_ID", "pod", "namespace", "container", "simulated",
    }
)  # fmt: skip


@dataclass
class DcgmRead:
    readings: list[GpuReading]
    problems: list[SamplerProblem]


@dataclass
class _Device:
    """Everything one scrape says about one device (a GPU or a MIG instance)."""

    gpu_uuid: str
    mig_gi_id: int | None
    gpu_index: int | None = None
    gpu_name: str = ""
    mig_profile: str = ""
    columns: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    pods: set[tuple[str, str, str]] = field(default_factory=set)
    simulated: bool = False
    out_of_range: list[str] = field(default_factory=list)  # DCGM fields whose value no column can hold


def readings_from_exposition(exposition: Exposition, ts_ns: int) -> DcgmRead:
    """Group dcgm-exporter series by device into readings stamped ``ts_ns``."""
    devices: dict[tuple[str, int | None], _Device] = {}
    unattributed = 0
    for sample in exposition.samples:
        if not sample.name.startswith("DCGM_FI_"):
            continue
        uuid = sample.labels.get("UUID") or sample.labels.get("uuid")
        if not uuid:
            unattributed += 1
            continue
        mig_gi_id = _integer_label(sample, "GPU_I_ID", _UINT32)
        device = devices.get((uuid, mig_gi_id))
        if device is None:
            device = devices[(uuid, mig_gi_id)] = _Device(uuid, mig_gi_id)
        _absorb(device, sample)

    problems = [
        SamplerProblem("dcgm unreadable line", f"dcgm-exporter line {problem.line_number} skipped: {problem.reason}")
        for problem in exposition.problems
    ]
    if exposition.problems_omitted:
        problems.append(SamplerProblem("dcgm unreadable line",
                                       f"{exposition.problems_omitted} more dcgm-exporter lines skipped"))
    if unattributed:
        problems.append(
            SamplerProblem("dcgm series without UUID", f"{unattributed} DCGM series had no UUID label and were skipped")
        )
    readings = [_reading(device, ts_ns) for device in devices.values()]
    problems += [
        SamplerProblem("dcgm value out of range",
                       f"{device.gpu_uuid}: {', '.join(device.out_of_range)} out of range for its column; left empty")
        for device in devices.values() if device.out_of_range
    ]  # fmt: skip
    return DcgmRead(readings, problems)


def parse_dcgm_text(text: str, ts_ns: int) -> DcgmRead:
    return readings_from_exposition(parse_exposition(text), ts_ns)


class DcgmScraper:
    """Scrapes one dcgm-exporter (default port 9400). ``read`` raises ``ScrapeError`` when unreachable.

    dcgm-exporter refreshes its values every collection interval (``-c``,
    30 s by default), so scraping faster than that repeats the same values.
    """

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = check_scrape_url(url)
        self.timeout_s = timeout_s

    def read(self, ts_ns: int) -> DcgmRead:
        return readings_from_exposition(scrape(self.url, self.timeout_s), ts_ns)


def _integer_label(sample: Sample, name: str, limit: int) -> int | None:
    text = sample.labels.get(name, "")
    value = int(text) if _LABEL_INTEGER.fullmatch(text) else None
    return value if value is not None and value < limit else None


def _fits(attribute: str, value: float) -> bool:
    """Whether ``value`` can be stored in the column ``attribute`` (always, for a float column)."""
    limit = _INTEGER_COLUMNS.get(attribute)
    return limit is None or (math.isfinite(value) and 0 <= round(value) < limit)


def _absorb(device: _Device, sample: Sample) -> None:
    labels = sample.labels
    if device.gpu_index is None:
        device.gpu_index = _integer_label(sample, "gpu", _UINT16)
    device.gpu_name = device.gpu_name or labels.get("modelName", "")
    device.mig_profile = device.mig_profile or labels.get("GPU_I_PROFILE", "")
    device.simulated = device.simulated or labels.get("simulated") == "true"
    pod = (labels.get("pod", ""), labels.get("namespace", ""), labels.get("container", ""))
    if any(pod):
        device.pods.add(pod)
    if math.isnan(sample.value):
        return  # DCGM writes NaN for a field it could not read this cycle: leave it empty
    column = _COLUMNS.get(sample.name)
    if column is not None:
        attribute, factor = column
        if _fits(attribute, sample.value * factor):
            device.columns[attribute] = sample.value * factor
        else:
            device.out_of_range.append(sample.name)
        return
    measure_labels = sorted((key, value) for key, value in labels.items() if not _is_identity_label(key))
    key = sample.name
    if measure_labels:  # e.g. DCGM_FI_DEV_XID_ERRORS{err_code="79",...}
        key += "{" + ",".join(f"{name}={value}" for name, value in measure_labels) + "}"
    device.extra[key] = sample.value


def _is_identity_label(name: str) -> bool:
    return name in _IDENTITY_LABELS or name.startswith("DCGM_FI_")


def _reading(device: _Device, ts_ns: int) -> GpuReading:
    columns: dict[str, float | int] = {
        name: round(value) if name in _INTEGER_COLUMNS else value for name, value in device.columns.items()
    }
    parts = [columns.get(name) for name in ("mem_used_bytes", "mem_free_bytes")]
    if "mem_total_bytes" not in columns and None not in parts:
        # Older default counter sets carry no FB_TOTAL: used + free + reserved is the whole frame buffer.
        total = sum(parts) + columns.get("mem_reserved_bytes", 0)
        if _fits("mem_total_bytes", total):
            columns["mem_total_bytes"] = total
    pods, namespaces, containers = _joined_pod_labels(device.pods)
    return GpuReading(
        ts_ns=ts_ns,
        source="dcgm",
        device_id=device_id_for(device.gpu_uuid, device.mig_gi_id),
        gpu_uuid=device.gpu_uuid,
        gpu_index=device.gpu_index,
        gpu_name=device.gpu_name,
        mig_profile=device.mig_profile,
        mig_gi_id=device.mig_gi_id,
        pod=pods,
        namespace=namespaces,
        container=containers,
        extra=device.extra,
        simulated=device.simulated,
        **columns,
    )


def _joined_pod_labels(pods: Iterable[tuple[str, str, str]]) -> tuple[str, str, str]:
    """A device shared by several pods (time-slicing) lists them all, comma-separated, in one order."""
    ordered = sorted(pods)
    return tuple(",".join(pod[part] for pod in ordered) for part in range(3))  # type: ignore[return-value]
