"""Prefill time against prompt size, per server and model, from requests that arrived to an idle server.

A request that arrives while nothing else is in flight on its server cannot
queue, so its server TTFT is all prefill (DESIGN.md, "queue vs prefill").
Those requests calibrate a line, prefill ≈ intercept + slope × prompt size,
fitted robustly (Theil–Sen, ``robust.theil_sen``) so a few odd requests (a
cold cache, a pause) do not bend it. Any other request's queue time is then
its server TTFT minus the prefill the line predicts for its size.

Prompt size is the prompt token count from the stream's ``usage`` where the
client asked for it, else the request's bytes on the wire. Each gets its own
line (``size_unit`` tokens or bytes): one calibration is the pair, under one
``calibration_id``. The bytes line needs ``calibration_min_points`` idle
arrivals; the tokens line as many among those that carried usage.

Every analysis refits from the most recent idle arrivals before the end of
its range (``calibration_lookback_s``), so the line follows the server as
data arrives; a server with too few idle arrivals keeps its latest stored
calibration. Where the engine exports its own mean prefill time (vLLM's
``request_prefill_time_seconds``), the calibration is checked against it and
scaled to agree (``engine_scale``): the engine sees batching effects that an
idle-arrival fit cannot.

A fit says how good it is, and a poor one splits nothing (``UnitFit.quality_problem``): it is used only
where the prompt size explains the idle arrivals' TTFT (R² ≥ ``MIN_R2``) or where its typical error is
small beside the prefill it predicts (MAD ≤ ``MAX_RELATIVE_MAD`` of its prediction for the middle prompt
size: prompts of one size leave R² nothing to explain, yet a flat line predicts them well). A
calibration with no usable line leaves its requests' queue and prefill unsplit, ``split_method``
``poor fit``; the report prints such a line as rejected, not as a result.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from ..contract import measures
from ..contract.analysis import PREFILL_CALIBRATION_TABLE
from ..contract.requests import REQUESTS_TABLE
from ..contract.samples import ENGINE_SAMPLES_TABLE
from ..store.client import Store
from .config import AnalysisSpans
from .robust import LineFit, theil_sen
from .scope import Scope, Server
from .timerange import TimeRange, range_condition

METHOD = "theil-sen on idle arrivals"
TOKENS, BYTES = "tokens", "bytes"
# An engine figure this far from ours is taken as a sign of trouble on one
# side, not a correction: the scale is held within these bounds.
ENGINE_SCALE_BOUNDS = (0.2, 5.0)

ServerModel = tuple[str, int, str]  # node, server_port, model
IDLE_ARRIVALS_FIRST_SPAN_S = 300.0  # read first: where a busy server has enough idle arrivals
# The quality a line needs to split TTFT (see the module docstring).
MIN_R2 = 0.5
MAX_RELATIVE_MAD = 0.2


class IdleArrivalFloors:
    """Per server and model, the start (Unix ns) of the oldest of the latest idle arrivals a calibration
    used, where it found all ``calibration_max_points`` of them: for the next one to read from.

    Those arrivals stay in the store, so a later calibration's latest ones, over a look-back that holds
    them all (it ends no earlier and starts at or before the floor), started at or after that floor: the
    live analysis reads the seconds since instead of the 5 minutes ``IDLE_ARRIVALS_FIRST_SPAN_S`` searches
    first.
    """

    def __init__(self) -> None:
        self._max_points: int | None = None
        self._until_ns = 0  # the end of the look-back the floors were found in
        self.floors: dict[ServerModel, int] = {}

    def search_from(self, needed: Iterable[ServerModel], lookback: TimeRange, max_points: int) -> int | None:
        """Where the latest idle arrivals of every server and model ``needed`` start at the earliest, if
        known and within ``lookback``."""
        if self._max_points != max_points or lookback.end_ns < self._until_ns:
            self._max_points, self.floors = max_points, {}
        self._until_ns = lookback.end_ns
        floors = [self.floors.get(key) for key in needed]
        if not floors or None in floors or min(floors) < lookback.start_ns:
            return None
        return min(floors)

    def update(self, points: pd.DataFrame, needed: Iterable[ServerModel]) -> None:
        """Keep the floor of each server and model ``needed`` that has all its points in ``points`` (the
        latest idle arrivals in the look-back ``search_from`` was last asked about)."""
        by_key = [] if points.empty else points.groupby(["node", "server_port", "model"], observed=True)["start_ns"]
        found = {(node, int(port), model): starts for (node, port, model), starts in by_key}
        for key in needed:
            starts = found.get(key)
            if starts is not None and len(starts) >= self._max_points:
                self.floors[key] = int(starts.min())
            else:
                self.floors.pop(key, None)


@dataclass(frozen=True)
class UnitFit:
    unit: str  # tokens | bytes
    fit: LineFit
    size_min: int
    size_max: int

    @property
    def quality_problem(self) -> str | None:
        """Why this line is too poor to split TTFT with, or None where it is good enough."""
        fit = self.fit
        if fit.r2 is None or fit.r2 >= MIN_R2:
            return None  # the size explains the TTFT, or the inliers' TTFT does not vary at all
        middle_ms = fit.intercept + fit.slope * (self.size_min + self.size_max) / 2
        if middle_ms > 0 and fit.mad <= MAX_RELATIVE_MAD * middle_ms:
            return None
        return (f"R2 {fit.r2:.2f} < {MIN_R2} and MAD {fit.mad:.1f} ms > {MAX_RELATIVE_MAD:.0%} of the "
                f"{max(middle_ms, 0.0):.1f} ms it predicts")


@dataclass(frozen=True)
class Calibration:
    calibration_id: str
    node: str
    server_port: int
    model: str
    fitted_at_ns: int
    data_from_ns: int
    data_to_ns: int
    fits: dict[str, UnitFit]  # always "bytes"; "tokens" when enough idle arrivals carried usage
    engine_scale: float = 1.0
    engine_samples: int = 0
    engine_prefill_ms: float | None = None
    predicted_prefill_ms: float | None = None
    server_overhead_ms: float | None = None  # where the engine exports its TTFT
    fresh: bool = True  # fitted by this analysis, not read back from the table

    @property
    def uses_engine(self) -> bool:
        return self.engine_samples > 0

    @property
    def usable_units(self) -> list[str]:
        """The size units whose line is good enough to split TTFT with."""
        return [unit for unit, unit_fit in self.fits.items() if unit_fit.quality_problem is None]


def calibrate(store: Store, analysed: TimeRange, scope: Scope, spans: AnalysisSpans,
              now_ns: int, needed: Iterable[ServerModel] | None = None,
              floors: IdleArrivalFloors | None = None) -> dict[ServerModel, Calibration]:
    """The calibration for every server and model with inference requests in ``analysed`` (or ``needed``,
    where the caller knows them: those whose phases a live pass computes).

    Fresh fits are stored in ``prefill_calibration``. A server and model with
    neither enough idle arrivals nor a stored calibration is left out: its
    queue and prefill cannot be split. ``floors``: where an earlier calibration found its idle arrivals
    (``IdleArrivalFloors``), kept up to date.
    """
    lookback = analysed.ending_span(spans.calibration_lookback_s)
    needed = _keys_with_requests(store, analysed, scope) if needed is None else list(needed)
    fresh = _fit_idle_arrivals(store, lookback, scope, spans, now_ns, needed, floors or IdleArrivalFloors())
    fresh = _check_against_engine(store, lookback, scope, spans, fresh)
    if fresh:
        store.insert_rows(PREFILL_CALIBRATION_TABLE, [row for c in fresh.values() for row in calibration_rows(c)])
    missing = [key for key in needed if key not in fresh]
    stored = latest_stored(store, missing) if missing else {}
    return {key: fresh.get(key) or stored[key] for key in needed if key in fresh or key in stored}


def _keys_with_requests(store: Store, analysed: TimeRange, scope: Scope) -> list[ServerModel]:
    in_range, range_parameters = range_condition("req_start", "analysed", analysed)
    in_scope, scope_parameters = scope.condition()
    rows = store.query_rows(
        f"SELECT DISTINCT node, server_port, model FROM {store.table(REQUESTS_TABLE)}"
        f" WHERE {measures.IS_INFERENCE} AND {in_range} AND {in_scope}",
        {**range_parameters, **scope_parameters},
    )
    return [(node, int(port), model) for node, port, model in rows]


def _fit_idle_arrivals(store: Store, lookback: TimeRange, scope: Scope, spans: AnalysisSpans, now_ns: int,
                       needed: list[ServerModel], floors: IdleArrivalFloors) -> dict[ServerModel, Calibration]:
    frame = _latest_idle_arrivals(store, lookback, scope, spans, needed, floors)
    calibrations: dict[ServerModel, Calibration] = {}
    if frame.empty:  # an empty result has no columns at all
        return calibrations
    # Only the servers and models needed: another one's points may reach further back than searched.
    wanted = set(needed)
    for (node, port, model), points in frame.groupby(["node", "server_port", "model"], sort=True, observed=True):
        if (node, int(port), model) not in wanted or len(points) < spans.calibration_min_points:
            continue
        ttft = points["ttft_ms"].to_numpy(dtype=np.float64)
        fits = {BYTES: _unit_fit(BYTES, points["bytes_in"].to_numpy(dtype=np.float64), ttft)}
        with_usage = points["prompt_tokens"].notna().to_numpy()
        if with_usage.sum() >= spans.calibration_min_points:
            tokens = points["prompt_tokens"].to_numpy(dtype=np.float64, na_value=np.nan)[with_usage]
            fits[TOKENS] = _unit_fit(TOKENS, tokens, ttft[with_usage])
        calibrations[(node, int(port), model)] = Calibration(
            calibration_id=uuid.uuid4().hex[:16], node=node, server_port=int(port), model=model,
            fitted_at_ns=now_ns, data_from_ns=int(points["start_ns"].min()), data_to_ns=int(points["start_ns"].max()),
            fits=fits,
        )
    return calibrations


def _latest_idle_arrivals(store: Store, lookback: TimeRange, scope: Scope, spans: AnalysisSpans,
                          needed: list[ServerModel], floors: IdleArrivalFloors) -> pd.DataFrame:
    """The most recent ``calibration_max_points`` idle arrivals in ``lookback`` of each server and model ``needed``
    (and any others in ``scope`` it came across, perhaps not all of theirs: the caller leaves them out).

    A busy server that still sees idle arrivals has that many in its last
    minutes: the query reads those first, and the whole look-back only where
    they are too few (at most a few minutes more than reading it at once).
    Where ``floors`` knows where the last ones started, the search starts there.
    """
    in_scope, scope_parameters = scope.condition()
    floor_ns = floors.search_from(needed, lookback, spans.calibration_max_points)
    if floor_ns is not None:
        first = [TimeRange(floor_ns, lookback.end_ns)]
    else:
        first = [lookback.ending_span(IDLE_ARRIVALS_FIRST_SPAN_S)] if IDLE_ARRIVALS_FIRST_SPAN_S < lookback.seconds else []
    for searched in (*first, lookback):
        in_range, range_parameters = range_condition("req_start", "lookback", searched)
        frame = store.query_df(
            f"""SELECT node, server_port, model, toUnixTimestamp64Nano(req_start) AS start_ns,
                       {measures.TTFT_SERVER_MS} AS ttft_ms, prompt_tokens, bytes_in
                FROM {store.table(REQUESTS_TABLE)}
                WHERE {measures.IS_INFERENCE} AND inflight_at_arrival = 0 AND status BETWEEN 200 AND 299
                  AND req_end IS NOT NULL AND first_token IS NOT NULL AND first_token > req_end
                  AND {in_range} AND {in_scope}
                ORDER BY req_start DESC
                LIMIT {{max_points:UInt32}} BY node, server_port, model""",
            {**range_parameters, **scope_parameters, "max_points": spans.calibration_max_points},
        )
        found = {} if frame.empty else frame.groupby(["node", "server_port", "model"], observed=True).size()
        if all(found.get(key, 0) >= spans.calibration_max_points for key in needed):
            break
    floors.update(frame, needed)
    return frame


def _unit_fit(unit: str, size: np.ndarray, ttft_ms: np.ndarray) -> UnitFit:
    return UnitFit(unit, theil_sen(size, ttft_ms), int(size.min()), int(size.max()))


def _check_against_engine(store: Store, lookback: TimeRange, scope: Scope, spans: AnalysisSpans,
                          calibrations: dict[ServerModel, Calibration]) -> dict[ServerModel, Calibration]:
    """Scale each calibration so its mean predicted prefill matches the engine's own mean, where there is one."""
    if not calibrations:
        return calibrations
    in_range, range_parameters = range_condition("ts", "lookback", lookback)
    in_scope, scope_parameters = scope.condition(with_model=False)
    engine = {
        (node, int(port)): (float(mean_ms), int(samples), None if _is_missing(ttft_ms) else float(ttft_ms))
        for node, port, mean_ms, samples, ttft_ms in store.query_rows(
            f"""SELECT node, server_port, avg(prefill_mean_s) * 1000, count(), avg(ttft_mean_s) * 1000
                FROM {store.table(ENGINE_SAMPLES_TABLE)}
                WHERE prefill_mean_s IS NOT NULL AND {in_range} AND {in_scope}
                GROUP BY node, server_port HAVING count() >= {{min_samples:UInt32}}""",
            {**range_parameters, **scope_parameters, "min_samples": spans.engine_check_min_samples},
        )
    }
    if not engine:
        return calibrations
    in_range, range_parameters = range_condition("req_start", "lookback", lookback)
    in_scope, scope_parameters = scope.condition()
    # The model is linear, so the mean prediction needs only counts and sums of sizes.
    sums = store.query_rows(
        f"""SELECT node, server_port, model,
                   countIf(prompt_tokens IS NOT NULL), sumIf(prompt_tokens, prompt_tokens IS NOT NULL),
                   sumIf(bytes_in, prompt_tokens IS NOT NULL),
                   countIf(prompt_tokens IS NULL), sumIf(bytes_in, prompt_tokens IS NULL),
                   avg({measures.TTFT_SERVER_MS})
            FROM {store.table(REQUESTS_TABLE)}
            WHERE {measures.IS_INFERENCE} AND first_token IS NOT NULL AND {in_range} AND {in_scope}
            GROUP BY node, server_port, model""",
        {**range_parameters, **scope_parameters},
    )
    checked = dict(calibrations)
    for node, port, model, n_usage, usage_tokens, usage_bytes, n_bytes, other_bytes, ttft_ms in sums:
        key = (node, int(port), model)
        if key not in calibrations or (node, int(port)) not in engine:
            continue
        calibration = calibrations[key]
        engine_ms, samples, engine_ttft_ms = engine[(node, int(port))]
        predicted_ms = _mean_prediction(calibration, int(n_usage), float(usage_tokens or 0),
                                        float(usage_bytes or 0), int(n_bytes), float(other_bytes or 0))
        if predicted_ms is None or predicted_ms <= 0:
            continue
        low, high = ENGINE_SCALE_BOUNDS
        # What the server's TTFT holds beyond the engine's is spent outside it: not queue.
        overhead_ms = None if engine_ttft_ms is None else max(0.0, float(ttft_ms) - engine_ttft_ms)
        checked[key] = replace(calibration, engine_scale=min(high, max(low, engine_ms / predicted_ms)),
                               engine_samples=samples, engine_prefill_ms=engine_ms, predicted_prefill_ms=predicted_ms,
                               server_overhead_ms=overhead_ms)
    return checked


def _mean_prediction(calibration: Calibration, n_usage: int, usage_tokens: float, usage_bytes: float,
                     n_bytes: int, other_bytes: float) -> float | None:
    total = n_usage + n_bytes
    if total == 0:
        return None
    bytes_fit = calibration.fits[BYTES].fit
    if TOKENS in calibration.fits:
        tokens_fit = calibration.fits[TOKENS].fit
        usage_part = n_usage * tokens_fit.intercept + tokens_fit.slope * usage_tokens
    else:
        usage_part = n_usage * bytes_fit.intercept + bytes_fit.slope * usage_bytes
    return (usage_part + n_bytes * bytes_fit.intercept + bytes_fit.slope * other_bytes) / total


def calibration_rows(calibration: Calibration) -> list[dict]:
    """The ``prefill_calibration`` rows of one calibration: one per size unit."""
    return [
        {
            "calibration_id": calibration.calibration_id, "fitted_at": calibration.fitted_at_ns,
            "node": calibration.node, "server_port": calibration.server_port, "model": calibration.model,
            "size_unit": unit_fit.unit, "method": METHOD,
            "intercept_ms": unit_fit.fit.intercept, "slope_ms": unit_fit.fit.slope, "r2": unit_fit.fit.r2,
            "mad_ms": unit_fit.fit.mad, "n": unit_fit.fit.n, "n_outliers": unit_fit.fit.n_outliers,
            "size_min": unit_fit.size_min, "size_max": unit_fit.size_max,
            "data_from": calibration.data_from_ns, "data_to": calibration.data_to_ns,
            "engine_scale": calibration.engine_scale, "engine_samples": calibration.engine_samples,
            "engine_prefill_ms": calibration.engine_prefill_ms,
            "predicted_prefill_ms": calibration.predicted_prefill_ms,
            "server_overhead_ms": calibration.server_overhead_ms,
        }
        for unit_fit in calibration.fits.values()
    ]


def latest_stored(store: Store, keys: Iterable[ServerModel]) -> dict[ServerModel, Calibration]:
    """The most recently fitted stored calibration of each server and model asked for.

    Only the servers and models asked for are read (the table gains a row per size unit, server and model
    every pass that fits), and their latest fit is found by when it was fitted: its rows share that time.
    """
    wanted = set(keys)
    if not wanted:
        return {}
    table = store.table(PREFILL_CALIBRATION_TABLE)
    # the servers and models asked for, and maybe others of theirs (left out below)
    asked, parameters = Scope(tuple(Server(port, node) for node, port in sorted({key[:2] for key in wanted})),
                              tuple(sorted({model for _, _, model in wanted}))).condition()
    frame = store.query_df(
        f"""SELECT calibration_id, toUnixTimestamp64Nano(fitted_at) AS fitted_at_ns, node, server_port, model,
                   size_unit, intercept_ms, slope_ms, r2, mad_ms, n, n_outliers, size_min, size_max,
                   toUnixTimestamp64Nano(data_from) AS data_from_ns, toUnixTimestamp64Nano(data_to) AS data_to_ns,
                   engine_scale, engine_samples, engine_prefill_ms, predicted_prefill_ms, server_overhead_ms
            FROM {table}
            WHERE {asked} AND (node, server_port, model, fitted_at) IN (
                SELECT node, server_port, model, max(fitted_at) FROM {table} WHERE {asked}
                GROUP BY node, server_port, model)""",
        parameters,
    )
    calibrations: dict[ServerModel, Calibration] = {}
    if frame.empty:
        return calibrations
    for calibration_id, rows in frame.groupby("calibration_id", sort=False, observed=True):
        first = rows.iloc[0]
        key = (first["node"], int(first["server_port"]), first["model"])
        if key not in wanted or BYTES not in set(rows["size_unit"]):
            continue
        fits = {
            row["size_unit"]: UnitFit(row["size_unit"], LineFit(
                float(row["intercept_ms"]), float(row["slope_ms"]), None if _is_missing(row["r2"]) else
                float(row["r2"]), float(row["mad_ms"]), int(row["n"]), int(row["n_outliers"])),
                int(row["size_min"]), int(row["size_max"]))
            for _, row in rows.iterrows()
        }
        calibrations[key] = Calibration(
            calibration_id=str(calibration_id), node=key[0], server_port=key[1], model=key[2],
            fitted_at_ns=int(first["fitted_at_ns"]), data_from_ns=int(first["data_from_ns"]),
            data_to_ns=int(first["data_to_ns"]), fits=fits, engine_scale=float(first["engine_scale"]),
            engine_samples=int(first["engine_samples"]),
            engine_prefill_ms=None if _is_missing(first["engine_prefill_ms"]) else float(first["engine_prefill_ms"]),
            predicted_prefill_ms=None if _is_missing(first["predicted_prefill_ms"])
            else float(first["predicted_prefill_ms"]),
            server_overhead_ms=None if _is_missing(first["server_overhead_ms"])
            else float(first["server_overhead_ms"]),
            fresh=False,
        )
    return calibrations


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))
