"""A process's container and pod, from its cgroup path alone (/proc/PID/cgroup).

Container runtimes name the cgroup of a container after its id, and the kubelet names a
pod's cgroup after the pod's UID, in both of its cgroup drivers:

    cgroupfs: /kubepods/burstable/pod0d5c…-…/3f1a…(64 hex)
    systemd:  /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0d5c…_….slice/
              cri-containerd-3f1a….scope   (crio-…, docker-…, cri-dockerd-…)
    Docker:   /docker/3f1a…   /system.slice/docker-3f1a….scope
    podman:   /libpod_parent/libpod-3f1a…   /machine.slice/libpod-3f1a….scope

The text comes from a process anyone may start, so it is read bounded and matched, never
trusted: anything that does not look like an id is no id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The most of /proc/PID/cgroup read: a v1 host lists a line per controller, each well under 1 KiB.
MAX_CGROUP_BYTES = 16384
# A container id as runtimes write it: 64 hex digits, after a separator or a runtime's prefix.
_CONTAINER_ID = re.compile(r"(?:^|[/\-:])([0-9a-f]{64})(?:\.scope)?$")
# The kubelet's pod cgroup: pod + UID, with dashes (cgroupfs) or underscores (systemd).
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    container_id: str = ""
    pod_uid: str = ""


NO_CONTAINER = CgroupIdentity()


def identity_of_cgroup(text: str) -> CgroupIdentity:
    """The container id and pod UID a /proc/PID/cgroup text names; empty where it names none."""
    container_id = pod_uid = ""
    for line in text[:MAX_CGROUP_BYTES].splitlines():
        path = line.split(":", 2)[-1]
        for part in path.split("/"):
            if not container_id and (match := _CONTAINER_ID.search(part)):
                container_id = match[1]
            elif not pod_uid and (match := _POD_UID.search(part)):
                pod_uid = match[1].replace("_", "-")
        if container_id:
            break
    return CgroupIdentity(container_id, pod_uid) if container_id else NO_CONTAINER


def read_cgroup_identity(pid: int) -> CgroupIdentity:
    """The container of a process now; empty for a process outside any container or one gone."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            raw = f.read(MAX_CGROUP_BYTES)
    except OSError:
        return NO_CONTAINER
    return identity_of_cgroup(raw.decode("utf-8", "replace"))
