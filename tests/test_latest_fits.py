"""The stored fits a pass reads back: the knee in use (``knee.latest_found_knees``: per server and model, the
newest fit that found one) and the calibration of a server with too few idle arrivals
(``calibration.latest_stored``: its newest fit).

Both are read in two steps (when, from narrow columns; then those rows); the reference is one ``argMax``
over every stored fit, as before.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from tokenprobe.analytics.calibration import (
    BYTES,
    TOKENS,
    Calibration,
    UnitFit,
    calibration_rows,
    latest_stored,
)
from tokenprobe.analytics.knee import latest_found_knees
from tokenprobe.analytics.robust import LineFit
from tokenprobe.analytics.scope import EVERYTHING, Scope, Server
from tokenprobe.analytics.timerange import NS_PER_S
from tokenprobe.store.embedded import open_store

NOW_NS = time.time_ns() // NS_PER_S * NS_PER_S
PASS_NS = 30 * NS_PER_S


def fit(node: str, port: int, at_ns: int, knee: float | None, model: str = "m") -> dict:
    return {"fitted_at": at_ns, "node": node, "server_port": port, "model": model, "knee_concurrency": knee,
            "knee_concurrency_p99": None if knee is None else knee + 1, "confidence": 0.5 if knee else 0.0,
            "method": "test", "flat_ttft_ms": 40.0, "slope_after_ms": None if knee is None else 12.5,
            "max_concurrency_seen": 9, "levels": 7, "n_requests": at_ns // NS_PER_S % 1000, "engine_slots": None,
            "data_from": at_ns - 3600 * NS_PER_S, "data_to": at_ns, "explanation": f"fit at {at_ns}"}


def reference(store, scope: Scope) -> dict:
    """The newest fit with a knee per server and model, from one argMax over every stored row."""
    in_scope, parameters = scope.condition()
    return {(node, int(port), model): (int(fitted_ns), explanation) for node, port, model, fitted_ns, explanation in
            store.query_rows(
                f"""SELECT node, server_port, model, argMax(toUnixTimestamp64Nano(fitted_at), fitted_at),
                           argMax(explanation, fitted_at)
                    FROM tokenprobe.knee WHERE knee_concurrency IS NOT NULL AND {in_scope}
                    GROUP BY node, server_port, model""", parameters)}


def calibration(key: tuple[str, int, str], at_ns: int, with_tokens: bool = True) -> Calibration:
    line = LineFit(20.0 + at_ns // NS_PER_S % 7, 0.1, 0.9, 1.5, 2000, 3)
    units = (BYTES, TOKENS) if with_tokens else (BYTES,)
    return Calibration("-".join(map(str, (*key, at_ns))), *key, fitted_at_ns=at_ns, data_from_ns=at_ns - NS_PER_S,
                       data_to_ns=at_ns, fits={unit: UnitFit(unit, line, 16, 4096) for unit in units})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = open_store(f"chdb://{tmp_path_factory.mktemp('knees') / 'store'}", serve=False)
    try:
        store.ensure_schema()
        fits = []
        for index in range(200):  # a live pass's fits, oldest first, over several inserts (parts)
            at_ns = NOW_NS - (200 - index) * PASS_NS
            fits += [fit("n1", 8000, at_ns, 4.0 + index % 3),  # a knee every pass
                     fit("n1", 8001, at_ns, 6.0 if index < 50 else None),  # found one early, none since
                     fit("n1", 8002, at_ns, None),  # never found one
                     fit("n1", 8000, at_ns, None if index % 2 else 3.0, model="other"),  # the newest has none
                     fit("n2", 8000, at_ns + 1, 9.0)]  # another node's
            if index % 40 == 39:
                store.insert_rows("knee", fits)
                fits = []
        store.insert_rows("knee", [fit("n1", 8000, NOW_NS - 90 * PASS_NS, 1.0)])  # stored late, fitted before
        for index in range(120):
            at_ns = NOW_NS - (120 - index) * PASS_NS
            store.insert_rows("prefill_calibration", [
                row for key in (("n1", 8000, "m"), ("n1", 8001, "m"), ("n1", 8000, "other"), ("n2", 8000, "m"))
                for row in calibration_rows(calibration(key, at_ns + key[1] % 2, with_tokens=index % 3 != 0))])
        late = calibration(("n1", 8000, "m"), NOW_NS - 60 * PASS_NS)  # stored late, fitted before
        store.insert_rows("prefill_calibration", calibration_rows(late))
        yield store
    finally:
        store.close()


@pytest.mark.parametrize("scope", [EVERYTHING, Scope((Server(8000, "n1"),)), Scope((Server(8001),))])
def test_the_knee_in_use_is_the_newest_fit_that_found_one(store, scope):
    knees = latest_found_knees(store, scope)
    assert {key: (knee.fitted_at_ns, knee.explanation) for key, knee in knees.items()} == reference(store, scope)
    if scope is EVERYTHING:
        assert set(knees) == {("n1", 8000, "m"), ("n1", 8001, "m"), ("n1", 8000, "other"), ("n2", 8000, "m")}
        newest = knees[("n1", 8000, "m")]
        assert (newest.fitted_at_ns, newest.knee_concurrency, newest.knee_concurrency_p99) == (
            NOW_NS - PASS_NS, 4.0 + 199 % 3, 5.0 + 199 % 3)
        assert newest.slope_after_ms == 12.5 and newest.engine_slots is None
        assert knees[("n1", 8001, "m")].fitted_at_ns == NOW_NS - 151 * PASS_NS
        assert knees[("n1", 8000, "other")].fitted_at_ns == NOW_NS - 2 * PASS_NS


@pytest.mark.parametrize("keys", [
    [("n1", 8000, "m")],
    [("n1", 8001, "m"), ("n1", 8000, "other"), ("n2", 8000, "m")],
    [("n1", 8000, "m"), ("n1", 8001, "other"), ("n3", 8000, "m")],  # two never fitted
])
def test_a_stored_calibration_is_the_newest_fit_of_its_server_and_model(store, keys):
    newest = {(node, int(port), model): calibration_id for node, port, model, calibration_id in store.query_rows(
        "SELECT node, server_port, model, argMax(calibration_id, fitted_at) FROM tokenprobe.prefill_calibration"
        " GROUP BY node, server_port, model")}
    stored = latest_stored(store, keys)
    assert {key: c.calibration_id for key, c in stored.items()} == {key: newest[key] for key in keys if key in newest}
    for key, kept in stored.items():  # the last pass's, read back whole (fitted_at + 1 on odd ports)
        assert kept == replace(calibration(key, NOW_NS - PASS_NS + key[1] % 2), fresh=False)
