"""The little of 64-bit ELF the agent reads itself: section headers, symbol
tables and strings, from a read-only mapping of the file."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator

__all__ = ["EM_X86_64", "SHT_DYNSYM", "SHT_NOBITS", "SHT_SYMTAB", "exported_names", "file_offset", "machine",
           "open_elf", "string_at", "symbol_entries"]

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
SHT_SYMTAB, SHT_NOBITS, SHT_DYNSYM = 2, 8, 11
EM_X86_64 = 62


def _sections(elf: mmap.mmap) -> list[tuple]:
    header = _ELF64_HEADER.unpack_from(elf)
    if header[0][:4] != b"\x7fELF" or header[0][4] != 2:  # 64-bit ELF only: what this agent runs on
        raise ValueError("not a 64-bit ELF file")
    shoff, shentsize, shnum = header[6], header[11], header[12]
    return [_SECTION.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]


def open_elf(path: str) -> tuple[mmap.mmap, list[tuple]]:
    """The file mapped read-only and its section headers; ValueError if it is no 64-bit ELF file."""
    with open(path, "rb") as f:
        elf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return elf, _sections(elf)
    except (ValueError, struct.error, IndexError):
        elf.close()
        raise ValueError(f"{path}: not a readable 64-bit ELF file") from None


def machine(elf: mmap.mmap) -> int:
    """The header's e_machine (EM_X86_64, ...)."""
    return _ELF64_HEADER.unpack_from(elf)[2]


def string_at(elf: mmap.mmap, table: tuple, offset: int) -> bytes:
    start = table[4] + offset
    return elf[start:elf.find(b"\0", start)]


def symbol_entries(elf: mmap.mmap, sections: list[tuple], kind: int) -> Iterator[tuple[bytes, int, int, int]]:
    """(name, value, size, section index) of each named symbol in the tables of `kind`."""
    for section in sections:
        if section[1] != kind:
            continue
        strings = sections[section[6]]
        for pos in range(section[4], section[4] + section[5], _SYMBOL.size):
            name, _info, _other, shndx, value, size = _SYMBOL.unpack_from(elf, pos)
            if name:
                yield string_at(elf, strings, name), value, size, shndx


def exported_names(elf: mmap.mmap, sections: list[tuple]) -> Iterator[bytes]:
    """The names of the symbols the file defines and exports (its .dynsym)."""
    for name, _value, _size, shndx in symbol_entries(elf, sections, SHT_DYNSYM):
        if shndx:
            yield name


def file_offset(sections: list[tuple], shndx: int, address: int) -> int | None:
    """Where in the file the byte at `address` of section `shndx` lies; None if it has no bytes there."""
    if not 0 < shndx < len(sections):
        return None
    _name, kind, _flags, start, offset, size = sections[shndx][:6]
    if kind == SHT_NOBITS or not start <= address < start + size:
        return None
    return offset + address - start
