"""The dashboard in a real browser: Playwright drives Debian's chromium against `tokenprobe dashboard`.

An owner process fills an embedded store with an hour of synthetic fleet
traffic, GPU samples and decisions, runs the real analytics over it, and
serves the store as an agent would. The dashboard runs through its CLI code
path (``streamlit run`` as a subprocess, auto-refreshing every few seconds). The test checks
that the page opens on a window that fits the traffic, that the heatmaps (ITL
among them) and the indicator strip rendered, that Streamlit's deploy menu is
hidden, that clicking a heatmap cell drills down to its requests and on to one
request's timeline, that a critical indicator cell of the traffic's overload
episode (over well before the window ends) lists the requests of its window,
and that a request arriving later shows up on its own; it saves a screenshot
(path printed, copy in /tmp).
"""

from __future__ import annotations

import calendar
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tokenprobe.store.embedded import open_store

from tests.support import free_port

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT_COPY = Path("/tmp/tokenprobe-dashboard.png")
FAILURE_SCREENSHOT = Path("/tmp/tokenprobe-dashboard-failure.png")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# Generous: other engineers run tests on the same 2-core machine.
START_TIMEOUT_S = 180
PAGE_TIMEOUT_MS = 120_000
ATTEMPT_TIMEOUT_MS = 8_000
REFRESH_S = 10  # the default: long enough for a click between two refreshes on a busy machine
SPAN_S = 3600
FITTED_BIN_S = 60  # a fitted window over an hour of traffic is drawn in 1-minute bins

OWNER_SCRIPT = """
import sys, time
from tokenprobe.store import open_store
from tokenprobe.analytics.pipeline import analyze
from tokenprobe.analytics.timerange import TimeRange
from tokenprobe.refserver import fleet as synthetic
span_s = int(sys.argv[2])
store = open_store(sys.argv[1])
store.ensure_schema()
start_ns = time.time_ns() - span_s * 1_000_000_000
synthetic.fill_requests(store, count=20_000, start_ns=start_ns, span_s=span_s)
synthetic.fill_gpus(store, start_ns=start_ns, span_s=span_s)
synthetic.fill_decisions(store, start_ns=start_ns, span_s=span_s)
analyze(store, TimeRange(start_ns, start_ns + span_s * 1_000_000_000))
print(start_ns, flush=True)
sys.stdin.read()
store.close()
"""

# `tokenprobe dashboard ...`, through the subcommand's own parser and runner.
DASHBOARD_SCRIPT = """
import argparse, sys
from tokenprobe.dashboard.cli import add_dashboard_parser
parser = argparse.ArgumentParser(prog="tokenprobe")
add_dashboard_parser(parser.add_subparsers(required=True), default_store="unused")
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def require_browser():
    """Skip where Playwright or chromium is missing; in CI (which installs both) that is a failure."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package")
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing:
        message = f"the browser test needs {' and '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def wait_for_http(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the dashboard exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


@pytest.fixture
def served_store(tmp_path):
    url = f"chdb://{tmp_path / 'store'}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, url, str(SPAN_S)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        start_ns = owner.stdout.readline().strip()
        assert start_ns.isdigit(), "the store's owner did not fill the store"
        yield url, int(start_ns)
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)


@pytest.fixture
def dashboard(served_store, tmp_path):
    url, _ = served_store
    port = free_port()
    with open(tmp_path / "dashboard.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", DASHBOARD_SCRIPT, "dashboard", "--store", url, "--port", str(port),
             "--refresh", str(REFRESH_S)],
            # Streamlit keeps files under ~/.streamlit: a home of its own keeps the test off the user's.
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(tmp_path)})
        try:
            wait_for_http(f"http://127.0.0.1:{port}/_stcore/health", process, START_TIMEOUT_S)
            yield f"http://127.0.0.1:{port}/"
        finally:
            process.terminate()
            process.wait(timeout=60)


def act_until_shown(page, action, shown, what: str, attempts: int = 20) -> None:
    """Repeat ``action(attempt)`` until ``shown`` appears: an auto-refresh that redraws the page in the
    middle of a click (or of an open dropdown) loses it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(attempts):
        try:
            action(attempt)
            shown.wait_for(timeout=ATTEMPT_TIMEOUT_MS)
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")  # close whatever the lost attempt left open
    page.screenshot(path=str(FAILURE_SCREENSHOT), full_page=True)
    raise AssertionError(f"{what} did not work in {attempts} attempts (the page then: {FAILURE_SCREENSHOT})")


def hover_until(page, chart, shows) -> str | None:
    """Move the mouse over a chart's plot (right of its row labels) until its tooltip's text satisfies
    ``shows``; that text, or None if no tooltip did."""
    chart.scroll_into_view_if_needed()
    box = chart.bounding_box()
    tooltip = page.locator("#vg-tooltip-element")
    for row in range(1, 20):
        for column in range(12):
            page.mouse.move(box["x"] + box["width"] * (0.42 + 0.045 * column), box["y"] + box["height"] * row / 20)
            if tooltip.count() and tooltip.is_visible() and shows(tooltip.inner_text()):
                return tooltip.inner_text()
    return None


def shown_window(page) -> tuple[float, float]:
    """The window the page says it shows (its caption "start UTC → end UTC"), as epoch seconds."""
    caption = page.get_by_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC → ")).first.inner_text()
    return tuple(calendar.timegm(time.strptime(moment.strip(), "%Y-%m-%d %H:%M:%S UTC"))
                 for moment in caption.split("→"))


def test_dashboard_renders_in_a_browser(dashboard, served_store, tmp_path):
    require_browser()
    store_url, start_ns = served_store
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 3400})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(dashboard)

            # The heatmap: Vega drew its marks (on a canvas, or as SVG for small charts).
            heatmap = page.locator('[data-testid="stTabPanel"] [data-testid="stVegaLiteChart"]').first
            heatmap.locator("canvas, svg .mark-rect").first.wait_for()
            # The window it opens on fits the hour of traffic: all of it, and not much more.
            start_s, end_s = shown_window(page)
            assert start_s <= start_ns / 1e9 < start_s + 2 * FITTED_BIN_S, (start_s, start_ns)
            assert end_s - start_s <= SPAN_S + 2 * FITTED_BIN_S
            # Beside TTFT, TPOT and end-to-end: the ITL heatmap, counting gaps.
            page.get_by_role("tab", name="ITL").click()
            itl_panel = page.locator('[data-testid="stTabPanel"]').filter(has_text="inter-token gaps")
            itl_panel.locator('[data-testid="stVegaLiteChart"]').locator("canvas, svg .mark-rect").first.wait_for()
            page.get_by_role("tab", name="TTFT").click()

            # The indicator strip, computed by the real analytics, drawn over the whole window; hovering a
            # critical cell says why.
            strip = page.locator(".st-key-indicator_strip").locator("canvas.marks, svg.marks").first
            strip.wait_for()
            expect(page.get_by_text("load vs. capacity knee", exact=False).first).to_be_visible()
            explained = hover_until(page, strip, lambda text: "\ncritical\n" in text
                                    and re.search(r"^why\s*\n\S", text, re.MULTILINE))
            assert explained is not None, "no critical cell on the strip explains itself"
            # A page for viewers: no Deploy button.
            expect(page.get_by_role("button", name="Deploy")).to_have_count(0)

            # A click on a heatmap cell fills the drill-down and lists the cell's requests. The click goes
            # where the synthetic traffic's cells are dense: TTFT of tens of ms, early in the hour.
            box = heatmap.locator("canvas, svg").first.bounding_box()
            act_until_shown(page, lambda attempt: page.mouse.click(
                box["x"] + box["width"] * 0.3, box["y"] + box["height"] * (0.70, 0.66, 0.74, 0.62)[attempt % 4]),
                page.get_by_text("requests in this cell"), "clicking a heatmap cell")
            # ... and one of those requests opens its own timeline, every token event on it.
            request_selector = page.locator('[data-testid="stSelectbox"]', has=page.get_by_text("Request", exact=True))

            def pick_first_request(_attempt: int) -> None:
                request_selector.click(timeout=ATTEMPT_TIMEOUT_MS)
                page.get_by_role("option").first.click(timeout=ATTEMPT_TIMEOUT_MS)

            act_until_shown(page, pick_first_request, page.get_by_text("Request timeline:"), "picking a request")

            # The overload episode (60-70 % of the hour) is long over, yet its critical queue waits are offered,
            # and one leads to the requests its server served in that window.
            cell_selector = page.locator('[data-testid="stSelectbox"]',
                                         has=page.get_by_text("Indicator cell", exact=True))
            critical_window_ends = []

            def pick_a_critical_cell(_attempt: int) -> None:
                cell_selector.click(timeout=ATTEMPT_TIMEOUT_MS)
                # Typing narrows the options: the list draws only its first few.
                page.keyboard.type("queue wait (p95) · critical")
                option = page.get_by_role("option").filter(has_text="queue wait (p95) · critical · ").first
                critical_window_ends.append(option.inner_text().rpartition("→")[2].strip())
                option.click(timeout=ATTEMPT_TIMEOUT_MS)

            window_listed = page.get_by_text(re.compile(r"\d+ requests of \S+ started in this window"))
            act_until_shown(page, pick_a_critical_cell, window_listed, "picking a critical indicator cell")
            assert int(window_listed.inner_text().split()[0]) > 0
            critical_end_s = calendar.timegm(time.strptime(critical_window_ends[-1], "%Y-%m-%d %H:%M:%S UTC"))
            assert critical_end_s < shown_window(page)[1] - 0.2 * SPAN_S, critical_window_ends[-1]

            # Auto-refresh: a request arriving later moves the window on its own.
            with open_store(store_url) as store:
                (latest,), = store.query_rows(
                    "SELECT toUnixTimestamp64Nano(max(req_start)) FROM tokenprobe.requests")
                late = latest + 600 * 1_000_000_000
                store.command(
                    "INSERT INTO tokenprobe.requests (node, conn_id, role, server_port, req_start, path, model)"
                    " VALUES ('node-a', 999999999, 'server', 8000,"
                    " fromUnixTimestamp64Nano({late:Int64}, 'UTC'), '/v1/chat/completions', 'llama-3.1-8b')",
                    {"late": late})
            bin_ns = FITTED_BIN_S * 1_000_000_000
            new_end = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(-(-(late + 1) // bin_ns) * bin_ns / 1e9))
            expect(page.get_by_text(f"→ {new_end} UTC")).to_be_visible(timeout=PAGE_TIMEOUT_MS)

            screenshot = tmp_path / "tokenprobe-dashboard.png"
            page.screenshot(path=str(screenshot))
            shutil.copyfile(screenshot, SCREENSHOT_COPY)
            print(f"dashboard screenshot: {screenshot} (copy: {SCREENSHOT_COPY})")
        finally:
            browser.close()
