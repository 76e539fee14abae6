"""Go's crypto/tls inside an executable: where its uprobes go.

Go links its TLS into the program, so the plaintext is read at
crypto/tls.(*Conn).Read and Write (and the handshake's end at
serverHandshake/clientHandshake), found by name in the symbol table. The
returns of Read and of the handshakes are probed at each RET instruction,
found by disassembling the function (capstone): a uretprobe rewrites the
return address on the goroutine's stack, which Go moves when it grows. Write
is read whole at its entry (bpf/go_tls.c says why). "Entry" is the first
instruction after the prologue's stack check: a goroutine whose stack must
grow runs the prologue twice (runtime.morestack starts the function again),
and a probe on the first instruction would see one Write twice. The kernel side (bpf/go_tls.c, "Go
crypto/tls") reads the register ABI of Go >= 1.17 on x86-64; this module
accepts Go >= 1.18, whose build information carries its version inline.

An executable without its symbol table (`go build -ldflags=-s`) cannot be
probed: GoTlsUnprobed names why, and its connections are counted as
tls_unprobed.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass

from .elf import (
    EM_X86_64,
    SHT_SYMTAB,
    MalformedElf,
    file_bytes,
    file_offset,
    find_in_file,
    machine,
    open_elf,
    symbol_entries,
)

__all__ = ["GO_TLS_HANDSHAKES", "GO_TLS_READ", "GO_TLS_WRITE", "GoTlsBinary", "GoTlsUnprobed", "go_tls_binary",
           "go_tls_in"]

GO_TLS_READ = "crypto/tls.(*Conn).Read"
GO_TLS_WRITE = "crypto/tls.(*Conn).Write"
GO_TLS_HANDSHAKES = ("crypto/tls.(*Conn).serverHandshake", "crypto/tls.(*Conn).clientHandshake")
# *net.TCPConn as a net.Conn: the one kind of tls.Conn transport whose socket the kernel side follows.
_TCP_CONN_ITABS = (b"go:itab.*net.TCPConn,net.Conn", b"go.itab.*net.TCPConn,net.Conn")  # Go >= 1.20, older
_ITAB_HASH_OFFSET = 16  # itab{inter, _type *T; hash uint32}: the same offset in the kernel side
_BUILDINFO_MAGIC = b"\xff Go buildinf:"
_MIN_GO_MINOR = 18
_MAX_VERSION_BYTES = 1024  # "go1.25-20250209-RC00 cl/724970549 +ff27d270c9 X:fieldtrack,boringcrypto": 71
# The probed functions are a few KiB of code (serverHandshake, the largest, 3 KiB in Go 1.19): a symbol
# claiming more is garbage, and its bytes would be copied and disassembled whole.
MAX_FUNCTION_BYTES = 1 << 20


class GoTlsUnprobed(ValueError):
    """This Go executable's TLS cannot be probed; the message says why."""


@dataclass(frozen=True)
class GoTlsBinary:
    version: str                        # "go1.19.8"
    tcp_conn_itab_hash: int
    returns: dict[str, tuple[int, ...]]  # function → offsets of its RET instructions (Write: none sought)
    entries: dict[str, int]              # function → offset of its body, past the stack check


def _links_go_tls(elf: mmap.mmap) -> bool:
    # Go keeps its function names in .gopclntab even when .symtab is stripped.
    return find_in_file(elf, GO_TLS_READ.encode()) >= 0


def _go_version(elf: mmap.mmap) -> str:
    at = find_in_file(elf, _BUILDINFO_MAGIC)
    if at < 0:
        raise GoTlsUnprobed(f"built by a Go older than 1.{_MIN_GO_MINOR}")
    header = file_bytes(elf, at, 32, "Go's build information")
    if not header[15] & 2:  # flag 2: the version is inline (Go >= 1.18)
        raise GoTlsUnprobed(f"built by a Go older than 1.{_MIN_GO_MINOR}")
    length, shift = 0, 0
    for pos in range(at + 32, at + 35):  # a uvarint length (a version's takes one byte), then the version
        byte = file_bytes(elf, pos, 1, "Go's version length")[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    else:
        raise MalformedElf("Go's version length runs past 3 bytes")
    if length > _MAX_VERSION_BYTES:
        raise MalformedElf(f"Go's version is said to be {length} bytes long")
    version = file_bytes(elf, pos + 1, length, "Go's version").decode("ascii", "replace")
    found = re.match(r"go1\.(\d+)", version)
    if not found or int(found[1]) < _MIN_GO_MINOR:
        raise GoTlsUnprobed(f"built by {version}; Go >= 1.{_MIN_GO_MINOR} is read")
    return version


def _disassemble(code: bytes, start: int, name: str) -> list[tuple[int, int, str, str]]:
    """Every instruction of a function, as (offset in it, size, mnemonic, operands)."""
    try:
        import capstone
    except ImportError:
        raise GoTlsUnprobed("capstone (pip install capstone) is not installed: "
                            "the functions' returns cannot be found") from None
    decoder = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    instructions = [(address - start, size, mnemonic, operands)
                    for address, size, mnemonic, operands in decoder.disasm_lite(code, start)]
    # A sweep that stopped early would miss returns: the calls would never end.
    if sum(size for _, size, _, _ in instructions) != len(code):
        raise GoTlsUnprobed(f"{name} does not disassemble whole")
    return instructions


def _ret_offsets(instructions: list[tuple[int, int, str, str]], name: str) -> tuple[int, ...]:
    rets = tuple(offset for offset, _, mnemonic, _ in instructions if mnemonic == "ret")
    if not rets:
        raise GoTlsUnprobed(f"{name} has no RET instruction to probe")
    return rets


def _body_offset(instructions: list[tuple[int, int, str, str]]) -> int:
    """Where the function's body starts: after the prologue's `cmp <sp>, [r14 + 0x10]; jbe morestack`
    (g.stackguard0 is at 0x10 of the goroutine R14 holds), or 0 for a function without that check."""
    for (_, _, mnemonic, operands), (offset, size, jump, _) in zip(instructions[:4], instructions[1:5]):
        if mnemonic == "cmp" and "r14" in operands and jump in ("jbe", "jb"):
            return offset + size
    return 0


def go_tls_binary(path: str) -> GoTlsBinary | None:
    """Where the probes go in the executable at `path`: None if it links no Go crypto/tls,
    GoTlsUnprobed if it does and cannot be probed (OSError, ValueError: no readable ELF file)."""
    elf, sections = open_elf(path)
    with elf:
        return go_tls_in(elf, sections)


def go_tls_in(elf: mmap.mmap, sections: list[tuple]) -> GoTlsBinary | None:
    """go_tls_binary of an ELF file already open (elf.open_elf)."""
    if not _links_go_tls(elf):
        return None
    if machine(elf) != EM_X86_64:
        raise GoTlsUnprobed("not an x86-64 executable: the register ABI read is x86-64's")
    version = _go_version(elf)
    probed = {GO_TLS_READ, GO_TLS_WRITE, *GO_TLS_HANDSHAKES}
    returns, entries, itab_hash = {}, {}, None
    for raw, value, size, shndx in symbol_entries(elf, sections, SHT_SYMTAB):
        name = raw.decode("utf-8", "replace")
        start = file_offset(sections, shndx, value)
        if start is None:
            continue
        if name in probed and size:
            if size > MAX_FUNCTION_BYTES:
                raise MalformedElf(f"{name} is said to be {size} bytes of code")
            instructions = _disassemble(file_bytes(elf, start, size, name), value, name)
            entries[name] = _body_offset(instructions)
            returns[name] = () if name == GO_TLS_WRITE else _ret_offsets(instructions, name)
        elif raw in _TCP_CONN_ITABS:
            itab_hash = int.from_bytes(file_bytes(elf, start + _ITAB_HASH_OFFSET, 4, "the *net.TCPConn itab"), "little")
    if GO_TLS_READ not in returns or GO_TLS_WRITE not in returns:
        raise GoTlsUnprobed("no symbol table (built with -ldflags=-s): crypto/tls.(*Conn).Read and "
                            "Write cannot be found")
    if itab_hash is None:
        raise GoTlsUnprobed("its TLS runs over no *net.TCPConn, the one transport whose socket is followed")
    return GoTlsBinary(version, itab_hash, returns, entries)
