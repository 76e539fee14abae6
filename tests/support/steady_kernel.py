"""The kernel's side of batching steady SSE streams, modelled in Python, around an assembler.

`KernelBatching` is fed as the tracker feeds an assembler, but as if the kernel batched:
it names the templates the assembler gives after each whole response write (what the
tracker sends the kernel), judges each later whole write against the template as
bpf/tokenprobe.c's steady_classify does, holds the plain ones back and hands them over
with feed_steady_response_writes before any other call (as the kernel sends a batch
ahead of any other event of the connection). The model has no race: the template
takes effect at once, so every batch must find the stream in step.
"""

from __future__ import annotations

import re

from tokenprobe.agent.capture.probes import (
    STEADY_BATCH,
    STEADY_WRITE_MAX,
    steady_template_fits,
)

__all__ = ["KernelBatching", "classify"]

DIFFERENT, ESCAPED, PLAIN = "different", "escaped", "plain"
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,8})\r\n")
_SPECIAL = re.compile(rb'["\\\x00-\x1f]')


def classify(write: bytes, template: tuple[bytes, bytes]) -> str:
    """steady_classify of bpf/tokenprobe.c."""
    prefix, suffix = template
    if len(write) > STEADY_WRITE_MAX or len(write) < len(prefix) + len(suffix) + 4:
        return DIFFERENT
    line = _CHUNK_LINE.match(write)
    if line is None or int(line[1], 16) != len(write) - line.end() - 2:
        return DIFFERENT
    start = line.end()
    if len(write) < start + len(prefix) + len(suffix) + 1:
        return DIFFERENT
    if not write.startswith(prefix, start) or not write.endswith(suffix):
        return DIFFERENT
    return ESCAPED if _SPECIAL.search(write, start + len(prefix), len(write) - len(suffix)) else PLAIN


class KernelBatching:
    batched = 0  # writes that went through batches, all instances together

    def __init__(self, assembler) -> None:
        self.assembler = assembler
        self.template: tuple[bytes, bytes] | None = None  # what the kernel holds
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
            if verdict == PLAIN:
                self.pending.append((ts, total_len))
                KernelBatching.batched += 1
                return self._send() if len(self.pending) == STEADY_BATCH else []
            if verdict == DIFFERENT:
                self.template = None
        done = self._send() + self.assembler.feed_response_bytes(ts, head, total_len, tail)
        if whole:
            template = self.assembler.steady_template(head)
            if template is not None and steady_template_fits(*template):
                self.template = template
        return done

    def close(self, ts_ns, reason):
        return self._send() + self.assembler.close(ts_ns, reason)

    def _send(self) -> list:
        if self.pending:
            writes, self.pending = self.pending, []
            assert self.assembler.feed_steady_response_writes(writes), "a batch found the stream out of step"
        return []
