"""The two fits the analytics rest on, in numpy, on aggregates pulled from ClickHouse.

- ``theil_sen``: a straight line robust to outliers (prefill time against
  prompt size). The slope is the median of the slopes between all pairs of
  points, the intercept the median of what is left; up to about 29% of the
  points can be arbitrarily wrong without moving the line. It costs n² (2M
  pairs for the 2000 points of a calibration, tens of ms), so the latest fits
  are kept by their points: a live pass whose server saw no new idle arrival
  refits nothing.
- ``fit_knee``: where a latency curve turns from flat to steep: a line, then
  a jump and a steeper line, the turn searched over the observed levels,
  each candidate solved by weighted least squares. See ``fit_knee`` for the
  model and the confidence.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# A residual this many robust standard deviations out is an outlier.
OUTLIER_SIGMAS = 3.0
# Median absolute deviation × this estimates the standard deviation of normal data.
MAD_TO_SIGMA = 1.4826
# Theil-Sen fits kept by the digest of their points (two per server and model: tokens and bytes).
KEPT_FITS = 256
# A median of more values than this is selected within a bracket drawn from a sample of MEDIAN_SAMPLE of
# them, MEDIAN_MARGIN sample ranks either side of the middle (4 standard deviations of the middle's rank).
BRACKETED_MEDIAN_MIN = 1 << 17
MEDIAN_SAMPLE = 1 << 14
MEDIAN_MARGIN = 4 * 64  # the sample's middle rank varies by √MEDIAN_SAMPLE / 2


@dataclass(frozen=True)
class LineFit:
    intercept: float
    slope: float
    r2: float | None  # over the inliers; None when they do not vary
    mad: float  # median |residual|: the typical error of a prediction
    n: int
    n_outliers: int


def theil_sen(x: np.ndarray, y: np.ndarray) -> LineFit:
    """Fit y ≈ intercept + slope·x robustly. Needs at least two points.

    When every x is the same there is no slope to find: the line is flat at
    the median of y.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("x and y must be 1-D arrays of the same length")
    if len(x) < 2:
        raise ValueError(f"a line needs at least 2 points, got {len(x)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite")
    key = hashlib.blake2b(x.tobytes() + b"|" + y.tobytes(), digest_size=16).digest()
    with _kept_lock:
        if key in _kept_fits:
            _kept_fits.move_to_end(key)
            return _kept_fits[key]
    fit = _fit_theil_sen(x, y)
    with _kept_lock:
        _kept_fits[key] = fit
        while len(_kept_fits) > KEPT_FITS:
            _kept_fits.popitem(last=False)
    return fit


_kept_fits: OrderedDict[bytes, LineFit] = OrderedDict()
_kept_lock = threading.Lock()


def _fit_theil_sen(x: np.ndarray, y: np.ndarray) -> LineFit:
    slopes = _pair_slopes(x, y)
    slope = _median(slopes) if len(slopes) else 0.0
    intercept = float(np.median(y - slope * x))
    residuals = y - (intercept + slope * x)
    mad = float(np.median(np.abs(residuals)))
    spread = MAD_TO_SIGMA * float(np.median(np.abs(residuals - np.median(residuals))))
    inliers = np.abs(residuals) <= OUTLIER_SIGMAS * spread if spread > 0 else np.ones(len(x), dtype=bool)
    return LineFit(intercept, slope, _r2(y[inliers], residuals[inliers]), mad, len(x), int((~inliers).sum()))


def _pair_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The slope between every two points of different x (in no particular order: only their median counts).

    Sorted by x, a point's pairs with a larger x are the points after the last of its own x: each row of
    slopes is written straight into one array, with no pair of equal x to mask out and no index arrays to
    gather through (a third to a half of ``np.triu_indices``' time). (y_j − y_i) / (x_j − x_i) is the same
    float whichever of the two comes first.
    """
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    n = len(x)
    larger = np.searchsorted(x, x, side="right")  # each point's first point of a larger x
    slopes = np.empty(int((n - larger).sum()))
    steps = np.empty(n)
    at = 0
    for i, first in enumerate(larger):
        if first == n:  # so are all after it
            break
        row = slopes[at:at + n - first]
        np.subtract(y[first:], y[i], out=row)
        np.divide(row, np.subtract(x[first:], x[i], out=steps[:n - first]), out=row)
        at += n - first
    return slopes


def _median(values: np.ndarray) -> float:
    """``np.median`` of finite values, to the bit. Of many (the n² pair slopes), the middle values are
    selected among those between two order statistics of a sample, which bracket them: counting and
    gathering those costs a few passes over the values (6 ms for the 2M slopes of 2000 points, where
    partitioning them all took 20–35 ms). The value is exact either way: a sample that misses the middle,
    which 4 standard deviations make rare, leaves all of them to partition."""
    n = len(values)
    middle = n // 2
    lowest = middle if n % 2 else middle - 1  # the lower middle rank
    if n > BRACKETED_MEDIAN_MIN:
        sample = np.sort(values[np.random.default_rng(n).integers(0, n, MEDIAN_SAMPLE)])
        at = lowest * MEDIAN_SAMPLE // n
        low, high = sample[max(at - MEDIAN_MARGIN, 0)], sample[min(at + MEDIAN_MARGIN, MEDIAN_SAMPLE - 1)]
        below = np.count_nonzero(values < low)
        between = values[(values >= low) & (values <= high)]  # ranks below .. below + len(between) - 1
        if below <= lowest and middle < below + len(between):
            values, middle = between, middle - below
    parted = np.partition(values, middle)
    upper = parted[middle]
    return float(upper if n % 2 else np.mean([parted[:middle].max(), upper]))


def _r2(y: np.ndarray, residuals: np.ndarray) -> float | None:
    total = float(((y - y.mean()) ** 2).sum()) if len(y) else 0.0
    return None if total == 0 else 1.0 - float((residuals**2).sum()) / total


@dataclass(frozen=True)
class KneeFit:
    """Where a latency curve turns from flat to steep, or why no turn was found.

    ``knee`` is the last level before the turn, in the curve's x units; None
    when the curve shows no turn (``reason`` says why).
    """

    knee: float | None
    confidence: float
    flat_level: float | None  # the curve's fitted value at the knee
    slope_before: float | None
    slope_after: float | None  # mean rise per level from the knee to the highest level fitted
    reason: str


# The curve must at least rise this much past the knee (as a share of the
# flat level) to count as a knee rather than noise on a flat curve.
MIN_RISE = 0.5
MIN_LEVELS = 5
# Levels needed on each side of the knee for full confidence.
FULL_SUPPORT_BEFORE = 2
FULL_SUPPORT_AFTER = 2
# A level more than this share above every level below it has risen.
FLAT_TOLERANCE = 0.15
# The least latency among the lowest levels is the curve's base; RISE_FACTOR × base marks a clear rise.
BASE_LEVELS = 3
RISE_FACTOR = 2.0


def fit_knee(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> KneeFit:
    """Fit y = a + s1·x + [x > b]·(d + s2·(x − b⁺)) and report b, the last level before the turn.

    x: the load levels (e.g. concurrency), y: latency at each level, weights:
    how much each level counts (e.g. √requests). A queue makes latency jump
    at the turn (the first request that waits, waits for a slot to free) and
    then climb: ``d`` ≥ 0 is that jump at b⁺, the first level after b, and
    ``s2`` the extra climb per level from there. With a jump, any b between
    two levels fits alike, so b is searched over the observed levels, leaving
    at least two on each side, then stepped back while the level at b has
    itself clearly risen (``_step_back``). Only levels up to twice the first
    one whose latency doubled the base (+ 2) are fitted (``_near_the_turn``).

    Confidence in [0, 1] is the product of
    - improvement: 1 − SSE(turn) / SSE(one straight line): how much a turn
      explains that a single line cannot (0 for a straight or flat curve);
    - contrast: s_after / (|s_before| + s_after), s_after the mean rise per
      level after the knee: 1 when flat then steep;
    - support: levels seen at or before (up to 2) and after (up to 2) the knee.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64)
    if not (x.shape == y.shape == w.shape and x.ndim == 1):
        raise ValueError("x, y and weights must be 1-D arrays of the same length")
    if len(np.unique(x)) != len(x):
        raise ValueError("each load level must appear once")
    order = np.argsort(x)
    x, y, w = _near_the_turn(x[order], y[order], w[order])
    if len(x) < MIN_LEVELS:
        return KneeFit(None, 0.0, None, None, None, f"only {len(x)} load levels seen; {MIN_LEVELS} are needed")
    root_w = np.sqrt(w)
    line_sse = _weighted_lstsq(np.column_stack([np.ones_like(x), x]), y, root_w)[1]
    fits = {float(b): _fit_turn(x, y, root_w, b) for b in x[1:-2]}
    rising = {b: fit for b, fit in fits.items() if fit[0][2] + fit[0][3] > 0}
    if not rising:
        return KneeFit(None, 0.0, None, None, None, "latency does not rise faster at higher load")
    b = _step_back(x, y, min(rising, key=lambda candidate: rising[candidate][1]))
    (a, s_before, jump, bend), sse = fits.get(b) or _fit_turn(x, y, root_w, b)
    flat_level = a + s_before * b
    rise = jump + s_before * (x[-1] - b) + bend * (x[-1] - x[x > b].min())
    s_after = rise / (x[-1] - b)
    if flat_level <= 0 or rise < MIN_RISE * flat_level:
        return KneeFit(None, 0.0, float(flat_level), float(s_before), float(s_after),
                       f"latency stays within {MIN_RISE:.0%} of its flat level up to the highest load seen")
    improvement = max(0.0, 1.0 - sse / line_sse) if line_sse > 0 else 0.0
    contrast = s_after / (abs(s_before) + s_after)
    levels_before = int((x <= b).sum())
    levels_after = int((x > b).sum())
    support = min(1.0, levels_before / FULL_SUPPORT_BEFORE) * min(1.0, levels_after / FULL_SUPPORT_AFTER)
    return KneeFit(b, float(improvement * contrast * support), float(flat_level), float(s_before), float(s_after), "")


def _fit_turn(x: np.ndarray, y: np.ndarray, root_w: np.ndarray, b: float) -> tuple[np.ndarray, float]:
    """Coefficients (a, s1, d, s2) and SSE of the turn after level ``b``.

    The jump d is measured at the first level after b, and s2 climbs from
    there; a jump that would be negative (latency does not drop at a turn) is
    left out.
    """
    after = (x > b).astype(np.float64)
    design = np.column_stack([np.ones_like(x), x, after, after * (x - x[x > b].min())])
    # A single level before the turn has no slope to fit: it is taken flat.
    columns = [0, 1, 2, 3] if (x <= b).sum() >= 2 else [0, 2, 3]
    coefficients, sse = _solve(design, columns, y, root_w)
    if coefficients[2] < 0:
        coefficients, sse = _solve(design, [column for column in columns if column != 2], y, root_w)
    return coefficients, sse


def _solve(design: np.ndarray, columns: list[int], y: np.ndarray, root_w: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares on some of the design's columns; the coefficients of the others are 0."""
    solved, sse = _weighted_lstsq(design[:, columns], y, root_w)
    coefficients = np.zeros(design.shape[1])
    coefficients[columns] = solved
    return coefficients, sse


def _step_back(x: np.ndarray, y: np.ndarray, knee: float) -> float:
    """Move the knee down while its own latency stands clearly above every level below it.

    A small first step (the first request to queue waits only for the
    soonest slot to free) can be fitted as part of the flat segment; the
    level at the knee must itself still be flat.
    """
    while True:
        below = x < knee
        if not below.any():
            return knee
        if y[x == knee][0] <= (1 + FLAT_TOLERANCE) * float(y[below].max()):
            return knee
        knee = float(x[below][-1])


def _near_the_turn(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The levels up to twice the first one whose latency doubled the lowest levels' (+ 2), in order.

    Far into overload a latency curve is one straight climb: it says nothing
    about where it turned, yet its many levels would outweigh those that do.
    A curve that never doubles is kept whole.
    """
    base = float(np.min(y[:BASE_LEVELS]))
    risen = np.nonzero(y > RISE_FACTOR * base)[0] if base > 0 else np.array([], dtype=int)
    if len(risen) == 0:
        return x, y, w
    keep = x <= 2 * x[risen[0]] + 2
    return x[keep], y[keep], w[keep]


def _weighted_lstsq(design: np.ndarray, y: np.ndarray, root_w: np.ndarray) -> tuple[np.ndarray, float]:
    coefficients = np.linalg.lstsq(design * root_w[:, None], y * root_w, rcond=None)[0]
    residuals = (y - design @ coefficients) * root_w
    return coefficients, float(residuals @ residuals)
