"""Kernel batching, the tracker's half, without the kernel: batch records decoded, templates
named after steady writes, batched writes counted as the events they hold, and a batch that
finds its stream out of step or never arrives marked in the row (tests/test_kernel_batching.py
runs it with the real kernel)."""

from __future__ import annotations

import struct

import pytest
from tokenprobe.agent.capture.inflight import inflight_snapshot
from tokenprobe.agent.capture.kernel.clock import MonotonicWallClock
from tokenprobe.agent.capture.kernel.records import (
    DIR_READ,
    DIR_WRITE,
    EV_ACCEPT,
    EV_CLOSE,
    EV_DATA,
    EV_EXIT,
    EV_STEADY_BATCH,
    STEADY_WRITE_MAX,
    EventDecodeError,
    SteadyBatch,
    WholeWrite,
    decode_event,
)
from tokenprobe.contract.inflight import STREAMING

from tests.support.steady_kernel import DIFFERENT, PLAIN, classify
from tests.test_tracker import HEAD, REQUEST, ev, make_tracker, sse_chunk

BATCH_HEADER = struct.Struct("<QQQQIIIIBBBBIQII16H")
CLOCK = MonotonicWallClock()  # one for every tracker here: their rows compare equal


def batch_record(words, nbytes=0, *, count=None, whole_at=()) -> bytes:
    head = BATCH_HEADER.pack(9, 500, 10, 20, 42, 7, 1, 2, EV_STEADY_BATCH, DIR_WRITE, 1, 0,
                             len(words) if count is None else count, nbytes, len(whole_at), 0,
                             *whole_at, *[0] * (16 - len(whole_at)))
    return head + b"".join(struct.pack("<Q", word) for word in words)


def carried(ts: int, data: bytes, run_bytes: int) -> list[int]:
    """A write carried whole, as the kernel lays it out in a batch's words."""
    padded = data + bytes(-len(data) % 8)
    return [ts, len(data) | run_bytes << 32, *struct.unpack(f"<{len(padded) // 8}Q", padded)]


def test_batch_records_decode_and_bad_ones_are_refused():
    batch = decode_event(batch_record([5, 7], 220))
    assert isinstance(batch, SteadyBatch) and batch.kind == EV_STEADY_BATCH
    assert (batch.tgid, batch.fd, batch.conn_ns, batch.tls) == (42, 7, 500, True)
    assert (batch.bytes_before, batch.events_before, batch.write_ns, batch.nbytes) == ((10, 20), (1, 2), [5, 7], 220)
    assert batch.whole == ()
    for raw in (batch_record([5], count=2), batch_record([]), batch_record([5])[:-1],
                batch_record([5, 3 | 1 << 32], whole_at=(0,)), batch_record([5, 0], whole_at=(0,)),
                batch_record([5, 6], whole_at=(1,))):
        with pytest.raises(EventDecodeError, match="words|shorter|outside"):
            decode_event(raw)


def test_writes_carried_whole_decode_in_their_places():
    words = [*carried(4, b"first", 0), 5, 7, *carried(8, b"a longer write", 220), 9]
    batch = decode_event(batch_record(words, 330, whole_at=(0, 5)))
    assert (batch.write_ns, batch.nbytes) == ([5, 7, 9], 330)
    assert batch.whole == (WholeWrite(0, 0, 4, b"first"), WholeWrite(2, 220, 8, b"a longer write"))


def token(i: int, response: int = 1) -> bytes:
    text = b'w\\"q' if i % 7 == 3 else b"w%d" % i  # now and then a text with an escape: sent whole
    return sse_chunk(b'{"id":"cmpl-%d","object":"text_completion","created":%d,"model":"m",'
                     b'"choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":null}]}'
                     % (response, 1700000000 + response, text))


LAST = sse_chunk(b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
                 b'"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}')
END = sse_chunk(b"[DONE]") + b"0\r\n\r\n"


class Kernel:
    """What the kernel does with the templates the tracker names (bpf/steady.c, modelled by
    tests/support/steady_kernel.py): it numbers every write, batches the plain ones (but the
    first that matches after the template was named or a write did not match it), carries in the
    open batch the writes it reads whole once one that matches opened it, sends the batch at the
    end of a chunked body and ahead of any other event; `lose_batches` drops batches as a full
    ring buffer would."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.template = None
        self.hold = False
        self.pending: list[tuple[int, int | bytes]] = []  # (time, size of a batched write, or the bytes of one carried)
        self.start = None
        self.bytes, self.events = [0, 0], [0, 0]
        self.ts = 1_000_000
        self.lose_batches = False
        self.records = 0

    def arm_steady(self, tgid, fd, template):
        self.template, self.hold = template, True
        return True

    def take_steady_batch(self, tgid, fd):
        batch, self.pending = self._batch(), []
        return batch

    def held_steady_writes(self, tgid, fd):
        return (self.pending[0][0], self.pending[-1][0]) if self.pending else None

    def send(self, direction, data=b"", kind=EV_DATA):
        self.ts += 1_000_000
        if kind == EV_DATA and direction == DIR_WRITE and self.template is not None:
            verdict = classify(data, self.template)
            if verdict == PLAIN and not self.hold:
                self._hold_back(direction, len(data))
                return
            self.hold = verdict == DIFFERENT
            if len(data) <= STEADY_WRITE_MAX and (self.pending or verdict != DIFFERENT):
                self._hold_back(direction, data)
                if data.endswith(b"0\r\n\r\n"):
                    self.flush()
                return
        self.flush()
        event = ev(kind, self.ts, direction=direction, data=data,
                   bytes_before=tuple(self.bytes), events_before=tuple(self.events))
        if kind == EV_DATA:
            self._count(direction, len(data))
        self.records += 1
        self.tracker.handle(event)

    def _hold_back(self, direction, write: int | bytes):
        if not self.pending:
            self.start = (tuple(self.bytes), tuple(self.events))
        self.pending.append((self.ts, write))
        self._count(direction, write if type(write) is int else len(write))

    def flush(self):
        batch, self.pending = self._batch(), []
        if batch is not None and not self.lose_batches:
            self.records += 1
            self.tracker.handle(batch)

    def _batch(self) -> SteadyBatch | None:
        if not self.pending:
            return None
        times, whole, run_bytes = [], [], 0
        for ts, write in self.pending:
            if type(write) is int:
                times.append(ts)
                run_bytes += write
            else:
                whole.append(WholeWrite(len(times), run_bytes, ts, write))
                run_bytes = 0
        return SteadyBatch(EV_STEADY_BATCH, self.pending[-1][0], 500, *self.start, 42, 7, False, times,
                           sum(write for _, write in self.pending if type(write) is int), tuple(whole))

    def _count(self, direction, size):
        self.bytes[direction] += size
        self.events[direction] += 1


def serve(kernel: Kernel, tokens: int = 20) -> None:
    kernel.send(DIR_READ, REQUEST)
    kernel.send(DIR_WRITE, HEAD)
    for i in range(tokens):
        kernel.send(DIR_WRITE, token(i))
    kernel.send(DIR_WRITE, LAST)
    kernel.send(DIR_WRITE, END)


def batching_tracker(**kwargs):
    tracker, rows = make_tracker(**kwargs)
    tracker.clock = CLOCK
    kernel = Kernel(tracker)
    tracker.steady = kernel
    return tracker, rows, kernel


def rows_of(*, batching: bool = True, lose_batches: bool = False) -> tuple[list[dict], object]:
    """Two requests on one connection, with kernel batching on or off (the kernel then numbers
    the events as it always does)."""
    tracker, rows, kernel = batching_tracker()
    kernel.lose_batches = lose_batches
    if not batching:
        tracker.steady = None
    tracker.handle(ev(EV_ACCEPT, 500))
    serve(kernel)
    serve(kernel)
    kernel.send(DIR_READ, kind=EV_CLOSE)
    return rows.rows, tracker.stats


# Token writes of the two responses that come in batches: those with escapes (3 a response) come
# whole; so do the first response's first (it names the template) and the one after (the kernel
# sends whole the first write after being given a template), and the second response's first
# (the kernel kept the template, and sends whole the first write like it after one unlike it).
BATCHED = (20 - 3 - 2) + (20 - 3 - 1)
# Writes the batches carry whole: of each response, the first that matched the template after it was
# named or after a write unlike it, the 3 escaped, and the closing two (the head goes before any batch).
CARRIED = 2 * (1 + 3 + 2)


def test_batched_writes_give_the_rows_every_event_gives():
    full, _ = rows_of(batching=False)
    batched, stats = rows_of()
    assert batched == full and [r["capture"] for r in full] == ["exact", "exact"]
    assert full[0]["token_events"] == 20 and stats.steady_templates == 1
    assert stats.steady_writes == BATCHED


def test_a_keep_alive_connections_next_responses_keep_the_template(monkeypatch):
    """Another response id and creation time: the template's shape, and it stays named. A write the kernel
    carried in a batch came with the template named (the kernel opened the batch with a write like it): the
    tracker reads for a template only the writes sent as events of their own."""
    from tokenprobe.agent.capture.wire.assembler import HttpConnectionAssembler
    read = []
    steady_template = HttpConnectionAssembler.steady_template
    monkeypatch.setattr(HttpConnectionAssembler, "steady_template",
                        lambda self, write: read.append(write) or steady_template(self, write))
    tracker, rows, kernel = batching_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    for response in range(3):
        kernel.send(DIR_READ, REQUEST)
        kernel.send(DIR_WRITE, HEAD)
        for i in range(20):
            kernel.send(DIR_WRITE, token(i, response))
        kernel.send(DIR_WRITE, LAST)
        kernel.send(DIR_WRITE, END)
    kernel.send(DIR_READ, kind=EV_CLOSE)
    assert [(r["capture"], r["token_events"], r["response_id"]) for r in rows.rows] == [
        ("exact", 20, f"cmpl-{response}") for response in range(3)]
    assert tracker.stats.steady_templates == 1 and tracker.stats.steady_writes == BATCHED + 20 - 3 - 1
    # Each head, and the first response's first text (it names the template); nothing a batch carried.
    assert read == [HEAD, token(0, 0), HEAD, HEAD]


def test_a_lost_batch_marks_its_row_dropped():
    rows, stats = rows_of(lose_batches=True)
    assert [r["capture"] for r in rows] == ["dropped", "dropped"]
    assert stats.lost_events == BATCHED + CARRIED


def test_a_batch_for_a_stream_out_of_step_is_booked_unseen():
    tracker, rows, kernel = batching_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    kernel.send(DIR_READ, REQUEST)
    kernel.send(DIR_WRITE, HEAD)
    kernel.send(DIR_WRITE, token(0))
    named, kernel.template = kernel.template, None
    # The response ends before the kernel learns the template the agent named: the writes it then
    # batches belong to no event stream the agent is in step with.
    kernel.send(DIR_WRITE, END)
    kernel.send(DIR_READ, REQUEST)
    kernel.send(DIR_WRITE, HEAD.replace(b"text/event-stream", b"application/json"))
    kernel.template, kernel.hold = named, True
    kernel.send(DIR_WRITE, token(1))  # the first like the template comes whole: the next is batched
    kernel.send(DIR_WRITE, token(2))
    kernel.send(DIR_WRITE, END)
    kernel.send(DIR_READ, kind=EV_CLOSE)
    assert [(r["capture"], r["bytes_unseen"]) for r in rows.rows] == [("exact", 0), ("gaps", len(token(2)))]


@pytest.mark.parametrize("end", ["process_exit", "agent_stop", "idle_timeout"])
def test_a_batch_the_kernel_still_holds_is_read_from_its_map(end):
    """No close() sends it: the process died (its sockets closed without one), the agent stops, or
    the stream stalled past the idle timeout (no next write sends it)."""
    tracker, rows, kernel = batching_tracker(forget_connection=lambda tgid, fd, generation: None)
    tracker.handle(ev(EV_ACCEPT, 500))
    kernel.send(DIR_READ, REQUEST)
    kernel.send(DIR_WRITE, HEAD)
    for i in range(10):
        kernel.send(DIR_WRITE, token(i))
    assert kernel.pending
    if end == "process_exit":
        tracker.handle(ev(EV_EXIT, kernel.ts + 1))
    elif end == "idle_timeout":
        assert tracker.evict_idle(kernel.ts + tracker.idle_timeout_ns + 1) == 1
    else:
        tracker.close_all(kernel.ts + 1)
    assert [(r["outcome"], r["capture"], r["token_events"]) for r in rows.rows] == [("truncated", "exact", 10)]


def test_a_response_whose_texts_the_kernel_holds_is_sampled_streaming():
    """Its batch goes at the body's end: meanwhile the in-flight sample reads its times in the kernel."""
    tracker, _, kernel = batching_tracker()
    tracker.handle(ev(EV_ACCEPT, 500))
    serve(kernel)  # names the template
    kernel.send(DIR_READ, REQUEST)
    kernel.send(DIR_WRITE, HEAD)
    for i in range(3):
        kernel.send(DIR_WRITE, token(i, 2))
    first, last = kernel.pending[0][0], kernel.pending[-1][0]
    assert len(kernel.pending) == 3
    (sample,) = inflight_snapshot(tracker, last + 1_000_000_000)
    assert (sample["stage"], sample["first_token"]) == (STREAMING, tracker.clock.to_wall_ns(first))
    assert sample["since_progress_ms"] == pytest.approx(1000)
