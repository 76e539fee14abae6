"""Naming each process's TLS library from its ELF files: OpenSSL by what a file
exports (a libssl whatever its name, OpenSSL linked into an executable such as the
image's Node.js 20), Go's crypto/tls by its symbols (and where its return probes
go), rustls by its crate paths in a stripped extension module."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenprobe.agent.capture.kernel.go_tls import (
    GO_TLS_READ,
    GO_TLS_WRITE,
    GoTlsUnprobed,
    go_tls_binary,
)
from tokenprobe.agent.capture.kernel.loader import openssl_copies
from tokenprobe.agent.capture.kernel.tls_libraries import (
    TlsReach,
    elf_tls,
    tls_reach,
    unreadable_tls,
)

from tests.support import mapped_libssl
from tests.test_kernel_matrix import build_go_server

NODE = "/usr/bin/node"
GRANIAN = glob.glob(str(Path(sys.executable).parent.parent / "lib/python3*/site-packages/granian/_granian*.so"))


def _holding(*argv: str) -> subprocess.Popen:
    """A process that maps what `argv` loads and then waits."""
    proc = subprocess.Popen(argv)
    time.sleep(0.5)
    return proc


def test_a_libssl_under_another_name_is_found_by_what_it_exports(tmp_path: Path):
    renamed = tmp_path / "libtls-vendored-9f3e.so"
    shutil.copy(mapped_libssl(), renamed)
    assert elf_tls(str(renamed)).openssl_io and not elf_tls(__file__).openssl_io  # not ELF
    holder = _holding(sys.executable, "-c", f"import ctypes, time; ctypes.CDLL({str(renamed)!r}); time.sleep(30)")
    try:
        (copy,) = [c for c in openssl_copies([holder.pid]) if c.path.endswith(str(renamed))]
        reach = tls_reach(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    # Found through the process's own root, with the libcrypto it loaded beside it for BIO_write.
    assert copy.path == f"/proc/{holder.pid}/root{renamed}" and "libcrypto" in copy.crypto
    assert (reach.library, reach.probed) == (f"OpenSSL ({renamed})", True)


def test_openssl_linked_into_the_executable_is_probed_in_the_executable():
    assert {b"SSL_read", b"SSL_write", b"SSL_set_bio", b"BIO_write"} <= elf_tls(NODE).openssl
    node = _holding(NODE, "-e", "setTimeout(() => {}, 30000)")
    try:
        (copy,) = [c for c in openssl_copies([node.pid]) if c.path.endswith(NODE)]
        assert copy.crypto == copy.path  # BIO_write is in the executable too
        assert unreadable_tls([node.pid]) == []
        assert (tls_reach(node.pid).library, tls_reach(node.pid).probed) == ("OpenSSL linked into the executable", True)
    finally:
        node.kill()
        node.wait()


def test_go_crypto_tls_is_probed_where_the_executable_keeps_its_symbols(tmp_path: Path):
    """Each RET offset found by disassembly is one objdump (binutils) also decodes as a ret."""
    binary = build_go_server(tmp_path)
    go = go_tls_binary(str(binary))
    assert go.version.startswith("go1.") and go.tcp_conn_itab_hash
    assert {GO_TLS_READ, GO_TLS_WRITE} <= set(go.returns) and go.returns[GO_TLS_READ]
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)], capture_output=True, text=True,
                             check=True).stdout
    for function, offsets in go.returns.items():
        body = listing.split(f"<{function}>:\n", 1)[1].split("\n\n", 1)[0]
        lines = [(int(line.split(":", 1)[0], 16), line.split("\t")[-1]) for line in body.splitlines()]
        start = lines[0][0]
        # Entry probes sit after the stack check (cmp against [r14+0x10], jbe to morestack), which a
        # goroutine whose stack grows runs twice.
        check = next(i for i, (_, text) in enumerate(lines) if text.startswith("jbe"))
        assert "%r14" in lines[check - 1][1] and go.entries[function] == lines[check + 1][0] - start, function
        if function == GO_TLS_WRITE:  # read at its entry: no RET sought
            continue
        assert [a - start for a, text in lines if text.startswith("ret")] == list(offsets), function
    server = _holding(str(binary), "-port", "0")
    try:
        assert tls_reach(server.pid) == TlsReach(server.pid, str(binary), f"Go crypto/tls ({go.version})", True)
    finally:
        server.kill()
        server.wait()


def test_go_executable_without_symbols_is_named_and_not_probed(tmp_path: Path):
    binary = build_go_server(tmp_path, stripped=True)
    with pytest.raises(GoTlsUnprobed, match=r"no symbol table \(built with -ldflags=-s\)"):
        go_tls_binary(str(binary))
    assert go_tls_binary(sys.executable) is None  # no Go at all
    server = _holding(str(binary), "-port", "0")
    try:
        (reach,) = unreadable_tls([server.pid])
        assert reach.library.startswith("Go crypto/tls, no symbol table") and not reach.probed
    finally:
        server.kill()
        server.wait()


def test_rustls_in_an_extension_module_is_named_though_the_process_maps_libssl():
    """granian serves TLS through rustls, compiled into its stripped extension module;
    the same process maps libssl for asyncio. Its TLS is named unreadable: rustls."""
    assert GRANIAN, "granian is not installed (scripts/install.sh installs it)"
    assert elf_tls(GRANIAN[0]).unprobed == "rustls" and not elf_tls(GRANIAN[0]).openssl
    holder = _holding(sys.executable, "-c", "import ssl, time, granian._granian; time.sleep(30)")
    try:
        assert unreadable_tls([holder.pid]) == [tls_reach(holder.pid)]
        assert tls_reach(holder.pid).library == (f"rustls ({os.path.realpath(GRANIAN[0])}); TLS through its "
                                                 f"OpenSSL ({mapped_libssl()}) is read")
    finally:
        holder.kill()
        holder.wait()
