"""Names of containers and pods, from the container runtime's own API.

Two APIs cover the runtimes a GPU node runs:

- CRI (containerd, CRI-O): the gRPC RuntimeService the kubelet itself uses, on a unix socket.
  A container's status carries the kubelet's ``io.kubernetes.*`` labels; a pod sandbox carries
  the pod's own labels (what ``--pod-selector`` matches).
- The Docker Engine API (Docker, podman's compatible service), HTTP on a unix socket: a
  container's labels, the kubelet's where it made the container, and its name.

Every call is bounded in time and in what it reads, and none is made on the capture path
(identity/resolver.py asks from a thread of its own).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

POD_NAME, POD_NAMESPACE, POD_UID, CONTAINER_NAME = (
    "io.kubernetes.pod.name", "io.kubernetes.pod.namespace", "io.kubernetes.pod.uid", "io.kubernetes.container.name")
CALL_TIMEOUT_S = 2.0
MAX_RESPONSE_BYTES = 4 << 20
# Where runtimes listen, as a node mounts them for a DaemonSet (deploy/kubernetes/daemonset.yaml).
DEFAULT_SOCKETS = ("/run/containerd/containerd.sock", "/run/crio/crio.sock", "/var/run/docker.sock",
                   "/run/podman/podman.sock")


@dataclass(frozen=True, slots=True)
class ContainerNames:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""


class RuntimeUnavailable(Exception):
    """The runtime did not answer, or answered what cannot be read."""


class ContainerRuntime(Protocol):
    name: str

    def names(self, container_id: str) -> ContainerNames | None:
        """The names of a container; None if the runtime does not know it."""

    def matching(self, namespace: str | None, labels: Mapping[str, str]) -> set[str]:
        """The ids of running containers in pods of `namespace` (any, if None) with all of `labels`."""


def names_from_labels(labels: Mapping[str, str], fallback_container: str = "") -> ContainerNames:
    return ContainerNames(str(labels.get(POD_NAMESPACE, "")), str(labels.get(POD_NAME, "")),
                          str(labels.get(CONTAINER_NAME, fallback_container)), str(labels.get(POD_UID, "")))


# -- the Docker Engine API ----------------------------------------------------------------------------
class _UnixHttp(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=CALL_TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(CALL_TIMEOUT_S)
        self.sock.connect(self._path)


class DockerApi:
    """Docker's Engine API, or podman's compatible service (``podman system service``)."""

    name = "docker-api"

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def _request(self, target: str) -> tuple[int, bytes]:
        connection = _UnixHttp(self.socket_path)
        try:
            connection.request("GET", target)
            response = connection.getresponse()
            return response.status, response.read(MAX_RESPONSE_BYTES + 1)
        except (OSError, http.client.HTTPException) as error:
            raise RuntimeUnavailable(f"{self.socket_path}: {error or type(error).__name__}") from error
        finally:
            connection.close()

    def answers(self) -> bool:
        """Whether the socket speaks the Engine API (``GET /_ping`` answers 200)."""
        try:
            return self._request("/_ping")[0] == 200
        except RuntimeUnavailable:
            return False

    def _get(self, target: str):
        status, body = self._request(target)
        if status == 404:
            return None
        if status != 200 or len(body) > MAX_RESPONSE_BYTES:
            raise RuntimeUnavailable(f"{self.socket_path}: GET {target.split('?')[0]} answered {status}")
        try:
            return json.loads(body)
        except ValueError as error:
            raise RuntimeUnavailable(f"{self.socket_path}: GET {target.split('?')[0]}: not JSON") from error

    def names(self, container_id: str) -> ContainerNames | None:
        found = self._get(f"/containers/{urllib.parse.quote(container_id)}/json")
        if not isinstance(found, dict):
            return None
        labels = (found.get("Config") or {}).get("Labels") or {}
        return names_from_labels(labels if isinstance(labels, dict) else {},
                                 str(found.get("Name") or "").lstrip("/"))

    def matching(self, namespace: str | None, labels: Mapping[str, str]) -> set[str]:
        wanted = [f"{key}={value}" for key, value in labels.items()]
        if namespace is not None:
            wanted.append(f"{POD_NAMESPACE}={namespace}")
        query = urllib.parse.urlencode({"filters": json.dumps({"label": wanted, "status": ["running"]})})
        found = self._get(f"/containers/json?{query}") or []
        return {str(container.get("Id")) for container in found if isinstance(container, dict)}


# -- CRI ----------------------------------------------------------------------------------------------
def _cri_messages() -> dict[str, type]:
    """The few messages of runtime.v1 (k8s.io/cri-api, api.proto) the agent sends and reads, with their
    field numbers there; a reply's other fields are skipped, as protobuf skips unknown fields."""
    proto = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="tokenprobe/cri_subset.proto", package="runtime.v1",
                                              syntax="proto3")
    text, flag, number = proto.TYPE_STRING, proto.TYPE_BOOL, proto.TYPE_INT32

    def add(name: str, *fields: tuple) -> None:
        """fields: (name, number, type) with type a scalar type, a message's name, or ("map",): a
        map<string, string>, which protobuf writes as a repeated entry message of its own."""
        message = file.message_type.add(name=name)
        for field_name, field_number, kind in fields:
            label = proto.LABEL_REPEATED if isinstance(kind, str) and kind.startswith(("map", "[]")) else \
                proto.LABEL_OPTIONAL
            if kind == "map":
                entry = message.nested_type.add(name=f"{field_name.title().replace('_', '')}Entry")
                entry.options.map_entry = True
                entry.field.add(name="key", number=1, type=text, label=proto.LABEL_OPTIONAL)
                entry.field.add(name="value", number=2, type=text, label=proto.LABEL_OPTIONAL)
                kind = f"{name}.{entry.name}"
            if isinstance(kind, str):
                message.field.add(name=field_name, number=field_number, type=proto.TYPE_MESSAGE, label=label,
                                  type_name=f".runtime.v1.{kind.removeprefix('[]')}")
            else:
                message.field.add(name=field_name, number=field_number, type=kind, label=label)

    add("ContainerMetadata", ("name", 1, text))
    add("ContainerStatusRequest", ("container_id", 1, text), ("verbose", 2, flag))
    add("ContainerStatus", ("id", 1, text), ("metadata", 2, "ContainerMetadata"), ("labels", 12, "map"))
    add("ContainerStatusResponse", ("status", 1, "ContainerStatus"))
    add("PodSandboxFilter", ("label_selector", 3, "map"))
    add("ListPodSandboxRequest", ("filter", 1, "PodSandboxFilter"))
    add("PodSandbox", ("id", 1, text), ("state", 3, number), ("labels", 5, "map"))
    add("ListPodSandboxResponse", ("items", 1, "[]PodSandbox"))
    add("ContainerFilter", ("pod_sandbox_id", 3, text))
    add("ListContainersRequest", ("filter", 1, "ContainerFilter"))
    add("Container", ("id", 1, text), ("state", 6, number))
    add("ListContainersResponse", ("containers", 1, "[]Container"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {message.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"runtime.v1.{message.name}"))
            for message in file.message_type}


_CRI = _cri_messages()
SANDBOX_READY, CONTAINER_RUNNING = 0, 1


class CriApi:
    """The CRI RuntimeService of containerd or CRI-O."""

    name = "cri"

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._channel = grpc.insecure_channel(f"unix://{socket_path}",
                                              options=[("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)])

    def _call(self, method: str, request, reply: str):
        call = self._channel.unary_unary(f"/runtime.v1.RuntimeService/{method}",
                                         request_serializer=lambda message: message.SerializeToString(),
                                         response_deserializer=_CRI[reply].FromString)
        try:
            return call(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise RuntimeUnavailable(f"{self.socket_path}: {method}: {error.code().name}") from error

    def names(self, container_id: str) -> ContainerNames | None:
        reply = self._call("ContainerStatus", _CRI["ContainerStatusRequest"](container_id=container_id),
                           "ContainerStatusResponse")
        if reply is None or not reply.HasField("status"):
            return None
        return names_from_labels(dict(reply.status.labels), reply.status.metadata.name)

    def matching(self, namespace: str | None, labels: Mapping[str, str]) -> set[str]:
        selector = dict(labels)
        if namespace is not None:
            selector[POD_NAMESPACE] = namespace  # the kubelet sets it on every sandbox too
        request = _CRI["ListPodSandboxRequest"](filter=_CRI["PodSandboxFilter"](label_selector=selector))
        sandboxes = self._call("ListPodSandbox", request, "ListPodSandboxResponse")
        found: set[str] = set()
        for sandbox in (sandboxes.items if sandboxes is not None else ()):
            if sandbox.state != SANDBOX_READY:
                continue
            request = _CRI["ListContainersRequest"](filter=_CRI["ContainerFilter"](pod_sandbox_id=sandbox.id))
            containers = self._call("ListContainers", request, "ListContainersResponse")
            found |= {c.id for c in (containers.containers if containers is not None else ())
                      if c.state == CONTAINER_RUNNING}
        return found

    def close(self) -> None:
        self._channel.close()


def connect_runtime(socket_path: str | None = None) -> ContainerRuntime | None:
    """The runtime at `socket_path`, or the first of DEFAULT_SOCKETS that exists; None if there is none.
    A socket that speaks HTTP is the Docker Engine API; any other, CRI."""
    for path in ([socket_path] if socket_path else DEFAULT_SOCKETS):
        if Path(path).is_socket():
            docker = DockerApi(path)
            return docker if docker.answers() else CriApi(path)
    return None
