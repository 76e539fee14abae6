"""The agent image, built from deploy/Dockerfile with podman (deploy/image.py: offline, on a debootstrapped
base where no registry answers), and run as the DaemonSet runs it.

The DaemonSet's container is read from deploy/kubernetes/daemonset.yaml, not restated: its capabilities, user,
seccomp profile, read-only root, host PID namespace, host paths, emptyDirs and ConfigMap become podman's flags.
Two things stand in for a cluster: the pod's network is slirp4netns (its own namespace, like a pod's, with the
host's loopback reachable as 10.0.2.2), and host paths the agent writes get a folder of the test.

The image is built once per session; podman's cache keeps a rebuild of unchanged layers to seconds. Where
podman is missing these tests skip, except under TOKENPROBE_REQUIRE_KERNEL=1 (CI), where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from tokenprobe.refserver.loadgen import LoadConfig, burst
from tokenprobe.refserver.tls import make_self_signed_cert

from tests.kernel_harness import REQUIRE_KERNEL, nginx_tls_proxy, read_rows, reference_server, require_kernel
from tests.support import free_port

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
DAEMONSET = KUBERNETES / "daemonset.yaml"
SECCOMP_PROFILES = ROOT / "deploy" / "seccomp"
IMAGE_TAG = "localhost/tokenprobe/agent:test"
MAX_IMAGE_BYTES = 600_000_000
# slirp4netns: the container's address, and the host's loopback as the container sees it.
POD_IP, HOST_FROM_POD = "10.0.2.100", "10.0.2.2"
# Never in the agent's image: the embedded engine, the dashboard, the reference server and its HTTP stacks,
# test tools.
NOT_IN_IMAGE = ("chdb", "streamlit", "altair", "tokenprobe.refserver", "uvicorn", "hypercorn", "pytest",
                "playwright", "hypothesis", "pip")


def load_image_tool():
    spec = importlib.util.spec_from_file_location("deploy_image", ROOT / "deploy" / "image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


image_tool = load_image_tool()


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory) -> dict[str, str]:
    missing = [tool for tool in ("podman", "runc", "slirp4netns", "debootstrap") if not shutil.which(tool)]
    if missing:
        reason = f"{', '.join(missing)} not installed (scripts/install.sh --test installs them)"
        if REQUIRE_KERNEL:
            pytest.fail(f"container tests are required (TOKENPROBE_REQUIRE_KERNEL=1) but {reason}")
        pytest.skip(reason)
    return image_tool.podman_environment(tmp_path_factory.mktemp("podman"))


@pytest.fixture(scope="session")
def agent_image(podman_env, tmp_path_factory) -> str:
    image_tool.build(IMAGE_TAG, podman_env, tmp_path_factory.mktemp("image-build"))
    return IMAGE_TAG


def run_in_image(env: dict[str, str], image: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", "run", "--rm", "--network", "none", "--entrypoint", command[0], image,
                           *command[1:]], env=env, capture_output=True, text=True, timeout=300)


def test_the_image_holds_the_agent_only(podman_env, agent_image):
    size = int(subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", agent_image], env=podman_env,
                              capture_output=True, text=True, check=True).stdout)
    assert size <= MAX_IMAGE_BYTES, f"the agent image is {size / 1e6:.0f} MB"
    probe = ("import importlib.util, json, sys\n"
             "print(json.dumps({name: importlib.util.find_spec(name) is not None for name in sys.argv[1:]}))")
    found = json.loads(run_in_image(podman_env, agent_image, "python3", "-c", probe, "bcc", "tokenprobe.agent",
                                    *NOT_IN_IMAGE).stdout)
    assert found == {"bcc": True, "tokenprobe.agent": True, **{name: False for name in NOT_IN_IMAGE}}
    # The BPF sources the agent compiles at start, every one of them.
    listing = ("import importlib.resources\n"
               "print(sorted(p.name for p in importlib.resources.files('tokenprobe.bpf').iterdir()"
               " if p.suffix in ('.c', '.h')))")
    shipped = run_in_image(podman_env, agent_image, "python3", "-c", listing).stdout
    sources = sorted(path.name for pattern in ("*.c", "*.h") for path in (ROOT / "bpf").glob(pattern))
    assert shipped.strip() == str(sources)
    # The agent's command loads; with a store elsewhere it imports nothing of the embedded engine.
    help_run = run_in_image(podman_env, agent_image, "python3", "-X", "importtime", "-m", "tokenprobe", "agent",
                            "--help")
    assert help_run.returncode == 0 and "--store URL" in help_run.stdout, help_run.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in help_run.stderr.splitlines() if "|" in line}
    assert "tokenprobe.store.client" in imported and not {"chdb", "tokenprobe.store.server"} & imported


# --------------------------------------------------------------------------- the DaemonSet, as shipped


def agent_pod(name: str = "agent") -> tuple[dict, dict]:
    """The DaemonSet's pod spec and its container (or init container) ``name``."""
    pod = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]
    (container,) = [container for container in pod["containers"] + pod["initContainers"] if container["name"] == name]
    return pod, container


def seccomp_options(profile: dict) -> list[str]:
    """podman's options for a container's seccompProfile. A Localhost profile is the file the manifests
    ship, as the kubelet would find it under its seccomp folder; RuntimeDefault is podman's own default
    (like the older runtimes' defaults, it refuses bpf() without CAP_SYS_ADMIN: DESIGN.md)."""
    if profile["type"] == "Localhost":
        return ["--security-opt", f"seccomp={SECCOMP_PROFILES / Path(profile['localhostProfile']).name}"]
    assert profile["type"] == "RuntimeDefault", profile
    return []


def podman_run_args(pod: dict, container: dict, work: Path, env: dict[str, str]) -> list[str]:
    """`podman run` options that hold the container to its manifest: security context, namespaces, volumes."""
    security = container["securityContext"]
    assert not security.get("privileged") and not pod.get("hostNetwork")
    args = ["--user", str(security["runAsUser"]), "--cap-drop", "ALL"]
    added = security["capabilities"].get("add", [])
    args += [arg for capability in added for arg in ("--cap-add", f"CAP_{capability}")]
    args += seccomp_options(security["seccompProfile"])
    if not security["allowPrivilegeEscalation"]:
        args += ["--security-opt", "no-new-privileges"]
    if security["readOnlyRootFilesystem"]:
        args += ["--read-only", "--read-only-tmpfs=false"]
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:  # the kernel holds the container to it, as the kubelet's cgroup would
        args += ["--memory", str(quantity(limits["memory"]))]
    if "cpu" in limits:
        args += ["--cpus", str(cpus(limits["cpu"]))]
    if pod.get("hostPID"):
        args += ["--pid", "host"]
    args += ["--network", "slirp4netns:allow_host_loopback=true"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume, target = volumes[mount["name"]], mount["mountPath"]
        read_only = ":ro" if mount.get("readOnly") else ""
        if volume.get("hostPath", {}).get("type") == "Directory":  # the node's own: tracefs, headers
            args += ["-v", f"{volume['hostPath']['path']}:{target}{read_only}"]
        elif "hostPath" in volume or "emptyDir" in volume:
            # The agent's own state (a host folder it may create) or scratch: a folder of the test stands in.
            folder = work / mount["name"]
            folder.mkdir()
            args += ["-v", f"{folder}:{target}{read_only}"]
        elif "configMap" in volume:
            folder = work / mount["name"]
            folder.mkdir()
            for key, text in config_map(volume["configMap"]["name"]).items():
                (folder / key).write_text(text)
            args += ["-v", f"{folder}:{target}{read_only}"]
        else:
            raise AssertionError(f"volume {volume} has no podman equivalent here")
    for name, value in env.items():
        args += ["-e", f"{name}={value}"]
    return args


def config_map(name: str) -> dict[str, str]:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document["kind"] == "ConfigMap" and document["metadata"]["name"] == name:
                return document["data"]
    raise AssertionError(f"no ConfigMap {name} in {KUBERNETES}")


def container_environment(container: dict, store_url: str) -> dict[str, str]:
    """The manifest's environment, with what Kubernetes would fill in: the Secret and the downward API."""
    downward = {"status.podIP": POD_IP, "spec.nodeName": socket.gethostname()}
    env = {}
    for variable in container["env"]:
        source = variable.get("valueFrom", {})
        if "secretKeyRef" in source:
            assert source["secretKeyRef"]["name"] == "tokenprobe-store-url"
            env[variable["name"]] = store_url
        elif "fieldRef" in source:
            env[variable["name"]] = downward[source["fieldRef"]["fieldPath"]]
        else:
            env[variable["name"]] = variable["value"]
    return env


def targets_only(args: str, ports: list[int]) -> str:
    """The ConfigMap's agent.args with its example --port lines replaced by the test's servers."""
    kept = [line for line in args.splitlines() if line.strip() and not line.startswith("--port=")]
    return "\n".join([*kept, *(f"--port={port}" for port in ports)]) + "\n"


def drive(port: int, n: int = 12) -> set[str]:
    config = LoadConfig(port=port, tls=True, requests=n, duration_s=None, max_tokens=(2, 6), seed=5)
    result = burst(config, n=n, concurrency=3, per_connection=2)
    assert not result.errors, result.errors
    return {record.response_id for record in result.records}


def test_the_daemonset_as_shipped_reads_tls_from_cpython_and_nginx(podman_env, agent_image, tmp_path):
    require_kernel()
    from tokenprobe.store.embedded import open_store
    from tokenprobe.store.server import StoreServer

    pod, container = agent_pod()
    store_port, token = free_port(), uuid.uuid4().hex
    store_url = f"http://default:{token}@{HOST_FROM_POD}:{store_port}/"
    env = container_environment(container, store_url)
    work = tmp_path / "pod"
    work.mkdir()
    args = podman_run_args(pod, container, work, env)
    # Kubernetes expands $(VAR) in args from the container's environment; podman does not.
    command = [re.sub(r"\$\((\w+)\)", lambda match: env[match[1]], arg) for arg in container["args"]]
    cert, key = make_self_signed_cert(tmp_path)
    name = f"tokenprobe-agent-{uuid.uuid4().hex[:8]}"
    with open_store(f"chdb://{tmp_path / 'store'}", serve=False) as owner, \
            reference_server(tmp_path, tls=True) as (cpython_port, _), \
            reference_server(tmp_path) as (backend, _), nginx_tls_proxy(tmp_path, backend, cert, key) as nginx_port:
        server = StoreServer(str(tmp_path / "store"), token, port=store_port)
        (work / "config" / "agent.args").write_text(targets_only(config_map("tokenprobe-agent")["agent.args"],
                                                                 [cpython_port, nginx_port]))
        log_path = tmp_path / "agent.log"
        with open(log_path, "w") as log:
            agent = subprocess.Popen(["podman", "run", "--rm", "--name", name, *args, agent_image, *command],
                                     env=podman_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300  # BCC compiles in the container: a minute or more on a busy machine
            while "tracing ports" not in log_path.read_text(errors="replace"):
                assert agent.poll() is None, log_path.read_text(errors="replace")
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")
                time.sleep(0.5)
            sent = {"cpython": drive(cpython_port), "nginx": drive(nginx_port)}
            memory = agent_memory(podman_env, name)
            subprocess.run(["podman", "stop", "--time", "60", name], env=podman_env, check=True,
                           capture_output=True)
            assert agent.wait(timeout=120) == 0, log_path.read_text(errors="replace")
        finally:
            if agent.poll() is None:
                subprocess.run(["podman", "kill", name], env=podman_env, capture_output=True)
                agent.wait(timeout=60)
            server.close()
    log = log_path.read_text(errors="replace")
    rows = read_rows(f"chdb://{tmp_path / 'store'}")
    assert "OpenSSL probed: -" not in log, log
    for server_name, port in (("cpython", cpython_port), ("nginx", nginx_port)):
        seen = {row["response_id"] for row in rows if row["server_port"] == port and row["tls"]}
        assert sent[server_name] <= seen, (server_name, sent[server_name] - seen, log[-4000:])
    # The manifest's memory limit holds the agent's peak (the BPF compile) and its request the steady state.
    resources = container["resources"]
    print(f"agent memory in the image: peak {memory['VmHWM'] >> 20} MiB, now {memory['VmRSS'] >> 20} MiB")
    assert memory["VmHWM"] < quantity(resources["limits"]["memory"]), memory
    assert memory["VmRSS"] < quantity(resources["requests"]["memory"]), memory


def agent_memory(env: dict[str, str], name: str) -> dict[str, int]:
    """Peak and current resident memory of the container's agent, in bytes, from the host's /proc."""
    pid = subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}", name], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    status = Path(f"/proc/{pid}/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)[1]) << 10
            for key in ("VmHWM", "VmRSS")}


def cpus(text: str) -> float:
    """A Kubernetes CPU quantity ("1", "250m") in CPUs."""
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def quantity(text: str) -> int:
    """A Kubernetes memory quantity (binary suffixes, as the manifests write them) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


# Runs in the agent's container: process_vm_writev() and ptrace(PTRACE_ATTACH) on a host process, as a
# compromised agent holding CAP_SYS_PTRACE would try; prints each call's errno (0: it worked).
INTO_ANOTHER_PROCESS = r"""
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
pid = int(sys.argv[1])
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
byte = ctypes.create_string_buffer(1)
local = iovec(ctypes.cast(byte, ctypes.c_void_p), 1)
remote = iovec(0x10000, 1)  # an address the call never reaches when the filter refuses it
seen = {}
seen["process_vm_writev"] = 0 if libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) >= 0 \
    else ctypes.get_errno()
PTRACE_ATTACH = 16
seen["ptrace"] = 0 if libc.ptrace(PTRACE_ATTACH, pid, 0, 0) == 0 else ctypes.get_errno()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("shipped_profile", [True, False], ids=["shipped-profile", "without-it"])
def test_the_shipped_profile_keeps_the_agent_out_of_other_processes(podman_env, agent_image, tmp_path,
                                                                    shipped_profile):
    """With the manifest's CAP_SYS_PTRACE and host PID namespace, only the seccomp profile stands between the
    agent and every process of the node; without it (unconfined) the same calls go through."""
    pod, container = agent_pod()
    work = tmp_path / "pod"
    work.mkdir()
    args = podman_run_args(pod, container, work, {})
    if not shipped_profile:
        shipped = seccomp_options(container["securityContext"]["seccompProfile"])[-1]
        args[args.index(shipped)] = "seccomp=unconfined"
    victim = subprocess.Popen(["sleep", "300"])
    try:
        result = subprocess.run(["podman", "run", "--rm", *args, "--entrypoint", "python3", agent_image, "-c",
                                 INTO_ANOTHER_PROCESS, str(victim.pid)],
                                env=podman_env, capture_output=True, text=True, timeout=120)
    finally:
        victim.kill()
        victim.wait()
    seen = json.loads(result.stdout)
    EPERM, EFAULT = 1, 14
    if shipped_profile:
        assert seen == {"process_vm_writev": EPERM, "ptrace": EPERM}
    else:  # the kernel let the call in: it wrote nowhere only because the address is unmapped
        assert seen == {"process_vm_writev": EFAULT, "ptrace": 0}


def test_the_init_container_installs_the_profile_where_the_kubelet_reads_it(podman_env, agent_image, tmp_path):
    """The init container, run as the manifest says (no capability, the runtime's default profile, read-only
    root), copies the profile from its ConfigMap into the kubelet's folder: root-owned, as on a node."""
    pod, init = agent_pod("seccomp-profile")
    work = tmp_path / "pod"
    work.mkdir()
    args = podman_run_args(pod, init, work, {})
    (kubelet_folder,) = [folder for folder in work.iterdir() if folder.name == "kubelet-seccomp"]
    kubelet_folder.chmod(0o755)
    result = subprocess.run(["podman", "run", "--rm", *args, "--entrypoint", init["command"][0], agent_image,
                             *init["command"][1:]], env=podman_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    installed = kubelet_folder / "tokenprobe-agent.json"
    assert installed.read_text() == (SECCOMP_PROFILES / "tokenprobe-agent.json").read_text()
