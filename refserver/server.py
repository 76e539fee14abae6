"""A real OpenAI-compatible streaming server that records ground truth for every request.

One thread per connection reads requests off a plain socket (or an
ssl.SSLSocket, so CPython drives OpenSSL's SSL_read_ex/SSL_write_ex on the
socket's fd), runs them through the simulated Engine, and writes every SSE
event as one HTTP chunk with one sendall(). The truth log says what really
happened, in CLOCK_MONOTONIC nanoseconds (the clock bpf_ktime_get_ns reads),
so an observer's measurements can be checked against it.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .api import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DONE_EVENT,
    ApiError,
    CompletionRequest,
    ResponseFormatter,
    error_body,
    models_body,
    new_response_id,
    parse_completion_request,
    per_request_metrics,
    stream_error_event,
)
from .engine import Engine, EngineSnapshot, EngineStopped, EngineTiming
from .sim_metrics import (
    PROMETHEUS_CONTENT_TYPE,
    SIMULATED_METRICS_PATHS,
    SimulatedKvCache,
    SimulatedMetrics,
)
from .text import generated_tokens
from .tls import server_context
from .truthlog import TruthLog
from .wire import (
    LAST_CHUNK,
    REASONS,
    BadRequest,
    HttpRequest,
    PeerClosed,
    RequestReader,
    chunk,
    response_head,
)

log = logging.getLogger(__name__)

SERVER_HEADER = ("server", "tokenprobe-refserver")
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Connections beyond --max-connections still get a proper 503; this caps the
# threads doing that, past it they are simply closed.
MAX_REJECTING_CONNECTIONS = 32
REJECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; read it back from ReferenceServer.port
    engine: EngineTiming = field(default_factory=EngineTiming)
    model: str = "ref-model"  # served model name, and the default when a request names none
    default_max_tokens: int = 16
    max_tokens_limit: int = 4096
    max_connections: int = 512
    idle_timeout_s: float = 60.0  # keep-alive idle time, and how long a write may stall
    # SO_SNDBUF of each accepted socket (as nginx's `listen ... sndbuf=`); None: the kernel's autotuning,
    # which on loopback buffers megabytes, so only a small one lets a slow client push back on the writes.
    send_buffer: int | None = None
    truth_log: str | Path | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    # Serve a simulated vLLM-style /metrics and dcgm-exporter page (/sim/dcgm)
    # derived from the engine's slots, so GPU joins can be shown without a GPU.
    simulated_metrics: bool = False
    # The simulated KV-cache gauge's size in blocks of 16 tokens, when the engine's cache is unbounded
    # (None: SimulatedKvCache's default). Sized to what the slots hold, a full batch fills it, as vLLM's
    # scheduler admits sequences until its blocks run out: the gauge then rises with load before requests
    # queue long enough to move TTFT. With the engine's KV cache bounded (EngineTiming.kv_cache_blocks),
    # the gauge reports that cache's real use instead, and this must be left None.
    kv_cache_blocks: int | None = None
    # As vLLM's --enable-per-request-metrics: the last usage chunk of a stream and a whole body carry the
    # request's own `metrics` (queue, time to first token from scheduling, generation).
    per_request_metrics: bool = False
    # Every Nth streamed request fails after its first token, inside its 200 stream: an error event as
    # vLLM sends one (`stream_error_type`, code 500), then `data: [DONE]`. 0: none fails.
    fail_streams_every: int = 0
    stream_error_type: str = "InternalServerError"
    # Time the API server spends on a request before its engine sees it (request handling, tokenising), as
    # vLLM's API server does: ``overhead_ms`` at idle, plus ``overhead_ms_per_request`` for every other
    # request in the server, as one busy event loop serves them all. The truth log's ``engine_arrival_ns``
    # says when the request reached the engine's queue.
    overhead_ms: float = 0.0
    overhead_ms_per_request: float = 0.0

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be between 1 and max_tokens_limit")
        if self.idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be positive")
        if self.fail_streams_every < 0:
            raise ValueError(f"fail_streams_every must be 0 (none) or more, got {self.fail_streams_every}")
        if self.overhead_ms < 0 or self.overhead_ms_per_request < 0:
            raise ValueError("overhead_ms and overhead_ms_per_request must not be negative")
        if self.send_buffer is not None and self.send_buffer < 1:
            raise ValueError(f"send_buffer must be a positive number of bytes, got {self.send_buffer}")
        if self.kv_cache_blocks is not None:
            if self.kv_cache_blocks < 1:
                raise ValueError(f"kv_cache_blocks must be at least 1, got {self.kv_cache_blocks}")
            if self.engine.kv_cache_blocks is not None:
                raise ValueError("kv_cache_blocks sizes the gauge of an unbounded engine cache; the engine's "
                                 "bounded cache (engine.kv_cache_blocks) is reported as it is")

    @property
    def simulated_kv_cache(self) -> SimulatedKvCache:
        """The KV cache the simulated pages describe: the engine's when it is bounded."""
        if self.engine.kv_cache_blocks is not None:
            return SimulatedKvCache(block_size=self.engine.block_size, num_blocks=self.engine.kv_cache_blocks)
        return SimulatedKvCache() if self.kv_cache_blocks is None else SimulatedKvCache(num_blocks=self.kv_cache_blocks)


@dataclass(frozen=True)
class _ServingContext:
    """What every connection handler shares with the server."""

    config: ServerConfig
    engine: Engine
    truth_log: TruthLog | None
    stopping: threading.Event
    wall_offset_ns: int
    simulated: SimulatedMetrics | None
    stream_numbers: Iterator[int]  # numbers the streamed requests, 1 up, across connections
    in_server: InServer  # completions between parse and last byte, for the server's overhead


class InServer:
    """How many completions the server holds (parsed, not yet answered in full)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def enter(self) -> int:
        """Count one more; returns how many others there were."""
        with self._lock:
            self._count += 1
            return self._count - 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1


class _StreamFailed(Exception):
    """The engine failed a request mid-stream (ServerConfig.fail_streams_every)."""



class ClientGone(Exception):
    """A write to the client failed: it closed, reset, or stopped reading."""


@dataclass
class RequestTrace:
    """One truth-log line. Timestamps are CLOCK_MONOTONIC ns; None where the step never happened."""

    peer: str
    conn_seq: int
    tls: bool
    accept_ns: int
    tls_done_ns: int | None
    wall_offset_ns: int  # add to any *_ns value to get Unix-epoch ns
    method: str = ""
    path: str = ""
    id: str = ""
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int = 0
    outcome: str = "complete"  # complete | stream_error (failed inside its 200 stream) | client_gone | server_stopped | server_error
    error: str = ""
    request_start_ns: int | None = None  # first byte of the request received
    arrival_ns: int | None = None  # request fully read (after its last body byte)
    headers_ns: int | None = None  # just before the response head's sendall
    engine_arrival_ns: int | None = None  # after the server's overhead (ServerConfig.overhead_ms): queued for a slot
    slot_ns: int | None = None
    prefill_done_ns: int | None = None
    preemptions: int = 0  # times the engine's full KV cache preempted it (each costs a recompute)
    # Streams: just before each token chunk's sendall. stream=false: when each
    # token was generated (the body goes out once, at done_ns).
    token_ns: list[int] = field(default_factory=list)
    done_ns: int | None = None  # after the response's final sendall


class ReferenceServer:
    """Start with .start() (or a with block); serves from background threads until .stop()."""

    def __init__(self, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self._engine = Engine(self.config.engine)
        self._ssl_context = (
            server_context(self.config.tls_cert, self.config.tls_key) if self.config.tls_cert is not None else None
        )
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._truth_log: TruthLog | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._rejecting = 0
        self._stopping = threading.Event()
        self._context: _ServingContext | None = None

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> ReferenceServer:
        if self._listener is not None:
            raise RuntimeError("server already started")
        self._listener = socket.create_server((self.config.host, self.config.port), backlog=1024)
        if self.config.truth_log is not None:
            self._truth_log = TruthLog(self.config.truth_log)
        wall_offset_ns = time.time_ns() - time.monotonic_ns()
        simulated = (SimulatedMetrics(self._listener.getsockname()[1], self.config.model,
                                      kv_cache=self.config.simulated_kv_cache)
                     if self.config.simulated_metrics else None)
        self._context = _ServingContext(
            self.config, self._engine, self._truth_log, self._stopping, wall_offset_ns, simulated, itertools.count(1),
            InServer())
        self._accept_thread = threading.Thread(target=self._accept_forever, name="refserver-accept", daemon=True)
        self._accept_thread.start()
        log.info("reference server listening on %s", self.url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end in-flight requests (outcome server_stopped), flush the truth log."""
        if self._listener is None or self._stopping.is_set():
            return
        self._stopping.set()
        try:
            # shutdown() wakes a thread blocked in accept(); close() alone does not on Linux.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._engine.stop()
        with self._lock:
            connections = dict(self._connections)
        for sock in connections:
            try:
                # The base-class call skips SSLSocket.shutdown, which would drop the
                # TLS object under a thread that may still be writing.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for thread in [self._accept_thread, *connections.values()]:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._truth_log is not None:
            self._truth_log.close()

    def __enter__(self) -> ReferenceServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return self._listener.getsockname()[1]

    @property
    def tls(self) -> bool:
        return self._ssl_context is not None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.config.host}:{self.port}"

    @property
    def wall_offset_ns(self) -> int:
        """time.time_ns() - time.monotonic_ns() at start: maps truth-log times to Unix-epoch ns."""
        if self._context is None:
            raise RuntimeError("server not started")
        return self._context.wall_offset_ns

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def snapshot(self) -> EngineSnapshot:
        return self._engine.snapshot()

    def set_slowdown(self, factor: float) -> None:
        """Scale prefill and decode times from now on (1.0 = as configured)."""
        self._engine.set_slowdown(factor)

    # -- connections -----------------------------------------------------------

    def _accept_forever(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                log.warning("accept failed: %s", exc)
                time.sleep(0.05)  # e.g. out of file descriptors: do not spin
                continue
            accept_ns = time.monotonic_ns()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.config.send_buffer is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.send_buffer)
            peer = f"{address[0]}:{address[1]}"
            with self._lock:
                over_capacity = len(self._connections) >= self.config.max_connections
                if over_capacity and self._rejecting >= MAX_REJECTING_CONNECTIONS:
                    sock.close()
                    continue
                thread = threading.Thread(
                    target=self._serve_connection,
                    args=(sock, peer, accept_ns, over_capacity),
                    name=f"refserver-conn-{peer}",
                    daemon=True,
                )
                if over_capacity:
                    self._rejecting += 1
                else:
                    self._connections[sock] = thread
            thread.start()

    def _serve_connection(self, raw: socket.socket, peer: str, accept_ns: int, over_capacity: bool) -> None:
        sock = raw
        try:
            sock.settimeout(REJECT_TIMEOUT_S if over_capacity else self.config.idle_timeout_s)
            tls_done_ns = None
            if self._ssl_context is not None:
                sock = self._ssl_context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                if not over_capacity:
                    with self._lock:  # so stop() shuts down the object the thread uses
                        self._connections[sock] = self._connections.pop(raw)
                sock.do_handshake()
                tls_done_ns = time.monotonic_ns()
            assert self._context is not None
            connection = _Connection(self._context, sock, peer, accept_ns, tls_done_ns)
            if over_capacity:
                connection.reject_one()
            else:
                connection.serve()
        except (OSError, PeerClosed, ClientGone) as exc:  # ssl.SSLError is an OSError
            log.debug("connection %s ended: %s", peer, exc)
        finally:
            sock.close()
            with self._lock:
                if over_capacity:
                    self._rejecting -= 1
                else:
                    self._connections.pop(sock, None)


class _Connection:
    """Serves the requests of one accepted connection, in order."""

    def __init__(
        self, context: _ServingContext, sock: socket.socket, peer: str, accept_ns: int, tls_done_ns: int | None
    ):
        self._config = context.config
        self._engine = context.engine
        self._truth_log = context.truth_log
        self._stopping = context.stopping
        self._simulated = context.simulated
        self._stream_numbers = context.stream_numbers
        self._in_server = context.in_server
        self._sock = sock
        self._reader = RequestReader(sock)
        self._trace_base = {
            "peer": peer,
            "tls": isinstance(sock, ssl.SSLSocket),
            "accept_ns": accept_ns,
            "tls_done_ns": tls_done_ns,
            "wall_offset_ns": context.wall_offset_ns,
        }
        self._next_seq = 0

    def serve(self) -> None:
        while not self._stopping.is_set():
            trace = self._new_trace()
            try:
                request = self._reader.read_request()
            except BadRequest as exc:
                # The framing is unknown after a malformed request: answer and close.
                trace.request_start_ns = self._reader.last_recv_ns
                self._refuse(trace, exc.status, exc.message)
                return
            if request is None:
                return
            if not self._handle(request, trace) or not request.keep_alive:
                return

    def reject_one(self) -> None:
        """Read one request and answer 503: the server is at --max-connections."""
        trace = self._new_trace()
        try:
            request = self._reader.read_request()
        except BadRequest:
            request = None
        if request is not None:
            self._note_request(trace, request)
        self._refuse(trace, 503, f"server is at its connection limit ({self._config.max_connections}); retry later")

    def _refuse(self, trace: RequestTrace, status: int, message: str) -> None:
        """Answer with an error and record it; the caller closes the connection."""
        try:
            self._send_error(trace, status, message, close=True)
        except ClientGone:
            trace.outcome = "client_gone"
        finally:
            self._record(trace)

    def _new_trace(self) -> RequestTrace:
        trace = RequestTrace(conn_seq=self._next_seq, **self._trace_base)
        self._next_seq += 1
        return trace

    @staticmethod
    def _note_request(trace: RequestTrace, request: HttpRequest) -> None:
        trace.method = request.method
        trace.path = request.path
        trace.request_start_ns = request.first_byte_ns
        trace.arrival_ns = request.arrival_ns

    def _handle(self, request: HttpRequest, trace: RequestTrace) -> bool:
        """Answer one request; False when the connection must close afterwards."""
        self._note_request(trace, request)
        close = not request.keep_alive
        try:
            if request.path in (CHAT_PATH, COMPLETIONS_PATH):
                if request.method != "POST":
                    return self._send_error(trace, 405, f"{request.path} accepts POST only", close, allow="POST")
                return self._handle_completion(request, trace, close)
            if request.path == "/v1/models":
                if request.method != "GET":
                    return self._send_error(trace, 405, "/v1/models accepts GET only", close, allow="GET")
                return self._send_json(trace, 200, models_body(self._config.model), close)
            if request.path in SIMULATED_METRICS_PATHS and self._simulated is not None:
                if request.method != "GET":
                    return self._send_error(trace, 405, f"{request.path} accepts GET only", close, allow="GET")
                text = self._simulated.render(request.path, self._engine.snapshot())
                return self._send_body(trace, 200, text.encode(), PROMETHEUS_CONTENT_TYPE, close)
            if request.path == "/health":
                if request.method != "GET":
                    return self._send_error(trace, 405, "/health accepts GET only", close, allow="GET")
                return self._send_json(trace, 200, b"", close)
            return self._send_error(trace, 404, f"no route for {request.method} {request.path[:200]}", close)
        except ClientGone:
            trace.outcome = "client_gone"
            return False
        except EngineStopped:
            trace.outcome = "server_stopped"
            return False
        except Exception:
            # A bug must cost one connection, never the server.
            log.exception("internal error serving %s %s", request.method, request.path)
            trace.outcome = "server_error"
            return False
        finally:
            self._record(trace)

    def _handle_completion(self, request: HttpRequest, trace: RequestTrace, close: bool) -> bool:
        chat = request.path == CHAT_PATH
        try:
            completion = parse_completion_request(
                request.body,
                chat=chat,
                default_model=self._config.model,
                default_max_tokens=self._config.default_max_tokens,
                max_tokens_limit=self._config.max_tokens_limit,
            )
        except ApiError as exc:
            return self._send_error(trace, exc.status, exc.message, close)
        limit = self._engine.timing.max_model_tokens
        if limit is not None and completion.prompt_tokens + completion.max_tokens > limit:
            # As vLLM past its max-model-len: a request the whole KV cache cannot hold is never admitted.
            return self._send_error(trace, 400, f"this model's maximum context length is {limit} tokens; the request "
                                    f"asks for {completion.prompt_tokens + completion.max_tokens} "
                                    f"({completion.prompt_tokens} in the prompt, {completion.max_tokens} to generate)",
                                    close)
        trace.id = new_response_id(chat)
        trace.model = completion.model
        trace.stream = completion.stream
        trace.include_usage = completion.include_usage
        trace.prompt_tokens = completion.prompt_tokens
        trace.completion_tokens = 0
        formatter = ResponseFormatter(completion, trace.id)
        others = self._in_server.enter()
        try:
            if completion.stream:
                self._stream(completion, formatter, trace, close, others)
            else:
                self._respond_whole(completion, formatter, trace, close, others)
        finally:
            self._in_server.leave()
        return not close

    def _stream(
        self, completion: CompletionRequest, formatter: ResponseFormatter, trace: RequestTrace, close: bool,
        others: int,
    ) -> None:
        # Like vLLM (starlette + uvicorn), the head goes out before the request
        # is even queued; the role chunk follows prefill, right before token 1.
        headers = [SERVER_HEADER, ("content-type", SSE_CONTENT_TYPE)]
        if close:
            headers.append(("connection", "close"))
        headers.append(("transfer-encoding", "chunked"))
        trace.status = 200
        trace.headers_ns = time.monotonic_ns()
        self._send(response_head(200, headers))
        every = self._config.fail_streams_every
        fails = every > 0 and next(self._stream_numbers) % every == 0

        def emit(index: int, text: str, last: bool) -> None:
            if index == 0 and completion.chat:
                self._send(chunk(formatter.role_event()))
            if fails and index == 1:
                raise _StreamFailed
            trace.token_ns.append(time.monotonic_ns())
            self._send(chunk(formatter.token_event(text, last)))

        try:
            self._generate(completion, trace, emit, others)
        except _StreamFailed:
            trace.outcome, trace.error = "stream_error", self._config.stream_error_type
            self._send(chunk(stream_error_event(trace.error, "the engine failed while generating", 500)))
        else:
            if completion.include_usage:
                self._send(chunk(formatter.usage_event(trace.completion_tokens, self._metrics(trace))))
        self._send(chunk(DONE_EVENT))
        self._send(LAST_CHUNK)
        trace.done_ns = time.monotonic_ns()

    def _respond_whole(
        self, completion: CompletionRequest, formatter: ResponseFormatter, trace: RequestTrace, close: bool,
        others: int,
    ) -> None:
        pieces: list[str] = []

        def emit(index: int, text: str, last: bool) -> None:
            trace.token_ns.append(time.monotonic_ns())  # generated; nothing is sent until the end
            pieces.append(text)

        self._generate(completion, trace, emit, others)
        body = formatter.full_body("".join(pieces), trace.completion_tokens, self._metrics(trace))
        self._send_json(trace, 200, body, close)

    def _metrics(self, trace: RequestTrace) -> dict[str, float | None] | None:
        """vLLM's per-request `metrics` for a finished request, when the server states them."""
        if not self._config.per_request_metrics or not trace.token_ns:
            return None
        return per_request_metrics(trace.engine_arrival_ns, trace.slot_ns, trace.token_ns[0], trace.token_ns[-1],
                                   trace.completion_tokens)

    def _generate(
        self, completion: CompletionRequest, trace: RequestTrace, emit: Callable[[int, str, bool], None], others: int
    ) -> None:
        """The server's overhead (``others``: the other requests it holds), then queue for a slot, prefill, and
        emit one token per decode interval (see ``engine`` on preemption)."""
        engine = self._engine
        overhead_ms = self._config.overhead_ms + others * self._config.overhead_ms_per_request
        trace.engine_arrival_ns = trace.arrival_ns + round(overhead_ms * 1e6)
        engine.sleep_until(trace.engine_arrival_ns)
        sequence = engine.admit(completion.prompt_tokens)
        trace.slot_ns = time.monotonic_ns()
        finished = False
        try:
            engine.sleep_until(trace.slot_ns + engine.prefill_ns(completion.prompt_tokens))
            trace.prefill_done_ns = time.monotonic_ns()
            engine.count_prompt(completion.prompt_tokens)
            words = generated_tokens(completion.seed)
            # Prefill yields the first token; later ones follow on an absolute
            # schedule so a late wake-up never pushes the rest back.
            next_token_ns = trace.prefill_done_ns
            for index in range(completion.max_tokens):
                engine.sleep_until(next_token_ns)
                while not engine.reserve_token(sequence):
                    # Preempted and readmitted: recompute the KV of everything it holds; that yields the token.
                    trace.preemptions += 1
                    engine.sleep_until(time.monotonic_ns() + engine.prefill_ns(sequence.tokens))
                    next_token_ns = time.monotonic_ns()
                emit(index, next(words), index == completion.max_tokens - 1)
                engine.count_generated_token()
                trace.completion_tokens += 1
                next_token_ns += engine.decode_interval_ns()
            finished = True
        finally:
            engine.release(sequence)
            engine.count_finished(completed=finished)

    def _send_json(self, trace: RequestTrace, status: int, body: bytes, close: bool, allow: str | None = None) -> bool:
        return self._send_body(trace, status, body, "application/json", close, allow)

    def _send_body(
        self, trace: RequestTrace, status: int, body: bytes, content_type: str, close: bool, allow: str | None = None
    ) -> bool:
        headers = [SERVER_HEADER, ("content-length", str(len(body))), ("content-type", content_type)]
        if allow:
            headers.append(("allow", allow))
        if close:
            headers.append(("connection", "close"))
        trace.status = status
        trace.headers_ns = time.monotonic_ns()
        self._send(response_head(status, headers) + body)
        trace.done_ns = time.monotonic_ns()
        return not close

    def _send_error(
        self, trace: RequestTrace, status: int, message: str, close: bool, allow: str | None = None
    ) -> bool:
        trace.error = message
        body = error_body(status, REASONS.get(status, "Error"), message)
        return self._send_json(trace, status, body, close, allow)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:  # EPIPE, ECONNRESET, timeout, ssl.SSLError
            raise ClientGone(str(exc)) from exc

    def _record(self, trace: RequestTrace) -> None:
        if self._truth_log is not None:
            self._truth_log.record(asdict(trace))
