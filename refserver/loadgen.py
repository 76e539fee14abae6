"""Load generator for OpenAI-compatible streaming servers.

Two modes:
- run_load(): open loop. Poisson arrivals at a fixed rate (or one that ramps
  linearly to ``ramp_to_rate``), independent of how fast the server answers,
  over a keep-alive connection pool. This is how real traffic behaves, and
  what exposes queueing. With ``retries``, clients retry at once, without
  backoff and ignoring Retry-After, on a 429 or 5xx answer or a timeout, as
  naive SDK loops do: the retry storm that turns an overload into a collapse.
- burst(): closed loop. Exactly N requests from C workers, each worker reusing
  its connection for K requests; for tests that need exact counts.

Every request reads its whole response and records client-side CLOCK_MONOTONIC
timestamps, comparable with the server's truth log and with BPF timestamps.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import random
import ssl
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..contract.tenant import DEFAULT_TENANT_HEADER
from .api import CHAT_PATH, COMPLETIONS_PATH
from .text import pseudo_prompt

PROGRESS_INTERVAL_S = 2.0


@dataclass(frozen=True)
class LoadConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    tls: bool = False  # HTTPS without certificate checks (the reference server's cert is self-signed)
    rate: float = 5.0  # open loop: mean arrivals per second (at the start, when ramping)
    ramp_to_rate: float | None = None  # open loop: the rate climbs linearly to this over duration_s
    retries: int = 0  # open loop: attempts after the first on a 429/5xx or a failure, each sent at once
    duration_s: float | None = 10.0  # open loop: stop scheduling after this long ...
    requests: int | None = None  # ... or after this many requests, whichever comes first
    prompt_tokens: tuple[int, int] = (16, 512)  # inclusive range, drawn uniformly
    max_tokens: tuple[int, int] = (8, 64)
    chat_fraction: float = 0.5  # the rest go to /v1/completions
    stream_fraction: float = 1.0
    include_usage_fraction: float = 0.5  # of streamed requests
    model: str = "ref-model"
    tenant: str = ""  # sent as the x-tenant-id header when set, as a gateway's tenants would
    seed: int = 0
    max_connections: int = 64  # also the bound on requests in flight
    timeout_s: float = 60.0  # per socket operation
    progress: bool = False  # a status line on stderr every few seconds

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.duration_s is None and self.requests is None:
            raise ValueError("give duration_s, requests, or both")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if self.ramp_to_rate is not None and (self.ramp_to_rate <= 0 or self.duration_s is None):
            raise ValueError("ramp_to_rate must be positive, and needs duration_s to ramp over")
        if self.retries < 0:
            raise ValueError(f"retries must not be negative, got {self.retries}")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be at least 1")
        for name in ("prompt_tokens", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, got {(low, high)}")
        for name in ("chat_fraction", "stream_fraction", "include_usage_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


@dataclass(frozen=True)
class RequestSpec:
    index: int
    path: str
    stream: bool
    include_usage: bool
    prompt_tokens: int  # the size asked for; the server reports its own estimate
    max_tokens: int
    body: bytes


@dataclass
class RequestRecord:
    """What the client saw. Times are CLOCK_MONOTONIC ns, None where not reached."""

    index: int
    path: str
    stream: bool
    include_usage: bool
    max_tokens: int
    scheduled_ns: int | None = None  # open loop: the Poisson arrival time (a retry: when it was decided)
    attempt: int = 0  # 0 for the first send of a request, n for its n-th retry (same body)
    send_ns: int | None = None  # just before the request was written
    first_byte_ns: int | None = None  # response head received
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    end_ns: int | None = None  # response fully read
    status: int = 0
    response_id: str = ""
    token_events: int = 0
    prompt_tokens: int | None = None  # from the response's usage, when it carried one
    completion_tokens: int | None = None
    local_addr: str = ""  # "ip:port" of the client socket: the server logs it as the peer
    reused_connection: bool = False
    error: str = ""

    @property
    def ttft_ns(self) -> int | None:
        if self.send_ns is None or self.first_token_ns is None:
            return None
        return self.first_token_ns - self.send_ns


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    errors: int
    duration_s: float
    achieved_rate: float  # requests sent per second of the sending period
    mean_interarrival_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    token_events: int

    def describe(self) -> str:
        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.1f} ms"

        return (
            f"{self.requests} requests, {self.errors} errors in {self.duration_s:.1f} s "
            f"({self.achieved_rate:.2f} req/s, mean inter-arrival {ms(self.mean_interarrival_ms)}); "
            f"TTFT p50 {ms(self.ttft_p50_ms)}, p99 {ms(self.ttft_p99_ms)}; {self.token_events} token events"
        )


@dataclass
class LoadResult:
    records: list[RequestRecord]
    started_ns: int
    finished_ns: int
    wall_offset_ns: int = field(default_factory=lambda: time.time_ns() - time.monotonic_ns())

    @property
    def errors(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error]

    def summary(self) -> LoadSummary:
        sends = sorted(r.send_ns for r in self.records if r.send_ns is not None)
        ttfts = sorted(r.ttft_ns / 1e6 for r in self.records if r.ttft_ns is not None)
        sending_s = (sends[-1] - sends[0]) / 1e9 if len(sends) > 1 else 0.0
        mean_gap_ms = sending_s * 1e3 / (len(sends) - 1) if len(sends) > 1 else None
        return LoadSummary(
            requests=len(self.records),
            errors=len(self.errors),
            duration_s=(self.finished_ns - self.started_ns) / 1e9,
            achieved_rate=(len(sends) - 1) / sending_s if sending_s > 0 else 0.0,
            mean_interarrival_ms=mean_gap_ms,
            ttft_p50_ms=_percentile(ttfts, 0.50),
            ttft_p99_ms=_percentile(ttfts, 0.99),
            token_events=sum(r.token_events for r in self.records),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": asdict(self.summary()),
            "wall_offset_ns": self.wall_offset_ns,
            "requests": [asdict(r) for r in self.records],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class RequestMix:
    """Seeded stream of request specs mixing endpoints, sizes, streaming and usage."""

    def __init__(self, config: LoadConfig):
        self._config = config
        self._rng = random.Random(config.seed)

    def make(self, index: int) -> RequestSpec:
        config, rng = self._config, self._rng
        chat = rng.random() < config.chat_fraction
        stream = rng.random() < config.stream_fraction
        include_usage = stream and rng.random() < config.include_usage_fraction
        prompt_tokens = rng.randint(*config.prompt_tokens)
        max_tokens = rng.randint(*config.max_tokens)
        prompt = pseudo_prompt(prompt_tokens, rng)
        payload: dict[str, Any] = {"model": config.model}
        if chat:
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        payload.update({"max_tokens": max_tokens, "stream": stream})
        if include_usage:
            payload["stream_options"] = {"include_usage": True}
        return RequestSpec(
            index=index,
            path=CHAT_PATH if chat else COMPLETIONS_PATH,
            stream=stream,
            include_usage=include_usage,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            body=json.dumps(payload).encode(),
        )


class _Client:
    """Opens connections to the target and runs one request on a given connection."""

    def __init__(self, config: LoadConfig):
        self._config = config
        self._ssl_context: ssl.SSLContext | None = None
        if config.tls:
            self._ssl_context = ssl.create_default_context()
            self._ssl_context.check_hostname = False
            self._ssl_context.verify_mode = ssl.CERT_NONE

    def connect(self) -> http.client.HTTPConnection:
        config = self._config
        if self._ssl_context is not None:
            return http.client.HTTPSConnection(
                config.host, config.port, timeout=config.timeout_s, context=self._ssl_context
            )
        return http.client.HTTPConnection(config.host, config.port, timeout=config.timeout_s)

    def run(
        self, spec: RequestSpec, record: RequestRecord, connection: http.client.HTTPConnection, reused: bool
    ) -> http.client.HTTPConnection | None:
        """Run one request on `connection`; returns it if it can carry another request, else closes it.

        A reused keep-alive connection may have been closed by the server while
        idle; that shows up before any response byte, and the request is then
        retried once on a fresh connection.
        """
        try:
            try:
                self._exchange(connection, spec, record)
            except ConnectionError:
                if not reused or record.first_byte_ns is not None:
                    raise
                connection.close()
                connection, reused = self.connect(), False
                self._exchange(connection, spec, record)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.reused_connection = reused
        if record.error or connection.sock is None:
            connection.close()
            return None
        return connection

    def _exchange(self, connection: http.client.HTTPConnection, spec: RequestSpec, record: RequestRecord) -> None:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if spec.stream else "application/json",
        }
        if self._config.tenant:
            headers[DEFAULT_TENANT_HEADER] = self._config.tenant
        if connection.sock is None:
            connection.connect()
        local = connection.sock.getsockname()
        record.local_addr = f"{local[0]}:{local[1]}"
        record.send_ns = time.monotonic_ns()
        connection.request("POST", spec.path, body=spec.body, headers=headers)
        response = connection.getresponse()
        record.first_byte_ns = time.monotonic_ns()
        record.status = response.status
        content_type = response.getheader("content-type", "")
        if response.status == 200 and content_type.startswith("text/event-stream"):
            self._read_stream(response, record)
        else:
            self._read_whole(response, record)
        record.end_ns = time.monotonic_ns()
        if response.will_close:
            connection.close()

    @staticmethod
    def _read_stream(response: http.client.HTTPResponse, record: RequestRecord) -> None:
        saw_done = False
        # readline() decodes the chunked framing; it returns b"" after the last chunk.
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                saw_done = True
                continue
            event = json.loads(payload)
            if not isinstance(event, dict):
                raise ValueError(f"SSE data is not a JSON object: {payload[:80]!r}")
            error = event.get("error")
            if isinstance(error, dict):  # the server failed the request inside its 200 stream
                record.error = f"error event in the stream: {error.get('type')}"
            record.response_id = record.response_id or event.get("id", "")
            if _carries_text(event):
                now = time.monotonic_ns()
                record.first_token_ns = record.first_token_ns or now
                record.last_token_ns = now
                record.token_events += 1
            _note_usage(event, record)
        if not saw_done:
            record.error = "stream ended without data: [DONE]"

    @staticmethod
    def _read_whole(response: http.client.HTTPResponse, record: RequestRecord) -> None:
        body = response.read()
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = {}
        if not isinstance(payload, dict):
            payload = {}
        if response.status != 200:
            error = payload.get("error")
            message = error.get("message", "") if isinstance(error, dict) else ""
            record.error = f"HTTP {response.status} {response.reason}: {message}".rstrip(": ")
            return
        record.response_id = payload.get("id", "")
        if payload.get("choices"):
            record.first_token_ns = record.last_token_ns = time.monotonic_ns()
        _note_usage(payload, record)


def _carries_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


def _note_usage(payload: dict[str, Any], record: RequestRecord) -> None:
    usage = payload.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")


class _ConnectionPool:
    """Idle keep-alive connections; a request takes the most recently used one or a new one."""

    def __init__(self, client: _Client):
        self._client = client
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._client.connect(), False

    def give_back(self, connection: http.client.HTTPConnection | None) -> None:
        if connection is not None:
            with self._lock:
                self._idle.append(connection)

    def close_all(self) -> None:
        with self._lock:
            for connection in self._idle:
                connection.close()
            self._idle.clear()


class _Progress:
    """Prints a status line on stderr every few seconds while a run lasts."""

    def __init__(self, enabled: bool, records: list[RequestRecord]):
        self._records = records
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._report, name="loadgen-progress", daemon=True) if enabled else None

    def __enter__(self) -> _Progress:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _report(self) -> None:
        while not self._done.wait(PROGRESS_INTERVAL_S):
            records = list(self._records)
            sent = sum(1 for r in records if r.send_ns is not None)
            finished = sum(1 for r in records if r.end_ns is not None or r.error)
            errors = sum(1 for r in records if r.error)
            print(
                f"[load] sent {sent}, finished {finished}, errors {errors}, in flight {sent - finished}",
                file=sys.stderr,
                flush=True,
            )


RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


def _retryable(record: RequestRecord) -> bool:
    """A 429 or 5xx answer, or no whole answer (a timeout, a reset, a stream cut short); not other 4xx."""
    return record.status in RETRIED_STATUSES or (bool(record.error) and record.status in (0, 200))


def _rate_at(config: LoadConfig, elapsed_ns: int) -> float:
    if config.ramp_to_rate is None:
        return config.rate
    progress = min(1.0, elapsed_ns / (config.duration_s * 1e9))
    return config.rate + (config.ramp_to_rate - config.rate) * progress


def run_load(config: LoadConfig) -> LoadResult:
    """Open-loop Poisson load; returns after the last in-flight request (and its retries) has finished."""
    client = _Client(config)
    pool = _ConnectionPool(client)
    mix = RequestMix(config)
    arrivals = random.Random(config.seed + 1)  # separate stream: sizes don't shift arrival times
    in_flight = threading.BoundedSemaphore(config.max_connections)
    records: list[RequestRecord] = []

    def perform(spec: RequestSpec, record: RequestRecord) -> None:
        try:
            for attempt in range(config.retries + 1):
                if attempt:
                    record = RequestRecord(spec.index, spec.path, spec.stream, spec.include_usage, spec.max_tokens,
                                           scheduled_ns=time.monotonic_ns(), attempt=attempt)
                    records.append(record)
                connection, reused = pool.take()
                pool.give_back(client.run(spec, record, connection, reused))
                if not _retryable(record):
                    break
        finally:
            in_flight.release()

    started_ns = time.monotonic_ns()
    end_ns = started_ns + int(config.duration_s * 1e9) if config.duration_s is not None else None
    next_arrival_ns = started_ns
    with _Progress(config.progress, records):
        for index in itertools.count():
            if config.requests is not None and index >= config.requests:
                break
            next_arrival_ns += int(arrivals.expovariate(_rate_at(config, next_arrival_ns - started_ns)) * 1e9)
            if end_ns is not None and next_arrival_ns >= end_ns:
                break
            spec = mix.make(index)
            _sleep_until(next_arrival_ns)
            # At max_connections in flight the client itself queues the arrival;
            # send_ns - scheduled_ns shows how late it went out.
            in_flight.acquire()
            record = RequestRecord(
                spec.index, spec.path, spec.stream, spec.include_usage, spec.max_tokens, scheduled_ns=next_arrival_ns
            )
            records.append(record)
            threading.Thread(target=perform, args=(spec, record), name=f"loadgen-{index}", daemon=True).start()
        # Holding every permit means no request is left in flight.
        for _ in range(config.max_connections):
            in_flight.acquire()
    pool.close_all()
    return LoadResult(records, started_ns, time.monotonic_ns())


def burst(config: LoadConfig, n: int, concurrency: int, per_connection: int = 1) -> LoadResult:
    """Closed loop: exactly `n` requests from `concurrency` workers.

    Worker w sends requests w, w+C, w+2C, ... back to back, reusing one
    keep-alive connection for `per_connection` requests before opening the
    next. The rate and duration settings of `config` are not used.
    """
    if n < 1 or concurrency < 1 or per_connection < 1:
        raise ValueError("n, concurrency and per_connection must all be at least 1")
    client = _Client(config)
    mix = RequestMix(config)
    specs = [mix.make(index) for index in range(n)]
    records = [RequestRecord(s.index, s.path, s.stream, s.include_usage, s.max_tokens) for s in specs]

    def worker(first_index: int) -> None:
        # A static share, not a shared queue: the connections and their request
        # counts are then exact, whatever the timing.
        connection: http.client.HTTPConnection | None = None
        uses = 0
        for index in range(first_index, n, concurrency):
            if connection is None or uses == per_connection:
                if connection is not None:
                    connection.close()
                connection, uses = client.connect(), 0
            connection = client.run(specs[index], records[index], connection, reused=uses > 0)
            uses += 1
        if connection is not None:
            connection.close()

    started_ns = time.monotonic_ns()
    threads = [
        threading.Thread(target=worker, args=(i,), name=f"burst-{i}", daemon=True) for i in range(min(concurrency, n))
    ]
    with _Progress(config.progress, records):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return LoadResult(records, started_ns, time.monotonic_ns())


def _sleep_until(deadline_ns: int) -> None:
    remaining = deadline_ns - time.monotonic_ns()
    if remaining > 0:
        time.sleep(remaining / 1e9)
