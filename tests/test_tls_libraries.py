"""Naming each process's TLS library from its ELF files: libssl by DT_SONAME (not
its file name), OpenSSL linked into the executable (the image's Node.js 20) by
its exported SSL_read/SSL_write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tokenprobe.agent.capture.tls_libraries import (
    dynamic_symbols,
    soname,
    tls_reach,
    unreadable_tls,
)

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
