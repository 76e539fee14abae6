"""`tokenprobe doctor`: what works on this node, in plain words, and what to do
about what does not."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from .capture.kernel.headers import choose_headers
from .capture.kernel.loader import ProbeError, Probes, Targets, openssl_copies
from .capture.kernel.tls_libraries import unreadable_tls

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    name: str
    state: str
    detail: str
    fix: str = ""


def _check_root() -> Check:
    if os.geteuid() == 0:
        return Check("privileges", OK, "running as root")
    return Check("privileges", FAIL, "not root: loading BPF programs needs CAP_BPF, CAP_PERFMON "
                 "and CAP_SYS_RESOURCE", "run as root, or grant those capabilities")


def _check_btf() -> Check:
    if Path("/sys/kernel/btf/vmlinux").exists():
        return Check("BTF", OK, "kernel type information at /sys/kernel/btf/vmlinux")
    return Check("BTF", WARN, "no /sys/kernel/btf/vmlinux: the probes cannot read an accepted socket's "
                 "addresses in the kernel, so the agent reads them from /proc (short-lived "
                 "connections may be missed)", "use a kernel built with CONFIG_DEBUG_INFO_BTF")


def _check_tracefs() -> Check:
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        events = Path(path) / "events"
        if events.is_dir():
            missing = [tp for tp in ("syscalls/sys_enter_read", "syscalls/sys_exit_accept4",
                                     "syscalls/sys_enter_sendto", "sched/sched_process_exec")
                       if not (events / tp).is_dir()]
            if missing:
                return Check("tracepoints", FAIL, f"tracefs at {path} lacks {', '.join(missing)}",
                             "use a kernel with CONFIG_FTRACE_SYSCALLS")
            return Check("tracepoints", OK, f"tracefs mounted at {path}; syscall and sched "
                         "tracepoints present")
    return Check("tracepoints", WARN, "tracefs is not mounted (the agent mounts it itself when root)",
                 "mount -t tracefs nodev /sys/kernel/tracing")


def _check_headers() -> Check:
    choice = choose_headers()
    if choice.exact:
        return Check("kernel headers", OK, choice.note)
    if choice.kernel_source is not None:
        return Check("kernel headers", WARN, choice.note)
    return Check("kernel headers", FAIL, choice.note,
                 "apt-get install linux-headers-$(uname -r), or Debian's newest linux-headers-6.12.*-amd64")


def _check_probe_types() -> list[Check]:
    devices = Path("/sys/bus/event_source/devices")
    checks = []
    if (devices / "uprobe").exists():
        checks.append(Check("uprobes", OK, "available: TLS plaintext through libssl"))
    else:
        checks.append(Check("uprobes", FAIL, "not available: HTTPS traffic cannot be decrypted",
                            "use a kernel with CONFIG_UPROBE_EVENTS"))
    if (devices / "kprobe").exists():
        checks.append(Check("kprobes", OK, "available (tokenprobe does not need them)"))
    else:
        checks.append(Check("kprobes", OK, "not available, and not needed: tokenprobe uses tracepoints"))
    return checks


def _check_bcc() -> Check:
    try:
        import bcc  # noqa: F401
    except ImportError:
        return Check("BCC", FAIL, "BCC's Python module is not importable",
                     "apt-get install bpfcc-tools python3-bpfcc (scripts/install.sh links it into the venv)")
    version = getattr(bcc, "__version__", "unknown version")
    return Check("BCC", OK, f"BCC {version}")


def _check_libssl() -> Check:
    paths = [copy.path for copy in openssl_copies()]
    if not paths:
        return Check("OpenSSL", WARN, "no OpenSSL found (no file exports SSL_read and SSL_write): HTTPS "
                     "served with another TLS library (rustls, BoringSSL without symbols, a Go binary without "
                     "symbols) is not decrypted", "serve TLS with OpenSSL, or terminate TLS in a proxy that uses it")
    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
    return Check("OpenSSL", OK, f"{len(paths)} found: {shown}")


def _check_tls_reach() -> Check:
    # Not the doctor itself: its store (chDB) links rustls, and it serves nothing.
    blind = unreadable_tls(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid())
    if not blind:
        return Check("TLS reach", OK, "no process uses a TLS library the probes cannot read")
    named = "; ".join(f"pid {r.pid} ({r.exe}): {r.library}" for r in blind[:8])
    more = f" and {len(blind) - 8} more" if len(blind) > 8 else ""
    return Check("TLS reach", WARN, f"TLS not readable in {len(blind)} process(es): {named}{more}; their "
                 "connections are counted as unsupported rows (reason tls_unprobed)",
                 "serve TLS with OpenSSL, or terminate TLS in a proxy that uses it")


def _check_nvml() -> Check:
    try:
        import pynvml
    except ImportError:
        return Check("NVML", WARN, "nvidia-ml-py is not installed: no GPU samples",
                     "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Check("NVML", WARN, f"no NVIDIA driver or GPU here ({exc}): requests are stored "
                     "without GPU state", "on GPU nodes, mount the driver's libnvidia-ml into the agent")
    try:
        count = pynvml.nvmlDeviceGetCount()
        return Check("NVML", OK, f"{count} GPU(s)")
    finally:
        pynvml.nvmlShutdown()


def _check_load() -> list[Check]:
    try:
        probes = Probes(Targets(ports=[1]))
    except (ProbeError, ValueError) as exc:
        return [Check("BPF load", FAIL, str(exc), "see the checks above")]
    try:
        sizes = ", ".join(f"{name} {size}" for name, size in probes.map_sizes().items())
        return [Check("BPF load", OK, f"the probes compile, pass the verifier and attach "
                      f"({len(probes.attached_ssl)} copies of OpenSSL probed)"),
                # This program's own maps are empty: a running agent's overflows are on its /metrics.
                Check("kernel maps", OK, f"entries each map holds (the ring buffer: bytes): {sizes}; every one is "
                      "an LRU or counts what it could not hold, which a running agent reports as "
                      "tokenprobe_agent_map_overflows_total{map=...} on /metrics and in its summary at stop")]
    finally:
        probes.close()


def run_checks(load: bool = True) -> list[Check]:
    checks = [Check("kernel", OK, f"{platform.release()} on {platform.machine()}"),
              _check_root(), _check_btf(), _check_tracefs(), _check_headers(), *_check_probe_types(),
              _check_bcc(), _check_libssl(), _check_tls_reach(), _check_nvml()]
    if load and os.geteuid() == 0:
        checks += _check_load()
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.state:>4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.state != OK:
            lines.append(f"{'':>4}  {'':<{width}}  → {c.fix}")
    failed = [c.name for c in checks if c.state == FAIL]
    lines.append("")
    lines.append("tokenprobe can run here." if not failed else
                 f"tokenprobe cannot run here until these are fixed: {', '.join(failed)}.")
    return "\n".join(lines)
