"""The sink's on-disk spool: batches the store could not take yet, replayed oldest first.

One compressed Arrow IPC file per batch, named ``<token>-<rows>.arrow``: the
token (``<time_ns>-<random>``) sorts in arrival order and is the batch's
insert deduplication token, so a batch replayed after a crash between its
insert and its removal is dropped by the store instead of stored twice; the
row count makes counting free. The spool is bounded in bytes: past
``max_bytes`` the oldest batches are dropped, and the rows dropped are
counted in a file beside them, so the count survives restarts. Batches the
store refused outright go to ``rejected/`` with the reason beside them: kept
for an operator, never retried automatically.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from pathlib import Path

import pyarrow as pa

DEFAULT_MAX_BYTES = 1 << 30
_DROPPED_FILE = "dropped-rows"
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


class UnreadableSpoolFile(Exception):
    """A spool file that cannot be read back (truncated by a crash, disk error)."""


def new_batch_token() -> str:
    """A deduplication token for one batch: sorts by creation time, unique across processes and restarts."""
    return f"{time.time_ns():020d}-{secrets.token_hex(6)}"


class Spool:
    """Undelivered batches on disk (see the module docstring). Thread-safe."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1:
            raise ValueError("the spool's max_bytes must be positive")
        self.directory = directory
        self.max_bytes = max_bytes
        self.rejected_directory = directory / "rejected"
        self.rejected_directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Two sinks replaying one spool would insert every batch twice.
        self._lock_fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"spool directory {directory} is in use by another tokenprobe sink") from None
        self._mutex = threading.Lock()
        # Half-written files of a process that died mid-write: their batch was never acknowledged as spooled.
        for leftover in directory.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        self.rows = sum(self.rows_in(path) for path in self.files())
        self.bytes = sum(path.stat().st_size for path in self.files())
        self.dropped_rows = self._read_dropped()

    @staticmethod
    def rows_in(path: Path) -> int:
        return int(path.stem.rsplit("-", 1)[1])

    @staticmethod
    def token_of(path: Path) -> str:
        return path.stem.rsplit("-", 1)[0]

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("*-*-*.arrow"))

    def append(self, table: pa.Table, token: str) -> Path:
        """Write one batch durably (fsync of the file, an atomic rename, fsync of the folder), then drop
        the oldest batches while the spool is over its bound. Raises OSError if the disk refuses."""
        with self._mutex:
            path = self.directory / f"{token}-{table.num_rows}.arrow"
            temporary = path.with_name(f".{path.name}.tmp")
            try:
                with open(temporary, "wb") as handle:
                    with pa.ipc.new_file(handle, table.schema, options=_WRITE_OPTIONS) as writer:
                        writer.write_table(table)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(temporary, 0o600)
                os.replace(temporary, path)
                self._sync_directory()
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            self.rows += table.num_rows
            self.bytes += path.stat().st_size
            self._drop_oldest_beyond_bound(keep=path)
            return path

    def oldest(self) -> Path | None:
        files = self.files()
        return files[0] if files else None

    @staticmethod
    def read(path: Path) -> pa.Table:
        try:
            with pa.memory_map(str(path)) as source:
                return pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowException) as error:
            raise UnreadableSpoolFile(f"unreadable spool file {path.name}: {error}") from error

    def remove(self, path: Path) -> None:
        with self._mutex:
            self._forget(path)
            path.unlink()
            self._sync_directory()

    def reject(self, path: Path, reason: str) -> None:
        with self._mutex:
            self._forget(path)
            path.replace(self.rejected_directory / path.name)
            (self.rejected_directory / f"{path.name}.reason.txt").write_text(reason + "\n")
            self._sync_directory()

    def close(self) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    # -- inside the mutex

    def _forget(self, path: Path) -> None:
        self.rows -= self.rows_in(path)
        self.bytes -= path.stat().st_size

    def _drop_oldest_beyond_bound(self, keep: Path) -> None:
        dropped = 0
        for path in self.files():
            if self.bytes <= self.max_bytes or path == keep:
                break
            dropped += self.rows_in(path)
            self._forget(path)
            path.unlink()
        if dropped:
            self.dropped_rows += dropped
            self._write_dropped()
            self._sync_directory()

    def _read_dropped(self) -> int:
        try:
            return int((self.directory / _DROPPED_FILE).read_text())
        except (OSError, ValueError):
            return 0

    def _write_dropped(self) -> None:
        temporary = self.directory / f".{_DROPPED_FILE}.tmp"
        temporary.write_text(f"{self.dropped_rows}\n")
        os.replace(temporary, self.directory / _DROPPED_FILE)

    def _sync_directory(self) -> None:
        """Make renames and removals in the folder durable, not just the files' contents."""
        descriptor = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
