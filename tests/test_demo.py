"""`tokenprobe demo` as a person runs it: the load sweeps past the server's
capacity through the gateway, and the control loop contains it on its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenprobe.cli.demo import port_in_use, shell_command
from tokenprobe.contract.indicators import NO_DATA
from tokenprobe.store.embedded import open_store

from tests.kernel_harness import require_kernel
from tests.support import free_port
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, require_browser, wait_for_http

README = Path(__file__).parents[1] / "README.md"

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
    answers = next(line for line in result.stdout.splitlines() if line.startswith("demo: the gateway answered"))
    assert "× 200" in answers and ("× 429" in answers or "× 503" in answers), answers
    listed = [line for line in result.stdout.splitlines() if line.startswith("  ") and "[applied]" in line]
    with open_store(store, serve=False) as opened:
        kinds = dict(opened.query_rows("SELECT kind, count() FROM tokenprobe.decisions GROUP BY kind"))
        # Analysis ran on its own: the dashboard's phase and indicator panels have data.
        split, = opened.query_rows("SELECT countIf(calibration_id != ''), count() FROM tokenprobe.request_split FINAL")
        matrix, = opened.query_rows("SELECT count(), countIf(state != {no_data:String})"
                                    " FROM tokenprobe.indicator_matrix FINAL", {"no_data": NO_DATA})
    assert kinds.get("token_budget", 0) + kinds.get("breaker", 0) == len(listed) > 0, (kinds, listed)
    assert any(line.startswith("demo: analysis: ") for line in result.stdout.splitlines()), result.stdout[-3000:]
    assert 0 < split[0] <= split[1], split
    assert matrix[1] > 0, matrix


def readme_demo_commands() -> list[str]:
    """The commands README.md shows after `make demo`, one string each: a line that does not start a command
    continues the one before (after a backslash, or inside a quoted SQL statement)."""
    block = re.search(r"leaves a store .*?```sh\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    commands: list[str] = []
    for line in block.splitlines():
        if line.startswith(".venv/bin/tokenprobe "):
            commands.append(line)
        elif commands:
            commands[-1] += "\n" + line
    return commands


def test_the_commands_the_demo_and_the_readme_print_work_verbatim(tmp_path):
    """A newcomer's path: the demo, then the dashboard it names (a real browser opens it, so the dashboard owns
    the store), then the query beside it; the README's own commands the same way. No error, no traceback."""
    require_kernel()
    require_browser()
    directory = tmp_path / "demo store"  # a space: the printed commands must quote it
    store = f"chdb://{directory}"
    demo = subprocess.run([sys.executable, "-m", "tokenprobe", "demo", "--store", store, "--port", str(free_port()),
                           "--no-actuator", "--duration", "8"], capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "Traceback" not in demo.stderr, demo.stderr[-3000:]
    lines = demo.stdout.splitlines()
    # Inference counted apart from other traffic; the agent's own scrapes of the server's metrics pages are
    # no rows at all.
    traced = next(line for line in lines if " inference requests" in line and line.startswith("demo: "))
    assert re.match(r"demo: [1-9]\d* inference requests( and \d+ other requests \([^)]*\))? traced; \d+ rows", traced), \
        traced
    assert "/metrics" not in traced and "/sim/dcgm" not in traced, traced
    dashboard, query = [line.strip() for line in lines[-3:] if line.startswith("  ")]
    tokenprobe = shell_command()
    assert dashboard.startswith(f"{tokenprobe} dashboard --store ") and dashboard.endswith(" --own-store"), dashboard
    # The README shows the same commands, for the demo's default store and the installed script.
    readme = [command.replace("chdb:///var/lib/tokenprobe/demo-store", f"'{store}'")
                     .replace(".venv/bin/tokenprobe", tokenprobe) for command in readme_demo_commands()]
    assert readme[0] == dashboard, (readme, dashboard)
    assert len(readme) == 2 and readme[1].startswith(f"{tokenprobe} query --store '{store}' "), readme

    port = free_port()
    shell_env = {**os.environ, "HOME": str(tmp_path)}  # Streamlit's own files stay out of the user's home
    with open(tmp_path / "dashboard.log", "w") as log:
        served = subprocess.Popen(["bash", "-c", f"exec {dashboard} --port {port} --refresh 0"], stdout=log,
                                  stderr=subprocess.STDOUT, env=shell_env)
        try:
            wait_for_http(f"http://127.0.0.1:{port}/_stcore/health", served, 180)
            from playwright.sync_api import sync_playwright

            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                try:
                    page = browser.new_page()
                    page.set_default_timeout(120_000)
                    page.goto(f"http://127.0.0.1:{port}/")
                    page.locator('[data-testid="stVegaLiteChart"]').first.wait_for()  # the store is open
                    assert page.locator('[data-testid="stAlert"]').filter(has_text="cannot be reached").count() == 0
                    # The dashboard owns the store now: the commands beside it read through it.
                    for command in (query, readme[1]):
                        beside = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                                timeout=300, env=shell_env)
                        assert beside.returncode == 0 and beside.stderr == "", (command, beside.stderr)
                        # The query groups the stored requests by path: the agent's own scrapes are none of them.
                        assert "/v1/chat/completions" in beside.stdout and "/metrics" not in beside.stdout, \
                            beside.stdout
                finally:
                    browser.close()
        finally:
            served.terminate()
            served.wait(timeout=60)
    log_text = (tmp_path / "dashboard.log").read_text()
    assert "Traceback" not in log_text, log_text[-3000:]
