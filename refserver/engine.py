"""The simulated inference engine: a fixed number of decode slots with a FIFO queue.

A request holds a slot for its whole life in the engine: prefill (a sleep that
grows with the prompt) and then one token per decode interval. When every slot
is busy the request's thread blocks in a real first-come-first-served queue,
so queueing delay shows up on the wire exactly as it does with vLLM's
--max-num-seqs or llama.cpp's -np.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}")
        for name in ("prefill_base_ms", "prefill_ms_per_token", "decode_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        _check_slowdown(self.slowdown)


@dataclass(frozen=True)
class EngineSnapshot:
    """Live engine state, the raw material for a /metrics endpoint."""

    slots: int
    running: int  # requests holding a slot (prefill or decode)
    waiting: int  # requests queued for a slot
    completed: int  # requests that generated all their tokens
    aborted: int  # requests that left early (client gone, server stopping)
    prompt_tokens_total: int
    generation_tokens_total: int
    slowdown: float


class EngineStopped(Exception):
    """The server is shutting down; the request leaves the engine."""


def _check_slowdown(factor: float) -> None:
    if not factor > 0:
        raise ValueError(f"slowdown must be positive, got {factor}")


class Engine:
    def __init__(self, timing: EngineTiming):
        self._timing = timing
        self._slowdown = timing.slowdown
        self._lock = threading.Lock()
        self._free_slots = timing.slots
        # One Event per queued request: a finishing request hands its slot
        # straight to the head of the queue, which keeps the order strictly FIFO
        # and wakes exactly one thread.
        self._waiters: deque[threading.Event] = deque()
        self._stopping = threading.Event()
        self._completed = 0
        self._aborted = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @property
    def slots(self) -> int:
        return self._timing.slots

    def set_slowdown(self, factor: float) -> None:
        _check_slowdown(factor)
        self._slowdown = factor

    def stop(self) -> None:
        """Wake every queued and sleeping request so their threads can finish."""
        self._stopping.set()
        with self._lock:
            while self._waiters:
                self._waiters.popleft().set()

    def acquire_slot(self) -> None:
        """Block until this request owns a slot (FIFO). Raises EngineStopped."""
        with self._lock:
            if self._stopping.is_set():
                raise EngineStopped
            if self._free_slots and not self._waiters:
                self._free_slots -= 1
                return
            turn = threading.Event()
            self._waiters.append(turn)
        turn.wait()
        if self._stopping.is_set():
            raise EngineStopped

    def release_slot(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._free_slots += 1

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
            # Slots are handed over directly, so free slots and waiters never coexist.
            return EngineSnapshot(
                slots=self._timing.slots,
                running=self._timing.slots - self._free_slots,
                waiting=len(self._waiters),
                completed=self._completed,
                aborted=self._aborted,
                prompt_tokens_total=self._prompt_tokens,
                generation_tokens_total=self._generation_tokens,
                slowdown=self._slowdown,
            )
