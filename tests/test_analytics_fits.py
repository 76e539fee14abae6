"""The numerical core of the analytics: the robust prefill line, the knee, configuration and time parsing."""

from __future__ import annotations

import numpy as np
import pytest
from tokenprobe.analytics import robust
from tokenprobe.analytics.calibration import UnitFit
from tokenprobe.analytics.config import AnalyticsConfig, Thresholds, load_config
from tokenprobe.analytics.robust import fit_knee, theil_sen
from tokenprobe.analytics.scope import Scope, Server
from tokenprobe.analytics.timerange import NS_PER_S, TimeRange, parse_time

NOW_NS = 1_800_000_000 * NS_PER_S


# -- Theil-Sen ---------------------------------------------------------------------


def test_theil_sen_recovers_a_line_despite_gross_outliers():
    rng = np.random.default_rng(1)
    size = rng.uniform(16, 512, 200)
    prefill = 20.0 + 0.1 * size + rng.normal(0, 0.3, 200)
    prefill[:40] += rng.uniform(200, 2000, 40)  # 20% of requests hit a pause
    fit = theil_sen(size, prefill)
    assert fit.slope == pytest.approx(0.1, rel=0.03)
    assert fit.intercept == pytest.approx(20.0, abs=1.5)
    assert fit.n == 200 and 35 <= fit.n_outliers <= 45
    assert fit.r2 > 0.95  # over the inliers
    assert fit.mad < 1.0


def test_theil_sen_slope_is_the_median_of_the_pair_slopes_to_the_bit():
    rng = np.random.default_rng(5)
    for points in (2, 3, 4, 7, 50, 201):  # odd and even pair counts, and sizes that repeat (pairs left out)
        size = rng.integers(16, 40, points).astype(np.float64)
        ttft = 20.0 + 0.1 * size + rng.normal(0, 5, points)
        i, j = np.triu_indices(points, k=1)
        distinct = size[j] != size[i]
        slopes = (ttft[j] - ttft[i])[distinct] / (size[j] - size[i])[distinct]
        expected = float(np.median(slopes)) if len(slopes) else 0.0
        assert theil_sen(size, ttft).slope == expected


@pytest.mark.parametrize("values", [
    np.random.default_rng(7).normal(0, 1, 400_001),  # odd
    np.random.default_rng(8).normal(0, 1, 400_000),  # even
    np.random.default_rng(9).integers(0, 5, 300_000).astype(np.float64),  # ties across the bracket
    np.repeat([1.0, 2.0], [150_000, 150_001]),  # the middle values differ, on the edge of two runs
    np.full(200_000, 3.5),
    np.arange(250_000, dtype=np.float64)[::-1].copy(),
    np.concatenate([np.full(199_999, -1e300), np.full(200_001, 1e300)]),
])
def test_median_of_many_values_is_numpys_to_the_bit(values):
    assert robust._median(values) == float(np.median(values))


def test_median_whose_bracket_misses_is_numpys_still(monkeypatch):
    monkeypatch.setattr(robust, "MEDIAN_MARGIN", 0)  # a bracket of one sample value: the middle falls outside
    values = np.random.default_rng(10).normal(0, 1, 300_000)
    assert robust._median(values) == float(np.median(values))


def test_theil_sen_slope_of_a_calibrations_points_is_the_median_of_the_pair_slopes_to_the_bit():
    rng = np.random.default_rng(11)
    size = np.round(rng.uniform(16, 512, 2000))  # sizes repeat: pairs left out
    ttft = 20.0 + 0.1 * size + rng.normal(0, 5, 2000)
    i, j = np.triu_indices(2000, k=1)
    distinct = size[j] != size[i]
    slopes = (ttft[j] - ttft[i])[distinct] / (size[j] - size[i])[distinct]
    assert theil_sen(size, ttft).slope == float(np.median(slopes))


def test_theil_sen_refits_only_points_it_has_not_fitted():
    rng = np.random.default_rng(6)
    size = rng.uniform(16, 512, 300)
    ttft = 20.0 + 0.1 * size + rng.normal(0, 0.3, 300)
    fit = theil_sen(size, ttft)
    assert theil_sen(size.copy(), ttft.copy()) is fit, "the same points: the kept fit"
    moved = ttft.copy()
    moved[-1] += 50.0  # one new idle arrival in place of the oldest
    refit = theil_sen(size, moved)
    assert refit is not fit and refit.n_outliers == fit.n_outliers + 1


def test_theil_sen_without_spread_in_x_is_flat_at_the_median():
    fit = theil_sen(np.full(5, 300.0), np.array([10.0, 11.0, 12.0, 13.0, 100.0]))
    assert fit.slope == 0.0 and fit.intercept == 12.0


@pytest.mark.parametrize("x, y", [([1.0], [2.0]), ([1.0, np.nan], [1.0, 2.0]), ([1.0, 2.0], [1.0])])
def test_theil_sen_refuses_unusable_input(x, y):
    with pytest.raises(ValueError):
        theil_sen(np.array(x), np.array(y))


# -- the knee ----------------------------------------------------------------------


def queue_curve(slots: int, levels: int, *, prefill_ms=15.0, service_ms=115.0, first_wait_share=0.5,
                noise=0.0, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """TTFT p50 against concurrency on a slot server: flat, then a first wait (for the soonest slot to free:
    a share of the per-slot service time), then one more service time per slot for each request further back."""
    rng = np.random.default_rng(seed)
    x = np.arange(1, levels + 1, dtype=float)
    beyond = np.maximum(0, x - slots)
    waits = np.where(beyond > 0, service_ms / slots * (beyond - 1 + first_wait_share), 0.0)
    return x, prefill_ms + waits + rng.normal(0, noise, levels)


@pytest.mark.parametrize("slots", [2, 3, 4, 6, 8])
def test_knee_is_the_slot_count(slots):
    x, y = queue_curve(slots, 2 * slots + 3, noise=0.5, seed=slots)
    fit = fit_knee(x, y, np.full(len(x), 5.0))
    assert fit.knee == slots
    assert fit.confidence > 0.5
    assert fit.flat_level == pytest.approx(15.0, abs=2)


def test_a_barely_visible_first_wait_puts_the_knee_within_one_of_the_slot_count():
    x, y = queue_curve(8, 19, first_wait_share=0.1, noise=0.5)
    assert fit_knee(x, y).knee in (8, 9)


def test_knee_ignores_far_overload():
    """Open-loop overload reaches hundreds in flight; those levels must not drown the turn."""
    x, y = queue_curve(4, 300, noise=1.0)
    weights = np.where(x <= 8, 30.0, 2.0)
    assert fit_knee(x, y, weights).knee == 4


def test_flat_curve_has_no_knee():
    x = np.arange(1, 12, dtype=float)
    fit = fit_knee(x, 40 + np.random.default_rng(3).normal(0, 1, len(x)))
    assert fit.knee is None and fit.confidence == 0.0
    assert "flat" in fit.reason


def test_too_few_levels_have_no_knee():
    fit = fit_knee(np.array([1.0, 2.0, 3.0]), np.array([10.0, 10.0, 80.0]))
    assert fit.knee is None and "levels" in fit.reason


def test_a_straight_climb_gets_little_confidence():
    x = np.arange(1, 12, dtype=float)
    fit = fit_knee(x, 10 + 30 * x)
    assert fit.knee is None or fit.confidence < 0.3


# -- configuration -----------------------------------------------------------------


def test_config_overrides_from_toml(tmp_path):
    path = tmp_path / "analytics.toml"
    path.write_text("""
[thresholds]
queue_wait_p95_warn_ms = 200
long_stream_events = 32

[[slo]]
objective = "ttft"
threshold_ms = 800
target = 0.995

[analysis]
calibration_min_points = 20
""")
    config = load_config(path)
    assert config.thresholds.queue_wait_p95_warn_ms == 200 and config.thresholds.long_stream_events == 32
    assert config.thresholds.queue_wait_p95_crit_ms == Thresholds().queue_wait_p95_crit_ms
    assert [(o.objective, o.threshold_ms, o.target) for o in config.objectives] == [("ttft", 800.0, 0.995)]
    assert config.spans.calibration_min_points == 20


@pytest.mark.parametrize("text, message", [
    ("[thresholds]\nqueue_wait_p95_warn = 1\n", "unknown key"),
    ("[thresholds]\nqueue_wait_p95_warn_ms = 'fast'\n", "must be a number"),
    ("[thresholds]\nlong_stream_events = 16.5\n", "must be an integer"),
    ("[thresholds]\ngpu_memory_warn = 0.95\ngpu_memory_crit = 0.9\n", "at most"),
    ("[[slo]]\nobjective = 'latency'\nthreshold_ms = 1\ntarget = 0.9\n", "must be one of"),
    ("[[slo]]\nobjective = 'ttft'\nthreshold_ms = 1\ntarget = 1.5\n", "between 0 and 1"),
    ("[alerts]\nx = 1\n", "unknown section"),
    ("[thresholds\n", "not valid TOML"),
])
def test_bad_config_is_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "analytics.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_duplicate_objectives_are_refused():
    objective = AnalyticsConfig().objectives[0]
    with pytest.raises(ValueError, match="one SLO per objective"):
        AnalyticsConfig(objectives=(objective, objective))


# -- times and scope ---------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("now", NOW_NS),
    ("15m", NOW_NS - 900 * NS_PER_S),
    ("-2h", NOW_NS - 7200 * NS_PER_S),
    ("1d", NOW_NS - 86400 * NS_PER_S),
    ("1700000000", 1_700_000_000 * NS_PER_S),
    ("2023-11-14T22:13:20Z", 1_700_000_000 * NS_PER_S),
    ("2023-11-14T23:13:20+01:00", 1_700_000_000 * NS_PER_S),
    ("2023-11-14 22:13:20.5", 1_700_000_000 * NS_PER_S + NS_PER_S // 2),
])
def test_times_people_write(text, expected):
    assert parse_time(text, NOW_NS) == expected


def test_unreadable_time_and_empty_range_are_errors():
    with pytest.raises(ValueError, match="cannot read the time"):
        parse_time("yesterday", NOW_NS)
    with pytest.raises(ValueError, match="empty time range"):
        TimeRange(NOW_NS, NOW_NS)


def test_scope_condition_binds_servers_and_models():
    scope = Scope((Server.parse("8000"), Server.parse("gpu-a:8001")), ("llama",))
    sql, parameters = scope.condition()
    assert "server_port = {scope_port_0:UInt16}" in sql and "node = {scope_node_1:String}" in sql
    assert parameters == {"scope_port_0": 8000, "scope_port_1": 8001, "scope_node_1": "gpu-a",
                          "scope_models": ["llama"]}
    assert "model" not in scope.condition(with_model=False)[0]
    assert Scope().condition() == ("1", {})
    with pytest.raises(ValueError):
        Server.parse("gpu-a:http")


def test_a_prefill_line_is_used_only_where_it_predicts_well():
    rng = np.random.default_rng(3)
    sizes = rng.uniform(100, 4000, 400)
    # prefill follows the prompt size: used
    assert unit_fit(sizes, 20 + 0.1 * sizes + rng.normal(0, 2, 400)).quality_problem is None
    # prompts of one size: nothing for R2 to explain, but the flat line is within a few % of every TTFT
    assert unit_fit(np.full(400, 512.0), 60 + rng.normal(0, 2, 400)).quality_problem is None
    # the size explains nothing and the error is as large as the TTFT itself: not used, and it says why
    problem = unit_fit(sizes, rng.uniform(0, 300, 400)).quality_problem
    assert problem is not None and problem.startswith(("R2 0.0", "R2 -0.0")) and "MAD" in problem


def unit_fit(sizes: np.ndarray, ttft_ms: np.ndarray) -> UnitFit:
    return UnitFit("bytes", theil_sen(sizes, ttft_ms), int(sizes.min()), int(sizes.max()))
