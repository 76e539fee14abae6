"""A parser for the Prometheus text exposition format (version 0.0.4).

The GPU and engine scrapers read what real exporters serve: dcgm-exporter,
vLLM and SGLang (Python prometheus_client), TGI (Rust metrics-exporter), and
llama.cpp (hand-written). Their output differs in small ways the format allows
and this parser accepts all of them:

- ``# HELP`` and ``# TYPE`` lines, in any order, or missing altogether; HELP
  text with escapes or a trailing space; other ``#`` lines are comments.
- label values with ``\\\\``, ``\\"`` and ``\\n`` escapes, and with commas,
  braces or ``=`` inside the quotes; a trailing comma before ``}``.
- values written as ``0``, ``4.0``, ``1.796e+09``, ``NaN``, ``+Inf``, ``-Inf``;
  an optional integer millisecond timestamp after the value.
- OpenMetrics leftovers: a ``# EOF`` line and exemplars (`` # {...} 1.0``).
- prometheus_client's ``_created`` series, which arrive as their own gauge
  families with their own HELP/TYPE lines (see shared/fixtures/README.md).

A line that cannot be read is skipped and recorded in ``Exposition.problems``
with its line number and the reason, so one bad series never loses a scrape.

Memory stays bounded whatever a server sends: a page over ``MAX_PAGE_BYTES``
or with more than ``MAX_SERIES`` samples (or families) is refused with a
``ScrapeError``; only the first ``MAX_PROBLEMS`` bad lines are kept (the rest
are counted in ``Exposition.problems_omitted``), each quoted in a few dozen
characters at most.

``parse_page(body)`` parses a body as served (bytes), ``scrape(url, timeout_s)``
fetches one over HTTP first; a page or server that cannot be read raises
``ScrapeError`` with the reason in plain words, and nothing else.
"""

from __future__ import annotations

import http.client
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

# Series names a TYPE line's family owns besides its own name.
_FAMILY_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("_sum", "_count", "_created"),
}

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABELS_END = re.compile(r"\s*\}")
_LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED_CHARS = {"\\": "\\", '"': '"', "n": "\n"}

# Bounds on what one page may make this parser hold. Real pages are far below
# them: vLLM's is ~600 samples and 60 KB, dcgm-exporter's ~40 samples per GPU.
MAX_PAGE_BYTES = 16 * 1024 * 1024
MAX_SERIES = 100_000  # samples, and families, per page
MAX_PROBLEMS = 100  # bad lines kept with their reasons; the rest are only counted
_QUOTE_CHARS = 60  # of a bad line or token quoted in a problem


@dataclass(frozen=True, slots=True)  # slots: a page may hold up to MAX_SERIES of these
class Sample:
    """One series' value: ``name{labels} value [timestamp_ms]``."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None = None


@dataclass(slots=True)
class MetricFamily:
    """The samples a ``# TYPE`` line announces, or one untyped series name."""

    name: str
    type: str = "untyped"
    help: str = ""
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class Problem:
    """A line the parser skipped, and why; ``line`` is its first characters."""

    line_number: int
    reason: str
    line: str


@dataclass
class Exposition:
    """A parsed scrape: families in the order first seen, every sample, and skipped lines.

    ``problems`` holds the first ``MAX_PROBLEMS`` skipped lines;
    ``problems_omitted`` counts the skipped lines after those.
    """

    families: dict[str, MetricFamily] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    problems_omitted: int = 0

    @property
    def samples(self) -> list[Sample]:
        return [sample for family in self.families.values() for sample in family.samples]

    def series_by_name(self) -> dict[str, list[Sample]]:
        """Samples grouped by series name (``x_bucket`` apart from ``x_sum``), in text order."""
        index: dict[str, list[Sample]] = {}
        for sample in self.samples:
            index.setdefault(sample.name, []).append(sample)
        return index


class _LineError(ValueError):
    pass


def parse_exposition(text: str) -> Exposition:
    """Parse one scrape's body; bad lines land in ``problems``.

    Raises ``ScrapeError`` only for a page beyond the bounds above (over
    ``MAX_PAGE_BYTES`` characters, or more than ``MAX_SERIES`` samples or families).
    """
    if len(text) > MAX_PAGE_BYTES:
        raise ScrapeError(f"metrics page has {len(text)} characters, over the {MAX_PAGE_BYTES} a page may hold")
    exposition = Exposition()
    current: MetricFamily | None = None
    sample_count = 0
    for line_number, raw_line in enumerate(_lines(text), start=1):
        line = raw_line.strip()
        if not line:
            continue
        try:
            if line.startswith("#"):
                current = _parse_comment(line, exposition, current)
                continue
            sample = _parse_sample(line)
        except _LineError as error:
            if len(exposition.problems) < MAX_PROBLEMS:
                exposition.problems.append(Problem(line_number, str(error), raw_line[:_QUOTE_CHARS]))
            else:
                exposition.problems_omitted += 1
            continue
        sample_count += 1
        if sample_count > MAX_SERIES:
            raise ScrapeError(f"metrics page holds more than {MAX_SERIES} samples; not a page this agent reads")
        if current is not None and _belongs_to(sample.name, current):
            current.samples.append(sample)
        else:
            _family(exposition, sample.name).samples.append(sample)
    return exposition


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` one at a time: a list of them all would cost ~50 bytes a line.

    Lines end in "\n" only: str.splitlines() would also split on characters
    (U+2028, form feed...) that may legally sit inside a HELP text or label value.
    """
    start = 0
    while start <= len(text):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        yield text[start:end]
        start = end + 1


def _quote(text: str) -> str:
    """``text`` for a problem's reason: quoted, and cut short."""
    return repr(text[:_QUOTE_CHARS]) + ("..." if len(text) > _QUOTE_CHARS else "")


def _family(exposition: Exposition, name: str) -> MetricFamily:
    family = exposition.families.get(name)
    if family is None:
        if len(exposition.families) == MAX_SERIES:
            raise ScrapeError(f"metrics page holds more than {MAX_SERIES} families; not a page this agent reads")
        family = exposition.families[name] = MetricFamily(name)
    return family


def _belongs_to(series_name: str, family: MetricFamily) -> bool:
    return series_name == family.name or any(
        series_name == family.name + suffix for suffix in _FAMILY_SUFFIXES.get(family.type, ())
    )


def _parse_comment(line: str, exposition: Exposition, current: MetricFamily | None) -> MetricFamily | None:
    """Handle a ``#`` line; return the family that following samples should join."""
    parts = line[1:].strip().split(None, 2)
    if len(parts) < 2 or parts[0] not in ("HELP", "TYPE"):
        return current  # a plain comment, or OpenMetrics' "# EOF"
    keyword, name = parts[0], parts[1]
    if not _METRIC_NAME.fullmatch(name):
        raise _LineError(f"{keyword} line names an invalid metric {_quote(name)}")
    family = _family(exposition, name)
    rest = parts[2] if len(parts) > 2 else ""
    if keyword == "HELP":
        family.help = _unescape(rest.rstrip())
    else:
        family.type = rest.strip().lower() or "untyped"
    return family


def _parse_sample(line: str) -> Sample:
    name_match = _METRIC_NAME.match(line)
    if name_match is None:
        raise _LineError("line does not start with a metric name")
    name = name_match.group()
    position = name_match.end()
    labels: dict[str, str] = {}
    label_start = len(line) - len(line[position:].lstrip())
    if line.startswith("{", label_start):
        labels, position = _parse_labels(line, label_start + 1)
    fields = line[position:].split("#", 1)[0].split()  # drop an OpenMetrics exemplar
    if not fields:
        raise _LineError(f"series {_quote(name)} has no value")
    if len(fields) > 2:
        raise _LineError(f"series {_quote(name)} has unexpected text after its value: {_quote(' '.join(fields[2:]))}")
    value = _parse_value(fields[0], name)
    timestamp_ms = _parse_timestamp(fields[1], name) if len(fields) == 2 else None
    return Sample(name, labels, value, timestamp_ms)


def _parse_labels(line: str, position: int) -> tuple[dict[str, str], int]:
    """Read ``a="x",b="y"}`` starting just after ``{``; return labels and the index after ``}``."""
    labels: dict[str, str] = {}
    while True:
        closing = _LABELS_END.match(line, position)
        if closing:
            return labels, closing.end()
        pair = _LABEL_PAIR.match(line, position)
        if pair is None:
            raise _LineError(f"malformed label set near column {position + 1}")
        label_name, escaped_value = pair.groups()
        if label_name in labels:
            raise _LineError(f"label {_quote(label_name)} appears twice")
        labels[label_name] = _unescape(escaped_value)
        position = pair.end()
        if position < len(line) and line[position] == ",":
            position += 1
        elif not (position < len(line) and line[position] == "}"):
            raise _LineError(f"expected ',' or '}}' after label {_quote(label_name)}")


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda match: _ESCAPED_CHARS.get(match.group(1), match.group(0)), text)


def _parse_value(text: str, name: str) -> float:
    # float() also takes "nan", "inf", "infinity" in any case and "1_000":
    # accept the exposition spellings of the specials, reject underscores.
    if "_" in text:
        raise _LineError(f"series {_quote(name)} has a value that is not a number: {_quote(text)}")
    try:
        value = float(text)
    except ValueError:
        raise _LineError(f"series {_quote(name)} has a value that is not a number: {_quote(text)}") from None
    if math.isinf(value) and text.lstrip("+-").lower() not in ("inf", "infinity"):
        raise _LineError(f"series {_quote(name)} has a value out of range: {_quote(text)}")
    return value


def _parse_timestamp(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _LineError(f"series {_quote(name)} has a timestamp that is not an integer: {_quote(text)}") from None


class ScrapeError(Exception):
    """A /metrics endpoint or page could not be read; the message says why in plain words."""


def check_scrape_url(url: str) -> str:
    """Return ``url`` if it is an http(s) URL with a host, else raise ValueError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"metrics URL {url!r} must be http:// or https:// with a host")
    return url


def parse_page(body: bytes) -> Exposition:
    """Parse a body as served. Raises ``ScrapeError`` past ``MAX_PAGE_BYTES`` (or ``MAX_SERIES``).

    The text format is UTF-8 by definition, whatever charset a server names
    (Prometheus reads it so too); bytes that are not UTF-8 become U+FFFD.
    """
    if len(body) > MAX_PAGE_BYTES:
        raise ScrapeError(f"metrics page is over {MAX_PAGE_BYTES} bytes; not a page this agent reads")
    return parse_exposition(body.decode("utf-8", errors="replace"))


def scrape(url: str, timeout_s: float) -> Exposition:
    """GET ``url`` asking for the 0.0.4 text format, and parse the body."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain; version=0.0.4"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(MAX_PAGE_BYTES + 1)  # one byte over tells a page too large
    except urllib.error.HTTPError as error:
        raise ScrapeError(f"{url} answered HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        # HTTPException: a response that is not HTTP (bad status line, overlong header, short body).
        reason = getattr(error, "reason", error)
        raise ScrapeError(f"{url} could not be read: {reason}") from None
    try:
        return parse_page(body)
    except ScrapeError as error:
        raise ScrapeError(f"{url}: {error}") from None
