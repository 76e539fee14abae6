"""The kernel's side of batching steady SSE streams, modelled in Python, around an assembler.

`KernelBatching` is fed as the tracker feeds an assembler, but as if the kernel batched:
it names the templates the assembler gives after each whole response write (what the
tracker sends the kernel), judges each later whole write against the template as
bpf/steady.c's steady_classify does, holds the plain ones back and hands them over
with feed_steady_response_writes before any other call (as the kernel sends a batch
ahead of any other event of the connection). As the kernel does, it keeps the template
for the connection's later responses, and sends whole the first write that matches it
after it was named or after a write that did not match. The model has no race: the
template takes effect at once, so every batch must find the stream in step.
"""

from __future__ import annotations

import re

from tokenprobe.agent.capture.kernel.records import (
    STEADY_WORDS,
    STEADY_WRITE_MAX,
    steady_template_fits,
)
from tokenprobe.agent.capture.wire.sse import SteadyTemplate

__all__ = ["KernelBatching", "classify"]

DIFFERENT, ESCAPED, PLAIN = "different", "escaped", "plain"
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,8})\r\n")
_SPECIAL = re.compile(rb'["\\\x00-\x1f]')


def classify(write: bytes, template: SteadyTemplate) -> str:
    """steady_classify of bpf/steady.c."""
    prefix, suffix = template.prefix, template.suffix
    if len(write) > STEADY_WRITE_MAX or len(write) < len(prefix) + len(suffix) + 4:
        return DIFFERENT
    line = _CHUNK_LINE.match(write)
    if line is None or int(line[1], 16) != len(write) - line.end() - 2:
        return DIFFERENT
    start = line.end()
    if len(write) < start + len(prefix) + len(suffix) + 1 or not write.endswith(suffix):
        return DIFFERENT
    if not SteadyTemplate(write[start:start + len(prefix)], suffix, template.digits, template.plain).same_shape(
            template) or not _own_fields_hold(write[start:start + len(prefix)], template):
        return DIFFERENT
    return ESCAPED if _SPECIAL.search(write, start + len(prefix), len(write) - len(suffix)) else PLAIN


def _own_fields_hold(prefix: bytes, template: SteadyTemplate) -> bool:
    """The write's bytes where the template has values of the response's own are of their kind."""
    return (all(prefix[a:b].isdigit() and prefix[a:b].isascii() for a, b in template.digits)
            and not any(_SPECIAL.search(prefix, a, b) for a, b in template.plain))


class KernelBatching:
    batched = 0  # writes that went through batches, all instances together

    def __init__(self, assembler) -> None:
        self.assembler = assembler
        self.template: SteadyTemplate | None = None  # what the kernel holds
        self.hold = False  # the next write that matches the template goes whole
        self.pending: list[tuple[int, int]] = []

    @property
    def error(self):
        return self.assembler.error

    def feed_request_bytes(self, ts, head, total_len, tail=b""):
        return self._send() + self.assembler.feed_request_bytes(ts, head, total_len, tail)

    def feed_response_bytes(self, ts, head, total_len, tail=b""):
        whole = type(head) is bytes and type(total_len) is int and total_len == len(head) and tail == b""
        if self.template is not None:
            # A write seen in part is one larger than the kernel ever batches.
            verdict = classify(head, self.template) if whole else DIFFERENT
            if verdict == PLAIN and not self.hold:
                self.pending.append((ts, total_len))
                KernelBatching.batched += 1
                return self._send() if len(self.pending) == STEADY_WORDS else []
            self.hold = verdict == DIFFERENT
        done = self._send() + self.assembler.feed_response_bytes(ts, head, total_len, tail)
        if whole:
            template = self.assembler.steady_template(head)
            if template is not None and steady_template_fits(template):
                self.template, self.hold = template, True
        return done

    def close(self, ts_ns, reason):
        return self._send() + self.assembler.close(ts_ns, reason)

    def _send(self) -> list:
        if self.pending:
            writes, self.pending = self.pending, []
            assert self.assembler.feed_steady_response_writes([ts for ts, _ in writes],
                                                              sum(size for _, size in writes)), \
                "a batch found the stream out of step"
        return []
