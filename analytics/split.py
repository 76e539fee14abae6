"""The split of server TTFT into queue, prefill and overhead, in memory: the live pass's engine.

``phases.compute_phases`` splits a range's requests in the store (SQL); the
agent's live pass splits the requests it produced itself, which it holds
(``live.HeldRequests``), with numpy, by the same definition: prefill is what
the request's calibration predicts for its prompt size (its usable lines only,
``UnitFit.quality_problem``), scaled to the engine's, at most its TTFT;
overhead the calibration's server overhead, at most what prefill leaves; queue
the rest. ``tests/test_split_engines.py`` holds the two equal on the same rows.

Requests come as a frame of ``SPLIT_INPUT`` columns: timestamps in Unix ns,
-1 (``NO_TIME``) where the row has none, prompt tokens NaN where the stream
carried no usage, the engine's stated queue and prefill NaN where it stated none
(where it states them, they are the split, as ``phases`` takes them). The split rows also carry the times of the request's
occupancy interval (``OCCUPANCY_COLUMNS``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from ..contract import measures
from ..contract.analysis import KEY_COLUMNS, REQUEST_SPLIT_COLUMNS, REQUEST_SPLIT_TABLE
from ..store.client import Store
from .calibration import BYTES, TOKENS, Calibration, ServerModel
from .phases import POOR_FIT

SPLIT_INPUT = ("node", "server_port", "model", "conn_id", "req_seq", "req_start", "req_end", "first_token",
               "last_token", "resp_end", "prompt_tokens", "bytes_in", "engine_queue_ms", "engine_prompt_ms")
NO_TIME = -1  # a timestamp the row does not have


def split_requests(requests: pd.DataFrame, calibrations: Mapping[ServerModel, Calibration]) -> pd.DataFrame:
    """The split of each request of ``requests`` (``SPLIT_INPUT``): its key, model, ``SPLIT_COLUMNS`` and
    ``OCCUPANCY_COLUMNS``, NaN where a figure is NULL (-1 a time), the durations rounded to Float32 as the
    store keeps them."""
    count = len(requests)
    ttft = np.where((requests["req_end"].to_numpy() == NO_TIME) | (requests["first_token"].to_numpy() == NO_TIME),
                    np.nan, (requests["first_token"].to_numpy(np.int64) - requests["req_end"].to_numpy(np.int64)) / 1e6)
    tokens = requests["prompt_tokens"].to_numpy(np.float64)
    size_bytes = requests["bytes_in"].to_numpy(np.float64)
    # Each request's calibration's coefficients (NaN where it has none), per server and model at once.
    columns = {name: np.full(count, np.nan) for name in _COEFFICIENTS}
    calibrated = np.zeros(count, dtype=bool)
    ids = np.full(count, "", dtype=object)
    by_key = requests.groupby(["node", "server_port", "model"], sort=False, observed=True).indices if count else {}
    for (node, port, model), rows in by_key.items():
        calibration = calibrations.get((node, int(port), model))
        if calibration is not None:
            calibrated[rows] = True
            ids[rows] = calibration.calibration_id
            for name, value in _coefficients(calibration).items():
                columns[name][rows] = value
    has_tokens, has_bytes = columns["has_tokens"] == 1, columns["has_bytes"] == 1
    with_usage = ~np.isnan(tokens)
    uses_tokens = with_usage & has_tokens
    usable = uses_tokens | has_bytes
    predicted = np.maximum(0, np.where(uses_tokens, columns["tokens_intercept"] + columns["tokens_slope"] * tokens,
                                       columns["bytes_intercept"] + columns["bytes_slope"] * size_bytes)
                           ) * columns["scale"]
    # The engine's own figures (Float32 in the row, as the SQL reads them), where it stated them.
    engine_queue = _float32(requests["engine_queue_ms"].to_numpy(np.float64))
    engine_prefill = _float32(requests["engine_prompt_ms"].to_numpy(np.float64))
    prefill_stated = ~np.isnan(engine_prefill)
    split_stated = prefill_stated & ~np.isnan(engine_queue)
    with np.errstate(invalid="ignore"):
        splittable = (prefill_stated | (calibrated & usable)) & (ttft >= 0)
        prefill = np.where(split_stated, engine_prefill,
                           np.minimum(np.where(prefill_stated, engine_prefill, predicted), ttft))
        has_overhead = ~np.isnan(columns["overhead"])
        # Stated queue and prefill: the rest of the TTFT is the server's time outside its engine.
        overhead = np.where(split_stated, np.maximum(0, ttft - engine_queue - engine_prefill),
                            np.where(has_overhead, np.minimum(columns["overhead"], ttft - prefill), 0.0))
    uses_usage = with_usage & (~calibrated | has_tokens)
    method = np.select([~splittable & calibrated & ~usable, ~splittable, split_stated, prefill_stated, has_overhead,
                        columns["engine_used"] == 1],
                       [POOR_FIT, "", "engine", "engine_prefill", "calibration+engine+overhead", "calibration+engine"],
                       "calibration")
    return pd.DataFrame({
        **{name: requests[name].to_numpy() for name in (*KEY_COLUMNS, "model")},
        "queue_ms": _float32(np.where(splittable, np.where(split_stated, engine_queue, ttft - prefill - overhead),
                                      np.nan)),
        "prefill_ms": _float32(np.where(splittable, prefill, np.nan)),
        "overhead_ms": _float32(np.where(splittable & (split_stated | has_overhead), overhead, np.nan)),
        "prompt_size": np.where(uses_usage, tokens, size_bytes),
        "prompt_size_source": np.where(uses_usage, "usage", "bytes"),
        "calibration_id": np.where(calibrated & usable, ids, ""),
        "split_method": method,
        "req_end": requests["req_end"].to_numpy(), "last_token": requests["last_token"].to_numpy(),
        "finished_at": first_known(requests, measures.FINISHED_AT_COLUMNS),
    })


def first_known(requests: pd.DataFrame, names: tuple[str, ...]) -> np.ndarray:
    """Per request, the first of the times ``names`` it has (``coalesce``)."""
    known = requests[names[-1]].to_numpy(np.int64)
    for name in reversed(names[:-1]):
        times = requests[name].to_numpy(np.int64)
        known = np.where(times != NO_TIME, times, known)
    return known


_COEFFICIENTS = ("has_tokens", "has_bytes", "tokens_intercept", "tokens_slope", "bytes_intercept", "bytes_slope",
                 "scale", "engine_used", "overhead")


def _coefficients(calibration: Calibration) -> dict[str, float]:
    usable = calibration.usable_units
    fits = calibration.fits
    return {
        "has_tokens": float(TOKENS in usable), "has_bytes": float(BYTES in usable),
        "tokens_intercept": fits[TOKENS].fit.intercept if TOKENS in fits else np.nan,
        "tokens_slope": fits[TOKENS].fit.slope if TOKENS in fits else np.nan,
        "bytes_intercept": fits[BYTES].fit.intercept, "bytes_slope": fits[BYTES].fit.slope,
        "scale": calibration.engine_scale, "engine_used": float(calibration.uses_engine),
        "overhead": np.nan if calibration.server_overhead_ms is None else calibration.server_overhead_ms,
    }


def _float32(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32).astype(np.float64)


def store_split(store: Store, split: pd.DataFrame, computed_ns: int) -> None:
    """Insert ``split`` (``split_requests``) into ``request_split``, computed at ``computed_ns``."""
    types = store.row_schema(REQUEST_SPLIT_TABLE).types
    arrays = {}
    for column in REQUEST_SPLIT_COLUMNS:
        name, kind = column.name, types[column.name].arrow
        if name == "computed_at":
            arrays[name] = pa.array(np.full(len(split), computed_ns, dtype=np.int64), type=kind)
            continue
        values = split[name].to_numpy()
        if pa.types.is_timestamp(kind):
            arrays[name] = pa.array(values, type=kind, mask=values == NO_TIME)
            continue
        missing = np.isnan(values) if values.dtype.kind == "f" else None
        if missing is not None:  # NULL where NaN; an integer column's values as integers
            values = np.where(missing, 0, values)
            if pa.types.is_integer(kind):
                values = values.astype(np.int64)
        arrays[name] = pa.array(values, type=kind, mask=missing)
    store.insert_arrow(REQUEST_SPLIT_TABLE, pa.table(arrays))
