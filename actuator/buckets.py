"""A token bucket counted in LLM tokens (prompt + completion), not requests.

The level may go below zero: a request admitted on an estimate that turns out
low (or a delayed request that reserved tokens ahead of the refill) leaves a
debt that the refill repays before the tenant is admitted again. The debt is
bounded by one bucket (`burst_tokens`), so no count, however wild, shuts a
tenant out for longer than two full refills. Not thread-safe: the engine
serialises access.
"""

from __future__ import annotations


class TokenBucket:
    def __init__(self, tokens_per_second: float, burst_tokens: float, now: float):
        self.tokens_per_second = tokens_per_second
        self.burst_tokens = burst_tokens
        self._level = burst_tokens  # a new budget starts full
        self._updated = now

    def level(self, now: float) -> float:
        self._refill(now)
        return self._level

    def wait_for(self, tokens: float, now: float) -> float:
        """Seconds until `tokens` can be taken (0 when they can be now).

        A request larger than the whole bucket waits for a full bucket and then
        goes into debt, so it is slowed to the budget's rate but never starved.
        """
        needed = min(tokens, self.burst_tokens)
        shortfall = needed - self.level(now)
        return max(0.0, shortfall / self.tokens_per_second)

    def take(self, tokens: float, now: float) -> float:
        """Charge a request at admission: at most what the bucket holds when full; returns the charge."""
        charge = min(tokens, self.burst_tokens)
        self.adjust(charge, now)
        return charge

    def adjust(self, tokens: float, now: float) -> None:
        """Charge (positive) or refund (negative) the difference found at settlement."""
        self._refill(now)
        self._level = max(-self.burst_tokens, min(self.burst_tokens, self._level - tokens))

    def reconfigure(self, tokens_per_second: float, burst_tokens: float, now: float) -> None:
        """New rate and size; the tokens already spent stay spent."""
        self._refill(now)
        self.tokens_per_second = tokens_per_second
        self.burst_tokens = burst_tokens
        self._level = min(self._level, burst_tokens)

    def _refill(self, now: float) -> None:
        elapsed = now - self._updated
        if elapsed > 0:  # a clock that steps back must not drain the bucket
            self._level = min(self.burst_tokens, self._level + elapsed * self.tokens_per_second)
            self._updated = now
