"""Which pod and container a process belongs to, for every row, metric, span and GPU sample.

The container id and pod UID come from the process's cgroup at once (a /proc read); the names come
from the container runtime's API (runtime.py), asked by a thread of this resolver's, so capture
never waits on a runtime: a row made before its container's names came carries the ids, and the
names from then on. Both caches are bounded; an entry is read again after ``REFRESH_S`` (a pid may
be reused by another container's process), and a runtime that fails is asked again later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .cgroup import CgroupIdentity, read_cgroup_identity
from .runtime import ContainerNames, ContainerRuntime, RuntimeUnavailable

log = logging.getLogger("tokenprobe.identity")

REFRESH_S = 30.0
MAX_PROCESSES = 65536
MAX_CONTAINERS = 8192
MAX_PENDING = 1024  # container ids waiting for the runtime
RETRY_AFTER_FAILURE_S = 10.0


@dataclass(frozen=True, slots=True)
class Identity(ContainerNames):
    """A row's Kubernetes identity: its container's names and id; every field empty for a process outside
    any container."""

    container_id: str = ""

    def fields(self) -> dict[str, str]:
        """The row's columns (asdict's deep copy costs several times this, once a row)."""
        return {"namespace": self.namespace, "pod": self.pod, "container": self.container, "pod_uid": self.pod_uid,
                "container_id": self.container_id}


HOST = Identity()


@dataclass
class IdentityStats:
    processes: int = 0           # processes whose cgroup was read
    containers_named: int = 0    # containers the runtime named
    runtime_failures: int = 0    # calls to the runtime that failed
    pending_dropped: int = 0     # container ids not asked about: the queue was full


class IdentityResolver:
    def __init__(self, runtime: ContainerRuntime | None, *,
                 read_cgroup: Callable[[int], CgroupIdentity] = read_cgroup_identity) -> None:
        self.runtime = runtime
        self.stats = IdentityStats()
        self._read_cgroup = read_cgroup
        self._lock = threading.Lock()
        self._processes: OrderedDict[int, tuple[float, CgroupIdentity]] = OrderedDict()
        self._names: OrderedDict[str, ContainerNames] = OrderedDict()
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._asking: str | None = None  # the container the runtime is being asked about now
        self._failed_at: dict[str, float] = {}
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        if runtime is not None:
            self._thread = threading.Thread(target=self._name_containers, name="tokenprobe-identity", daemon=True)
            self._thread.start()

    def of(self, pid: int) -> Identity:
        """The identity of a process as known now; never waits on the runtime."""
        now = time.monotonic()
        with self._lock:
            cached = self._processes.get(pid)
        if cached is None or now - cached[0] > REFRESH_S:
            cached = (now, self._read_cgroup(pid))
            with self._lock:
                self.stats.processes += 1
                self._processes[pid] = cached
                self._processes.move_to_end(pid)
                while len(self._processes) > MAX_PROCESSES:
                    self._processes.popitem(last=False)
        ids = cached[1]
        if not ids.container_id:
            return HOST
        names = self._names_of(ids.container_id, now)
        return Identity(names.namespace, names.pod, names.container, ids.pod_uid or names.pod_uid, ids.container_id)

    def _names_of(self, container_id: str, now: float) -> ContainerNames:
        with self._lock:
            names = self._names.get(container_id)
            if names is not None:
                return names
            if self.runtime is not None and container_id not in self._pending \
                    and now - self._failed_at.get(container_id, -RETRY_AFTER_FAILURE_S) >= RETRY_AFTER_FAILURE_S:
                if len(self._pending) < MAX_PENDING:
                    self._pending[container_id] = None
                    self._wake.notify()
                else:
                    self.stats.pending_dropped += 1
        return ContainerNames()

    def _name_containers(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                container_id, _ = self._pending.popitem(last=False)
                self._asking = container_id
            try:
                names = self.runtime.names(container_id) or ContainerNames()
            except (RuntimeUnavailable, ValueError) as error:
                with self._lock:
                    self._asking = None
                    self.stats.runtime_failures += 1
                    self._failed_at[container_id] = time.monotonic()
                    if len(self._failed_at) > MAX_CONTAINERS:
                        self._failed_at.clear()
                log.debug("container %s: %s", container_id[:12], error)
                continue
            with self._lock:
                self._asking = None
                self._names[container_id] = names
                self.stats.containers_named += 1
                while len(self._names) > MAX_CONTAINERS:
                    self._names.popitem(last=False)

    def naming(self, container_id: str) -> bool:
        """Whether the runtime is yet to answer for this container (its names may still come)."""
        with self._lock:
            return container_id in self._pending or container_id == self._asking

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        close = getattr(self.runtime, "close", None)
        if close is not None:
            close()


class RowNaming:
    """Names each row's pod and container before the row leaves. A row of a container the runtime has yet
    to name waits for the answer, at most NAMES_WAIT_S, and the rows after it wait behind it (rows leave in
    the order they came): capture never waits, only rows do, and only the first ones of a new container."""

    NAMES_WAIT_S = 2.0
    MAX_HELD = 10_000

    def __init__(self, resolver: IdentityResolver, dispatch: Callable[[dict], None]) -> None:
        self._resolver = resolver
        self._dispatch = dispatch
        self._held: deque[tuple[float, dict]] = deque()

    def put(self, row: dict) -> None:
        identity = self._resolver.of(row["pid"])
        if not self._held and not self._unnamed(identity):
            self._send(row, identity)
            return
        if len(self._held) >= self.MAX_HELD:
            held = self._held.popleft()[1]
            self._send(held, self._resolver.of(held["pid"]))
        self._held.append((time.monotonic() + self.NAMES_WAIT_S, row))

    def release(self, *, everything: bool = False) -> None:
        """Sends the rows whose names came (or whose wait is over); every row if ``everything``."""
        now = time.monotonic()
        while self._held:
            deadline, row = self._held[0]
            identity = self._resolver.of(row["pid"])
            if not (everything or now >= deadline or not self._unnamed(identity)):
                return
            self._held.popleft()
            self._send(row, identity)

    def _unnamed(self, identity: Identity) -> bool:
        return bool(identity.container_id and not identity.container and self._resolver.naming(identity.container_id))

    def _send(self, row: dict, identity: Identity) -> None:
        row.update(identity.fields())
        self._dispatch(row)


class PodSelection:
    """The processes of the pods an operator named (``--namespace``, ``--pod-selector``): the runtime
    names the running containers, /proc says which processes are in them."""

    def __init__(self, runtime: ContainerRuntime, namespace: str | None, labels: Mapping[str, str],
                 resolver: IdentityResolver) -> None:
        self.runtime, self.namespace, self.labels, self.resolver = runtime, namespace, dict(labels), resolver

    def pids(self, candidates: Iterable[int] | None = None) -> set[int]:
        """The pids, among `candidates` (every process if None), in a selected container now."""
        try:
            containers = self.runtime.matching(self.namespace, self.labels)
        except RuntimeUnavailable as error:
            log.warning("pod selection: the container runtime did not answer (%s); retried at the next rescan", error)
            return set()
        if not containers:
            return set()
        if candidates is None:
            candidates = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
        return {pid for pid in candidates if self.resolver.of(pid).container_id in containers}


def parse_pod_selector(text: str) -> dict[str, str]:
    """``app=vllm,tier=gpu`` → labels; a clear ValueError for anything else."""
    labels: dict[str, str] = {}
    for part in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--pod-selector takes key=value[,key=value]: {part!r} is not one")
        labels[key.strip()] = value.strip()
    if not labels:
        raise ValueError("--pod-selector is empty")
    return labels
