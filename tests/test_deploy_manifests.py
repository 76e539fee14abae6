"""deploy/: Kubernetes manifests validated offline (kubernetes-validate, strict), the Operator resources
checked against what they refer to, the generated files current, the cluster DDL complete and real
ClickHouse SQL, the Dockerfile and the Alertmanager example sound."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from tokenprobe.contract import registry
from tokenprobe.contract.tables import Table, View

from tests.test_alert_rules import RULES, promtool, require_binary

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
# The oldest Kubernetes still widely run, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29.0", latest_version())
CRD_KINDS = {"PrometheusRule", "ServiceMonitor"}  # not in kubernetes-validate's schemas: checked below
AGENT_CAPABILITIES = {"BPF", "PERFMON", "SYS_ADMIN", "SYS_RESOURCE", "SYS_PTRACE"}
SECCOMP_PROFILE = DEPLOY / "seccomp" / "tokenprobe-agent.json"
# The system call tables of x86-64 and of its 32-bit x86 ABI, both in the profile (Debian's linux-libc-dev).
SYSCALL_TABLES = [Path(f"/usr/include/x86_64-linux-gnu/asm/unistd_{bits}.h") for bits in (64, 32)]


def load_render():
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_render()


def manifests() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        found += [(path.name, document) for document in yaml.safe_load_all(path.read_text()) if document]
    return found


def resource(kind: str, name: str | None = None) -> dict:
    (document,) = [document for _, document in manifests()
                   if document["kind"] == kind and name in (None, document["metadata"]["name"])]
    return document


# --------------------------------------------------------------------------- Kubernetes schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_core_manifest_validates_strictly(version):
    validated = []
    for name, document in manifests():
        if document["kind"] in CRD_KINDS or document["apiVersion"].startswith("kustomize.config.k8s.io/"):
            continue
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{name}: {document['kind']} is invalid for Kubernetes {version} at {path}: {error.message}")
        validated.append(document["kind"])
    assert sorted(validated) == ["ConfigMap", "ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "Service",
                                 "ServiceAccount"]


def test_strict_validation_catches_a_misspelt_field():
    daemonset = resource("DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostPid"] = True  # hostPID, misspelt: silently ignored by apply
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest():
    (kustomization,) = [d for _, d in manifests() if d["kind"] == "Kustomization"]
    listed = set(kustomization["resources"])
    assert listed == {path.name for path in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert kustomization["resources"][0] == "namespace.yaml"  # created first
    assert {image["name"] for image in kustomization["images"]} == {agent_container()["image"].split(":")[0]}


# --------------------------------------------------------------------------- the agent DaemonSet


def agent_container() -> dict:
    (container,) = resource("DaemonSet")["spec"]["template"]["spec"]["containers"]
    return container


def test_daemonset_runs_on_gpu_nodes_in_the_host_pid_namespace():
    pod = resource("DaemonSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork")
    assert pod["automountServiceAccountToken"] is False


def test_daemonset_holds_the_fewest_capabilities_and_is_not_privileged():
    security = agent_container()["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == AGENT_CAPABILITIES
    # Every capability granted, and the ones left out on purpose, are explained in docs/deploy.md.
    readme = (ROOT / "docs" / "deploy.md").read_text()
    for capability in AGENT_CAPABILITIES | {"SYS_ADMIN", "DAC_READ_SEARCH", "DAC_OVERRIDE"}:
        assert f"`CAP_{capability}`" in readme, capability


def test_daemonset_runs_the_agent_under_the_shipped_seccomp_profile_which_its_init_container_installs():
    pod = resource("DaemonSet")["spec"]["template"]["spec"]
    assert agent_container()["securityContext"]["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": "profiles/tokenprobe-agent.json"}
    assert "Unconfined" not in yaml.safe_dump(pod)
    # The init container copies the profile from its ConfigMap (rendered from the file) into the kubelet's
    # profiles folder, holding no capability at all.
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in init["volumeMounts"]}
    (source,) = [name for name in mounts if "configMap" in volumes[name]]
    (target,) = [name for name in mounts if "hostPath" in volumes[name]]
    assert volumes[source]["configMap"]["name"] == resource("ConfigMap", "tokenprobe-seccomp")["metadata"]["name"]
    assert volumes[target]["hostPath"]["path"] == "/var/lib/kubelet/seccomp/profiles"
    assert init["command"] == ["cp", *(f"{mounts[name]}/tokenprobe-agent.json" for name in (source, target))]
    profile = resource("ConfigMap", "tokenprobe-seccomp")["data"]["tokenprobe-agent.json"]
    assert profile == SECCOMP_PROFILE.read_text()


def seccomp_rules() -> dict[str, dict]:
    """Each system call the shipped profile names -> its rule."""
    return {name: rule for rule in json.loads(SECCOMP_PROFILE.read_text())["syscalls"] for name in rule["names"]}


def test_the_localhost_seccomp_profile_allows_what_bcc_needs_and_denies_other_processes():
    profile = json.loads(SECCOMP_PROFILE.read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    rules = seccomp_rules()
    # BCC: load programs and maps, open perf events (tracepoints, uprobes), map and drive them.
    for needed in ("bpf", "perf_event_open", "mmap", "ioctl", "setrlimit", "prlimit64", "openat", "readlinkat"):
        assert needed not in rules, needed
    # CAP_SYS_PTRACE is held for /proc access checks only: the calls it would open into other processes are shut.
    for denied in ("ptrace", "process_vm_writev", "pidfd_getfd", "open_by_handle_at", "mount", "setns", "unshare"):
        assert rules[denied]["action"] == "SCMP_ACT_ERRNO" and rules[denied]["errnoRet"] == 1, denied
    # clone3 hides its flags from seccomp: ENOSYS sends glibc to clone(), where CLONE_NEWUSER is refused.
    assert rules["clone3"]["errnoRet"] == 38
    (new_user_namespace,) = rules["clone"]["args"]
    assert new_user_namespace == {"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}
    assert all(rule.get("comment") for rule in profile["syscalls"] if rule["names"] != ["clone3"])


def test_the_localhost_seccomp_profile_names_only_real_system_calls():
    if not all(table.exists() for table in SYSCALL_TABLES):
        pytest.skip(f"{SYSCALL_TABLES} are missing (apt-get install linux-libc-dev)")
    known = {name for table in SYSCALL_TABLES
             for name in re.findall(r"^#define __NR_(\w+) \d+$", table.read_text(), re.MULTILINE)}
    assert {"bpf", "perf_event_open", "clone3", "umount"} <= known  # umount: 32-bit x86 only
    assert set(seccomp_rules()) - known == set()


def test_daemonset_mounts_what_bcc_needs_from_the_host():
    pod = resource("DaemonSet")["spec"]["template"]["spec"]
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in pod["volumes"] if "hostPath" in volume}
    mounts = {mount["name"]: mount for mount in agent_container()["volumeMounts"]}
    for host_path in ("/sys/kernel/tracing", "/lib/modules", "/usr/src"):
        (name,) = [name for name, path in host_paths.items() if path == host_path]
        assert mounts[name]["mountPath"] == host_path and mounts[name]["readOnly"] is True
    # Written by the agent: the fingerprint key and the spool, kept on the node.
    (state,) = [name for name, path in host_paths.items() if path == "/var/lib/tokenprobe"]
    assert not mounts[state].get("readOnly")
    env = {variable["name"]: variable for variable in agent_container()["env"]}
    assert env["HOME"]["value"] == mounts[state]["mountPath"]


def test_daemonset_limits_resources_and_is_ready_when_it_serves_metrics():
    container = agent_container()
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/metrics"
    (port,) = [port for port in container["ports"] if port["name"] == probe["port"]]
    assert f"--metrics-port={port['containerPort']}" in agent_args()


def test_metrics_are_served_on_the_pod_ip_only_and_only_prometheus_may_reach_them():
    container = agent_container()
    env = {variable["name"]: variable for variable in container["env"]}
    # Kubernetes expands $(POD_IP) in args, never inside the ConfigMap's file: the flag must be here.
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "--metrics-host=$(POD_IP)" in container["args"]
    assert not any(arg.startswith("--metrics-host") for arg in agent_args())
    policy = resource("NetworkPolicy")
    pod_labels = resource("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    # One peer holding both selectors: Prometheus pods in the monitoring namespace (two peers would admit
    # every pod of that namespace, and every Prometheus anywhere).
    (peer,) = rule["from"]
    assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    (metrics_port,) = container["ports"]
    assert rule["ports"] == [{"port": metrics_port["name"], "protocol": "TCP"}]


def test_store_url_comes_from_a_secret_the_operator_creates_not_the_command_line():
    env = {variable["name"]: variable for variable in agent_container()["env"]}
    assert env["TOKENPROBE_STORE"]["valueFrom"]["secretKeyRef"] == {"name": "tokenprobe-store-url", "key": "url"}
    assert env["TOKENPROBE_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert not any("store" in arg for arg in agent_args() + agent_container()["args"])
    # No Secret is shipped (a placeholder password would be applied as is); the README says how to create it.
    assert "Secret" not in {document["kind"] for _, document in manifests()}
    assert not [path.name for path in DEPLOY.rglob("*") if path.is_file() and "CHANGE_ME" in path.read_text()]
    readme = (ROOT / "docs" / "deploy.md").read_text()
    assert re.search(r"kubectl -n tokenprobe create secret generic tokenprobe-store-url \\\n\s+"
                     r"--from-literal=url='https://", readme)


def agent_args() -> list[str]:
    return resource("ConfigMap", "tokenprobe-agent")["data"]["agent.args"].split()


def test_the_agent_command_line_accepts_the_configmap_arguments(tmp_path):
    from tokenprobe.cli.main import build_parser

    args_file = tmp_path / "agent.args"
    args_file.write_text(resource("ConfigMap", "tokenprobe-agent")["data"]["agent.args"])
    argument, *expanded = agent_container()["args"]
    assert argument == "@/etc/tokenprobe/agent.args"
    mounted = {m["name"]: m["mountPath"] for m in agent_container()["volumeMounts"]}
    assert argument.removeprefix("@").startswith(mounted["config"] + "/")
    pod_ip = "10.244.3.17"  # what Kubernetes puts in for $(POD_IP)
    parsed = build_parser().parse_args(["agent", f"@{args_file}", *(arg.replace("$(POD_IP)", pod_ip)
                                                                     for arg in expanded)])
    assert parsed.port == [8000]
    assert parsed.metrics_host == pod_ip


# --------------------------------------------------------------------------- Prometheus Operator resources


def test_service_monitor_scrapes_the_agents_through_their_service():
    service, monitor = resource("Service"), resource("ServiceMonitor")
    pod_labels = resource("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    # The Operator names the job after the Service: the name the rules select on.
    assert service["metadata"]["name"] == "tokenprobe-agent"
    assert 'job="tokenprobe-agent"' in RULES.read_text()


def test_prometheus_rule_carries_exactly_the_plain_rules_and_passes_promtool(tmp_path):
    rule = resource("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == resource("Namespace")["metadata"]["name"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    spec_as_rule_file = tmp_path / "spec.yml"
    spec_as_rule_file.write_text(yaml.safe_dump(rule["spec"]))
    result = promtool("check", "rules", str(spec_as_rule_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_files_are_current():
    stale = [path.name for path, text in render.rendered().items() if path.read_text() != text]
    assert not stale, f"{stale} are stale: run .venv/bin/python deploy/render.py"


# --------------------------------------------------------------------------- ClickHouse cluster DDL


def cluster_statements() -> list[str]:
    body = "\n".join(line for line in render.CLUSTER_SQL_FILE.read_text().splitlines() if not line.startswith("--"))
    return [statement.strip() for statement in body.split(";\n") if statement.strip()]


def test_cluster_ddl_has_every_table_with_every_column():
    text = render.CLUSTER_SQL_FILE.read_text()
    tables = render.registered_tables()
    assert {"requests", "gpu_samples", "engine_samples", "server_gpus"} <= set(tables)
    for name, ddl in tables.items():
        single_node = ddl.format(db="tokenprobe", ttl_days=30)
        if single_node.startswith("CREATE MATERIALIZED VIEW"):
            # Fires on each shard's inserts: it must read and write the shard-local tables.
            (view,) = [s for s in cluster_statements() if s.startswith(f"CREATE MATERIALIZED VIEW IF NOT EXISTS "
                                                                    f"tokenprobe.{name} ON CLUSTER")]
            assert "FROM tokenprobe.requests_local" in view and re.search(r"TO tokenprobe\.\w+_local ", view)
            continue
        (local,) = [statement for statement in cluster_statements()
                    if statement.startswith(f"CREATE TABLE IF NOT EXISTS tokenprobe.{name}_local ")]
        columns = [line.strip().rstrip(",") for line in single_node.splitlines() if line.strip().startswith("`")]
        assert columns, name
        for column in columns:
            assert column in local, f"{name}_local lacks {column}"
        assert re.search(r"ENGINE = Replicated\w*MergeTree\('/clickhouse/tables/\{shard\}/\{database\}/\{table\}', "
                         r"'\{replica\}'", local), name
        for clause in ("PARTITION BY", "ORDER BY", "TTL"):
            (single_clause,) = [line for line in single_node.splitlines() if line.startswith(clause)]
            assert single_clause in local, f"{name}_local: {clause} differs"
        assert re.search(rf"ENGINE = Distributed\('\{{cluster\}}', tokenprobe, {name}_local, \w+\(\w*\)\)", text), name


def test_a_table_the_renderer_cannot_replicate_is_refused_clearly():
    with pytest.raises(ValueError, match="expected 'CREATE TABLE IF NOT EXISTS db.scratch'"):
        render.cluster_table_ddl("scratch", "CREATE TABLE IF NOT EXISTS db.scratch\n(a UInt8)\nENGINE = Memory")


def test_every_table_declared_in_the_contract_is_registered_and_rendered():
    """A Table or View declared in any contract module but missing from the registry would never be created.
    The cluster gets all but what only an embedded store has (its views fed apart: contract/requests.py)."""
    declared = set()
    for path in (ROOT / "contract").glob("*.py"):
        module = importlib.import_module(f"tokenprobe.contract.{path.stem}")
        declared |= {value.name for value in vars(module).values() if isinstance(value, (Table, View))}
    embedded = {item.name for item in (*registry.tables(embedded=True), *registry.materialized_views(embedded=True))}
    assert declared == embedded
    assert embedded - set(render.registered_tables()) == {"requests_for_views"}


def test_cluster_ddl_is_clickhouse_sql_that_creates_working_tables(tmp_path):
    """Every statement parses in the real ClickHouse engine (chDB); the local tables and the shard-local
    GPU join are created and queried there, replication and cluster aside (they need Keeper and peers)."""
    from tokenprobe.store.embedded import open_store

    store = open_store(f"chdb://{tmp_path}/store", serve=False)
    try:
        for statement in cluster_statements():
            store.command("SELECT formatQuery({sql:String})", {"sql": statement})
        single_server = [
            re.sub(r"ENGINE = Replicated(\w*MergeTree)\('[^']*', '\{replica\}'(?:, )?",
                   r"ENGINE = \1(", statement.replace(" ON CLUSTER '{cluster}'", ""))
            for statement in cluster_statements() if "Distributed(" not in statement
        ]
        for statement in single_server:
            store.command(statement)
        assert store.query_rows("SELECT count() FROM tokenprobe.request_gpu_state_local") == [(0,)]
    finally:
        store.close()


# --------------------------------------------------------------------------- image and Alertmanager


def test_dockerfile_builds_the_agent_image_from_debian_with_bcc():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM debian:bookworm(-slim)? AS runtime$", dockerfile, re.MULTILINE)
    assert "python3-bpfcc" in dockerfile  # BCC's Python module and libbcc; bpfcc-tools' scripts are not needed
    assert "--system-site-packages" in dockerfile  # bcc is Debian's, for Debian's Python
    assert re.search(r'^ENTRYPOINT \["tokenprobe", "agent"\]$', dockerfile, re.MULTILINE)
    # Every folder the package is built from is copied into the build.
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top_folders = {folder.split("/")[0] for folder in package_dirs.values()} - {"."}
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", dockerfile, re.MULTILINE))
    assert top_folders <= copied, top_folders - copied
    # The root package's own files (the repository root is the package `tokenprobe`).
    assert re.search(r"^COPY __init__.py __main__.py /src/$", dockerfile, re.MULTILINE)


def test_alertmanager_example_is_a_valid_configuration():
    amtool = require_binary("amtool", "prometheus-alertmanager")
    result = subprocess.run([amtool, "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_check_mode_reports_stale_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(render, "CLUSTER_SQL_FILE", tmp_path / "cluster.sql")
    (tmp_path / "cluster.sql").write_text("-- edited by hand\n")
    assert render.main(["--check"]) == 1
    assert "cluster.sql is stale" in capsys.readouterr().err
    assert (tmp_path / "cluster.sql").read_text() == "-- edited by hand\n"
