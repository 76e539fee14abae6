"""`tokenprobe doctor`: what works on this node, in plain words, and what to do
about what does not.

What the kernel allows is tried, not inferred: the capabilities in effect are read, a trivial BPF program is
loaded (EPERM from capabilities or a seccomp filter is named as such), and every copy of OpenSSL found must be
probed by the real load, else the check fails with the reason (a read-only tracefs without CAP_SYS_ADMIN).
With ``--port`` it also looks at one server: who listens, its TLS library and whether the probes read it, and
the API of a request, if one arrives while it waits.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..contract.measures import is_inference
from .capture.kernel.clock import MonotonicWallClock
from .capture.kernel.headers import choose_headers
from .capture.kernel.loader import ProbeError, Probes, Targets, openssl_copies
from .capture.kernel.privileges import (
    CAPABILITIES,
    GRANT,
    bpf_refusal,
    effective_capabilities,
    missing_for_bpf,
    tracefs,
    try_bpf_load,
    uprobe_refusal,
)
from .capture.kernel.procfs import target_port_sockets
from .capture.kernel.tls_libraries import mapped_elves, tls_reach, unreadable_tls
from .capture.tracker import ConnectionTracker

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    name: str
    state: str
    detail: str
    fix: str = ""


def _check_capabilities() -> Check:
    held = effective_capabilities()
    shown = ", ".join(f"{name} {'yes' if name in held else 'no'}" for name in CAPABILITIES)
    missing = missing_for_bpf(held)
    if missing:
        return Check("capabilities", FAIL, f"in effect: {shown}; loading BPF programs needs {' and '.join(missing)}",
                     GRANT)
    if "CAP_SYS_PTRACE" not in held and "CAP_SYS_ADMIN" not in held:
        return Check("capabilities", WARN, f"in effect: {shown}; without CAP_SYS_PTRACE other processes' "
                     "libraries and executables cannot be read (TLS libraries, --exe targets)", GRANT)
    return Check("capabilities", OK, f"in effect: {shown}")


def _check_bpf_syscall() -> Check:
    refused = try_bpf_load()
    if refused == 0:
        return Check("bpf()", OK, "the kernel loads a BPF tracepoint program from this process")
    if refused < 0:
        return Check("bpf()", WARN, f"not tried on {platform.machine()}: the BPF load below tells")
    refusal = bpf_refusal(refused)
    return Check("bpf()", FAIL, refusal.cause, refusal.fix)


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
            refused = uprobe_refusal()
            if refused is not None:
                return Check("tracepoints", WARN, f"syscall and sched tracepoints present; {refused.cause}: "
                             "TLS uprobes cannot attach", refused.fix)
            writable = "read-write" if tracefs().writable else "read-only (uprobes go through CAP_SYS_ADMIN)"
            return Check("tracepoints", OK, f"tracefs mounted at {path}, {writable}; syscall and sched "
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


def _unprobed_fix() -> str:
    refused = uprobe_refusal()
    return refused.fix if refused else "the reason above, as the agent's warning 'OpenSSL in … not probed' gives it"


def _check_openssl_probed(probes: Probes) -> Check:
    """Every copy of OpenSSL the load found must have been probed: one found but not probed means HTTPS
    through it is not read, which must not pass for health."""
    unprobed = sorted(probes.unprobed_ssl)
    found = len(probes.attached_ssl) + len(unprobed)
    if not unprobed:
        return Check("TLS probes", OK, f"all {found} copies of OpenSSL found probed")
    reasons = "; ".join(sorted(set(probes.unprobed_ssl.values())))
    return Check("TLS probes", FAIL, f"{len(unprobed)} of {found} copies of OpenSSL could not be probed, so HTTPS "
                 f"through them is not read ({', '.join(unprobed)}): {reasons}", _unprobed_fix())


def _check_load(port: int | None, servers: list[int], wait_s: float) -> list[Check]:
    print("compiling and loading the probes (11-60 s)…", file=sys.stderr, flush=True)
    try:
        probes = Probes(Targets(ports=[port or 1]))
    except (ProbeError, ValueError) as exc:
        return [Check("BPF load", FAIL, str(exc), "see the checks above")]
    try:
        sizes = ", ".join(f"{name} {size}" for name, size in probes.map_sizes().items())
        checks = [Check("BPF load", OK, "the probes compile, pass the verifier and attach"),
                  _check_openssl_probed(probes),
                  # This program's own maps are empty: a running agent's overflows are on its /metrics.
                  Check("kernel maps", OK, f"entries each map holds (the ring buffer: bytes): {sizes}; every one is "
                        "an LRU or counts what it could not hold, which a running agent reports as "
                        "tokenprobe_agent_map_overflows_total{map=...} on /metrics and in its summary at stop")]
        checks += [_check_server_tls(probes, pid) for pid in servers]
        if servers:
            print(f"waiting up to {wait_s:g} s for a request to port {port}…", file=sys.stderr, flush=True)
            checks.append(_sample_request(probes, port, wait_s))
        return checks
    finally:
        probes.close()


def _check_listener(port: int) -> tuple[Check, list[int]]:
    """Who listens on ``port`` (the processes, to look at their TLS once the probes are loaded)."""
    owners = sorted({owner.pid for owner in target_port_sockets({port})[0]})
    if not owners:
        return Check(f"port {port}", FAIL, f"nothing listens on port {port}", "start the server, or give its port"), []
    listeners = ", ".join(f"pid {pid} ({_exe(pid)})" for pid in owners)
    return Check(f"port {port}", OK, f"listened on by {listeners}"), owners


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return "?"


def _check_server_tls(probes: Probes, pid: int) -> Check:
    reach = tls_reach(pid)
    if reach is None:
        return Check(f"TLS of pid {pid}", OK, "maps no TLS library: plain HTTP (or TLS ended before it)")
    if not reach.probed:
        return Check(f"TLS of pid {pid}", FAIL, f"{reach.library}: no probe reads it; its connections are stored as "
                     "unsupported rows", "serve TLS with OpenSSL, or terminate TLS in a proxy that uses it")
    try:
        mapped = {os.path.realpath(f"/proc/{pid}/root{elf.path}") for elf in mapped_elves(pid)}
    except OSError:
        mapped = set()
    own = sorted(mapped & set(probes.unprobed_ssl))
    if own:
        return Check(f"TLS of pid {pid}", FAIL, f"{reach.library}, but {', '.join(own)} could not be probed "
                     f"({probes.unprobed_ssl[own[0]]})", _unprobed_fix())
    return Check(f"TLS of pid {pid}", OK, f"{reach.library}: probed")


def _sample_request(probes: Probes, port: int, wait_s: float) -> Check:
    """The first inference request to ``port`` within ``wait_s``, traced as the agent would: its API."""
    seen: list[dict] = []
    tracker = ConnectionTracker(seen.append, clock=MonotonicWallClock(), fingerprint_key=os.urandom(32),
                                target_ports={port}, forget_connection=probes.forget_connection,
                                restart_connection=probes.restart_connection, steady=probes, unseen_ends=probes)
    probes.open(tracker.handle)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not any(is_inference(row) for row in seen):
        probes.poll(100)
    tracker.close_all(time.monotonic_ns())
    inference = [row for row in seen if is_inference(row)]
    if not inference:
        others = f" ({len(seen)} other requests)" if seen else ""
        return Check("sample request", WARN, f"no inference request (a POST) reached port {port} within "
                     f"{wait_s:g} s{others}", "send one while doctor waits, or wait longer with --wait")
    row = inference[0]
    api = row.get("api") or "unknown"
    detail = (f"{row['method']} {row['path']} → {row['status']}, API {api}, {row['token_events']} token events, "
              f"capture {row['capture']}" + (", over TLS" if row.get("tls") else ""))
    if api == "unknown" or row.get("capture") != "exact":
        return Check("sample request", WARN, detail, "see docs/servers.md for the APIs and stacks read")
    return Check("sample request", OK, detail)


def run_checks(load: bool = True, port: int | None = None, wait_s: float = 10.0) -> list[Check]:
    checks = [Check("kernel", OK, f"{platform.release()} on {platform.machine()}"),
              _check_capabilities(), _check_bpf_syscall(), _check_btf(), _check_tracefs(), _check_headers(),
              *_check_probe_types(), _check_bcc(), _check_libssl(), _check_tls_reach(), _check_nvml()]
    servers: list[int] = []
    if port is not None:
        listener, servers = _check_listener(port)
        checks.append(listener)
    if load and not any(c.state == FAIL and c.name in ("capabilities", "bpf()") for c in checks):
        checks += _check_load(port, servers, wait_s)
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
