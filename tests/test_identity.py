"""Kubernetes identity (agent/identity/): a process's container and pod from its cgroup, their names from
the container runtime's API, on every row and metric.

The end-to-end test runs two real containers under podman, each serving on port 8000 in its own network
namespace and labelled as the kubelet labels a pod's containers, and a real agent with real BPF: two pods
on one port are two named servers in its rows and its /metrics."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenprobe.agent.identity.cgroup import NO_CONTAINER, identity_of_cgroup
from tokenprobe.agent.identity.resolver import IdentityResolver, parse_pod_selector
from tokenprobe.agent.identity.runtime import CriApi, DockerApi, connect_runtime
from tokenprobe.agent.sampling.gpu import ServerGpu
from tokenprobe.agent.sampling.samplers import server_gpu_row

from tests.kernel_harness import agent, free_port, read_rows, require_kernel
from tests.support import wait_for_port, wait_until

CID = "3f1a" + "0123456789abcdef" * 3 + "cafe0123abcd"
UID = "0d5c8a7e-1b2c-4d3e-8f90-a1b2c3d4e5f6"

CGROUPS = {
    "cgroupfs kubelet, containerd": (f"0::/kubepods/burstable/pod{UID}/{CID}\n", CID, UID),
    "systemd kubelet, containerd": (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n", CID, UID),
    "systemd kubelet, CRI-O (cgroup v1)": (
        f"12:pids:/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n"
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n", CID, UID),
    "Docker": (f"0::/system.slice/docker-{CID}.scope\n", CID, ""),
    "Docker, cgroupfs": (f"13:memory:/docker/{CID}\n", CID, ""),
    "podman": (f"0::/libpod_parent/libpod-{CID}\n", CID, ""),
    "a host process": ("0::/user.slice/user-0.slice/session-3.scope\n", "", ""),
    "a pod cgroup without a container": (f"0::/kubepods/pod{UID}\n", "", ""),
    "a 63-digit id is none": (f"0::/docker/{CID[:-1]}\n", "", ""),
}


@pytest.mark.parametrize("case", CGROUPS)
def test_the_cgroup_names_the_container_and_the_pod(case):
    text, container_id, pod_uid = CGROUPS[case]
    found = identity_of_cgroup(text)
    assert (found.container_id, found.pod_uid) == (container_id, pod_uid)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000) | st.binary(max_size=3000).map(lambda raw: raw.decode("latin-1")))
def test_any_cgroup_text_gives_an_id_or_none_and_never_raises(text):
    """Any process can choose the cgroup names it lives in (cgroupfs, delegated subtrees)."""
    found = identity_of_cgroup(text)
    assert found == NO_CONTAINER or (len(found.container_id) == 64 and set(found.container_id) <= set("0123456789abcdef"))


def test_a_process_outside_any_container_has_empty_pod_fields():
    resolver = IdentityResolver(None)
    try:
        assert set(resolver.of(os.getpid()).fields().values()) == {""}
    finally:
        resolver.stop()


def test_pod_selectors_are_parsed_or_refused_clearly():
    assert parse_pod_selector("app=vllm, tier = gpu") == {"app": "vllm", "tier": "gpu"}
    for bad in ("app", "=x", ",", ""):
        with pytest.raises(ValueError, match="pod-selector"):
            parse_pod_selector(bad)


@contextmanager
def containerd(tmp: Path) -> Iterator[str]:
    """A real containerd, its CRI service on a socket of the test's own (no pods: none can be pulled here)."""
    socket = tmp / "containerd.sock"
    config = tmp / "containerd.toml"
    config.write_text(f'version = 2\nroot = "{tmp}/root"\nstate = "{tmp}/state"\n'
                      f'[grpc]\n  address = "{socket}"\n[ttrpc]\n  address = "{socket}.ttrpc"\n')
    daemon = subprocess.Popen(["containerd", "--config", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_until(socket.is_socket, timeout=30)
        yield str(socket)
    finally:
        daemon.terminate()
        daemon.wait(timeout=20)


def test_the_cri_client_speaks_to_a_real_containerd(tmp_path):
    """The few runtime.v1 messages the agent builds are the ones containerd's CRI service reads and answers."""
    if shutil.which("containerd") is None:
        pytest.fail("containerd is not installed (scripts/install.sh --test installs it)")
    with containerd(tmp_path) as socket:
        runtime = connect_runtime(socket)
        assert isinstance(runtime, CriApi)
        try:
            assert runtime.names("0" * 64) is None  # NOT_FOUND: not a failure
            assert runtime.matching("team-a", {"app": "vllm"}) == set()
        finally:
            runtime.close()
    assert connect_runtime(str(tmp_path / "nothing.sock")) is None


# -- real containers ----------------------------------------------------------------------------------
PODMAN = ["podman", "--cgroup-manager=cgroupfs", "--events-backend=file", "--runtime=runc"]
PODS = {"team-a": ("vllm-a-7d9f", "server"), "team-b": ("vllm-b-5c2e", "engine")}


def _podman(*args: str, check: bool = True) -> str:
    return subprocess.run([*PODMAN, *args], check=check, capture_output=True, text=True, timeout=120).stdout.strip()


@contextmanager
def podman_api(tmp: Path) -> Iterator[str]:
    """podman's Docker-compatible API on a socket of the test's own."""
    socket = tmp / "podman.sock"
    service = subprocess.Popen([*PODMAN, "system", "service", "--time=0", f"unix://{socket}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: socket.is_socket() and DockerApi(str(socket)).answers(), timeout=30)
        yield str(socket)
    finally:
        service.terminate()
        service.wait(timeout=20)


@contextmanager
def pod_container(namespace: str, pod: str, container: str, host_port: int) -> Iterator[str]:
    """A container labelled as the kubelet labels a pod's container, serving HTTP on port 8000 in a network
    namespace of its own (slirp4netns), published on the host's `host_port`. The host's root is its image
    (an overlay: nothing it writes reaches the host), so no registry is needed."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    name = f"tokenprobe-test-{pod}"
    _podman("rm", "-f", name, check=False)
    container_id = _podman(
        "run", "-d", "--name", name, "--ulimit", f"nofile={hard}:{hard}", "--ulimit", "nproc=32768:32768",
        "--network", "slirp4netns", "-p", f"127.0.0.1:{host_port}:8000",
        "--label", f"io.kubernetes.pod.namespace={namespace}", "--label", f"io.kubernetes.pod.name={pod}",
        "--label", f"io.kubernetes.container.name={container}",
        "--label", "app=vllm", "--rootfs", "/:O",
        "/usr/bin/python3", "-m", "http.server", "8000", "--bind", "0.0.0.0", "--directory", "/usr/share")
    try:
        wait_for_port(host_port)
        yield container_id
    finally:
        _podman("rm", "-f", "-t", "1", name, check=False)


def podman_unavailable() -> str | None:
    if shutil.which("podman") is None or shutil.which("slirp4netns") is None:
        return "podman and slirp4netns are not installed (scripts/install.sh installs them for the tests)"
    return None


@pytest.mark.kernel
def test_two_pods_on_one_port_are_two_named_servers(tmp_path):
    require_kernel()
    missing = podman_unavailable()
    if missing:
        pytest.fail(missing)
    metrics_port = free_port()
    with ExitStack() as stack:
        socket = stack.enter_context(podman_api(tmp_path))
        published = {}
        for namespace, (pod, container) in PODS.items():
            host_port = free_port()
            container_id = stack.enter_context(pod_container(namespace, pod, container, host_port))
            published[host_port] = (namespace, pod, container, container_id)
        assert isinstance(connect_runtime(socket), DockerApi)
        assert_gpu_memory_is_named_by_pod(socket, published)
        traced = stack.enter_context(agent(tmp_path, "--runtime-socket", socket, "--metrics-port", str(metrics_port),
                                           "--analyze-every", "0", ports=[8000]))
        # A second agent targets one pod by namespace and label alone: no port, no pid.
        (tmp_path / "selected").mkdir()
        selected = stack.enter_context(agent(tmp_path / "selected", "--runtime-socket", socket, "--namespace",
                                             "team-a", "--pod-selector", "app=vllm", "--analyze-every", "0",
                                             ports=[], ready="pods selected: tracing processes"))
        for host_port in published:
            for _ in range(3):
                with urllib.request.urlopen(f"http://127.0.0.1:{host_port}/", timeout=10) as response:
                    response.read()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            if all(f'pod="{pod}"' in metrics for pod, _ in PODS.values()):
                break
            time.sleep(0.5)
        assert traced.stop() == 0, traced.log()
        assert selected.stop() == 0, selected.log()
    assert {(row["namespace"], row["pod"]) for row in read_rows(selected.store_url)} == {("team-a", PODS["team-a"][0])}
    rows = read_rows(traced.store_url)
    by_pod = {}
    for row in rows:
        assert row["server_port"] == 8000
        by_pod.setdefault((row["namespace"], row["pod"], row["container"], row["container_id"]), []).append(row)
    assert sorted(by_pod) == sorted(published.values()), traced.log()
    assert all(len(served) == 3 for served in by_pod.values())
    for namespace, (pod, container) in PODS.items():
        assert (f'namespace="{namespace}"' in metrics and f'pod="{pod}"' in metrics
                and f'container="{container}"' in metrics), metrics


def assert_gpu_memory_is_named_by_pod(socket: str, published: dict) -> None:
    """NVML names the processes holding a GPU's memory by pid (no GPU here: the pid of each container's
    server stands for one); the server_gpus row of that pid names its pod and container."""
    resolver = IdentityResolver(connect_runtime(socket))
    try:
        for namespace, pod, container, container_id in published.values():
            pid = int(_podman("inspect", "-f", "{{.State.Pid}}", container_id))
            wait_until(lambda: resolver.of(pid).pod == pod, timeout=10)
            row = server_gpu_row(ServerGpu(pid, 0, "GPU-0", "GPU-0", "nvml"), time.time_ns(), "node",
                                 lambda process: resolver.of(process).fields())
            assert (row["namespace"], row["pod"], row["container"]) == (namespace, pod, container)
        host = server_gpu_row(ServerGpu(os.getpid(), 0, "GPU-0", "GPU-0", "nvml"), time.time_ns(), "node",
                              lambda process: resolver.of(process).fields())
        assert (host["namespace"], host["pod"], host["container"]) == ("", "", "")
    finally:
        resolver.stop()
