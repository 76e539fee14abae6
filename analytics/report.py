"""An ``AnalysisReport`` for people (aligned text tables) and for machines (JSON-ready dicts)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from ..contract.indicators import CRIT, INDICATORS, NO_DATA, OK, WARN
from .calibration import BYTES, TOKENS, Calibration
from .indicators import Cell
from .pipeline import AnalysisReport
from .slo import WINDOWS_S
from .timerange import NS_PER_S, format_ns
from .tool_figures import FIGURES, GOODPUT_FOLLOWS, SUMMARIES

_SEVERITY = {NO_DATA: 0, OK: 1, WARN: 2, CRIT: 3}
_PHASE_COLUMNS = (
    ("net in", "network_in_ms"), ("queue", "queue_ms"), ("prefill", "prefill_ms"), ("decode", "decode_ms"),
    ("net out", "network_out_ms"), ("TTFT server", "ttft_server_ms"), ("TTFT client", "ttft_client_ms"),
    ("TPOT", "tpot_ms"), ("ITL p99", "itl_p99_ms"),
)  # fmt: skip


def iso(ns: int) -> str:
    moment = datetime.fromtimestamp(ns // NS_PER_S, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % NS_PER_S // 1_000_000:03d}Z"


def _clean(value):
    """JSON-safe: NaN becomes null, numpy scalars plain numbers."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def to_json(report: AnalysisReport, store_url: str) -> dict:
    return {
        "store": store_url,
        "since": iso(report.analysed.start_ns),
        "until": iso(report.analysed.end_ns),
        "window_s": report.window_s,
        "phases": [{key: _clean(value) for key, value in record.items()}
                   for record in report.phases.to_dict("records")],
        "benchmark_figures": [_tool_figures_json(entry) for entry in report.tool_figures or []],
        "calibrations": [_calibration_json(c) for c in report.calibrations.values()],
        "knees": [
            {"node": k.node, "server_port": k.server_port, "model": k.model, "fitted_at": iso(k.fitted_at_ns),
             "knee_concurrency": k.knee_concurrency, "knee_concurrency_p99": k.knee_concurrency_p99,
             "confidence": k.confidence, "engine_slots": k.engine_slots, "explanation": k.explanation}
            for k in report.knees.values()
        ],
        "matrix": [
            {"window_start": iso(c.window_start_ns), "window_end": iso(c.window_end_ns), "node": c.node,
             "server_port": c.server_port, "device_id": c.device_id, "indicator": c.indicator,
             "value": _clean(c.value), "state": c.state, "warn": c.warn, "crit": c.crit,
             "explanation": c.explanation}
            for c in report.cells
        ],
        "slo": [
            {"node": s.node, "server_port": s.server_port, "model": s.model, "objective": s.objective,
             "threshold_ms": s.threshold_ms, "target": s.target, "alert": s.alert, "explanation": s.explanation,
             **{f"burn_{w}": s.burn(w) for w in WINDOWS_S},
             **{f"good_share_{w}": s.share_good(w) for w in WINDOWS_S},
             **{f"requests_{w}": s.requests[w] for w in WINDOWS_S}}
            for s in report.slos
        ],
    }


def _tool_figures_json(entry: dict) -> dict:
    """One server and model's figures, each with the tools whose definition it follows."""
    figures = {figure.name: {"follows": figure.follows,
                             **{summary: entry[f"{figure.name}_{summary}"] for summary in SUMMARIES}}
               for figure in FIGURES}
    return {key: entry[key] for key in ("node", "server_port", "model", "requests", "duration_s")} | {
        "figures": figures, "goodput": {"follows": GOODPUT_FOLLOWS, "requests_per_s": entry["goodput_rps"]}}


def _calibration_json(calibration: Calibration) -> dict:
    return {
        "calibration_id": calibration.calibration_id, "node": calibration.node,
        "server_port": calibration.server_port, "model": calibration.model,
        "fitted_at": iso(calibration.fitted_at_ns), "refitted_now": calibration.fresh,
        "engine_scale": calibration.engine_scale, "engine_samples": calibration.engine_samples,
        "fits": {unit: {"intercept_ms": f.fit.intercept, "slope_ms": f.fit.slope, "r2": f.fit.r2,
                        "mad_ms": f.fit.mad, "n": f.fit.n, "n_outliers": f.fit.n_outliers,
                        "used": f.quality_problem is None, "quality_problem": f.quality_problem}
                 for unit, f in calibration.fits.items()},
    }


# -- text ---------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in (headers, *rows)]


def _ms(value) -> str:
    value = _clean(value)
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _percent(value: float) -> str:
    return f"{value:.0%}"


_VALUE_FORMAT: dict[str, Callable[[float], str]] = {
    "gpu_memory_pressure": _percent, "batch_fill": _percent, "kv_cache_usage": _percent,
    "token_rate_decay": _percent, "stall_rate": lambda v: f"{v:.1%}", "retry_storm": lambda v: f"{v:.1%}",
    "tpot_trend": lambda v: f"{v:+.0%}", "queue_wait_p95": lambda v: f"{v:.0f}ms",
    "fragmentation": lambda v: f"{v:.0f}s", "knee_proximity": lambda v: f"{v:.2f}x",
    "inflight_stall": lambda v: f"{v:.0f}s",
}


def _cell_text(cells: Sequence[Cell]) -> str:
    """The worst of an indicator's cells in one window (several GPUs), as 'STATE value'."""
    worst = max(cells, key=lambda cell: _SEVERITY[cell.state])
    if worst.state == NO_DATA:
        return "-"
    state = worst.state if worst.state == OK else worst.state.upper()
    return f"{state} {_VALUE_FORMAT[worst.indicator](worst.value)}"


def render_text(report: AnalysisReport, store_url: str) -> str:
    lines = [f"tokenprobe analyze: {store_url}",
             f"{format_ns(report.analysed.start_ns)} -> {format_ns(report.analysed.end_ns)}, "
             f"windows of {report.window_s} s", ""]
    lines += _phases_text(report)
    lines += _tool_figures_text(report)
    lines += _matrix_text(report)
    lines += _slo_text(report)
    return "\n".join(lines).rstrip() + "\n"


def _phases_text(report: AnalysisReport) -> list[str]:
    lines = ["PHASES per server and model (ms, p50/p95)"]
    if report.phases.empty:
        return [*lines, "  no inference requests in this range", ""]
    rows = []
    for record in report.phases.to_dict("records"):
        rows.append([f"{record['node']}:{record['server_port']}", record["model"] or "-", str(record["requests"]),
                     *(f"{_ms(record[f'{name}_p50'])}/{_ms(record[f'{name}_p95'])}" for _, name in _PHASE_COLUMNS)])
    lines += ["  " + line for line in _table(["server", "model", "requests", *(h for h, _ in _PHASE_COLUMNS)], rows)]
    for record in report.phases.to_dict("records"):
        key = (record["node"], int(record["server_port"]), record["model"])
        server = f"{record['node']}:{record['server_port']} {record['model'] or '-'}"
        lines.append(f"  {server}: {_calibration_text(report.calibrations.get(key), record)}")
        knee = report.knees.get(key)
        lines.append(f"  {server}: knee " + (f"{knee.knee_concurrency:.1f} concurrent requests: {knee.explanation}"
                                             if knee else "not seen yet (the server was not loaded past it)"))
        stalls, gaps = int(record["total_stalls"]), int(record["total_itl_gaps"])
        if gaps:
            lines.append(f"  {server}: {stalls} stalls in {gaps} inter-token gaps")
    return [*lines, ""]


def _tool_figures_text(report: AnalysisReport) -> list[str]:
    if report.tool_figures is None:
        return []
    lines = [("AS THE BENCHMARK TOOLS PRINT THEM per server and model (ms; successful requests; TTFT leaves out "
              "the network's own delay)")]
    if not report.tool_figures:
        return [*lines, "  no successful inference requests in this range", ""]
    for entry in report.tool_figures:
        lines.append(f"  {entry['node']}:{entry['server_port']} {entry['model'] or '-'}: {entry['requests']} requests "
                     f"over {entry['duration_s']:.1f} s")
        rows = [[figure.label, *(_ms(entry[f"{figure.name}_{summary}"]) for summary in SUMMARIES), figure.follows]
                for figure in FIGURES]
        goodput = entry["goodput_rps"]
        rows.append(["goodput", "-" if goodput is None else f"{goodput:.2f} req/s", *[""] * (len(SUMMARIES) - 1),
                     GOODPUT_FOLLOWS])
        lines += ["    " + line for line in _table(["figure", *SUMMARIES, "as defined by"], rows)]
    return [*lines, ""]


def _calibration_text(calibration: Calibration | None, record: dict) -> str:
    if calibration is None:
        return ("queue and prefill not split: no request has yet arrived to an idle server to calibrate "
                "prefill time")
    lines, rejected = [], []
    for unit, label in ((TOKENS, "token"), (BYTES, "byte")):
        if unit in calibration.fits:
            fit = calibration.fits[unit].fit
            problem = calibration.fits[unit].quality_problem
            if problem is not None:  # a poor line is no result: it says why, not what it would predict
                rejected.append(f"the per-{label} line ({problem}, n {fit.n})")
                continue
            r2 = "-" if fit.r2 is None else f"{fit.r2:.2f}"
            lines.append(f"{fit.intercept:.1f} ms + {fit.slope:.4g} ms/{label} "
                         f"(R2 {r2}, MAD {fit.mad:.1f} ms, n {fit.n})")
    not_used = f"; not used, too poor to split with: {'; '.join(rejected)}" if rejected else ""
    if not lines:
        return f"queue and prefill not split{not_used}"
    origin = "fitted now" if calibration.fresh else f"kept from {format_ns(calibration.fitted_at_ns)}"
    engine = f", scaled x{calibration.engine_scale:.2f} to the engine's prefill" if calibration.uses_engine else ""
    usage, size_bytes = int(record["prompt_size_from_usage"]), int(record["prompt_size_from_bytes"])
    return (f"prefill = {'; '.join(lines)} [{origin} from idle arrivals{engine}]{not_used}; prompt size from "
            f"usage for {usage}, from request bytes for {size_bytes} requests")


def _matrix_text(report: AnalysisReport) -> list[str]:
    by_server: dict[tuple[str, int], dict[int, dict[str, list[Cell]]]] = defaultdict(lambda: defaultdict(
        lambda: defaultdict(list)))
    for cell in report.cells:
        by_server[(cell.node, cell.server_port)][cell.window_start_ns][cell.indicator].append(cell)
    lines = []
    if not by_server:
        return ["INDICATORS", "  no activity in this range", ""]
    for (node, port), windows in sorted(by_server.items()):
        lines.append(f"INDICATORS {node}:{port} (per window; '-' where there is no data)")
        rows = [[datetime.fromtimestamp(start // NS_PER_S, tz=UTC).strftime("%H:%M:%S"),
                 *(_cell_text(cells[indicator.name]) if cells.get(indicator.name) else "-"
                   for indicator in INDICATORS)]
                for start, cells in sorted(windows.items())]
        lines += ["  " + line for line in _table(["window", *(i.label for i in INDICATORS)], rows)]
        latest_start = max(windows)
        latest = [cell for cells in windows[latest_start].values() for cell in cells]
        lit = sorted((cell for cell in latest if cell.state in (WARN, CRIT)),
                     key=lambda cell: -_SEVERITY[cell.state])
        lines.append(f"  latest window ({format_ns(latest_start)}): "
                     + ("nothing lit" if not lit else f"{len(lit)} lit"))
        for cell in lit:
            device = f" [{cell.device_id}]" if cell.device_id else ""
            lines.append(f"    {cell.state.upper():<4} {cell.indicator}{device}: {cell.explanation}")
        lines.append("")
    return lines


def _slo_text(report: AnalysisReport) -> list[str]:
    lines = [f"SLO at {format_ns(report.analysed.end_ns)} (burn rate per window; page: 1h and 5m > 14.4x, "
             "ticket: 6h and 30m > 6x)"]
    if not report.slos:
        return [*lines, "  no requests in the 6 hours before"]
    rows = []
    for status in report.slos:
        goal = ("every objective" if status.threshold_ms is None else
                f"{status.target:.2%} <= {status.threshold_ms:g} ms")
        good = status.share_good("1h")
        rows.append([f"{status.node}:{status.server_port}", status.model or "-", status.objective, goal,
                     "-" if good is None else f"{good:.2%}",
                     *("-" if status.burn(w) is None else f"{status.burn(w):.1f}x" for w in WINDOWS_S),
                     status.alert.upper() if status.alert in ("page", "ticket") else status.alert])
    headers = ["server", "model", "objective", "goal", "good 1h", *(f"burn {w}" for w in WINDOWS_S), "alert"]
    lines += ["  " + line for line in _table(headers, rows)]
    for status in report.slos:
        if status.alert in ("page", "ticket"):
            lines.append(f"  {status.alert.upper()} {status.node}:{status.server_port} {status.objective}: "
                         f"{status.explanation}")
    return lines
