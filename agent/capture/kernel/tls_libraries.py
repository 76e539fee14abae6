"""Which TLS library each process uses, read from its ELF files, so that a
process whose TLS the probes cannot read is named rather than looking idle,
and so that every copy of OpenSSL the probes can read is found.

OpenSSL is found by content, whatever its file is called: any mapped ELF file
(a libssl, a wheel's bundled `libssl-<hash>.so.3`, or an executable with
OpenSSL linked in and its API exported, such as Node.js) that exports
SSL_read and SSL_write is probed. Go's crypto/tls and rustls are found by
their own names inside the file (Go's function table, rustls's crate paths),
which survive stripping; no uprobe of OpenSSL can ever see them. Go's is
probed where the file keeps its symbol table (go_tls.py); rustls is not.

The files are whatever other processes map, so any of them may be hostile: a
file that cannot be read as ELF is skipped (no TLS found in it) and counted by
reason (skipped_files), once per file; nothing read from it can raise past
elf_tls.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .elf import MalformedElf, exported_names, find_in_file, open_elf
from .go_tls import GoTlsBinary, GoTlsUnprobed, go_tls_in

__all__ = ["OPENSSL_IO", "ElfTls", "MappedElf", "TlsReach", "elf_tls", "mapped_elves", "skipped_files", "tls_reach", "unreadable_tls"]

OPENSSL_IO = frozenset({b"SSL_read", b"SSL_write"})  # what a file must export to be probed as OpenSSL
# The OpenSSL API functions the probes attach to (agent/capture/kernel/loader.py); the rest of a file's symbols is dropped.
_OPENSSL_API = frozenset({b"SSL_read", b"SSL_read_ex", b"SSL_write", b"SSL_write_ex", b"SSL_do_handshake",
                          b"SSL_set_fd", b"SSL_set_bio", b"SSL_free", b"BIO_write", b"BIO_read"})
# Rust keeps its crates' source paths (panic locations) in .rodata, stripped or not: ".../rustls-0.23.1/src/...".
_RUSTLS = b"/rustls-"


@dataclass(frozen=True)
class ElfTls:
    """What one ELF file holds of TLS: the OpenSSL API functions it exports, Go's crypto/tls
    where its probes go (`go`), and a TLS library no probe reads (`unprobed`, in words)
    found in its content."""

    openssl: frozenset[bytes]
    unprobed: str | None
    go: GoTlsBinary | None = None

    @property
    def openssl_io(self) -> bool:
        return OPENSSL_IO <= self.openssl


log = logging.getLogger(__name__)

_NO_TLS = ElfTls(frozenset(), None)
_elf_cache: dict[tuple[str, int], ElfTls] = {}
# Files skipped, by reason: "unreadable" (gone, no access, not a regular file), "not_elf",
# "malformed_elf" (an ELF file whose headers contradict themselves or its size).
_skipped: Counter[str] = Counter()
# A process mapping more distinct files than this is read for its first ones only (the kernel's
# vm.max_map_count, 65530 by default, is the only other bound): a server maps hundreds.
MAX_MAPPED_FILES = 8192


def skipped_files() -> dict[str, int]:
    """Mapped files the scans skipped since the agent started, by reason (each file once while cached)."""
    return dict(_skipped)


def _skip(path: str, reason: str, why: Exception) -> ElfTls:
    _skipped[reason] += 1
    if _skipped[reason] <= 20:  # a process mapping thousands of bad files must not flood the log
        log.warning("skipped %s (%s): %s", path, reason, why)
    return _NO_TLS


def file_id_of(path: str) -> tuple[str, int] | None:
    """A file's (device, inode) as /proc/PID/maps prints them; None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino


def elf_tls(path: str, file_id: tuple[str, int] | None = None) -> ElfTls:
    """What TLS the ELF file at `path` holds; `file_id` (device, inode; read from the file when
    not given) caches the answer, since the agent asks again at every rescan and for every
    process mapping the file (a full read of a large library takes a good part of a second)."""
    file_id = file_id or file_id_of(path)
    cached = _elf_cache.get(file_id) if file_id else None
    if cached is not None:
        return cached
    try:
        found = _read_tls(path)
    except OSError as why:
        found = _skip(path, "unreadable", why)
    except (MalformedElf, IndexError, OverflowError, struct.error) as why:  # the last three: a check missed
        found = _skip(path, "malformed_elf", why)
    except ValueError as why:
        found = _skip(path, "not_elf", why)
    if file_id and len(_elf_cache) < 65536:
        _elf_cache[file_id] = found
    return found


def _read_tls(path: str) -> ElfTls:
    elf, sections = open_elf(path)
    with elf:
        openssl = frozenset(_OPENSSL_API.intersection(exported_names(elf, sections)))
        unprobed, go = None, None
        if not OPENSSL_IO <= openssl:
            try:
                go = go_tls_in(elf, sections)
            except GoTlsUnprobed as why:
                unprobed = f"Go crypto/tls, {why}"
            if go is None and unprobed is None and find_in_file(elf, _RUSTLS) >= 0:
                unprobed = "rustls"
        return ElfTls(openssl, unprobed, go)


@dataclass(frozen=True)
class MappedElf:
    path: str                   # as the process sees it
    file_id: tuple[str, int]    # (device, inode), from /proc/PID/maps


def mapped_elves(pid: int | str) -> list[MappedElf]:
    """The files process `pid` maps executable code from (its executable and shared objects), each once,
    at most MAX_MAPPED_FILES of them (those past it counted as skipped, reason "too_many_files")."""
    found: dict[tuple[str, int], MappedElf] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            # address perms offset dev inode path: only code, so each ELF file counts once.
            if len(fields) == 6 and "x" in fields[1] and fields[5].startswith("/") and fields[4].isdigit():
                file_id = (fields[3], int(fields[4]))
                if file_id not in found and len(found) == MAX_MAPPED_FILES:
                    _skipped["too_many_files"] += 1
                    continue
                found.setdefault(file_id, MappedElf(fields[5].rstrip("\n"), file_id))
    return list(found.values())


@dataclass(frozen=True)
class TlsReach:
    """What TLS library a process uses (`library`, in words) and whether the agent's
    uprobes read it (`probed`)."""

    pid: int
    exe: str
    library: str
    probed: bool


def tls_reach(pid: int) -> TlsReach | None:
    """What TLS library process `pid` uses; None if it maps none the agent knows of. A TLS
    library no probe reads is named first: the process serves through it, even if it maps a
    libssl too (asyncio imports one)."""
    root = f"/proc/{pid}/root"
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        mapped = mapped_elves(pid)
    except OSError:
        return None
    held = {elf.path: elf_tls(root + elf.path, elf.file_id) for elf in sorted(mapped, key=lambda m: m.path)}
    unprobed = [tls.unprobed + ("" if path == exe else f" ({path})") for path, tls in held.items() if tls.unprobed]
    probed = [*("OpenSSL linked into the executable" if path == exe else f"OpenSSL ({path})"
                for path, tls in held.items() if tls.openssl_io),
              *(f"Go crypto/tls ({tls.go.version})" + ("" if path == exe else f" in {path}")
                for path, tls in held.items() if tls.go)]
    if unprobed:
        beside = f"; TLS through its {probed[0]} is read" if probed else ""
        return TlsReach(pid, exe, ", ".join(unprobed) + beside, False)
    return TlsReach(pid, exe, probed[0], True) if probed else None


def unreadable_tls(pids: Iterable[int]) -> list[TlsReach]:
    """The processes among `pids` that use a TLS library the probes cannot read."""
    return [reach for reach in map(tls_reach, sorted(set(pids))) if reach and not reach.probed]
