"""Which TLS library each process uses, read from its ELF files, so that a
process whose TLS the probes cannot read is named rather than looking idle,
and so that every copy of OpenSSL the probes can read is found.

OpenSSL is found by content, whatever its file is called: any mapped ELF file
(a libssl, a wheel's bundled `libssl-<hash>.so.3`, or an executable with
OpenSSL linked in and its API exported, such as Node.js) that exports
SSL_read and SSL_write is probed. Go's crypto/tls and rustls are found by
their own names inside the file (Go's function table, rustls's crate paths),
which survive stripping; no uprobe of OpenSSL can ever see them.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["OPENSSL_IO", "ElfTls", "MappedElf", "TlsReach", "elf_tls", "mapped_elves", "tls_reach", "unreadable_tls"]

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_SHT_DYNSYM = 11
OPENSSL_IO = frozenset({b"SSL_read", b"SSL_write"})  # what a file must export to be probed as OpenSSL
# The OpenSSL API functions the probes attach to (agent/capture/probes.py); the rest of a file's symbols is dropped.
_OPENSSL_API = frozenset({b"SSL_read", b"SSL_read_ex", b"SSL_write", b"SSL_write_ex", b"SSL_do_handshake",
                          b"SSL_set_fd", b"SSL_set_bio", b"SSL_free", b"BIO_write"})
_GO_TLS = b"crypto/tls.(*Conn).Read"
# Rust keeps its crates' source paths (panic locations) in .rodata, stripped or not: ".../rustls-0.23.1/src/...".
_RUSTLS = b"/rustls-"


def _sections(elf: mmap.mmap) -> list[tuple]:
    header = _ELF64_HEADER.unpack_from(elf)
    if header[0][:4] != b"\x7fELF" or header[0][4] != 2:  # 64-bit ELF only: what this agent runs on
        raise ValueError("not a 64-bit ELF file")
    shoff, shentsize, shnum = header[6], header[11], header[12]
    return [_SECTION.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]


def _string(elf: mmap.mmap, table: tuple, offset: int) -> bytes:
    start = table[4] + offset
    return elf[start:elf.find(b"\0", start)]


def _exported(elf: mmap.mmap, sections: list[tuple]):
    """The names of the symbols the file defines and exports (its .dynsym)."""
    for section in sections:
        if section[1] != _SHT_DYNSYM:
            continue
        strings = sections[section[6]]
        for pos in range(section[4], section[4] + section[5], _SYMBOL.size):
            name, _info, _other, shndx, _value, _size = _SYMBOL.unpack_from(elf, pos)
            if name and shndx:
                yield _string(elf, strings, name)


def _open(path: str) -> tuple[mmap.mmap, list[tuple]]:
    with open(path, "rb") as f:
        elf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return elf, _sections(elf)
    except (ValueError, struct.error, IndexError):
        elf.close()
        raise ValueError(f"{path}: not a readable 64-bit ELF file") from None


@dataclass(frozen=True)
class ElfTls:
    """What one ELF file holds of TLS: the OpenSSL API functions it exports, and a TLS
    library no OpenSSL probe reads (`unprobed`, in words) found in its content."""

    openssl: frozenset[bytes]
    unprobed: str | None

    @property
    def openssl_io(self) -> bool:
        return OPENSSL_IO <= self.openssl


_NO_TLS = ElfTls(frozenset(), None)
_elf_cache: dict[tuple[str, int], ElfTls] = {}


def elf_tls(path: str, file_id: tuple[str, int] | None = None) -> ElfTls:
    """What TLS the ELF file at `path` holds; `file_id` (device, inode) caches the answer,
    since the agent asks again for every process mapping the file."""
    cached = _elf_cache.get(file_id) if file_id else None
    if cached is not None:
        return cached
    try:
        elf, sections = _open(path)
    except (OSError, ValueError):
        found = _NO_TLS
    else:
        with elf:
            openssl = frozenset(_OPENSSL_API.intersection(_exported(elf, sections)))
            unprobed = None
            if not OPENSSL_IO <= openssl:
                # Go keeps its function names in .gopclntab even when .symtab is stripped.
                if elf.find(_GO_TLS) >= 0:
                    unprobed = "Go crypto/tls"
                elif elf.find(_RUSTLS) >= 0:
                    unprobed = "rustls"
            found = ElfTls(openssl, unprobed)
    if file_id and len(_elf_cache) < 65536:
        _elf_cache[file_id] = found
    return found


@dataclass(frozen=True)
class MappedElf:
    path: str                   # as the process sees it
    file_id: tuple[str, int]    # (device, inode), from /proc/PID/maps


def mapped_elves(pid: int | str) -> list[MappedElf]:
    """The files process `pid` maps executable code from (its executable and shared objects), each once."""
    found: dict[tuple[str, int], MappedElf] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            # address perms offset dev inode path: only code, so each ELF file counts once.
            if len(fields) == 6 and "x" in fields[1] and fields[5].startswith("/"):
                file_id = (fields[3], int(fields[4]))
                found.setdefault(file_id, MappedElf(fields[5].rstrip("\n"), file_id))
    return list(found.values())


@dataclass(frozen=True)
class TlsReach:
    """What TLS library a process uses (`library`, in words) and whether the agent's
    OpenSSL uprobes read it (`probed`)."""

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
    openssl = ["OpenSSL linked into the executable" if path == exe else f"OpenSSL ({path})"
               for path, tls in held.items() if tls.openssl_io]
    if unprobed:
        beside = f"; TLS through its {openssl[0]} is read" if openssl else ""
        return TlsReach(pid, exe, ", ".join(unprobed) + beside, False)
    return TlsReach(pid, exe, openssl[0], True) if openssl else None


def unreadable_tls(pids: Iterable[int]) -> list[TlsReach]:
    """The processes among `pids` that use a TLS library the probes cannot read."""
    return [reach for reach in map(tls_reach, sorted(set(pids))) if reach and not reach.probed]
