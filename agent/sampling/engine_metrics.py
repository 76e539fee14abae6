"""Inference servers' own ``/metrics``: vLLM, SGLang, TGI and llama.cpp, in one shape.

Each engine names the same facts differently. ``ENGINES`` lists, per engine,
which series answer each common field:

- ``requests_running``, ``requests_waiting`` (gauges),
- ``kv_cache_usage`` (fraction 0..1 of the KV cache in use),
- ``preemptions_total``, ``prompt_tokens_total``, ``generation_tokens_total``
  (counters since the server started),
- ``ttft``, ``queue``, ``prefill``, ``decode``, ``e2e``, ``itl`` latency
  histograms, turned into means over the scrape window: the mean of the
  requests the engine finished between the previous scrape and this one,
  ``(sum now - sum before) / (count now - count before)``, None when none did.

Fields an engine does not export stay None. A server with several engines or
models (vLLM's ``engine="0"``, ``"1"``...) is summed, except KV-cache usage,
where the fullest engine counts. Every other engine series (not histogram
buckets, not ``_created``, not ``*_info``) is kept in ``raw`` under
``name{label=value,...}``.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .prom_text import Exposition, Problem, Sample, check_scrape_url, scrape

LATENCY_FIELDS = ("ttft", "queue", "prefill", "decode", "e2e", "itl")


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    prefix: str  # every series of this engine starts with it; used to tell engines apart
    # field -> series names to try, first present wins (names changed across releases)
    gauges: dict[str, tuple[str, ...]]
    counters: dict[str, tuple[str, ...]]
    histograms: dict[str, tuple[str, ...]]  # latency field -> histogram family names, in seconds


ENGINES: tuple[EngineSpec, ...] = (
    EngineSpec(
        kind="vllm",
        prefix="vllm:",
        gauges={
            "requests_running": ("vllm:num_requests_running",),
            "requests_waiting": ("vllm:num_requests_waiting",),
            # v1 engine; the v0 engine called it gpu_cache_usage_perc. Both are fractions.
            "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        },
        counters={
            "preemptions_total": ("vllm:num_preemptions_total",),
            "prompt_tokens_total": ("vllm:prompt_tokens_total",),
            "generation_tokens_total": ("vllm:generation_tokens_total",),
        },
        histograms={
            "ttft": ("vllm:time_to_first_token_seconds",),
            "queue": ("vllm:request_queue_time_seconds",),
            "prefill": ("vllm:request_prefill_time_seconds",),
            "decode": ("vllm:request_decode_time_seconds",),
            "e2e": ("vllm:e2e_request_latency_seconds",),
            "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        },
    ),
    EngineSpec(
        kind="sglang",
        prefix="sglang:",
        gauges={
            "requests_running": ("sglang:num_running_reqs",),
            "requests_waiting": ("sglang:num_queue_reqs",),
            "kv_cache_usage": ("sglang:token_usage",),
        },
        counters={
            "prompt_tokens_total": ("sglang:prompt_tokens_total",),
            "generation_tokens_total": ("sglang:generation_tokens_total",),
        },
        histograms={
            "ttft": ("sglang:time_to_first_token_seconds",),
            "queue": ("sglang:queue_time_seconds",),
            "e2e": ("sglang:e2e_request_latency_seconds",),
            "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        },
    ),
    EngineSpec(
        kind="tgi",
        prefix="tgi_",
        gauges={
            "requests_running": ("tgi_batch_current_size",),
            "requests_waiting": ("tgi_queue_size",),
        },
        counters={
            # TGI counts tokens only in per-request histograms; their sums are the totals.
            "prompt_tokens_total": ("tgi_request_input_length_sum",),
            "generation_tokens_total": ("tgi_request_generated_tokens_sum",),
        },
        histograms={
            "queue": ("tgi_request_queue_duration",),
            "e2e": ("tgi_request_duration",),
            "itl": ("tgi_request_mean_time_per_token_duration",),
        },
    ),
    EngineSpec(
        kind="llamacpp",
        prefix="llamacpp:",
        gauges={
            "requests_running": ("llamacpp:requests_processing",),
            "requests_waiting": ("llamacpp:requests_deferred",),
            # Older llama-server builds only; later ones dropped it.
            "kv_cache_usage": ("llamacpp:kv_cache_usage_ratio",),
        },
        counters={
            "prompt_tokens_total": ("llamacpp:prompt_tokens_total",),
            "generation_tokens_total": ("llamacpp:tokens_predicted_total",),
        },
        histograms={},
    ),
)
_SPECS_BY_KIND = {spec.kind: spec for spec in ENGINES}
# How to combine one field's series across label sets (engines, models).
_COMBINE: dict[str, Callable[[Iterable[float]], float]] = {"kv_cache_usage": max}


@dataclass(frozen=True)
class EngineReading:
    """One scrape of one server; a row of ``tokenprobe.engine_samples`` without the node."""

    ts_ns: int
    server_url: str
    server_port: int
    engine: str  # "vllm", "sglang", "tgi", "llamacpp", or "unknown"
    model: str = ""
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    ttft_mean_s: float | None = None
    queue_mean_s: float | None = None
    prefill_mean_s: float | None = None
    decode_mean_s: float | None = None
    e2e_mean_s: float | None = None
    itl_mean_s: float | None = None
    raw: dict[str, float] = field(default_factory=dict)
    simulated: bool = False
    problems: tuple[Problem, ...] = ()  # lines of the page the parser skipped (the first MAX_PROBLEMS)
    problems_omitted: int = 0  # skipped lines after those


@dataclass(frozen=True)
class HistogramTotals:
    """A histogram's cumulative ``_sum`` and ``_count``, summed over its label sets."""

    sum: float
    count: float


def detect_engine(exposition: Exposition) -> str:
    """The engine whose prefix most series carry, or "unknown"."""
    counts = {spec.kind: 0 for spec in ENGINES}
    for sample in exposition.samples:
        for spec in ENGINES:
            if sample.name.startswith(spec.prefix):
                counts[spec.kind] += 1
    kind, count = max(counts.items(), key=lambda item: item[1])
    return kind if count else "unknown"


def histogram_totals(exposition: Exposition, engine: str) -> dict[str, HistogramTotals]:
    """Cumulative sum and count of each latency histogram the engine exports."""
    spec = _SPECS_BY_KIND.get(engine)
    if spec is None:
        return {}
    series = exposition.series_by_name()
    totals: dict[str, HistogramTotals] = {}
    for latency, names in spec.histograms.items():
        for name in names:
            sums, counts = series.get(f"{name}_sum"), series.get(f"{name}_count")
            if sums and counts:
                totals[latency] = HistogramTotals(_total(sums), _total(counts))
                break
    return totals


def window_mean(now: HistogramTotals, before: HistogramTotals | None) -> float | None:
    """Mean latency of the requests observed between two scrapes; None if there were none.

    A count that went down means the server restarted: the window is then
    everything since the restart.
    """
    if before is None:
        return None
    if now.count < before.count:
        before = HistogramTotals(0.0, 0.0)
    observed = now.count - before.count
    return (now.sum - before.sum) / observed if observed > 0 else None


def reading_from_exposition(
    exposition: Exposition,
    ts_ns: int,
    server_url: str,
    server_port: int,
    engine: str | None = None,
    previous_totals: dict[str, HistogramTotals] | None = None,
) -> tuple[EngineReading, dict[str, HistogramTotals]]:
    """Normalize one scrape. Returns the reading and the histogram totals to pass as ``previous_totals`` next time."""
    kind = engine or detect_engine(exposition)
    spec = _SPECS_BY_KIND.get(kind)
    series = exposition.series_by_name()
    fields: dict[str, float | None] = {}
    totals: dict[str, HistogramTotals] = {}
    raw: dict[str, float] = {}
    engine_samples: list[Sample] = []
    if spec is not None:
        for name, candidates in (spec.gauges | spec.counters).items():
            fields[name] = _first_present(series, candidates, _COMBINE.get(name, sum))
        totals = histogram_totals(exposition, kind)
        for latency, now in totals.items():
            fields[f"{latency}_mean_s"] = window_mean(now, (previous_totals or {}).get(latency))
        engine_samples = [sample for sample in exposition.samples if sample.name.startswith(spec.prefix)]
        raw = {_raw_key(sample): sample.value for sample in engine_samples if _worth_keeping(sample)}
    models = sorted({sample.labels["model_name"] for sample in engine_samples if "model_name" in sample.labels})
    reading = EngineReading(
        ts_ns=ts_ns,
        server_url=server_url,
        server_port=server_port,
        engine=kind,
        model=",".join(models),
        raw=raw,
        simulated=any(sample.labels.get("simulated") == "true" for sample in engine_samples),
        problems=tuple(exposition.problems),
        problems_omitted=exposition.problems_omitted,
        **fields,
    )
    return reading, totals


class EngineScraper:
    """Scrapes one inference server's ``/metrics`` and keeps what the window means need.

    ``server_port`` is the port clients send requests to, which the join
    matches against ``requests.server_port``; it defaults to the URL's port
    (TGI serves metrics on a port of its own, so give it there).
    ``engine`` forces the kind instead of detecting it from series prefixes.
    """

    def __init__(
        self, url: str, server_port: int | None = None, engine: str | None = None, timeout_s: float = 2.0
    ) -> None:
        self.url = check_scrape_url(url)
        parts = urllib.parse.urlsplit(url)
        self.server_port = server_port if server_port is not None else parts.port or _default_port(parts.scheme)
        if not 0 < self.server_port < 65536:
            raise ValueError(f"server port {self.server_port} is not a TCP port")
        if engine is not None and engine not in _SPECS_BY_KIND:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(_SPECS_BY_KIND)}")
        self.engine = engine
        self.timeout_s = timeout_s
        self._previous_totals: dict[str, HistogramTotals] | None = None

    def read(self, ts_ns: int) -> EngineReading:
        """Scrape now; raises ``ScrapeError`` when the server cannot be read."""
        return self.read_exposition(scrape(self.url, self.timeout_s), ts_ns)

    def read_exposition(self, exposition: Exposition, ts_ns: int) -> EngineReading:
        reading, self._previous_totals = reading_from_exposition(
            exposition, ts_ns, self.url, self.server_port, self.engine, self._previous_totals
        )
        return reading


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _total(samples: Iterable[Sample]) -> float:
    return sum(sample.value for sample in samples)


def _first_present(
    series: dict[str, list[Sample]], candidates: tuple[str, ...], combine: Callable[[Iterable[float]], float]
) -> float | None:
    for name in candidates:
        values = [sample.value for sample in series.get(name, ()) if not math.isnan(sample.value)]
        if values:
            return combine(values)
    return None


def _worth_keeping(sample: Sample) -> bool:
    # Buckets are many and rebuildable from nothing we store; _created stamps
    # and *_info gauges are constants, not measurements.
    return not (
        sample.name.endswith(("_bucket", "_created", "_info"))
        or math.isnan(sample.value)
        or "quantile" in sample.labels
    )


def _raw_key(sample: Sample) -> str:
    if not sample.labels:
        return sample.name
    return sample.name + "{" + ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items())) + "}"
