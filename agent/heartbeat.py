"""The agent's heartbeat: what lets the next run say when this one stopped tracing.

Every second the agent rewrites a small JSON file (atomically: a new file renamed over the old) with the
wall time it was last alive and tracing, and the time up to which its request sink made every row
durable (written or spooled: rows held in memory die with the process). A clean stop writes its time
and marks the file clean. The next run, once its probes attach, reads the file and knows the window in
which nothing was traced: from the clean stop (reason ``stopped``), or after a crash from the earliest
of the last beat and the sink's durable mark (reason ``crashed``), to now. That window is a row of
``agent_gaps`` (contract/gaps.py) and the ``tokenprobe_agent_blind_*`` metrics.

The runner stores the window through a sink of its own, which spools it while the store is down. The
totals (windows, seconds) are kept in the file, so the metrics count across restarts.

The file is the agent's own (beside its spool, root's): a file that cannot be read as one
(another format, damage) is set aside and reported, never trusted and never a reason not to start.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..contract.gaps import CRASHED, STOPPED

__all__ = ["BEAT_EVERY_S", "HEARTBEAT_FILE", "BlindWindow", "Heartbeat"]

log = logging.getLogger(__name__)

HEARTBEAT_FILE = "agent-heartbeat.json"  # the runner keeps it beside the store's spool: one per node and store
BEAT_EVERY_S = 1.0
_FORMAT = 1


@dataclass(frozen=True)
class BlindWindow:
    """A window in which the agent traced nothing: wall times in seconds."""

    start_s: float
    end_s: float
    reason: str  # contract.gaps STOPPED | CRASHED
    last_pid: int

    @property
    def seconds(self) -> float:
        return max(0.0, self.end_s - self.start_s)

    def row(self, node: str) -> dict:
        """This window as an ``agent_gaps`` row."""
        return {"gap_start": int(self.start_s * 1e9), "gap_end": int(self.end_s * 1e9), "node": node,
                "reason": self.reason, "seconds": self.seconds, "last_pid": self.last_pid}


@dataclass
class _State:
    beat_s: float = 0.0             # the last time the run was alive and tracing
    durable_until_s: float = 0.0    # every row handed to the sink before this is written or spooled
    stopped_s: float | None = None  # set by a clean stop
    pid: int = 0
    windows_total: int = 0
    blind_seconds_total: float = 0.0


class Heartbeat:
    """The heartbeat file at ``path``: ``start()`` once the probes attach (the window since the last run),
    ``beat()`` from the agent's loop, ``stop()`` at a clean stop."""

    def __init__(self, path: Path | str, every_s: float = BEAT_EVERY_S) -> None:
        self.path = Path(path)
        self.every_s = every_s
        self._state = _State(pid=os.getpid())
        self._last_write = 0.0
        self._started = False

    @property
    def windows_total(self) -> int:
        return self._state.windows_total

    @property
    def blind_seconds_total(self) -> float:
        return self._state.blind_seconds_total

    def start(self, durable_until_s: float, now_s: float | None = None) -> BlindWindow | None:
        """Reads the last run's file: the window in which nothing was traced, up to now (None on a
        first start, or when the file cannot be read); then beats."""
        now_s = time.time() if now_s is None else now_s
        last = self._read()
        window = None
        if last is not None:
            self._state.windows_total, self._state.blind_seconds_total = last.windows_total, last.blind_seconds_total
            if last.stopped_s is not None:
                window = BlindWindow(last.stopped_s, now_s, STOPPED, last.pid)
            else:
                window = BlindWindow(min(last.beat_s, last.durable_until_s), now_s, CRASHED, last.pid)
            self._state.windows_total += 1
            self._state.blind_seconds_total += window.seconds
            log.warning("not traced from %s to %s (%.1f s): the last run (pid %d) %s", _utc(window.start_s),
                        _utc(window.end_s), window.seconds, window.last_pid, window.reason)
        self._started = True
        self.beat(durable_until_s, now_s, force=True)
        return window

    def beat(self, durable_until_s: float, now_s: float | None = None, *, force: bool = False) -> None:
        """Records that the agent traces at ``now_s``, at most once every ``every_s`` unless forced."""
        now_s = time.time() if now_s is None else now_s
        if not force and now_s - self._last_write < self.every_s:
            return
        self._state.beat_s, self._state.durable_until_s = now_s, durable_until_s
        self._write()
        self._last_write = now_s

    def stop(self, durable_until_s: float, now_s: float | None = None) -> None:
        """A clean stop: the next run's window starts here, or at the sink's durable mark if it is
        earlier (rows the sink could neither write nor spool in time). A run that never traced (its
        probes did not attach) leaves the file as the last run left it: the window goes on."""
        if not self._started:
            return
        now_s = time.time() if now_s is None else now_s
        self._state.stopped_s = min(now_s, durable_until_s)
        self.beat(durable_until_s, now_s, force=True)

    def _read(self) -> _State | None:
        try:
            raw = json.loads(self.path.read_bytes())
            if raw.pop("format") != _FORMAT:
                raise ValueError("another format")
            state = _State(**raw)
            for name in ("beat_s", "durable_until_s", "blind_seconds_total"):
                setattr(state, name, float(getattr(state, name)))
            state.stopped_s = None if state.stopped_s is None else float(state.stopped_s)
            state.pid, state.windows_total = int(state.pid), int(state.windows_total)
            return state
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as why:
            aside = self.path.with_name(self.path.name + ".unreadable")
            log.warning("heartbeat %s cannot be read (%s): set aside as %s; the window since the last run "
                        "is unknown", self.path, why, aside)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return None

    def _write(self) -> None:
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary.write_text(json.dumps({"format": _FORMAT, **asdict(self._state)}))
            os.replace(temporary, self.path)
        except OSError as why:  # a full or read-only disk must not stop tracing: the next run knows less
            log.warning("heartbeat %s not written: %s", self.path, why)


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
