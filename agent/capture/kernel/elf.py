"""The little of 64-bit ELF the agent reads itself: section headers, symbol
tables and strings, from a read-only mapping of the file.

Any process on the node can map a file of its making, and the agent reads every
mapped file at its scans: so every field read here is checked against the file
before it is used, and nothing is allocated by a size the file states. A file
that breaks a rule raises MalformedElf (a ValueError) naming which; the callers
skip the file and count it (tls_libraries.skipped_files)."""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Iterator

__all__ = ["EM_X86_64", "MAX_NAME_BYTES", "MAX_SECTIONS", "MAX_SYMBOLS", "SHT_DYNSYM", "SHT_NOBITS", "SHT_SYMTAB", "MalformedElf",
           "exported_names", "file_bytes", "file_offset", "find_in_file", "machine", "open_elf", "string_at",
           "symbol_entries"]

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
SHT_SYMTAB, SHT_STRTAB, SHT_NOBITS, SHT_DYNSYM = 2, 3, 8, 11
EM_X86_64 = 62
# e_shnum is 16 bits: no real file nears this; a bound kept explicit all the same.
MAX_SECTIONS = 65535
# Every name the agent looks for is under 64 bytes: a longer one is read as its first
# MAX_NAME_BYTES, which match nothing sought, so a string table without NULs costs no more.
MAX_NAME_BYTES = 256
# Symbols a table may hold: the largest here (node's .symtab) holds 110k; a table past this is refused
# before it is walked, so a file cannot buy seconds of the scan with a huge table of empty symbols.
MAX_SYMBOLS = 1 << 22
# A whole-file search reads this much of the mapping at a time, and lets its pages go before the next:
# the files are other processes' (a GPU server maps libraries of a gigabyte and more), and a search that
# kept every page it read held the file's whole size in the agent's RSS (+508 MiB for chDB's 530 MiB one).
SEARCH_WINDOW = 16 << 20


class MalformedElf(ValueError):
    """An ELF file whose headers contradict themselves or the file's size; the message says how."""


def _sections(elf: mmap.mmap) -> list[tuple]:
    if len(elf) < _ELF64_HEADER.size:
        raise ValueError("shorter than an ELF header")
    header = _ELF64_HEADER.unpack_from(elf)
    if header[0][:4] != b"\x7fELF" or header[0][4] != 2:  # 64-bit ELF only: what this agent runs on
        raise ValueError("not a 64-bit ELF file")
    shoff, shentsize, shnum = header[6], header[11], header[12]
    if not shnum:
        return []
    if shentsize < _SECTION.size or shnum > MAX_SECTIONS or shoff + shnum * shentsize > len(elf):
        raise MalformedElf(f"{shnum} section headers of {shentsize} bytes at {shoff} do not fit the file")
    return [_SECTION.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]


def open_elf(path: str) -> tuple[mmap.mmap, list[tuple]]:
    """The file mapped read-only and its section headers; ValueError if it is no 64-bit ELF file
    (MalformedElf if it claims to be one and is not), OSError if it is not a regular file.

    Opened without blocking and checked to be a regular file before it is mapped: the path comes
    from another process's memory map, and that process may have put a FIFO at it since."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        elf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        return elf, _sections(elf)
    except MalformedElf as why:
        elf.close()
        raise MalformedElf(f"{path}: {why}") from None
    except ValueError:
        elf.close()
        raise ValueError(f"{path}: not a 64-bit ELF file") from None


def machine(elf: mmap.mmap) -> int:
    """The header's e_machine (EM_X86_64, ...)."""
    return _ELF64_HEADER.unpack_from(elf)[2]


def file_bytes(elf: mmap.mmap, offset: int, size: int, what: str) -> bytes:
    """`size` bytes of the file at `offset`; MalformedElf if they run past its end."""
    if offset < 0 or offset + size > len(elf):
        raise MalformedElf(f"{what}: {size} bytes at {offset} run past the file's end ({len(elf)} bytes)")
    return elf[offset:offset + size]


def _extent(elf: mmap.mmap, section: tuple, what: str) -> tuple[int, int]:
    """(start, end) in the file of a section that must lie whole inside it."""
    start, size = section[4], section[5]
    if start + size > len(elf):
        raise MalformedElf(f"{what}: {size} bytes at {start} run past the file's end ({len(elf)} bytes)")
    return start, start + size


def find_in_file(elf: mmap.mmap, needle: bytes) -> int:
    """Where ``needle`` first occurs in the mapped file, or -1; at most SEARCH_WINDOW of the file resident
    in the agent at once."""
    for start in range(0, len(elf), SEARCH_WINDOW):
        at = elf.find(needle, start, min(len(elf), start + SEARCH_WINDOW + len(needle) - 1))
        # The pages stay in the page cache (the file's owner maps them); only the agent's hold on them goes.
        elf.madvise(mmap.MADV_DONTNEED, start, min(SEARCH_WINDOW, len(elf) - start))
        if at >= 0:
            return at
    return -1


def string_at(elf: mmap.mmap, table: tuple[int, int], offset: int) -> bytes:
    """The NUL-terminated string at `offset` of a string table (its extent), at most MAX_NAME_BYTES of it."""
    start, end = table
    if offset >= end - start:
        raise MalformedElf(f"a name at {offset} lies outside its string table ({end - start} bytes)")
    stop = min(end, start + offset + MAX_NAME_BYTES)
    nul = elf.find(b"\0", start + offset, stop)
    return elf[start + offset:stop if nul < 0 else nul]


def symbol_entries(elf: mmap.mmap, sections: list[tuple], kind: int) -> Iterator[tuple[bytes, int, int, int]]:
    """(name, value, size, section index) of each named symbol in the tables of `kind`."""
    for section in sections:
        if section[1] != kind:
            continue
        link = section[6]
        if not 0 < link < len(sections) or sections[link][1] != SHT_STRTAB:
            raise MalformedElf(f"a symbol table's strings are said to be in section {link}, "
                               f"which is no string table (of {len(sections)} sections)")
        strings = _extent(elf, sections[link], "a string table")
        start, end = _extent(elf, section, "a symbol table")
        if (end - start) // _SYMBOL.size > MAX_SYMBOLS:
            raise MalformedElf(f"a symbol table of {(end - start) // _SYMBOL.size} symbols (at most {MAX_SYMBOLS})")
        for pos in range(start, end - _SYMBOL.size + 1, _SYMBOL.size):
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
