"""An assembler that reads every segment on both paths and requires the same exchanges.

`TwinAssembler` is the assembler with its fast path (the default); beside it run
a shadow assembler with `fast_path=False` (the general framing, every event
parsed) and one fed as if the kernel batched steady streams (steady_kernel.py),
fed the same calls. Each feed and close must return equal exchanges
(`dataclasses.asdict`), and the connections the same error. `inflight_at_arrival`
is left out: the caller's `on_request_start` fills it, on the exchange it was given.
"""

from __future__ import annotations

import dataclasses

from tokenprobe.agent.capture.wire.assembler import HttpConnectionAssembler

from .steady_kernel import KernelBatching

__all__ = ["TwinAssembler", "comparable"]


def comparable(exchange) -> dict:
    fields = dataclasses.asdict(exchange)
    del fields["inflight_at_arrival"]
    return fields


class TwinAssembler(HttpConnectionAssembler):
    made = 0  # twins constructed in this process

    def __init__(self, **kwargs) -> None:
        kwargs.pop("fast_path", None)
        super().__init__(**kwargs)
        TwinAssembler.made += 1
        shadow = dict(kwargs, on_request_start=None)
        self.general = HttpConnectionAssembler(**shadow, fast_path=False)
        self.kernel_batching = KernelBatching(HttpConnectionAssembler(**shadow))

    def feed_request_bytes(self, *args, **kwargs):
        return self._same(super().feed_request_bytes(*args, **kwargs),
                          self.general.feed_request_bytes(*args, **kwargs),
                          self.kernel_batching.feed_request_bytes(*args, **kwargs))

    def feed_response_bytes(self, *args, **kwargs):
        return self._same(super().feed_response_bytes(*args, **kwargs),
                          self.general.feed_response_bytes(*args, **kwargs),
                          self.kernel_batching.feed_response_bytes(*args, **kwargs))

    def close(self, *args, **kwargs):
        return self._same(super().close(*args, **kwargs), self.general.close(*args, **kwargs),
                          self.kernel_batching.close(*args, **kwargs))

    def _same(self, fast: list, general: list, batched: list) -> list:
        fast_rows = [comparable(e) for e in fast]
        assert fast_rows == [comparable(e) for e in general], \
            "the fast path returned other exchanges than the general path"
        assert fast_rows == [comparable(e) for e in batched], \
            "kernel batching returned other exchanges than the fast path"
        assert self.error == self.general.error == self.kernel_batching.error, \
            "the paths set different connection errors"
        return fast
