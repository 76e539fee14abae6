"""The ELF readers against files any process on the node can map: hand-made attacks, hypothesis
mutations of a small valid file, and the memory each read may take.

The property: whatever the bytes, reading a file for its TLS (tls_libraries.elf_tls) returns an answer
and counts the file it skipped, by reason; the lower readers (open_elf, exported_names, go_tls_binary)
raise only OSError or ValueError (MalformedElf for an ELF file that lies), never an IndexError or a
struct.error, and never allocate by a size the file states.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenprobe.agent.capture.kernel import tls_libraries
from tokenprobe.agent.capture.kernel.elf import (
    MAX_SYMBOLS,
    MalformedElf,
    exported_names,
    open_elf,
)
from tokenprobe.agent.capture.kernel.go_tls import (
    GO_TLS_READ,
    GoTlsUnprobed,
    go_tls_binary,
)
from tokenprobe.agent.capture.kernel.tls_libraries import elf_tls, skipped_files

_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_DYNSYM = 1, 2, 3, 11
BUILDINFO = b"\xff Go buildinf:" + b"\x08\x02" + bytes(16) + b"\x08go1.19.8"  # magic, ptr size, flags, pad, version


def build_elf(*, go: bool = False) -> tuple[bytes, list[int]]:
    """A small valid x86-64 ELF file exporting SSL_read and SSL_write (with `go`, holding Go's names and
    build information and a .symtab naming crypto/tls.(*Conn).Read), and the offsets of its header fields
    (ELF header and section headers) for the mutations."""
    names = [b"SSL_read", b"SSL_write", *([GO_TLS_READ.encode()] if go else [])]
    strings = b"\0" + b"".join(name + b"\0" for name in names)
    text = b"\xc3" * 64  # ret: a function body that disassembles whole
    symbols = bytes(_SYMBOL.size)  # symbol 0 is the null one
    at = 1
    for name in names:
        symbols += _SYMBOL.pack(at, 0x12, 0, 4, 0x1000, 16)  # a global function in .text (section 4)
        at += len(name) + 1
    body = strings + symbols + text + (BUILDINFO if go else b"")
    data_at = _HEADER.size
    offsets = {"dynstr": data_at, "dynsym": data_at + len(strings), "text": data_at + len(strings) + len(symbols)}
    shoff = data_at + len(body)
    sections = [bytes(_SECTION.size),
                _SECTION.pack(0, SHT_STRTAB, 0, 0, offsets["dynstr"], len(strings), 0, 0, 1, 0),
                _SECTION.pack(0, SHT_DYNSYM, 0, 0, offsets["dynsym"], len(symbols), 1, 1, 8, _SYMBOL.size),
                _SECTION.pack(0, SHT_SYMTAB, 0, 0, offsets["dynsym"], len(symbols), 1, 1, 8, _SYMBOL.size),
                _SECTION.pack(0, SHT_PROGBITS, 6, 0x1000, offsets["text"], len(text), 0, 0, 16, 0)]
    header = _HEADER.pack(b"\x7fELF\x02\x01\x01" + bytes(9), 3, 62, 1, 0, 0, shoff, 0, _HEADER.size, 0, 0,
                          _SECTION.size, len(sections), 0)
    fields = [*_field_offsets(_HEADER, 0),
              *(f for i in range(len(sections)) for f in _field_offsets(_SECTION, shoff + i * _SECTION.size)),
              *(f for i in range(len(names) + 1) for f in _field_offsets(_SYMBOL, offsets["dynsym"] + i * _SYMBOL.size))]
    return header + body + b"".join(sections), fields


def _field_offsets(layout: struct.Struct, base: int) -> list[int]:
    sizes = {"I": 4, "Q": 8, "H": 2, "B": 1, "s": 16}
    offsets, at = [], base
    for code in layout.format.lstrip("<").replace("16s", "s"):
        offsets.append(at)
        at += sizes[code]
    return offsets


VALID, FIELDS = build_elf()
VALID_GO, GO_FIELDS = build_elf(go=True)
INTERESTING = [0, 1, 2, 3, 11, 24, 64, 999, 0x7FFF, 0xFFFF, 0xFFFFFFFF, 1 << 31, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]
_ids = itertools.count()


def _read_every_way(path: Path) -> None:
    """What the agent does with a mapped file, each reader alone; fails on any exception but the documented."""
    answer = elf_tls(str(path), ("fuzz", next(_ids)))  # a fresh cache key: the file is read every time
    assert isinstance(answer, tls_libraries.ElfTls)
    try:
        elf, sections = open_elf(str(path))
    except (OSError, ValueError):
        return
    with elf:
        try:
            list(exported_names(elf, sections))
        except MalformedElf:
            pass
    try:
        go_tls_binary(str(path))
    except (OSError, ValueError):  # GoTlsUnprobed and MalformedElf are ValueErrors
        pass


def _mutated(base: bytes, fields: list[int], edits: list[tuple[int, int, int]]) -> bytes:
    data = bytearray(base)
    for field, value, width in edits:
        at = fields[field % len(fields)]
        data[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(data)


def test_the_valid_files_are_read_whole(tmp_path: Path):
    """The base of the mutations is a file the readers accept, so they start from a parse that goes deep."""
    for data, go in ((VALID, False), (VALID_GO, True)):
        path = tmp_path / f"valid-{go}.so"
        path.write_bytes(data)
        assert elf_tls(str(path), ("valid", go)).openssl_io
        if go:  # the .symtab names Read, not Write: found, and refused for the lack of Write
            with pytest.raises(GoTlsUnprobed, match="no symbol table"):
                go_tls_binary(str(path))


def test_a_dynsym_linked_to_section_999_is_skipped_and_counted(tmp_path: Path):
    """Issue 35: an 8 KiB ELF whose .dynsym names section 999 as its strings crashed the start-up scan."""
    data = bytearray(VALID + bytes(8192 - len(VALID)))
    dynsym = struct.unpack_from("<Q", VALID, 0x28)[0] + 2 * _SECTION.size
    struct.pack_into("<I", data, dynsym + 40, 999)  # sh_link
    path = tmp_path / "libevil.so"
    path.write_bytes(bytes(data))
    before = skipped_files().get("malformed_elf", 0)
    assert elf_tls(str(path)) == tls_libraries.ElfTls(frozenset(), None)
    assert skipped_files()["malformed_elf"] == before + 1
    elf_tls(str(path))  # asked again at every rescan: counted once
    assert skipped_files()["malformed_elf"] == before + 1


HAND_MADE = {
    "empty": b"",
    "truncated_header": VALID[:40],
    "header_only": VALID[:64],
    "not_elf": b"#!/bin/sh\n" + bytes(100),
    "32_bit": b"\x7fELF\x01" + VALID[5:],
    "sections_past_the_end": _mutated(VALID, FIELDS, [(12, 0xFFFF, 2)]),           # e_shnum
    "section_offset_huge": _mutated(VALID, FIELDS, [(6, (1 << 63) - 1, 8)]),     # e_shoff
    "section_entries_tiny": _mutated(VALID, FIELDS, [(11, 1, 2)]),              # e_shentsize
    "strtab_size_huge": _mutated(VALID, FIELDS, [(14 + 10 + 5, (1 << 64) - 1, 8)]),  # .dynstr sh_size
    "strtab_empty": _mutated(VALID, FIELDS, [(14 + 10 + 5, 0, 8)]),
    "symtab_offset_huge": _mutated(VALID, FIELDS, [(14 + 20 + 4, 1 << 62, 8)]),  # .dynsym sh_offset
    "symtab_linked_to_itself": _mutated(VALID, FIELDS, [(14 + 20 + 6, 2, 4)]),
    "name_past_its_table": _mutated(VALID, FIELDS, [(14 + 50 + 6, 0xFFFFFFFF, 4)]),  # first symbol's st_name
    "overlapping_sections": _mutated(VALID, FIELDS, [(14 + 20 + 4, 64, 8), (14 + 20 + 5, 200, 8)]),
    "go_version_length_huge": VALID_GO.replace(b"\x08go1.19.8", b"\xff\xff\xff\x7fgo1.1"),
    "go_version_past_the_end": VALID_GO.replace(b"\x08go1.19.8", b"\xff\x07go1.19."),
    "go_buildinfo_at_the_end": VALID_GO.replace(b"\xff Go buildinf:", b"\xff Go buildinX:") + b"\xff Go buildinf:\x08",
    "go_function_size_huge": _mutated(VALID_GO, GO_FIELDS, [(14 + 50 + 6 * 3 + 5, 1 << 40, 8)]),
}


@pytest.mark.parametrize("name", sorted(HAND_MADE))
def test_hand_made_attacks_are_answered_or_counted(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.so"
    path.write_bytes(HAND_MADE[name])
    _read_every_way(path)


def test_a_fifo_at_a_mapped_path_is_skipped_without_waiting(tmp_path: Path):
    """A process can unlink the file it mapped and put a FIFO at the path /proc/PID/maps prints:
    opening that blocked the scan until someone wrote to it."""
    fifo = tmp_path / "libssl.so.3 (deleted)"
    os.mkfifo(fifo)
    before = skipped_files().get("unreadable", 0)
    scan = threading.Thread(target=elf_tls, args=(str(fifo),), daemon=True)
    scan.start()
    scan.join(5)
    if scan.is_alive():  # let the blocked open return, so the thread ends with the test
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO at a mapped path blocked the scan")
    assert skipped_files()["unreadable"] == before + 1


edits = st.lists(st.tuples(st.integers(0, 10_000), st.one_of(st.sampled_from(INTERESTING), st.integers(0, (1 << 64) - 1)),
                           st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=edits, go=st.booleans())
def test_mutated_headers_are_answered_or_counted(tmp_path: Path, edits, go):
    base, fields = (VALID_GO, GO_FIELDS) if go else (VALID, FIELDS)
    path = tmp_path / "mutated.so"
    path.write_bytes(_mutated(base, fields, edits))
    _read_every_way(path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(VALID_GO)), junk=st.binary(max_size=256))
def test_truncated_or_extended_files_are_answered_or_counted(tmp_path: Path, cut, junk):
    path = tmp_path / "cut.so"
    path.write_bytes(VALID_GO[:cut] + junk)
    _read_every_way(path)


def test_a_huge_table_of_empty_symbols_is_refused_before_it_is_walked(tmp_path: Path):
    """A sparse file of 100 MiB holding a .dynsym of 4M+ zeroed symbols: walking it would cost the scan
    seconds of CPU for nothing; it is refused at once."""
    path = tmp_path / "sparse.so"
    path.write_bytes(VALID)
    size = (MAX_SYMBOLS + 1) * _SYMBOL.size
    with open(path, "r+b") as f:
        f.truncate(len(VALID) + size)  # sparse: no disk, zero pages when read
    at = len(VALID)
    data = _mutated(VALID, FIELDS, [(14 + 20 + 4, at, 8), (14 + 20 + 5, size, 8)])  # .dynsym offset and size
    with open(path, "r+b") as f:
        f.write(data)
    before = skipped_files().get("malformed_elf", 0)
    started = time.perf_counter()
    elf_tls(str(path), ("huge", 0))
    assert time.perf_counter() - started < 0.5
    assert skipped_files()["malformed_elf"] == before + 1


def test_sizes_the_file_states_allocate_nothing(tmp_path: Path):
    """Every size field at its largest, in a 64 KiB file: reading it allocates well under the file's size."""
    data = bytearray(VALID_GO + bytes(65536 - len(VALID_GO)))
    huge = _mutated(bytes(data), GO_FIELDS, [(14 + 10 * s + 5, (1 << 63) - 1, 8) for s in range(1, 5)])
    path = tmp_path / "huge.so"
    path.write_bytes(huge)
    tracemalloc.start()
    try:
        _read_every_way(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
