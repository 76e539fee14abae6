"""What the analytics can be told: indicator thresholds, SLO objectives, look-back spans.

Every field has the default the issue set out; ``load_config(path)`` reads a
TOML file that overrides any of them::

    [thresholds]
    queue_wait_p95_warn_ms = 200
    gpu_memory_crit = 0.95

    [[slo]]
    objective = "ttft"        # ttft | tpot | e2e
    threshold_ms = 800
    target = 0.995

    [analysis]
    calibration_lookback_s = 21600

Unknown sections or keys, and values of the wrong type, are errors that name
the key: a typo must not silently leave a default in force.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..contract.figures import DEFAULT_LONG_STREAM_EVENTS, DEFAULT_STALL_FACTOR

# The agent's live analysis (analytics/live.py): seconds between passes, and their window length.
DEFAULT_LIVE_EVERY_S = 30


@dataclass(frozen=True)
class Thresholds:
    """Indicator thresholds. Ratios are 0..1, times in ms, spans in s."""

    gpu_memory_warn: float = 0.75  # used / total
    gpu_memory_crit: float = 0.92
    fragmentation_memory: float = 0.85  # used / total above this ...
    fragmentation_queue: float = 10.0  # ... with more than this many requests queued ...
    fragmentation_util_pct: float = 30.0  # ... and the GPU less busy than this ...
    fragmentation_sustain_s: float = 120.0  # ... for this long
    batch_fill_ok: float = 0.85  # running / slots: at or above is a full batch
    batch_fill_warn: float = 0.4  # below this while requests queue
    batch_queue_min: float = 0.5  # "requests queue": at least this many queued on average
    queue_wait_p95_warn_ms: float = 120.0
    queue_wait_p95_crit_ms: float = 450.0
    kv_cache_warn: float = 0.80
    kv_cache_crit: float = 0.95
    long_stream_events: int = DEFAULT_LONG_STREAM_EVENTS  # a stream this long is judged for token-rate decay
    decay_warn: float = 0.8  # last-quarter decode rate / first-quarter rate below this
    decay_crit: float = 0.5
    tpot_trend_windows: int = 10  # windows the TPOT trend spans, this one included
    tpot_trend_warn: float = 0.25  # TPOT rose by this share over those windows
    tpot_trend_crit: float = 0.5
    stall_factor: float = DEFAULT_STALL_FACTOR  # a gap over this × the stream's median gap is a stall
    stall_rate_warn: float = 0.02  # share of gaps that are stalls
    stall_rate_crit: float = 0.05
    retry_window_s: float = 60.0  # the same fingerprint from the same client within this is a retry
    retry_rate_warn: float = 0.05
    retry_rate_crit: float = 0.20
    knee_proximity_warn: float = 0.8  # requests in flight / knee concurrency
    knee_proximity_crit: float = 1.0
    inflight_stall_warn_s: float = 10.0  # a request in flight without progress for this long
    inflight_stall_crit_s: float = 30.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"threshold {item.name} must be a non-negative number, got {value!r}")
        for warn, crit, worse in (
            ("gpu_memory_warn", "gpu_memory_crit", "above"),
            ("queue_wait_p95_warn_ms", "queue_wait_p95_crit_ms", "above"),
            ("kv_cache_warn", "kv_cache_crit", "above"),
            ("tpot_trend_warn", "tpot_trend_crit", "above"),
            ("stall_rate_warn", "stall_rate_crit", "above"),
            ("retry_rate_warn", "retry_rate_crit", "above"),
            ("knee_proximity_warn", "knee_proximity_crit", "above"),
            ("inflight_stall_warn_s", "inflight_stall_crit_s", "above"),
            ("decay_warn", "decay_crit", "below"),
        ):
            low, high = getattr(self, warn), getattr(self, crit)
            if (worse == "above" and low > high) or (worse == "below" and low < high):
                raise ValueError(f"{warn} ({low}) must be {'at most' if worse == 'above' else 'at least'} "
                                 f"{crit} ({high})")
        if self.long_stream_events < 4 or self.tpot_trend_windows < 3:
            raise ValueError("long_stream_events must be at least 4 and tpot_trend_windows at least 3")


SLO_MEASURES = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Objective:
    """``target`` of requests must have ``objective`` at or under ``threshold_ms``."""

    objective: str
    threshold_ms: float
    target: float

    def __post_init__(self) -> None:
        if self.objective not in SLO_MEASURES:
            raise ValueError(f"SLO objective must be one of {', '.join(SLO_MEASURES)}, got {self.objective!r}")
        if not self.threshold_ms > 0:
            raise ValueError(f"SLO threshold_ms must be positive, got {self.threshold_ms!r}")
        if not 0 < self.target < 1:
            raise ValueError(f"SLO target must be between 0 and 1 (exclusive), got {self.target!r}")


DEFAULT_OBJECTIVES = (
    Objective("ttft", 1000.0, 0.99),  # 99% of requests see their first token within 1 s
    Objective("tpot", 100.0, 0.99),
    Objective("e2e", 30_000.0, 0.99),
)


@dataclass(frozen=True)
class AnalysisSpans:
    """How far back each fit looks from the end of the analysed range, and sample sizes (seconds, counts)."""

    calibration_lookback_s: float = 6 * 3600.0
    calibration_min_points: int = 8  # idle arrivals needed to fit prefill
    calibration_max_points: int = 2000  # the most recent idle arrivals used
    knee_lookback_s: float = 6 * 3600.0
    knee_min_requests_per_level: int = 3
    baseline_lookback_s: float = 3600.0  # the controller's low-load p99 TTFT
    engine_check_min_samples: int = 5
    # The agent's live passes refit the prefill calibration and the knee at most this often, reusing
    # the last fits between (``pipeline.KeptFits``): both look back hours, which one window moves little.
    live_refit_every_s: float = 120.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{item.name} must be a positive number, got {value!r}")
        if self.calibration_min_points < 3:
            raise ValueError("calibration_min_points must be at least 3")


@dataclass(frozen=True)
class AnalyticsConfig:
    thresholds: Thresholds = field(default_factory=Thresholds)
    objectives: tuple[Objective, ...] = DEFAULT_OBJECTIVES
    spans: AnalysisSpans = field(default_factory=AnalysisSpans)

    def __post_init__(self) -> None:
        names = [objective.objective for objective in self.objectives]
        if len(set(names)) != len(names):
            raise ValueError(f"one SLO per objective, got {names}")


DEFAULT_CONFIG = AnalyticsConfig()


def load_config(path: str | Path) -> AnalyticsConfig:
    """Read a TOML file of overrides (see the module docstring); ValueError names what is wrong."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read analytics config {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"analytics config {path} is not valid TOML: {error}") from None
    unknown = set(document) - {"thresholds", "slo", "analysis"}
    if unknown:
        raise ValueError(f"analytics config {path}: unknown section(s) {sorted(unknown)}; "
                         "use [thresholds], [[slo]] and [analysis]")
    config = AnalyticsConfig()
    if "thresholds" in document:
        config = replace(config, thresholds=_override(config.thresholds, document["thresholds"], "thresholds"))
    if "analysis" in document:
        config = replace(config, spans=_override(config.spans, document["analysis"], "analysis"))
    if "slo" in document:
        entries = document["slo"]
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"analytics config {path}: [[slo]] must be a list of tables")
        config = replace(config, objectives=tuple(_objective(entry, index) for index, entry in enumerate(entries)))
    return config


def _override(defaults: Any, values: Any, section: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"[{section}] must be a table of key = value")
    known = {item.name: item for item in fields(defaults)}
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"[{section}]: unknown key(s) {sorted(unknown)}; known: {', '.join(known)}")
    for key, value in values.items():
        expected = int if isinstance(getattr(defaults, key), int) else float
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (expected is int and
                                                                              not isinstance(value, int)):
            raise ValueError(f"[{section}] {key} must be {'an integer' if expected is int else 'a number'}, "
                             f"got {value!r}")
    return replace(defaults, **values)


def _objective(entry: Any, index: int) -> Objective:
    if not isinstance(entry, dict) or set(entry) != {"objective", "threshold_ms", "target"}:
        raise ValueError(f"[[slo]] entry {index + 1} must have exactly objective, threshold_ms and target")
    for key in ("threshold_ms", "target"):
        if isinstance(entry[key], bool) or not isinstance(entry[key], (int, float)):
            raise ValueError(f"[[slo]] entry {index + 1}: {key} must be a number, got {entry[key]!r}")
    return Objective(str(entry["objective"]), float(entry["threshold_ms"]), float(entry["target"]))
