"""What this process may do with BPF, found by asking the kernel rather than by its uid.

A container's root may lack capabilities, a runtime's seccomp profile may refuse ``bpf()`` with EPERM
whatever the capabilities, and uprobes need CAP_SYS_ADMIN or a writable tracefs (without CAP_SYS_ADMIN the
uprobe PMU answers EACCES and BCC falls back to writing tracefs ``uprobe_events``). `tokenprobe doctor` and
the loader's errors name the cause from here, so that a refusal is never blamed on the kernel headers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass
from pathlib import Path

CAPABILITIES = {"CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24, "CAP_PERFMON": 38, "CAP_BPF": 39}
_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}
_BPF_PROG_LOAD = 5
_BPF_PROG_TYPE_TRACEPOINT = 5  # a tracing type: the kernel asks for CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN)
# r0 = 0; exit: the smallest program the verifier accepts.
_RETURN_ZERO = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])


class _ProgLoadAttr(ctypes.Structure):
    """The head of ``union bpf_attr`` for BPF_PROG_LOAD (the kernel takes a shorter attr as zero-extended)."""

    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32)]


def _status_field(name: str) -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return ""


def effective_capabilities() -> set[str]:
    """The capabilities of CAPABILITIES this process holds in effect (CapEff), by name."""
    held = int(_status_field("CapEff") or "0", 16)
    return {name for name, bit in CAPABILITIES.items() if held >> bit & 1}


def seccomp_filtered() -> bool:
    """Whether a seccomp filter applies to this process (mode 2), which may refuse bpf() with EPERM."""
    return _status_field("Seccomp") == "2"


def try_bpf_load() -> int:
    """Loads a two-instruction tracepoint program and closes it: 0 if the kernel took it, else the errno
    (EPERM: refused by capabilities or seccomp; ENOSYS: no bpf() here). -1 where the syscall is not known."""
    number = _BPF_SYSCALL.get(platform.machine())
    if number is None:
        return -1
    insns = ctypes.create_string_buffer(_RETURN_ZERO, len(_RETURN_ZERO))
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoadAttr(prog_type=_BPF_PROG_TYPE_TRACEPOINT, insn_cnt=len(_RETURN_ZERO) // 8,
                         insns=ctypes.addressof(insns), license=ctypes.addressof(license_))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(ctypes.c_long(number), ctypes.c_int(_BPF_PROG_LOAD), ctypes.byref(attr),
                      ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def missing_for_bpf(held: set[str]) -> list[str]:
    """The capabilities loading the probes needs that ``held`` lacks (CAP_SYS_ADMIN stands in for both)."""
    if "CAP_SYS_ADMIN" in held:
        return []
    return [name for name in ("CAP_BPF", "CAP_PERFMON") if name not in held]


GRANT = ("run as root, or grant CAP_BPF, CAP_PERFMON, CAP_SYS_RESOURCE and CAP_SYS_PTRACE (and CAP_SYS_ADMIN "
         "for TLS uprobes, unless tracefs is mounted read-write)")


@dataclass(frozen=True)
class Refusal:
    cause: str
    fix: str

    def __str__(self) -> str:
        return f"{self.cause}; fix: {self.fix}"


def bpf_refusal(error_number: int) -> Refusal:
    """Why bpf() was refused with ``error_number``, and the fix."""
    if error_number == errno.ENOSYS:
        return Refusal("this kernel has no bpf() system call", "use a kernel built with CONFIG_BPF_SYSCALL")
    refused = f"bpf() is refused ({errno.errorcode.get(error_number, error_number)})"
    held = effective_capabilities()
    missing = missing_for_bpf(held)
    if missing:
        return Refusal(f"{refused}: this process lacks {' and '.join(missing)}", GRANT)
    if seccomp_filtered():
        holding = ", ".join(sorted(held & {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN"}))
        return Refusal(f"{refused} although this process holds {holding}: a seccomp filter forbids it",
                       "run with a seccomp profile that allows bpf and perf_event_open (the project's, in "
                       "deploy/), not an older runtime's default")
    return Refusal(f"{refused} though no capability is missing and no seccomp filter applies",
                   "a Linux security module (SELinux, AppArmor, lockdown) may forbid it: see the kernel log")


@dataclass(frozen=True)
class Tracefs:
    path: str | None       # where tracefs is mounted, None if nowhere
    writable: bool         # whether uprobe_events can be written there


def tracefs() -> Tracefs:
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.isdir(os.path.join(path, "events")):
            return Tracefs(path, os.access(os.path.join(path, "uprobe_events"), os.W_OK))
    return Tracefs(None, False)


def uprobe_refusal() -> Refusal | None:
    """Why uprobes cannot attach here, where that can be told without trying: no CAP_SYS_ADMIN (the uprobe
    PMU refuses) and a tracefs that cannot be written (BCC's fallback). None where nothing stands in the way."""
    if "CAP_SYS_ADMIN" in effective_capabilities():
        return None
    mount = tracefs()
    if mount.writable:
        return None
    where = f"tracefs at {mount.path} is read-only" if mount.path else "tracefs is not mounted"
    return Refusal(f"without CAP_SYS_ADMIN the kernel's uprobe PMU refuses (EACCES) and BCC falls back to tracefs "
                   f"uprobe_events, but {where}",
                   "mount tracefs read-write (the DaemonSet's /sys/kernel/tracing hostPath, not readOnly) or grant "
                   "CAP_SYS_ADMIN")
