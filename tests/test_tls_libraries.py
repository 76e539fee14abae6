"""Naming each process's TLS library from its ELF files: libssl by DT_SONAME (not
its file name), OpenSSL linked into the executable (the image's Node.js 20) by
its exported SSL_read/SSL_write, Go's crypto/tls by its symbols (and where its
return probes go)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenprobe.agent.capture.go_tls import (
    GO_TLS_READ,
    GO_TLS_WRITE,
    GoTlsUnprobed,
    go_tls_binary,
)
from tokenprobe.agent.capture.tls_libraries import (
    TlsReach,
    dynamic_symbols,
    soname,
    tls_reach,
    unreadable_tls,
)

from tests.test_kernel_matrix import build_go_server

NODE = "/usr/bin/node"


def test_libssl_is_found_by_its_soname_whatever_its_file_is_called(tmp_path: Path):
    import _ssl  # maps libssl into this process

    libssl = next(line.split()[-1] for line in open("/proc/self/maps") if "libssl" in line)
    renamed = tmp_path / "libtls-vendored.so"
    shutil.copy(libssl, renamed)
    assert soname(str(renamed)).startswith("libssl.so")
    assert soname(_ssl.__file__) is None and soname(__file__) is None  # no DT_SONAME; not ELF
    reach = tls_reach(os.getpid())
    assert reach.probed and libssl in reach.library and reach.exe == os.path.realpath(sys.executable)


def test_openssl_linked_into_the_executable_is_named_and_not_read():
    assert {b"SSL_read", b"SSL_write"} <= dynamic_symbols(NODE)
    node = subprocess.Popen([NODE, "-e", "setTimeout(() => {}, 5000)"])
    try:
        time.sleep(0.3)
        assert unreadable_tls([node.pid, os.getpid()]) == [tls_reach(node.pid)]
        assert (tls_reach(node.pid).library, tls_reach(node.pid).probed) == ("static OpenSSL", False)
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
        if function == GO_TLS_WRITE:  # read at its entry: no RET sought
            continue
        body = listing.split(f"<{function}>:\n", 1)[1].split("\n\n", 1)[0]
        addresses = [int(line.split(":", 1)[0], 16) for line in body.splitlines()
                     if line.split("\t")[-1].startswith("ret")]
        start = int(re.search(rf"^([0-9a-f]+) <{re.escape(function)}>:", listing, re.MULTILINE)[1], 16)
        assert [a - start for a in addresses] == list(offsets), function
    server = subprocess.Popen([str(binary), "-port", "0"])
    try:
        time.sleep(0.3)
        assert tls_reach(server.pid) == TlsReach(server.pid, str(binary), f"Go crypto/tls ({go.version})", True)
    finally:
        server.kill()
        server.wait()


def test_go_executable_without_symbols_is_named_and_not_probed(tmp_path: Path):
    binary = build_go_server(tmp_path, stripped=True)
    with pytest.raises(GoTlsUnprobed, match=r"no symbol table \(built with -ldflags=-s\)"):
        go_tls_binary(str(binary))
    assert go_tls_binary(sys.executable) is None  # no Go at all
