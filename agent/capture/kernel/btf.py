"""Struct member offsets of the running kernel, read from its BTF.

The probes read a few kernel structs directly (an accepted socket's
addresses, through the task's fd table) where no tracepoint hands them over.
Those layouts depend on the kernel's version and configuration, and the
headers BCC compiles against may belong to another kernel, so the offsets are
taken from /sys/kernel/btf/vmlinux, which describes the running kernel itself,
and passed to the compiler as constants.
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

BTF_MAGIC = 0xEB9F
_KIND_STRUCT, _KIND_UNION = 4, 5
# Bytes that follow the 12-byte common header, per kind: fixed, and per vlen entry.
_EXTRA = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0),
          15: (0, 12), 17: (4, 0), 19: (0, 12)}

# (struct, member path) → the constant the BPF program is compiled with.
# A path goes through anonymous structs and unions without naming them.
SOCKET_OFFSETS = {
    "OFF_TASK_FILES": ("task_struct", "files"),
    "OFF_FILES_FDT": ("files_struct", "fdt"),
    "OFF_FDT_MAX_FDS": ("fdtable", "max_fds"),
    "OFF_FDT_FD": ("fdtable", "fd"),
    "OFF_FILE_PRIVATE": ("file", "private_data"),
    "OFF_SOCKET_SK": ("socket", "sk"),
    "OFF_SK_DADDR": ("sock_common", "skc_daddr"),
    "OFF_SK_DPORT": ("sock_common", "skc_dport"),
    "OFF_SK_NUM": ("sock_common", "skc_num"),
    "OFF_SK_FAMILY": ("sock_common", "skc_family"),
    "OFF_SK_V6_DADDR": ("sock_common", "skc_v6_daddr"),
}


class BtfError(RuntimeError):
    pass


class Btf:
    """The struct and union types of one BTF blob, by name."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 24:
            raise BtfError("BTF blob too short")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", blob)
        if magic != BTF_MAGIC:
            raise BtfError(f"not BTF (magic {magic:#x})")
        self._strings = blob[hdr_len + str_off:hdr_len + str_off + str_len]
        # type id → (kind, [(member name, member type id, bit offset)]); id 0 is void.
        self._members: dict[int, tuple[int, list[tuple[str, int, int]]]] = {}
        self._by_name: dict[str, int] = {}
        pos, end, type_id = hdr_len + type_off, hdr_len + type_off + type_len, 0
        while pos < end:
            type_id += 1
            name_off, info, _size = struct.unpack_from("<III", blob, pos)
            kind, vlen, kind_flag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            pos += 12
            if kind in (_KIND_STRUCT, _KIND_UNION):
                members = []
                for m_name, m_type, m_off in struct.iter_unpack("<III", blob[pos:pos + 12 * vlen]):
                    # With kind_flag the low 24 bits are the offset, the high 8 a bitfield size.
                    members.append((self._name(m_name), m_type, m_off & 0xFFFFFF if kind_flag else m_off))
                self._members[type_id] = (kind, members)
                name = self._name(name_off)
                if name and vlen and name not in self._by_name:
                    self._by_name[name] = type_id
            fixed, per_entry = _EXTRA.get(kind, (0, 0))
            pos += fixed + per_entry * vlen

    def _name(self, off: int) -> str:
        return self._strings[off:self._strings.index(b"\0", off)].decode()

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of a member in a struct, looking into anonymous members."""
        type_id = self._by_name.get(struct_name)
        if type_id is None:
            raise BtfError(f"struct {struct_name} is not in the kernel's BTF")
        found = self._find(type_id, member)
        if found is None or found % 8:
            raise BtfError(f"struct {struct_name} has no byte-aligned member {member}")
        return found // 8

    def _find(self, type_id: int, member: str) -> int | None:
        for name, m_type, bit_off in self._members[type_id][1]:
            if name == member:
                return bit_off
            if not name and m_type in self._members:
                inner = self._find(m_type, member)
                if inner is not None:
                    return bit_off + inner
        return None


def socket_offset_flags(path: Path = VMLINUX_BTF) -> list[str]:
    """-D flags with the offsets the probes need to read an fd's socket."""
    try:
        btf = Btf(path.read_bytes())
    except OSError as exc:
        raise BtfError(f"cannot read the kernel's BTF at {path}: {exc}") from exc
    return [f"-D{macro}={btf.offset(*where)}" for macro, where in SOCKET_OFFSETS.items()]
