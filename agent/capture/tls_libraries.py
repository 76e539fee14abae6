"""Which TLS library each process uses, read from its ELF files, so that a
process whose TLS the probes cannot read is named rather than looking idle.

libssl is found by content (a mapped shared object whose DT_SONAME is
libssl.so*, whatever its file is called); OpenSSL or BoringSSL linked into the
executable by its exported SSL_read/SSL_write; Go's crypto/tls and rustls by
their symbols, which no uprobe of libssl can ever see.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["TlsReach", "dynamic_symbols", "soname", "tls_reach", "unreadable_tls"]

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_DYN = struct.Struct("<qQ")
_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_DT_SONAME = 14
_SSL_IO = (b"SSL_read", b"SSL_write")
_GO_TLS = b"crypto/tls.(*Conn).Read"
_RUSTLS = b"rustls"


def _sections(elf: mmap.mmap) -> list[tuple]:
    header = _ELF64_HEADER.unpack_from(elf)
    if header[0][:4] != b"\x7fELF" or header[0][4] != 2:  # 64-bit ELF only: what this agent runs on
        raise ValueError("not a 64-bit ELF file")
    shoff, shentsize, shnum = header[6], header[11], header[12]
    return [_SECTION.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]


def _string(elf: mmap.mmap, table: tuple, offset: int) -> bytes:
    start = table[4] + offset
    return elf[start:elf.find(b"\0", start)]


def _symbols(elf: mmap.mmap, sections: list[tuple], kind: int, defined_only: bool):
    for section in sections:
        if section[1] != kind:
            continue
        strings = sections[section[6]]
        for pos in range(section[4], section[4] + section[5], _SYMBOL.size):
            name, _info, _other, shndx, _value, _size = _SYMBOL.unpack_from(elf, pos)
            if name and (shndx or not defined_only):
                yield _string(elf, strings, name)


def _open(path: str) -> tuple[mmap.mmap, list[tuple]]:
    with open(path, "rb") as f:
        elf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return elf, _sections(elf)
    except (ValueError, struct.error, IndexError):
        elf.close()
        raise ValueError(f"{path}: not a readable 64-bit ELF file") from None


def soname(path: str) -> str | None:
    """The shared object's DT_SONAME, None if it has none or is no ELF file."""
    try:
        elf, sections = _open(path)
    except (OSError, ValueError):
        return None
    with elf:
        for section in sections:
            if section[1] == _SHT_DYNAMIC:
                for pos in range(section[4], section[4] + section[5], _DYN.size):
                    tag, value = _DYN.unpack_from(elf, pos)
                    if tag == _DT_SONAME:
                        return _string(elf, sections[section[6]], value).decode("latin-1")
    return None


def dynamic_symbols(path: str) -> set[bytes]:
    """The symbols the file defines and exports (its .dynsym)."""
    elf, sections = _open(path)
    with elf:
        return set(_symbols(elf, sections, _SHT_DYNSYM, defined_only=True))


@dataclass(frozen=True)
class TlsReach:
    """What TLS library a process uses (`library`, in words) and whether the agent's
    libssl uprobes read it (`probed`)."""

    pid: int
    exe: str
    library: str
    probed: bool


def tls_reach(pid: int) -> TlsReach | None:
    """What TLS library process `pid` uses; None if it maps none the agent knows of."""
    root = f"/proc/{pid}/root"
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        with open(f"/proc/{pid}/maps") as maps:
            mapped = {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and "/" in line}
    except (OSError, IndexError):
        return None
    for path in sorted(mapped):
        if ".so" in path and (soname(root + path) or "").startswith("libssl.so"):
            return TlsReach(pid, exe, f"OpenSSL ({path})", True)
    try:
        exported = dynamic_symbols(root + exe)
        elf, sections = _open(root + exe)
    except (OSError, ValueError):
        return None
    with elf:
        if all(name in exported for name in _SSL_IO):
            # Its SSL_read/SSL_write could be probed in the executable; the agent does not yet.
            return TlsReach(pid, exe, "static OpenSSL", False)
        # Go keeps its function names in .gopclntab even when .symtab is stripped.
        if elf.find(_GO_TLS) >= 0:
            return TlsReach(pid, exe, "Go crypto/tls", False)
        if any(_RUSTLS in name for name in _symbols(elf, sections, _SHT_SYMTAB, defined_only=True)):
            return TlsReach(pid, exe, "rustls", False)
    return None


def unreadable_tls(pids: Iterable[int]) -> list[TlsReach]:
    """The processes among `pids` that use a TLS library the probes cannot read."""
    return [reach for reach in map(tls_reach, sorted(set(pids))) if reach and not reach.probed]
