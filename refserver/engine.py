"""The simulated inference engine: a fixed number of decode slots with a FIFO queue, and optionally a
KV cache of fixed size that admits and preempts as vLLM's scheduler does.

A request holds a slot for its whole life in the engine: prefill (a sleep that
grows with the prompt) and then one token per decode interval. When every slot
is busy the request's thread blocks in a real first-come-first-served queue,
so queueing delay shows up on the wire exactly as it does with vLLM's
--max-num-seqs or llama.cpp's -np.

With ``kv_cache_blocks`` set, the engine also has a KV cache of that many
blocks of ``block_size`` tokens, and a request holds the blocks its prompt and
generated tokens fill. It is admitted only when a slot is free and the cache
has room for what it holds; each token that opens a new block takes a free
one, and when none is free the engine preempts the request admitted last (it
may be the one asking): its blocks are freed, it goes back to the head of the
queue, and once readmitted it recomputes its KV (a prefill of its prompt and
everything it generated) before its next token. This is vLLM's default
(recompute) preemption, and how it collapses: long streams accumulate until
the cache is full, then running streams stall and requeue, and requests
queued behind them see TTFT jump. A request that could not fit in the whole
cache (prompt + max tokens) is refused up front, as vLLM refuses one past its
max-model-len. Without it (the default) the cache is unbounded and never the limit.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTiming:
    slots: int = 4
    prefill_base_ms: float = 20.0
    prefill_ms_per_token: float = 0.1
    decode_ms: float = 20.0
    # Multiplies prefill and decode times; > 1 emulates a degraded engine
    # (thermal throttling, a noisy neighbour). Adjustable at run time.
    slowdown: float = 1.0
    kv_cache_blocks: int | None = None  # None: an unbounded KV cache, never the limit
    block_size: int = 16  # tokens a KV block holds (vLLM's default)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}")
        for name in ("prefill_base_ms", "prefill_ms_per_token", "decode_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be at least 1, got {self.kv_cache_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        _check_slowdown(self.slowdown)

    @property
    def max_model_tokens(self) -> int | None:
        """The most tokens (prompt + output) one request may hold: the whole KV cache, when bounded."""
        return None if self.kv_cache_blocks is None else self.kv_cache_blocks * self.block_size


@dataclass(frozen=True)
class EngineSnapshot:
    """Live engine state, the raw material for a /metrics endpoint."""

    slots: int
    running: int  # requests holding a slot (prefill or decode)
    waiting: int  # requests queued for a slot (preempted ones among them)
    completed: int  # requests that generated all their tokens
    aborted: int  # requests that left early (client gone, server stopping)
    prompt_tokens_total: int
    generation_tokens_total: int
    slowdown: float
    kv_blocks_total: int | None = None  # None: unbounded
    kv_blocks_used: int = 0
    preemptions_total: int = 0


class EngineStopped(Exception):
    """The server is shutting down; the request leaves the engine."""


def _check_slowdown(factor: float) -> None:
    if not factor > 0:
        raise ValueError(f"slowdown must be positive, got {factor}")


class Sequence:
    """One request inside the engine: the tokens its KV holds and the blocks they take."""

    def __init__(self, prompt_tokens: int):
        self.tokens = prompt_tokens
        self.blocks = 0
        self.preempted = False  # its KV was freed: it must be readmitted and recompute before its next token
        self.admitted = threading.Event()


class Engine:
    def __init__(self, timing: EngineTiming):
        self._timing = timing
        self._slowdown = timing.slowdown
        self._lock = threading.Lock()
        self._running: list[Sequence] = []  # in order of admission: the last is preempted first
        self._waiting: deque[Sequence] = deque()  # FIFO; preempted requests go back to its head
        self._free_blocks = timing.kv_cache_blocks
        self._stopping = threading.Event()
        self._completed = 0
        self._aborted = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0

    @property
    def timing(self) -> EngineTiming:
        return self._timing

    def set_slowdown(self, factor: float) -> None:
        _check_slowdown(factor)
        self._slowdown = factor

    def stop(self) -> None:
        """Wake every queued and sleeping request so their threads can finish."""
        self._stopping.set()
        with self._lock:
            for sequence in self._waiting:
                sequence.admitted.set()

    def admit(self, prompt_tokens: int) -> Sequence:
        """Block until a new request holds a slot and the blocks of its prompt (FIFO). Raises EngineStopped."""
        sequence = Sequence(prompt_tokens)
        with self._lock:
            self._waiting.append(sequence)
            self._schedule()
        self._wait_admitted(sequence)
        return sequence

    def reserve_token(self, sequence: Sequence) -> bool:
        """Room in the KV cache for ``sequence``'s next token. False when it was preempted (now, or by
        another request since its last token) and has been readmitted: its KV must be recomputed
        (``prefill_ns(sequence.tokens)``) before the token. Raises EngineStopped."""
        with self._lock:
            if not sequence.preempted and self._room_for_next_token(sequence):
                sequence.tokens += 1
                return True
        self._wait_admitted(sequence)
        return False

    def release(self, sequence: Sequence) -> None:
        """``sequence`` leaves the engine (finished or aborted): its slot and blocks go to the queue."""
        with self._lock:
            if sequence in self._running:
                self._running.remove(sequence)
                self._free(sequence)
            elif sequence in self._waiting:
                self._waiting.remove(sequence)
            self._schedule()

    def _wait_admitted(self, sequence: Sequence) -> None:
        sequence.admitted.wait()
        if self._stopping.is_set():
            raise EngineStopped

    def _schedule(self) -> None:
        """Admit from the head of the queue while a slot and the head's blocks are free (lock held).
        Strictly FIFO: a head that does not fit holds back the requests behind it."""
        if self._stopping.is_set():
            return
        while self._waiting and len(self._running) < self._timing.slots:
            head = self._waiting[0]
            needed = self._blocks_for(head.tokens)
            if self._free_blocks is not None:
                if needed > self._free_blocks:
                    return
                self._free_blocks -= needed
            self._waiting.popleft()
            head.blocks, head.preempted = needed, False
            self._running.append(head)
            head.admitted.set()

    def _room_for_next_token(self, sequence: Sequence) -> bool:
        """Take a block for ``sequence``'s next token if it opens one, preempting the requests admitted
        last until one is free (lock held). False when ``sequence`` itself was preempted."""
        if self._free_blocks is None or self._blocks_for(sequence.tokens + 1) <= sequence.blocks:
            return True
        while self._free_blocks == 0:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is sequence:
                return False
        self._free_blocks -= 1
        sequence.blocks += 1
        return True

    def _preempt(self, victim: Sequence) -> None:
        self._running.remove(victim)
        self._free(victim)
        victim.preempted = True
        victim.admitted.clear()
        self._waiting.appendleft(victim)
        self._preemptions += 1

    def _free(self, sequence: Sequence) -> None:
        if self._free_blocks is not None:
            self._free_blocks += sequence.blocks
        sequence.blocks = 0

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self._timing.block_size)

    def prefill_ns(self, prompt_tokens: int) -> int:
        t = self._timing
        ms = (t.prefill_base_ms + prompt_tokens * t.prefill_ms_per_token) * self._slowdown
        return round(ms * 1e6)

    def decode_interval_ns(self) -> int:
        return round(self._timing.decode_ms * self._slowdown * 1e6)

    def sleep_until(self, deadline_ns: int) -> None:
        """Sleep to an absolute CLOCK_MONOTONIC deadline, so decode steps never drift."""
        while not self._stopping.is_set():
            remaining = deadline_ns - time.monotonic_ns()
            if remaining <= 0:
                return
            self._stopping.wait(remaining / 1e9)  # a timed wait, so stop() can cut it short
        raise EngineStopped

    def count_prompt(self, tokens: int) -> None:
        with self._lock:
            self._prompt_tokens += tokens

    def count_generated_token(self) -> None:
        with self._lock:
            self._generation_tokens += 1

    def count_finished(self, completed: bool) -> None:
        with self._lock:
            if completed:
                self._completed += 1
            else:
                self._aborted += 1

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            total = self._timing.kv_cache_blocks
            return EngineSnapshot(
                slots=self._timing.slots,
                running=len(self._running),
                waiting=len(self._waiting),
                completed=self._completed,
                aborted=self._aborted,
                prompt_tokens_total=self._prompt_tokens,
                generation_tokens_total=self._generation_tokens,
                slowdown=self._slowdown,
                kv_blocks_total=total,
                kv_blocks_used=0 if total is None else total - self._free_blocks,
                preemptions_total=self._preemptions,
            )
