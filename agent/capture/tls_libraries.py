"""Which TLS library each process uses, read from its ELF files, so that a
process whose TLS the probes cannot read is named rather than looking idle.

libssl is found by content (a mapped shared object whose DT_SONAME is
libssl.so*, whatever its file is called); OpenSSL or BoringSSL linked into the
executable by its exported SSL_read/SSL_write; Go's crypto/tls (probed where
its executable keeps its symbol table, see go_tls.py) and rustls by their
symbols, which no uprobe of libssl can ever see.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .elf import (
    SHT_DYNAMIC,
    SHT_DYNSYM,
    SHT_SYMTAB,
    open_elf,
    string_at,
    symbol_entries,
)
from .go_tls import GoTlsUnprobed, go_tls_binary

__all__ = ["TlsReach", "dynamic_symbols", "soname", "tls_reach", "unreadable_tls"]

_DYN = struct.Struct("<qQ")
_DT_SONAME = 14
_SSL_IO = (b"SSL_read", b"SSL_write")
_RUSTLS = b"rustls"


def _symbols(elf: mmap.mmap, sections: list[tuple], kind: int, defined_only: bool):
    for name, _value, _size, shndx in symbol_entries(elf, sections, kind):
        if shndx or not defined_only:
            yield name


def soname(path: str) -> str | None:
    """The shared object's DT_SONAME, None if it has none or is no ELF file."""
    try:
        elf, sections = open_elf(path)
    except (OSError, ValueError):
        return None
    with elf:
        for section in sections:
            if section[1] == SHT_DYNAMIC:
                for pos in range(section[4], section[4] + section[5], _DYN.size):
                    tag, value = _DYN.unpack_from(elf, pos)
                    if tag == _DT_SONAME:
                        return string_at(elf, sections[section[6]], value).decode("latin-1")
    return None


def dynamic_symbols(path: str) -> set[bytes]:
    """The symbols the file defines and exports (its .dynsym)."""
    elf, sections = open_elf(path)
    with elf:
        return set(_symbols(elf, sections, SHT_DYNSYM, defined_only=True))


@dataclass(frozen=True)
class TlsReach:
    """What TLS library a process uses (`library`, in words) and whether the agent's
    uprobes read it (`probed`)."""

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
        elf, sections = open_elf(root + exe)
    except (OSError, ValueError):
        return None
    with elf:
        if all(name in exported for name in _SSL_IO):
            # Its SSL_read/SSL_write could be probed in the executable; the agent does not yet.
            return TlsReach(pid, exe, "static OpenSSL", False)
        try:
            go = go_tls_binary(root + exe)
        except GoTlsUnprobed as why:
            return TlsReach(pid, exe, f"Go crypto/tls, {why}", False)
        if go:
            return TlsReach(pid, exe, f"Go crypto/tls ({go.version})", True)
        if any(_RUSTLS in name for name in _symbols(elf, sections, SHT_SYMTAB, defined_only=True)):
            return TlsReach(pid, exe, "rustls", False)
    return None


def unreadable_tls(pids: Iterable[int]) -> list[TlsReach]:
    """The processes among `pids` that use a TLS library the probes cannot read."""
    return [reach for reach in map(tls_reach, sorted(set(pids))) if reach and not reach.probed]
