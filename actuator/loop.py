"""The control loop: every window, figures → decisions → actuator → tokenprobe.decisions.

Once per ``ControllerPolicy.window_s`` the loop asks the analytics for the
window that just ended (``analytics.figures.window_figures``: rate, TTFT,
capacity, the tokens each tenant used as they left, and what the matrix
policy reads: the indicator cells live analysis stored and the queue of the
agent's in-flight samples), lets the ``Controller`` decide, pushes the decisions (``DecisionPublisher``) and records
every one with its evidence and how the actuator took it (``DecisionRecorder``).

The window is read ``settle_s`` behind the wall clock: the agent writes a row
when its request ends and flushes once a second, so the most recent second
of traffic is not in the store yet.

The loop never stops on a failing store or actuator: a window whose figures
cannot be read is skipped (the decisions in force then lapse at their
expiry, which is the fail-safe), a decision the actuator did not take is
still recorded with its outcome, and a record that cannot be written is
dropped. Each kind of failure is counted in ``errors`` and logged once, not
once per window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from ..analytics.figures import default_upstream, window_figures
from ..analytics.scope import EVERYTHING, Scope
from .controller import Controller
from .publisher import DecisionPublisher, DecisionRecorder, PushOutcome

log = logging.getLogger(__name__)

DEFAULT_SETTLE_S = 2.0


class ControlLoop:
    def __init__(self, store, publisher: DecisionPublisher, controller: Controller, *,
                 settle_s: float = DEFAULT_SETTLE_S, scope: Scope = EVERYTHING,
                 upstream_of: Callable[[str, int], str] = default_upstream,
                 clock: Callable[[], float] = time.time):
        if settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self.controller = controller
        self.window_s = controller.policy.window_s
        self._store = store
        self._publisher = publisher
        self._recorder = DecisionRecorder(store)
        self._settle_s = settle_s
        self._scope = scope
        self._upstream_of = upstream_of
        self._clock = clock
        self._last_window_end: float | None = None
        self.windows = 0  # windows stepped, failed or not
        self.errors: Counter[str] = Counter()  # failures by kind: figures, actuator, record, slow
        self.decisions: list[PushOutcome] = []  # every pushed decision, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, window_end: float) -> list[PushOutcome]:
        """Decide the window [window_end - window_s, window_end); returns what was pushed and how it went."""
        if self._last_window_end is not None and window_end <= self._last_window_end:
            raise ValueError(f"window ending {window_end} comes after {self._last_window_end}: windows go forward")
        self._last_window_end = window_end
        self.windows += 1
        started = time.monotonic()
        try:
            figures = window_figures(self._store, window_end - self.window_s, window_end, scope=self._scope,
                                     upstream_of=self._upstream_of)
        except Exception as error:  # noqa: BLE001 - a store outage must not end the loop
            self._failed("figures", f"cannot read the window's figures ({error}): decisions in force will lapse")
            return []
        for upstream_window in figures:
            log.debug("window figures: %s", upstream_window)
        decisions = [d for upstream_window in figures for d in self.controller.decide(upstream_window)]
        outcomes = self._publisher.publish(decisions)
        for outcome in outcomes:
            if outcome.outcome != "applied":
                self._failed("actuator", f"decision {outcome.outcome}: {outcome.detail}")
        try:
            self._recorder.record(outcomes, self._clock())
        except Exception as error:  # noqa: BLE001 - the decisions are in force; only their record is lost
            self._failed("record", f"cannot record decisions in tokenprobe.decisions ({error})")
        self.decisions.extend(outcomes)
        took_s = time.monotonic() - started
        if took_s > self.window_s:
            self._failed("slow", f"a window took {took_s:.1f} s to decide, longer than the window: windows are skipped")
        for outcome in outcomes:
            log.info("%s %s for %s: %s", outcome.outcome, _describe(outcome), outcome.decision.target.describe(),
                     outcome.decision.reason)
        return outcomes

    def _failed(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if self.errors[kind] == 1:
            log.warning("control loop: %s (further '%s' failures are counted, not logged)", message, kind)

    # -- running in a thread --------------------------------------------------

    def run(self) -> None:
        """Step once per window, on window boundaries, until stop()."""
        next_end = (self._clock() - self._settle_s) // self.window_s * self.window_s + self.window_s
        while not self._stop.is_set():
            wait = next_end + self._settle_s - self._clock()
            if wait > 0 and self._stop.wait(wait):
                return
            self.step(next_end)
            # A loop that fell behind (a slow store) skips the windows it missed rather than piling them up.
            next_end = max(next_end + self.window_s, (self._clock() - self._settle_s) // self.window_s * self.window_s)

    def start(self) -> ControlLoop:
        self._thread = threading.Thread(target=self.run, name="control-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> ControlLoop:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _describe(outcome: PushOutcome) -> str:
    action = outcome.decision.action
    if outcome.decision.kind == "breaker":
        return f"breaker {action.state.name}"
    return f"token budget {action.tokens_per_second:g} tokens/s"

