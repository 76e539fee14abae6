"""The ground-truth log: one JSON line per request, written off the request path.

Request threads only enqueue a dict; a single background thread serialises and
writes, flushing whenever the queue runs dry, so lines appear promptly without
a request ever waiting on the disk.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path
from typing import Any

_STOP = object()


class TruthLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        # Append: CLOCK_MONOTONIC values from several runs of one boot stay comparable.
        self._file = open(self.path, "a", encoding="utf-8")
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_forever, name="truth-log-writer", daemon=True)
        self._writer.start()

    def record(self, entry: dict[str, Any]) -> None:
        self._queue.put(entry)

    def close(self) -> None:
        """Write everything recorded so far, then close the file."""
        self._queue.put(_STOP)
        self._writer.join()
        self._file.close()

    def _write_forever(self) -> None:
        while True:
            entry = self._queue.get()
            while True:
                if entry is _STOP:
                    self._file.flush()
                    return
                self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
                try:
                    entry = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._file.flush()
