"""`tokenprobe demo` as a person runs it: the load sweeps past the server's
capacity through the gateway, and the control loop contains it on its own."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tokenprobe.cli.demo import port_in_use
from tokenprobe.contract.indicators import NO_DATA
from tokenprobe.store.embedded import open_store

from tests.kernel_harness import require_kernel
from tests.support import free_port

pytestmark = pytest.mark.kernel


def two_free_ports() -> int:
    """A port P with P + 1 free too: the demo's server and gateway."""
    for _ in range(50):
        port = free_port()
        if port < 65535 and not port_in_use(port + 1):
            return port
    raise RuntimeError("no two consecutive free ports")


def test_demo_contains_the_overload_and_lists_its_decisions(tmp_path):
    require_kernel()
    store = f"chdb://{tmp_path / 'store'}"
    result = subprocess.run([sys.executable, "-m", "tokenprobe", "demo", "--store", store,
                             "--port", str(two_free_ports())], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = next(line for line in result.stderr.splitlines() if line.startswith("demo: the gateway answered"))
    assert "× 200" in answers and ("× 429" in answers or "× 503" in answers), answers
    listed = [line for line in result.stderr.splitlines() if line.startswith("  ") and "[applied]" in line]
    with open_store(store, serve=False) as opened:
        kinds = dict(opened.query_rows("SELECT kind, count() FROM tokenprobe.decisions GROUP BY kind"))
        # Analysis ran on its own: the dashboard's phase and indicator panels have data.
        split, = opened.query_rows("SELECT countIf(calibration_id != ''), count() FROM tokenprobe.request_split FINAL")
        matrix, = opened.query_rows("SELECT count(), countIf(state != {no_data:String})"
                                    " FROM tokenprobe.indicator_matrix FINAL", {"no_data": NO_DATA})
    assert kinds.get("token_budget", 0) + kinds.get("breaker", 0) == len(listed) > 0, (kinds, listed)
    assert any(line.startswith("demo: analysis: ") for line in result.stderr.splitlines()), result.stderr[-3000:]
    assert 0 < split[0] <= split[1], split
    assert matrix[1] > 0, matrix
