"""Struct offsets from BTF: a hand-built blob with the shapes the kernel uses
(members inside anonymous unions and structs, bitfields), and the running
kernel's own BTF where it has one."""

from __future__ import annotations

import struct

import pytest
from tokenprobe.agent.capture.kernel.btf import (
    VMLINUX_BTF,
    Btf,
    BtfError,
    socket_offset_flags,
)

INT, PTR, STRUCT, UNION = 1, 2, 4, 5


def btf_blob(types: list[tuple[str, int, int, int, list[tuple[str, int, int]]]], kind_flag: set[int] = frozenset()):
    """BTF bytes from (name, kind, size_or_type, int_bits, members); members are (name, type id, bit offset)."""
    strings = bytearray(b"\0")

    def name_off(name: str) -> int:
        if not name:
            return 0
        off = len(strings)
        strings.extend(name.encode() + b"\0")
        return off

    body = bytearray()
    for type_id, (name, kind, size, bits, members) in enumerate(types, start=1):
        flag = 1 << 31 if type_id in kind_flag else 0
        body += struct.pack("<III", name_off(name), flag | kind << 24 | len(members), size)
        if kind == INT:
            body += struct.pack("<I", bits)
        for m_name, m_type, m_off in members:
            body += struct.pack("<III", name_off(m_name), m_type, m_off)
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(strings))
    return header + bytes(body) + bytes(strings)


def test_offsets_through_anonymous_members_and_bitfields():
    blob = btf_blob([
        ("int", INT, 4, 32, []),                                          # 1
        ("", STRUCT, 8, 0, [("skc_daddr", 1, 0), ("skc_rcv_saddr", 1, 32)]),  # 2: anonymous
        ("", UNION, 8, 0, [("skc_addrpair", 1, 0), ("", 2, 0)]),          # 3: anonymous
        ("sock_common", STRUCT, 24, 0, [("", 3, 0), ("skc_state", 1, 64), ("skc_reuse", 1, 4 << 24 | 96),
                                        ("skc_num", 1, 128)]),            # 4
        ("", PTR, 4, 0, []),                                              # 5
    ], kind_flag={4})
    btf = Btf(blob)
    assert btf.offset("sock_common", "skc_rcv_saddr") == 4
    assert btf.offset("sock_common", "skc_num") == 16
    assert btf.offset("sock_common", "skc_reuse") == 12  # bitfield size in the high bits is ignored
    with pytest.raises(BtfError, match="no byte-aligned member skc_missing"):
        btf.offset("sock_common", "skc_missing")
    with pytest.raises(BtfError, match="struct task_struct is not in"):
        btf.offset("task_struct", "files")


def test_not_btf_is_refused():
    with pytest.raises(BtfError, match="not BTF"):
        Btf(b"\x00" * 64)
    with pytest.raises(BtfError, match="too short"):
        Btf(b"\x9f\xeb")


@pytest.mark.skipif(not VMLINUX_BTF.exists(), reason="this kernel has no BTF")
def test_running_kernel_offsets():
    flags = dict(flag[2:].split("=") for flag in socket_offset_flags())
    offsets = {name: int(value) for name, value in flags.items()}
    # Layouts every kernel shares: the address pair, then the port pair.
    assert offsets["OFF_SK_DADDR"] == 0
    assert offsets["OFF_SK_NUM"] == offsets["OFF_SK_DPORT"] + 2
    assert offsets["OFF_FDT_FD"] > offsets["OFF_FDT_MAX_FDS"]
