"""One analysis run over a time range: calibrate, phases, knee, matrix, SLOs; every result stored.

``analyze(store, time_range)`` is what ``tokenprobe analyze`` runs, and what a
periodic job would run. The order matters: phases need the prefill
calibration, the matrix needs the phases and the servers' capacity (engine
slots or the knee), and each step writes its table before the next reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pandas as pd

from ..contract import measures
from ..contract.requests import REQUESTS_TABLE
from ..store.client import Store
from .calibration import Calibration, IdleArrivalFloors, ServerModel, calibrate
from .config import DEFAULT_CONFIG, AnalyticsConfig
from .indicators import (
    OCCUPANCY_LOOKBACK_S,
    Capacity,
    Cell,
    KeptOccupancy,
    Windows,
    compute_matrix,
    matrix_lead_s,
)
from .knee import Knee, fit_knees, latest_found_knees
from .phases import compute_phases, phase_requests, phase_summary
from .scope import EVERYTHING, Scope
from .slo import SloMinutes, SloStatus, evaluate_slos
from .split import split_requests, store_split
from .timerange import NS_PER_S, TimeRange, range_condition
from .tool_figures import tool_figures

# Window lengths offered when none is asked for: the smallest giving at most MAX_AUTO_WINDOWS windows.
NICE_WINDOWS_S = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
MAX_AUTO_WINDOWS = 12
DEFAULT_SPAN_S = 3600


@dataclass(frozen=True)
class AnalysisReport:
    analysed: TimeRange
    window_s: int
    phases: pd.DataFrame | None  # phase_summary: per server and model; None where not asked for (live passes)
    calibrations: dict[ServerModel, Calibration]
    knees: dict[ServerModel, Knee]  # the knee in use: this run's fit, else the latest one found before
    capacities: dict[tuple[str, int], Capacity]
    cells: list[Cell]
    slos: list[SloStatus]
    # per server and model, the figures as the benchmark tools define them (tool_figures); None with no summary
    tool_figures: list[dict] | None = None


def auto_window_s(analysed: TimeRange) -> int:
    for seconds in NICE_WINDOWS_S:
        if analysed.seconds / seconds <= MAX_AUTO_WINDOWS:
            return seconds
    return NICE_WINDOWS_S[-1]


def default_range(store: Store, scope: Scope) -> TimeRange | None:
    """The traffic of the last hour that has any: from the newest request in scope back at most an hour,
    and no further back than the first request (None if there is none). A live store and one left by a
    finished run (the demo's) alike show their latest traffic, in windows that fit it."""
    in_scope, parameters = scope.condition()
    table = store.table(REQUESTS_TABLE)
    newest, count = store.query_rows(
        f"SELECT max(toUnixTimestamp64Nano(coalesce(resp_end, req_start))), count()"
        f" FROM {table} WHERE {measures.IS_INFERENCE} AND {in_scope}",
        parameters,
    )[0]
    if not count:
        return None
    end_ns = int(newest) + 1  # the range is half-open: include the newest request
    recent, range_parameters = range_condition("req_start", "recent", TimeRange(end_ns - DEFAULT_SPAN_S * NS_PER_S,
                                                                                end_ns))
    earliest = store.query_rows(
        f"SELECT min(toUnixTimestamp64Nano(req_start)) FROM {table}"
        f" WHERE {measures.IS_INFERENCE} AND {in_scope} AND {recent}",
        {**parameters, **range_parameters},
    )[0][0]
    return TimeRange(min(int(earliest), end_ns - 1), end_ns)


def analyze(store: Store, analysed: TimeRange, *, window_s: int | None = None, scope: Scope = EVERYTHING,
            config: AnalyticsConfig = DEFAULT_CONFIG, now_ns: int | None = None,
            new_requests: tuple[str, dict] | None = None, schema_ready: bool = False,
            slo_minutes: SloMinutes | None = None, idle_floors: IdleArrivalFloors | None = None,
            occupancy: KeptOccupancy | None = None, fits: KeptFits | None = None,
            summarize: bool = True, held: pd.DataFrame | None = None) -> AnalysisReport:
    """Run every analysis over ``analysed`` and store the results (see the module docstring).

    ``new_requests`` (a condition over the requests, with its parameters) narrows the phases computed, and
    the servers and models calibrated for them, to those requests: an incremental pass (the live
    analysis) computes the phases of the requests new since the last one, whose earlier neighbours,
    which the matrix also reads, have theirs already.
    ``schema_ready``: the caller made sure of the schema (the agent, at start), so no DDL runs.
    ``slo_minutes``: the SLO counts of whole minutes an earlier pass took (``slo.SloMinutes``), reused.
    ``idle_floors``: where an earlier pass found the latest idle arrivals (``calibration.IdleArrivalFloors``).
    ``occupancy``: the request intervals an earlier pass kept (``indicators.KeptOccupancy``).
    ``fits``: the calibrations and knees an earlier pass fitted, reused until they are due (``KeptFits``).
    ``summarize=False`` leaves out the phase summary (a report for people; the live analysis has none).
    ``held``: the requests whose split to compute, held in memory (``held.HeldRequests.take``: the live
    analysis's own), in place of ``new_requests``: split in memory (``split.split_requests``), their rows
    given to ``occupancy`` as they are instead of read back.
    """
    now_ns = time.time_ns() if now_ns is None else now_ns
    window_s = window_s or auto_window_s(analysed)
    if not schema_ready:
        store.ensure_schema()
    # Phases reach back before the first window: the matrix looks back for
    # fragmentation, and requests that started earlier may still be in flight.
    lead_s = matrix_lead_s(window_s, config.thresholds)
    first_window_ns = Windows(analysed, window_s, lead_s).base_ns
    phases_range = TimeRange(first_window_ns, analysed.end_ns).extended_back(OCCUPANCY_LOOKBACK_S)
    requests = None if held is not None else phase_requests(store, phases_range, scope, config.thresholds,
                                                            new_requests)
    keys = requests.keys if requests is not None else sorted(
        (node, int(port), model) for node, port, model
        in held[["node", "server_port", "model"]].drop_duplicates().itertuples(index=False))
    fits = fits or KeptFits.none()
    calibrations = fits.calibrations(keys, lambda needed: calibrate(
        store, phases_range, scope, config.spans, now_ns, needed=needed, floors=idle_floors))
    if requests is not None:
        compute_phases(store, requests, calibrations, now_ns)
    else:
        split = split_requests(held, calibrations)
        store_split(store, split, now_ns)
        if occupancy is not None:
            occupancy.expect_held(held, split)
    knees, fitted = fits.knees(keys, lambda: (
        fit_knees(store, analysed, scope, config.spans, now_ns),
        latest_found_knees(store, scope)))  # this run's fits, where one found a knee, are the latest
    capacities = server_capacities(knees, fitted)
    cells = compute_matrix(store, analysed, window_s, scope, config.thresholds, capacities, now_ns, occupancy)
    slos = evaluate_slos(store, analysed.end_ns, config.objectives, scope, slo_minutes)
    summary = phase_summary(store, analysed, scope, config.thresholds) if summarize else None
    as_tools = tool_figures(store, analysed, scope, config.objectives) if summarize else None
    return AnalysisReport(analysed, window_s, summary, calibrations, knees, capacities, cells, slos, as_tools)


class KeptFits:
    """The prefill calibrations and knees a live pass fitted, reused by the passes after it until
    ``refit_every_ns`` has passed (on the passes' clock; ``due`` decides at the start of each).

    Both are fitted over hours of traffic (``AnalysisSpans``), which one window moves little, and fitting
    them (idle arrivals read, Theil–Sen fits, TTFT curves, both stored) was a third of a pass. A server and
    model with no kept calibration (new, or never idle enough to fit one) is calibrated every pass until it
    has one, and the knees are fitted again whenever one of the pass's servers and models has none kept,
    so a knee is found as soon as the load reveals it. Between refits the rows a pass writes name the kept
    calibration (its ``calibration_id``), as those of a pass that found too few idle arrivals did.
    """

    def __init__(self, refit_every_s: float) -> None:
        self.refit_every_ns = int(refit_every_s * NS_PER_S)
        self.kept_calibrations: dict[ServerModel, Calibration] = {}
        self.kept_knees: dict[ServerModel, Knee] = {}  # the knees in use (found now or before)
        self.kept_fitted: dict[ServerModel, Knee] = {}  # the latest fits, knee or not (their engine slots)
        self.refitting = True  # this pass fits everything again
        self._refitted_ns: int | None = None

    @classmethod
    def none(cls) -> KeptFits:
        """Nothing kept: every run fits (``tokenprobe analyze``)."""
        return cls(0)

    def due(self, now_ns: int) -> None:
        """A pass starts at ``now_ns``: it refits if the last refit is ``refit_every_ns`` old."""
        self.refitting = self._refitted_ns is None or now_ns - self._refitted_ns >= self.refit_every_ns
        if self.refitting:
            self._refitted_ns = now_ns

    def calibrations(self, keys: list[ServerModel],
                     calibrate_keys: Callable[[list[ServerModel]], dict[ServerModel, Calibration]]
                     ) -> dict[ServerModel, Calibration]:
        """The calibration of each of ``keys`` that has one: fitted by ``calibrate_keys`` for all of them
        on a refit, else for those with none kept."""
        unfitted = list(keys) if self.refitting else [key for key in keys if key not in self.kept_calibrations]
        if unfitted:
            self.kept_calibrations.update(calibrate_keys(unfitted))
        return {key: self.kept_calibrations[key] for key in keys if key in self.kept_calibrations}

    def knees(self, keys: list[ServerModel],
              fit: Callable[[], tuple[dict[ServerModel, Knee], dict[ServerModel, Knee]]]
              ) -> tuple[dict[ServerModel, Knee], dict[ServerModel, Knee]]:
        """The knees in use and the latest fits of ``keys``' servers: ``fit()`` (fits, then the knees in
        use) on a refit or where one of ``keys`` has no knee kept, else the kept ones."""
        if self.refitting or any(key not in self.kept_knees for key in keys):
            fitted, knees = fit()
            self.kept_fitted.update(fitted)
            self.kept_knees.update(knees)
            return knees, fitted
        servers = {(node, port) for node, port, _ in keys}
        return ({key: knee for key, knee in self.kept_knees.items() if key[:2] in servers},
                {key: knee for key, knee in self.kept_fitted.items() if key[:2] in servers})


def server_capacities(knees: Mapping[ServerModel, Knee],
                      fitted: Mapping[ServerModel, Knee]) -> dict[tuple[str, int], Capacity]:
    """Per server: the knee of its busiest model, and the engine's slot count from this run's fits.

    The matrix judges servers, but knees are per model; a server normally
    serves one model, and otherwise its busiest model decides.
    """
    capacities: dict[tuple[str, int], Capacity] = {}
    busiest: dict[tuple[str, int], int] = {}
    for (node, port, _), knee in sorted(knees.items()):
        server = (node, port)
        if knee.n_requests > busiest.get(server, -1):
            busiest[server] = knee.n_requests
            capacities[server] = Capacity(knee.knee_concurrency, knee.engine_slots)
    for (node, port, _), knee in fitted.items():
        if knee.engine_slots is not None:
            known = capacities.get((node, port), Capacity())
            capacities[(node, port)] = Capacity(known.knee_concurrency, knee.engine_slots)
    return capacities
