"""Event streams over the de-chunked response body: SSE and NDJSON, each event timestamped.

Both are line framings: lines end in CRLF, LF or CR, and a line may span any
number of segments. SSE (text/event-stream) gathers an event's `data:` lines
(joined with LF) until a blank line; NDJSON (application/x-ndjson) makes each
non-blank line an event. An event's time is that of the segment holding the end
of the line that completes it. Each event is handed to the response's dialect,
chosen once: from the path, else from the first event that parses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .. import dialects
from ..dialects.json_scan import json_object
from ..exchange import Exchange
from .byte_samples import HeadTailSample

__all__ = ["NdjsonBody", "SseBody", "SteadyTemplate"]

# Events up to this size are parsed with json.loads; larger ones (and events
# damaged by a capture gap) are read with regexes over their head and tail.
SSE_EVENT_JSON_MAX = 65536
SSE_EVENT_TAIL = 4096

_LINE_END = re.compile(rb"\r\n|\r|\n")
# What a text read from its template's bytes alone may not hold (Dialect.steady_text).
_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]')


Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class SteadyTemplate:
    """What the kernel matches a connection's steady writes against (kernel batching,
    bpf/steady.c): the bytes of the write before its text (after the chunk-size line) and
    after it (to the end of the write), and the spans of `prefix` that hold values of the
    response's own (Dialect.steady_own_fields): there a write needs only digits, or plain
    string bytes."""

    prefix: bytes
    suffix: bytes
    digits: Spans = ()
    plain: Spans = ()
    # The prefix with those spans blanked: templates of one shape, whatever their responses' values.
    shape: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = bytearray(self.prefix)
        for start, end in (*self.digits, *self.plain):
            shape[start:end] = bytes(end - start)
        object.__setattr__(self, "shape", bytes(shape))

    def same_shape(self, other: SteadyTemplate) -> bool:
        return (self.shape == other.shape and self.suffix == other.suffix and self.digits == other.digits
                and self.plain == other.plain)


class _LineEvents:
    """Line splitting across pieces and gaps, and the dispatch of events to the dialect."""

    __slots__ = ("_exchange", "_dialect", "_scan", "_line", "_cr_ts", "_gap_bytes", "_template")

    def __init__(self, exchange: Exchange, dialect: dialects.Dialect | None, *, scan: bool = True) -> None:
        self._exchange = exchange
        self._dialect = dialect  # None until the first event names one
        self._scan = scan  # let the dialect read events without parsing them (Dialect.scan)
        self._line = HeadTailSample(SSE_EVENT_JSON_MAX, SSE_EVENT_TAIL)  # a line split across pieces
        self._cr_ts: int | None = None  # a piece ended in CR: it may be the first half of CRLF
        self._gap_bytes = 0
        # The bytes around the text of the stream's events of visible text, once the dialect named
        # them (Dialect.steady_text): an event that has them around plain text is counted at once.
        self._template: tuple[bytes, bytes] | None = None

    # Hooks for the framings.
    def _whole_line(self, ts: int, line: bytes) -> None:
        raise NotImplementedError

    def _cut_line(self, ts: int, line: HeadTailSample) -> None:
        """A line too long to keep whole, or cut by a capture gap."""
        raise NotImplementedError

    def data(self, ts: int, chunk) -> None:
        data = bytes(chunk)
        end = len(data)
        pos = 0
        if self._cr_ts is not None:
            cr_ts, self._cr_ts = self._cr_ts, None
            if data[:1] == b"\n":
                pos = 1
                self._end_line(ts, b"")
            else:
                self._end_line(cr_ts, b"")
        for match in _LINE_END.finditer(data, pos):
            start, stop = match.span()
            if stop == end and stop - start == 1 and data[start] == 0x0D:
                self._line.add(data[pos:start])
                self._cr_ts = ts
                return
            self._end_line(ts, data[pos:start])
            pos = stop
        if pos < end:
            self._line.add(data[pos:])

    def gap(self, ts: int, nbytes: int) -> None:
        self._flush_cr()
        self._line.add_gap(nbytes)
        self._gap_bytes += nbytes
        self._exchange.error = (f"{self._gap_bytes} bytes of the event stream were not captured; "
                                "events inside them were not counted")

    def finish(self) -> None:
        # An event without its closing line end is incomplete and is not dispatched.
        self._flush_cr()
        exchange = self._exchange
        if not exchange.api:
            exchange.api = dialects.UNKNOWN.name
        if exchange.api == dialects.UNKNOWN.name and exchange.sse_events and not exchange.choice_events:
            exchange.error = exchange.error or (
                f"event stream in no known API shape ({exchange.sse_events} events); "
                "no output counted")

    def _flush_cr(self) -> None:
        if self._cr_ts is not None:
            cr_ts, self._cr_ts = self._cr_ts, None
            self._end_line(cr_ts, b"")

    def _end_line(self, ts: int, rest: bytes) -> None:
        pending = self._line
        if pending.length:  # the line began in an earlier piece
            pending.add(rest)
            line = pending.whole()
            if line is None:
                self._cut_line(ts, pending)
                pending.reset()
                return
            pending.reset()
        else:
            line = rest
        self._whole_line(ts, line)

    def _event(self, ts: int, payload: bytes) -> None:
        """A whole event's payload."""
        dialect = self._dialect
        if self._scan and dialect is not None:
            exchange = self._exchange
            template = self._template
            if template is not None and dialect.counts_steady(exchange):
                end = len(payload) - len(template[1])
                if (end > len(template[0]) and payload.startswith(template[0]) and payload.endswith(template[1])
                        and _NOT_PLAIN.search(payload, len(template[0]), end) is None):
                    exchange.record_output(ts)
                    return
            outputs, tokens = exchange.choice_events, len(exchange.token_event_ns)
            if dialect.scan(exchange, payload, ts):
                if exchange.choice_events == outputs + 1 and len(exchange.token_event_ns) == tokens + 1:
                    self._learn_template(payload)  # one output, of choice 0: it may name a template
                return
        obj = json_object(payload)
        if obj is None:
            self._partial_event(ts, payload, b"")
            return
        dialect = self._dialect
        if dialect is None:
            dialect = self._dialect = dialects.sniff(obj) or dialects.UNKNOWN
            self._exchange.api = dialect.name
        dialect.event(self._exchange, obj, ts)

    def _learn_template(self, payload: bytes) -> tuple[int, int] | None:
        """Where the text of `payload`, an event just read, lies, if the dialect counts events like
        it from their template (Dialect.steady_text); a new template is kept for the next ones."""
        template = self._template
        if template is not None and payload.startswith(template[0]) and payload.endswith(template[1]) \
                and len(payload) > len(template[0]) + len(template[1]):
            return len(template[0]), len(payload) - len(template[1])
        span = self._dialect.steady_text(payload)
        if span is not None:
            self._template = payload[:span[0]], payload[span[1]:]
        return span

    def _steady_span(self, value: int, payload: bytes) -> tuple[int, int, Spans, Spans] | None:
        """steady_text's answer for an event whose payload (its JSON) starts at `value` of the write."""
        span = self._learn_template(payload)
        if span is None or span[0] == span[1]:
            return None  # an empty text (vLLM's first chunk, with the role) names no shape the next ones have
        digits, plain = self._dialect.steady_own_fields(payload)
        return (value + span[0], value + span[1], tuple((value + a, value + b) for a, b in digits if b <= span[0]),
                tuple((value + a, value + b) for a, b in plain if b <= span[0]))

    def steady_events(self, times: list[int]) -> bool:
        """Events the kernel counted from their size alone (kernel batching), at `times`: each one
        whole event of visible text around a template steady_text named, read as `data` would read
        it. False, with nothing read, when the stream is not in step for them."""
        if not self._in_step():
            return False
        exchange = self._exchange
        exchange.sse_events += len(times)
        exchange.record_outputs(times)
        return True

    def _in_step(self) -> bool:
        """No line or event pending, and the dialect counts events from their template now."""
        dialect = self._dialect
        return (self._scan and dialect is not None and not self._line.length and self._cr_ts is None
                and dialect.counts_steady(self._exchange))

    def _partial_event(self, ts: int, head: bytes, tail: bytes) -> None:
        """An event too large for json.loads, cut by a gap, or not valid JSON."""
        if (tail or head).rstrip().endswith(b"[DONE]"):
            self._exchange.done_seen = True
        # Before any event named the dialect, read it as OpenAI's, the commonest.
        (self._dialect or dialects.OPENAI_CHAT).partial(self._exchange, head, tail, ts)


class SseBody(_LineEvents):
    """text/event-stream: `data:` lines joined with LF; a blank line ends an event;
    comments and other fields (`event:` names repeat the data's `type`) are ignored."""

    __slots__ = ("_event_data", "_event_has_data")

    def __init__(self, exchange: Exchange, dialect: dialects.Dialect | None, *, scan: bool = True) -> None:
        super().__init__(exchange, dialect, scan=scan)
        self._event_data = HeadTailSample(SSE_EVENT_JSON_MAX, SSE_EVENT_TAIL)
        self._event_has_data = False

    def _whole_line(self, ts: int, line: bytes) -> None:
        if not line:
            self._dispatch(ts)
        elif line.startswith(b"data"):
            if len(line) == 4:
                self._add_data(b"")
            elif line[4] == 0x3A:  # "data:"
                self._add_data(line[6:] if line[5:6] == b" " else line[5:])
        # Comments (":...") and other fields carry nothing recorded here.

    def _add_data(self, value: bytes) -> None:
        if self._event_has_data:
            self._event_data.add(b"\n")
        self._event_data.add(value)
        self._event_has_data = True

    def _cut_line(self, ts: int, line: HeadTailSample) -> None:
        """Its kept head and tail join the event, which is then read with the regex fallback."""
        head, tail = bytes(line.head), bytes(line.tail)
        if head.startswith(b"data:"):
            value_head = head[6:] if head[5:6] == b" " else head[5:]
        elif b"data:".startswith(head):  # empty or too short to tell: may be a data line
            value_head = b""
        else:
            return
        event = self._event_data
        if self._event_has_data:
            event.add(b"\n")
        event.add(value_head)
        # Mark the middle that was not kept (at least one byte, so the event is never "whole").
        event.add_gap(max(1, line.length - len(head) - len(tail)))
        event.add(tail)
        self._event_has_data = True

    def whole_events(self, ts: int, data, start: int, stop: int) -> bool:
        """data[start:stop], read in one step if it is whole events of one `data:` line
        each, LF-terminated, and no event or line is pending: what one write of vLLM or
        SGLang holds. False, with nothing read, otherwise: then `data` reads it."""
        if self._line.length or self._cr_ts is not None or self._event_has_data:
            return False
        if stop - start < 7 or not data.endswith(b"\n\n", start, stop) or data.find(b"\r", start, stop) >= 0:
            return False
        if data.find(b"\n", start, stop - 2) < 0 and data.startswith(b"data:", start):
            # One event of one line, as one write of vLLM or SGLang holds: read without splitting.
            if stop - start - 7 > SSE_EVENT_JSON_MAX:
                return False
            self._exchange.sse_events += 1
            value = data[start + 6:stop - 2] if data[start + 5] == 0x20 else data[start + 5:stop - 2]
            if value[:1] == b"{":  # a JSON object: never [DONE]
                self._event(ts, value)
            else:
                self._payload(ts, value)
            return True
        events = data[start:stop - 2].split(b"\n\n")
        for line in events:  # all checked before any is read
            # Longer values are read from their samples by _dispatch.
            if not line.startswith(b"data:") or b"\n" in line or len(line) - 5 > SSE_EVENT_JSON_MAX:
                return False
        exchange = self._exchange
        for line in events:
            exchange.sse_events += 1
            self._payload(ts, line[6:] if line[5:6] == b" " else line[5:])
        return True

    def steady_text(self, data, start: int, stop: int) -> tuple[int, int, Spans, Spans] | None:
        """Where the text of data[start:stop] lies, if that is one whole event of one `data:` line
        (after an `event:` line, as Anthropic's and the Responses API's events have), just read,
        that the dialect counts from its size alone (Dialect.steady_text), and the stream is in step
        to count more like it (steady_events), with the spans before it that hold values of the
        response's own (digits, plain: Dialect.steady_own_fields); else None."""
        if not self._in_step():
            return None
        # Its lines end in LF (vLLM, SGLang) or CRLF (sse-starlette), the blank line after them too.
        eol = b"\r\n" if data.endswith(b"\r\n\r\n", start, stop) else b"\n" if data.endswith(b"\n\n", start, stop) else b""
        lines = data[start:stop - 2 * len(eol)].split(eol) if eol else ()
        if not 1 <= len(lines) <= 2 or (len(lines) == 2 and not lines[0].startswith(b"event:")) \
                or not lines[-1].startswith(b"data:") or any(b"\r" in line or b"\n" in line for line in lines):
            return None  # an event line is ignored as `data` ignores it; any other line may not be
        line = stop - 2 * len(eol) - len(lines[-1])
        value = line + (6 if data[line + 5:line + 6] == b" " else 5)
        return self._steady_span(value, data[value:stop - 2 * len(eol)])

    def _in_step(self) -> bool:
        return not self._event_has_data and super()._in_step()

    def _dispatch(self, ts: int) -> None:
        if not self._event_has_data:  # a blank line after comments only: no event
            return
        self._exchange.sse_events += 1
        event = self._event_data
        payload = event.whole()
        if payload is None:
            self._partial_event(ts, bytes(event.head), bytes(event.tail))
        else:
            self._payload(ts, payload)
        event.reset()
        self._event_has_data = False

    def _payload(self, ts: int, payload: bytes) -> None:
        if payload.strip() == b"[DONE]":
            self._exchange.done_seen = True
        else:
            self._event(ts, payload)


class NdjsonBody(_LineEvents):
    """application/x-ndjson: every non-blank line is one JSON event."""

    __slots__ = ()

    def steady_text(self, data, start: int, stop: int) -> tuple[int, int, Spans, Spans] | None:
        """As SseBody.steady_text, for data[start:stop] that is one whole line (Ollama's)."""
        if not self._in_step():
            return None
        end = stop - 2 if data.endswith(b"\r\n", start, stop) else stop - 1 if data.endswith(b"\n", start, stop) else -1
        if end <= start or data.find(b"\n", start, end) >= 0 or data.find(b"\r", start, end) >= 0:
            return None
        return self._steady_span(start, data[start:end])

    def _whole_line(self, ts: int, line: bytes) -> None:
        if line.strip():
            self._exchange.sse_events += 1
            self._event(ts, line)

    def _cut_line(self, ts: int, line: HeadTailSample) -> None:
        self._exchange.sse_events += 1
        self._partial_event(ts, bytes(line.head), bytes(line.tail))
