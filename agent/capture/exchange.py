"""The record of one request and its response, and how a connection's close ends it."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CLOSE_REASONS", "OUTCOME_BY_CLOSE_REASON", "Exchange", "MAX_TOKEN_EVENTS", "Txn"]

CLOSE_REASONS = ("server_closed", "client_closed", "reset", "agent_stop", "idle_timeout")
# The outcome of an exchange whose response had not finished when the connection closed.
OUTCOME_BY_CLOSE_REASON = {
    "server_closed": "truncated",
    "client_closed": "client_closed",
    "reset": "reset",
    "agent_stop": "truncated",
    "idle_timeout": "truncated",  # no I/O for the agent's idle timeout: it stopped following the connection
}
# Token event timestamps kept per exchange (far above any model's output length);
# an endless stream must not grow the list without bound.
MAX_TOKEN_EVENTS = 1 << 18


@dataclass(slots=True)
class Exchange:
    """One request and its response on a connection. Timestamps are the probes'
    CLOCK_MONOTONIC ns of the segment holding the byte in question; None if unseen."""

    seq: int  # 0-based index on the connection
    method: str = ""
    path: str = ""  # query string removed: it may hold user data
    req_start_ns: int = 0
    req_end_ns: int | None = None
    req_bytes: int = 0  # on the wire: headers, body, chunk framing, uncaptured gaps
    req_model: str | None = None
    req_stream: bool | None = None
    body_fp: int = 0  # keyed hash of the request body; 0 if empty or not fully captured
    status: int = 0
    resp_start_ns: int | None = None
    resp_end_ns: int | None = None
    resp_bytes: int = 0  # includes interim 1xx responses
    streamed: bool = False  # an event stream: text/event-stream or application/x-ndjson
    token_event_ns: list[int] = field(default_factory=list)  # events with output of choice 0
    sse_events: int = 0  # all events of the stream (SSE events or NDJSON lines)
    done_seen: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    resp_model: str | None = None
    response_id: str | None = None
    outcome: str = "complete"  # complete | error | client_closed | reset | truncated
    request_seen: bool = True  # False: the request lay in a capture gap, only its response was read
    error: str | None = None
    # The API's label for an error the server sent inside its response (`overloaded_error`): a bounded
    # label (dialects/base.py, error_label), never the error's message. "" when it sent none.
    error_type: str = ""
    inflight_at_arrival: int = 0  # filled by the caller from on_request_start
    tenant: str = ""  # the tenant header's value (an identifier, never content); "" if absent
    api: str = ""  # the dialect that read the response (dialects/); "" if not an LLM API
    # Index in token_event_ns of the first event with visible text (not reasoning or a tool
    # call); an index rather than a time, so it moves with the event it names.
    first_content_index: int | None = None
    choices: int = 0  # choices that carried output (n > 1 streams several)
    choice_events: int = 0  # events with output, summed over all choices
    engine_queue_ms: float | None = None  # the engine's own time in its queue (scheduled - arrived), if reported
    engine_prompt_ms: float | None = None  # the engine's own prompt (prefill) time, if reported
    engine_decode_ms: float | None = None  # the engine's own generation time, if reported

    def record_output(self, ts: int, choice: int = 0, visible: bool = True) -> None:
        """An event at ts carried generated output (text, reasoning or a tool call) of
        `choice`. Timing figures (first token, ITL) follow choice 0 alone: with n > 1
        the choices' events interleave and their gaps are not one stream's."""
        self.choice_events += 1
        if choice >= self.choices:
            self.choices = choice + 1
        if choice:
            return
        events = self.token_event_ns
        if len(events) < MAX_TOKEN_EVENTS:
            if visible and self.first_content_index is None:
                self.first_content_index = len(events)
            events.append(ts)
        else:
            self.error = f"more than {MAX_TOKEN_EVENTS} token events; later ones not recorded"

    def record_outputs(self, times: list[int]) -> None:
        """Events at `times`, each with visible output of choice 0: record_output for each, at once."""
        self.choice_events += len(times)
        if not self.choices:
            self.choices = 1
        events = self.token_event_ns
        room = MAX_TOKEN_EVENTS - len(events)
        if room > 0 and times and self.first_content_index is None:
            self.first_content_index = len(events)
        if len(times) > room:
            times = times[:max(0, room)]
            self.error = f"more than {MAX_TOKEN_EVENTS} token events; later ones not recorded"
        events.extend(times)


class Txn:
    """An exchange being assembled, with the progress of its two halves."""

    __slots__ = ("exchange", "request_done", "response_done")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.request_done = False
        self.response_done = False
