"""The Prometheus text parser, against real captured /metrics pages and the format's corner cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tokenprobe.agent.sampling.prom_text import parse_exposition

# Real captures from real inference servers (tests/data/fixtures/README.md says how each was taken).
FIXTURES = Path(__file__).resolve().parent / "data" / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def family_types(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for family in parse_exposition(text).families.values():
        counts[family.type] = counts.get(family.type, 0) + 1
    return counts


# --------------------------------------------------------------------------- real pages


@pytest.mark.parametrize(
    "name, families",
    [
        # tests/data/fixtures/README.md: 22 counter, 12 gauge, 18 histogram, 2 summary families,
        # plus one gauge family per _created series (34 idle, 38 busy/after).
        ("vllm_metrics_idle.txt", {"counter": 22, "gauge": 12 + 34, "histogram": 18, "summary": 2}),
        ("vllm_metrics_busy.txt", {"counter": 22, "gauge": 12 + 38, "histogram": 18, "summary": 2}),
        ("vllm_metrics_after.txt", {"counter": 22, "gauge": 12 + 38, "histogram": 18, "summary": 2}),
        ("llamacpp_metrics_busy.txt", {"counter": 10, "gauge": 5}),
    ],
)
def test_real_pages_parse_into_their_typed_families_without_problems(name, families):
    text = fixture_text(name)
    exposition = parse_exposition(text)
    assert exposition.problems == []
    assert family_types(text) == families
    sample_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(exposition.samples) == len(sample_lines)


def test_vllm_histogram_series_stay_in_their_family_and_created_is_its_own_family():
    exposition = parse_exposition(fixture_text("vllm_metrics_busy.txt"))
    ttft = exposition.families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert {sample.name for sample in ttft.samples} == {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    }
    count = next(s for s in ttft.samples if s.name.endswith("_count"))
    assert count.value == 6.0 and count.labels == {"engine": "0", "model_name": "small"}
    created = exposition.families["vllm:time_to_first_token_seconds_created"]
    assert created.type == "gauge" and created.samples[0].value == pytest.approx(1.796073255e9, rel=1e-9)
    # A histogram whose name ends in _total is still one histogram family.
    iteration = exposition.families["vllm:iteration_tokens_total"]
    assert iteration.type == "histogram" and len(iteration.samples) == 14 + 2


def test_values_and_labels_of_real_pages():
    busy = parse_exposition(fixture_text("vllm_metrics_busy.txt")).series_by_name()
    assert busy["vllm:num_requests_waiting"][0].value == 2.0
    reasons = {s.labels["reason"]: s.value for s in busy["vllm:num_requests_waiting_by_reason"]}
    assert reasons == {"capacity": 2.0, "deferred": 0.0}
    info = busy["vllm:cache_config_info"][0]
    assert info.value == 1.0 and info.labels["num_gpu_blocks"] == "455"
    # HELP lines keep their text, minus the trailing space some http_* lines carry.
    exposition = parse_exposition(fixture_text("vllm_metrics_busy.txt"))
    assert not exposition.families["http_requests_total"].help.endswith(" ")
    llama = parse_exposition(fixture_text("llamacpp_metrics_busy_late.txt")).series_by_name()
    assert llama["llamacpp:prompt_tokens_total"][0].value == 2001
    assert llama["llamacpp:n_busy_slots_per_decode"][0].value == 1.995


# --------------------------------------------------------------------------- the format's corners


def test_escaped_label_values_and_separators_inside_quotes():
    text = (
        'm{path="C:\\\\dir\\\\",quote="say \\"hi\\"",nl="a\\nb",odd="x,y}z=1",} 3\n'
        'm { a = "1" , b="2" } 4\n'
    )
    exposition = parse_exposition(text)
    assert exposition.problems == []
    first, second = exposition.samples
    assert first.labels == {"path": "C:\\dir\\", "quote": 'say "hi"', "nl": "a\nb", "odd": "x,y}z=1"}
    assert first.value == 3.0
    assert second.labels == {"a": "1", "b": "2"} and second.value == 4.0


def test_special_values_timestamps_and_exemplars():
    text = "\n".join(
        [
            "a NaN",
            "b +Inf",
            "c -Inf 1700000000000",
            "d 1.7960732549667518e+09",
            "e 2001",
            'f_bucket{le="0.5"} 7 # {trace_id="abc"} 0.4 1700000000.1',
            "# EOF",
        ]
    )
    series = parse_exposition(text).series_by_name()
    assert math.isnan(series["a"][0].value)
    assert series["b"][0].value == math.inf
    assert series["c"][0].value == -math.inf and series["c"][0].timestamp_ms == 1700000000000
    assert series["d"][0].value == pytest.approx(1796073254.9667518)
    assert series["e"][0].value == 2001.0 and series["e"][0].timestamp_ms is None
    assert series["f_bucket"][0].value == 7.0


def test_counter_typed_without_total_owns_its_total_series():
    text = "# HELP jobs Jobs done.\n# TYPE jobs counter\njobs_total 5\njobs_created 1.7e9\n"
    family = parse_exposition(text).families["jobs"]
    assert family.type == "counter" and family.help == "Jobs done."
    assert [sample.name for sample in family.samples] == ["jobs_total", "jobs_created"]


def test_series_without_type_lines_are_untyped_families():
    exposition = parse_exposition("up 1\nup{job=\"x\"} 0\n")
    assert exposition.families["up"].type == "untyped"
    assert [s.value for s in exposition.families["up"].samples] == [1.0, 0.0]


@pytest.mark.parametrize(
    "line, reason",
    [
        ("9lives 1", "does not start with a metric name"),
        ("m", "has no value"),
        ("m{a=\"1\" 2", "expected ',' or '}'"),
        ("m{a=1} 2", "malformed label set"),
        ('m{a="1",a="2"} 3', "appears twice"),
        ("m one", "not a number"),
        ("m 1_000", "not a number"),
        ("m 1e999", "out of range"),
        ("m 1 2 3", "unexpected text"),
        ("m 1 soon", "timestamp that is not an integer"),
        ('m{a="open} 1', "malformed label set"),
        ("# TYPE 9bad gauge", "invalid metric"),
    ],
)
def test_bad_lines_are_skipped_with_their_line_number_and_reason(line, reason):
    exposition = parse_exposition(f"good 1\n{line}\nalso_good 2\n")
    assert [sample.name for sample in exposition.samples] == ["good", "also_good"]
    (problem,) = exposition.problems
    assert problem.line_number == 2 and reason in problem.reason and problem.line == line


def test_only_newline_ends_a_line():
    text = '# HELP m A help text with a line\u2028separator.\r\nm{note="form\x0cfeed"} 1\r\n'
    exposition = parse_exposition(text)
    assert exposition.problems == []
    assert exposition.families["m"].help == "A help text with a line\u2028separator."
    assert exposition.samples[0].labels == {"note": "form\x0cfeed"}


def test_empty_and_comment_only_pages():
    assert parse_exposition("").samples == []
    exposition = parse_exposition("# just a comment\n\n   \n# HELP x\n")
    assert exposition.samples == [] and exposition.problems == []
