"""The embedded store: one process owns a chDB directory and serves it to the others.

One process owns the directory (an exclusive ``flock`` on
``DIR/.tokenprobe.lock``) and serves it to every other process over the
ClickHouse HTTP protocol (see ``server``); it publishes the port and a fresh
token in ``DIR/.tokenprobe-serve.json``. ``open_store`` on a directory another
live process owns returns a client of that owner, so readers work unchanged
while the agent writes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

import clickhouse_connect
from clickhouse_connect.driver.exceptions import Error as ClickHouseError
from clickhouse_connect.driver.exceptions import OperationalError

logger = logging.getLogger(__name__)

from .client import Store, StoreUnavailable, network_reason
from .url import StoreURL, parse_store_url

if TYPE_CHECKING:  # the engine (chDB: 212 MiB resident once imported) is loaded only by an owner
    from .server import StoreServer

LOCK_FILE = ".tokenprobe.lock"
# The lock file's second line where its owner will not serve the store, so that a reader waiting for it can say so.
NOT_SERVING = "not serving"
SERVE_FILE = ".tokenprobe-serve.json"
# How long a reader waits for a starting owner to publish its serve file.
DEFAULT_OWNER_WAIT_S = 15.0
# The engine's startup arguments (its server settings). ClickHouse's memory worker reads the process's
# RSS and the allocator's figures several times a second by default: 2.7 ms a second of an idle agent's CPU,
# about a quarter of it. Once a second is enough for a store this size.
ENGINE_STARTUP = "memory_worker_period_ms=1000"


class _Ownership:
    """What an embedded owner holds: the directory lock and, when serving, the read server."""

    def __init__(self, directory: Path, lock_fd: int):
        self.directory = directory
        self.lock_fd = lock_fd
        self.server: StoreServer | None = None

    def publish(self, server: StoreServer, token: str, reader_token: str) -> None:
        """Start advertising ``server``: write the serve file atomically, readable by this user only."""
        self.server = server
        serve_file = self.directory / SERVE_FILE
        temporary = serve_file.with_name(f"{SERVE_FILE}.{os.getpid()}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump({"pid": os.getpid(), "port": server.port, "token": token, "reader_token": reader_token},
                      handle)
        os.replace(temporary, serve_file)

    def stop_serving(self) -> None:
        if self.server is None:
            return
        # Withdraw the advertisement first, so no new reader tries a closing server.
        if _read_json(self.directory / SERVE_FILE).get("pid") == os.getpid():
            (self.directory / SERVE_FILE).unlink(missing_ok=True)
        self.server.close()
        self.server = None

    def release(self) -> None:
        fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        os.close(self.lock_fd)


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def _read_lock_owner(lock_path: Path) -> tuple[int | None, bool]:
    """The owner's pid as its lock file names it, and whether it said it will serve the store."""
    try:
        lines = lock_path.read_text().split("\n")
        return int(lines[0]), NOT_SERVING not in lines[1:]
    except (OSError, ValueError):
        return None, True


def _command_of(pid: int | None) -> str:
    """The command line of ``pid``, shortened, to name a store's owner in messages ('' if it cannot be read)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return ""
    command = " ".join(word.decode(errors="replace") for word in words)
    return command if len(command) <= 100 else command[:99] + "…"


def _no_store_here(target: StoreURL, directory: Path) -> StoreUnavailable:
    return StoreUnavailable(
        f"{directory} holds no tokenprobe store (no database {target.database!r} in it): check the path; an agent "
        f"started with --store chdb://{directory} creates one")


def _holds_store(target: StoreURL, directory: Path) -> bool:
    """Whether chDB has the store's database in ``directory`` (its metadata file, written when it was created)."""
    return (directory / "metadata" / f"{target.database}.sql").exists()


def open_store(url: str, *, serve: bool = True, owner_wait_s: float = DEFAULT_OWNER_WAIT_S,
               may_own: bool = True, read_only: bool = False, create: bool | None = None) -> Store:
    """Open the store at ``url`` (see the module docstring).

    Embedded: become the directory's owner if no live process is, serving it to
    other processes when ``serve``; else connect to the owner, waiting up to
    ``owner_wait_s`` for a starting owner to publish its serve file, with its
    reader token when ``read_only`` (a server store is as read-only as the
    user in its URL). A long-lived reader passes ``may_own=False``: it never takes the directory
    (an agent started after it could then only spool), and is refused with
    StoreUnavailable while no owner runs. An embedded store is created where
    none is unless ``create`` is false (the default for a ``read_only`` opener:
    a mistyped path must not become a new, empty store). Raises StoreUnavailable
    when the store cannot be reached, or is not there to read.
    """
    target = parse_store_url(url)
    if target.kind == "server":
        return _open_server(target)
    return _open_embedded(target, serve=serve, owner_wait_s=owner_wait_s, may_own=may_own, read_only=read_only,
                          create=not read_only if create is None else create)


def _open_server(target: StoreURL) -> Store:
    try:
        client = clickhouse_connect.get_client(
            interface=target.scheme,
            host=target.host,
            port=target.port,
            username=target.username,
            password=target.password,
            proxy_path=target.proxy_path,
            # No server-side sessions: the store needs none, and they forbid concurrent queries.
            autogenerate_session_id=False,
        )
    except OperationalError as error:
        raise StoreUnavailable(f"cannot reach ClickHouse at {target.display()}: {network_reason(error)}") from error
    except ClickHouseError as error:  # it answered, but not as a ClickHouse server that lets this user in
        raise StoreUnavailable(f"ClickHouse at {target.display()} refused the connection: "
                               f"{network_reason(error)}") from error
    return Store(target, client, "server")


def _open_embedded(target: StoreURL, *, serve: bool, owner_wait_s: float, may_own: bool,
                   read_only: bool, create: bool) -> Store:
    directory = Path(target.path)
    if not create:
        if not directory.is_dir():
            raise StoreUnavailable(f"no store at {directory}: no such directory (check the path; an agent started "
                                   f"with --store chdb://{directory} creates one)")
        if not (directory / LOCK_FILE).exists() and not _holds_store(target, directory):
            raise _no_store_here(target, directory)
    try:
        # The store holds what every request did, and the owner's tokens: this user's alone.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if directory.stat().st_uid == os.getuid():
            directory.chmod(0o700)
    except OSError as error:
        raise StoreUnavailable(f"cannot create the embedded store directory {directory}: {error}") from error
    lock_path = directory / LOCK_FILE
    deadline = time.monotonic() + owner_wait_s
    while True:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
        else:
            refusal = None
            if not may_own:
                refusal = StoreUnavailable(
                    f"no process owns the embedded store {directory}: it is read through its owner. Start "
                    f"`tokenprobe agent --store chdb://{directory} …` on it, or serve it as it is with "
                    f"`tokenprobe dashboard --store chdb://{directory} --own-store`")
            elif not create and not _holds_store(target, directory):
                refusal = _no_store_here(target, directory)
            if refusal is not None:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                os.close(lock_fd)
                raise refusal
            return _become_owner(target, directory, lock_fd, serve=serve)
        # A live process holds the lock (the kernel drops a dead holder's lock).
        # Its serve file counts only once it carries that holder's pid: an
        # older file is a stale leftover of a previous owner.
        owner_pid, will_serve = _read_lock_owner(lock_path)
        advert = _read_json(directory / SERVE_FILE)
        if owner_pid is not None and advert.get("pid") == owner_pid:
            return _open_via_owner(target, owner_pid, advert, read_only=read_only)
        if time.monotonic() >= deadline:
            raise _not_served(directory, owner_pid, will_serve, owner_wait_s)
        time.sleep(0.1)


def _not_served(directory: Path, owner_pid: int | None, will_serve: bool, waited_s: float) -> StoreUnavailable:
    """Who holds the store without serving it, and what to do about it, in one line."""
    command = _command_of(owner_pid)
    holder = f"pid {owner_pid or 'unknown'}" + (f" ({command})" if command else "")
    if will_serve:
        return StoreUnavailable(f"embedded store {directory} is owned by {holder}, which has not served it to other "
                                f"processes within {waited_s:g} s (still starting?): try again in a moment")
    return StoreUnavailable(f"embedded store {directory} is owned by {holder}, which does not serve it to other "
                            f"processes: try again once it ends, or stop it (kill {owner_pid})")


def _become_owner(target: StoreURL, directory: Path, lock_fd: int, *, serve: bool) -> Store:
    # Only an owner needs the engine (chdb, ~235 MiB): a client of a server or of an owner, such as the
    # agent in its image, must not import it.
    from .server import StoreServer

    ownership = _Ownership(directory, lock_fd)
    client = None
    try:
        os.ftruncate(lock_fd, 0)
        marker = "" if serve else f"{NOT_SERVING}\n"
        os.pwrite(lock_fd, f"{os.getpid()}\n{marker}".encode(), 0)
        # Whatever serve file is here belongs to a dead owner.
        (directory / SERVE_FILE).unlink(missing_ok=True)
        from .server import StoreServer  # imports the engine: only an owner of the directory needs it

        try:
            client = clickhouse_connect.get_client(interface="chdb", path=f"{directory}?{ENGINE_STARTUP}")
        except ClickHouseError as error:
            raise StoreUnavailable(f"chDB cannot open {directory}: {error}") from error
        if serve:
            token, reader_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
            server = StoreServer(str(directory), token, reader_token=reader_token, database=target.database)
            ownership.publish(server, token, reader_token)
    except BaseException:
        ownership.stop_serving()
        if client is not None:
            client.close()
        ownership.release()
        raise
    return Store(target, client, "embedded-owner", ownership)


def _open_via_owner(target: StoreURL, owner_pid: int, advert: dict, *, read_only: bool) -> Store:
    try:
        client = clickhouse_connect.get_client(
            host="127.0.0.1",
            port=int(advert["port"]),
            username="default",
            password=str(advert["reader_token" if read_only else "token"]),
            # The owner is on this host: compression would only cost CPU on both ends.
            compress=False,
            autogenerate_session_id=False,
        )
    except (KeyError, ValueError) as error:
        raise StoreUnavailable(f"the serve file of embedded store {target.path} is malformed: {error!r}") from None
    except OperationalError as error:
        raise StoreUnavailable(
            f"embedded store {target.path} is owned by pid {owner_pid}, which does not answer: {error}"
        ) from error
    return Store(target, client, "embedded-via-owner")


