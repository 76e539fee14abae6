"""Posting the analytics' findings straight to Alertmanager (HTTP API v2).

Prometheus raises alerts from the agent's /metrics through the rules in
deploy/prometheus; the analytics see more than those series (the knee, a
fitted prefill model, a request's GPU state) and can raise their own alerts
the same way Prometheus does: ``POST /api/v2/alerts``.

How Alertmanager treats a posted alert (the same for Prometheus's):

- An alert is identified by its labels. Posting the same labels again
  refreshes it; it does not make a second alert.
- Without ``ends_at``, Alertmanager resolves the alert by itself after its
  ``resolve_timeout`` (5 minutes by default). So post every finding that
  still holds on every analytics cycle, and ``resolve`` it when it ends.
- With several Alertmanagers (an HA cluster), post to every one: they
  deduplicate among themselves. ``post`` succeeds if at least one accepted.

Labels follow the agent's rules (``severity``, ``server_port``, ``model``) so
the routes and inhibitions written for one serve both; ``finding`` builds
such an alert. Labels and annotations say what and where, never a prompt or a
completion.

    client = AlertmanagerClient("http://alertmanager:9093")
    client.post([finding("TokenprobeKneeReached", "warning", 8000, "llama-3-8b",
                         summary="load is past the knee: 14 req/s, capacity ~11")])
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

log = logging.getLogger(__name__)

SOURCE_LABEL = "source"
SOURCE = "tokenprobe-analytics"
SEVERITIES = ("critical", "warning", "info")

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_MAX_ERROR_BODY = 2000


class AlertmanagerError(Exception):
    """Alertmanager could not be reached or refused what was sent; the message says which and why."""


def _as_text(kind: str, name: str, value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"{kind} {name!r} must be a string or a number, got {type(value).__name__}")


def _checked_pairs(kind: str, pairs: Mapping[str, object]) -> dict[str, str]:
    checked = {}
    for name, value in pairs.items():
        if not isinstance(name, str) or not _LABEL_NAME.match(name):
            raise ValueError(f"{kind} name {name!r} is not a valid Prometheus label name")
        checked[name] = _as_text(kind, name, value)
    return checked


def _rfc3339(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError(f"alert times must be timezone-aware, got {moment!r}")
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Alert:
    """One alert as Alertmanager's API v2 takes it; ``name`` becomes the ``alertname`` label."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    starts_at: datetime | None = None
    ends_at: datetime | None = None
    generator_url: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an alert needs a name")
        if "alertname" in self.labels:
            raise ValueError("give the alert's name as `name`, not as an `alertname` label")
        # Normalise numbers (a port) to text once, so equal alerts compare and post equal.
        object.__setattr__(self, "labels", _checked_pairs("label", self.labels))
        object.__setattr__(self, "annotations", _checked_pairs("annotation", self.annotations))
        for moment in (self.starts_at, self.ends_at):
            if moment is not None:
                _rfc3339(moment)

    def to_api(self) -> dict:
        """The JSON object ``POST /api/v2/alerts`` takes."""
        body: dict = {"labels": {"alertname": self.name, **self.labels}, "annotations": dict(self.annotations)}
        if self.starts_at is not None:
            body["startsAt"] = _rfc3339(self.starts_at)
        if self.ends_at is not None:
            body["endsAt"] = _rfc3339(self.ends_at)
        if self.generator_url:
            body["generatorURL"] = self.generator_url
        return body


def finding(name: str, severity: str, server_port: int, model: str, *, summary: str, description: str = "",
            labels: Mapping[str, str] | None = None, generator_url: str = "") -> Alert:
    """An analytics finding about one server and model, labelled like the agent's Prometheus alerts."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    annotations = {"summary": summary}
    if description:
        annotations["description"] = description
    all_labels = {"severity": severity, "server_port": str(server_port), "model": model, SOURCE_LABEL: SOURCE,
                  **(labels or {})}
    # An empty label is no label to Prometheus: leave it out, so both kinds of alert carry the same set.
    all_labels = {name: value for name, value in all_labels.items() if value != ""}
    return Alert(name, all_labels, annotations, starts_at=datetime.now(timezone.utc),
                 generator_url=generator_url)


def _quoted(value: str) -> str:
    """A label value inside a matcher's double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def check_url(url: str) -> str:
    """An Alertmanager base URL, without its trailing slash; ValueError if it is not one."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"Alertmanager URL {url!r} must be http:// or https:// with a host")
    return url.rstrip("/")


class AlertmanagerClient:
    """Posts alerts to one Alertmanager or to every member of an HA cluster, and reads them back."""

    def __init__(self, urls: str | Sequence[str], *, timeout_s: float = 5.0,
                 headers: Mapping[str, str] | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("give at least one Alertmanager URL")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.urls = [check_url(url) for url in urls]
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})  # e.g. {"Authorization": "Bearer …"} behind a proxy

    def post(self, alerts: Sequence[Alert]) -> None:
        """Fire (or refresh) ``alerts`` on every Alertmanager; raises if none accepted them."""
        if not alerts:
            return
        body = json.dumps([alert.to_api() for alert in alerts]).encode()
        failures = []
        for url in self.urls:
            try:
                self._request("POST", f"{url}/api/v2/alerts", body)
            except AlertmanagerError as error:
                failures.append(str(error))
        if len(failures) == len(self.urls):
            raise AlertmanagerError("; ".join(failures))
        for failure in failures:
            log.warning("posting alerts: %s (another Alertmanager accepted them)", failure)

    def resolve(self, alerts: Sequence[Alert]) -> None:
        """Mark ``alerts`` resolved now (same labels, ``ends_at`` = now)."""
        now = datetime.now(timezone.utc)
        self.post([replace(alert, ends_at=now) for alert in alerts])

    def alerts(self, matchers: Mapping[str, str] | None = None, *, active: bool = True) -> list[dict]:
        """Alerts the first reachable Alertmanager holds, as API v2 objects, filtered by label equality."""
        query = [("active", str(active).lower())]
        query += [("filter", f'{name}="{_quoted(value)}"')
                  for name, value in _checked_pairs("label", matchers or {}).items()]
        errors = []
        for url in self.urls:
            try:
                return json.loads(self._request("GET", f"{url}/api/v2/alerts?{urllib.parse.urlencode(query)}"))
            except AlertmanagerError as error:
                errors.append(str(error))
            except json.JSONDecodeError:
                errors.append(f"{url} answered something that is not JSON")
        raise AlertmanagerError("; ".join(errors))

    def _request(self, method: str, url: str, body: bytes | None = None) -> bytes:
        headers = {**self.headers, "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            detail = error.read(_MAX_ERROR_BODY).decode(errors="replace").strip()
            raise AlertmanagerError(f"{method} {url} answered HTTP {error.code}: {detail or error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise AlertmanagerError(f"{method} {url} failed: {reason}") from None
