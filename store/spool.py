"""The sink's on-disk spool: batches the store could not take yet, replayed oldest first."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

logger = logging.getLogger(__name__)

class UnreadableSpoolFile(Exception):
    """A spool file that cannot be read back (truncated by a crash, disk error)."""


class Spool:
    """Undelivered batches on disk, one Arrow IPC file each, replayed oldest first.

    File names sort in arrival order and carry their row count
    (``<time_ns>-<seq>-<rows>.arrow``), so counting needs no reading. Batches
    the store refused outright go to ``rejected/`` with the reason beside them:
    kept for an operator, never retried automatically.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.rejected_directory = directory / "rejected"
        self.rejected_directory.mkdir(parents=True, exist_ok=True)
        # Two sinks replaying one spool would insert every batch twice.
        self._lock_fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"spool directory {directory} is in use by another tokenprobe sink") from None
        self._mutex = threading.Lock()
        self._sequence = 0
        self.rows = sum(self.rows_in(path) for path in self.files())

    @staticmethod
    def rows_in(path: Path) -> int:
        return int(path.stem.rsplit("-", 1)[1])

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("*-*-*.arrow"))

    def append(self, table: pa.Table) -> Path:
        """Write one batch durably (fsync, then an atomic rename). Raises OSError if the disk refuses."""
        with self._mutex:
            self._sequence += 1
            path = self.directory / f"{time.time_ns():020d}-{self._sequence:08d}-{table.num_rows}.arrow"
            temporary = path.with_name(f".{path.name}.tmp")
            try:
                with open(temporary, "wb") as handle:
                    with pa.ipc.new_file(handle, table.schema) as writer:
                        writer.write_table(table)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temporary, path)
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            self.rows += table.num_rows
            return path

    def oldest(self, max_rows: int) -> list[Path]:
        """The oldest files: at least one, and no more than ``max_rows`` rows unless one file alone has more."""
        chosen, rows = [], 0
        for path in self.files():
            if chosen and rows + self.rows_in(path) > max_rows:
                break
            chosen.append(path)
            rows += self.rows_in(path)
        return chosen

    @staticmethod
    def read(paths: Sequence[Path]) -> pa.Table:
        try:
            tables = []
            for path in paths:
                with pa.memory_map(str(path)) as source:
                    tables.append(pa.ipc.open_file(source).read_all())
            return pa.concat_tables(tables, promote_options="default")
        except (OSError, pa.ArrowException) as error:
            raise UnreadableSpoolFile(f"unreadable spool file: {error}") from error

    def remove(self, paths: Sequence[Path]) -> None:
        with self._mutex:
            for path in paths:
                path.unlink()
                self.rows -= self.rows_in(path)

    def reject(self, path: Path, reason: str) -> None:
        with self._mutex:
            path.replace(self.rejected_directory / path.name)
            (self.rejected_directory / f"{path.name}.reason.txt").write_text(reason + "\n")
            self.rows -= self.rows_in(path)

    def close(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)


