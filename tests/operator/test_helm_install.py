"""`helm install`, `helm upgrade` and `helm uninstall` of charts/ketch on a real cluster of the
test's own (the chart creates cluster-wide objects: CRDs, a ClusterRole, an operator serving
every namespace), as docs/helm.md shows them: the operator rolls out, reconciles
examples/mixed.yaml to Ready, rolls again on an upgrade and keeps reconciling, and the uninstall
leaves what docs/helm.md says it leaves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator

import operator_rbac
import pytest
from helmchart import CHART, helm

import procs

pytestmark = pytest.mark.timeout(900)
NS = "ketch-system"


@pytest.fixture
def cluster_env() -> Iterator[dict[str, str]]:
    if not operator_rbac.with_node():
        pytest.skip("KETCH_TEST_NODE_AGENT=0 starts no node: the operator's pods cannot run")
    with operator_rbac.own_cluster("installs cluster-wide objects") as kube:
        yield {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}


def kubectl(env: dict[str, str], *args: str, check: bool = True, timeout: float = 300) -> str:
    result = subprocess.run(
        ["kubectl", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}:\n{result.stderr}"
    return result.stdout if result.returncode == 0 else ""


def ok_helm(env: dict[str, str], *args: str) -> str:
    result = helm(*args, env=env, timeout=300)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def get(env: dict[str, str], *args: str) -> dict:
    return json.loads(kubectl(env, "get", *args, "-o", "json"))


def exists(env: dict[str, str], *args: str) -> bool:
    result = subprocess.run(
        ["kubectl", "get", *args, "-o", "name"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 or "NotFound" in result.stderr, result.stderr
    return result.returncode == 0


def rolled_out(env: dict[str, str]) -> dict:
    kubectl(env, "-n", NS, "rollout", "status", "deployment/ketch-operator", "--timeout", "240s")
    return get(env, "-n", NS, "deployment", "ketch-operator")


def ready(env: dict[str, str], namespace: str, name: str = "tiny") -> None:
    kubectl(
        env, "-n", namespace, "wait", "--for", "condition=Ready", "--timeout", "300s",
        f"inferenceservice/{name}",
    )  # fmt: skip


def test_install_upgrade_uninstall_cluster_wide(cluster_env, tmp_path):
    env = cluster_env
    ok_helm(env, "install", "ketch", str(CHART), "-n", NS, "--create-namespace")
    first = rolled_out(env)
    assert first["status"]["availableReplicas"] == 2
    assert exists(env, "clusterkopfpeering", "ketch-operator")

    kubectl(env, "apply", "-n", "default", "-f", "examples/mixed.yaml")
    ready(env, "default")

    # an upgrade with changed values rolls the operator, and updates the InferenceService CRD
    # (a template, not crds/): here a chart whose CRD carries one more label
    newer = tmp_path / "ketch"
    shutil.copytree(CHART, newer, symlinks=False)
    crd_file = newer / "files" / "inferenceservices.serving.ketch.dev.yaml"
    text = crd_file.read_text()
    assert "\n  labels:\n" in text
    crd_file.write_text(
        text.replace("\n  labels:\n", "\n  labels:\n    example.com/chart: newer\n", 1)
    )
    ok_helm(
        env, "upgrade", "ketch", str(newer), "-n", NS, "--reuse-values",
        "--set", "logLevel=DEBUG", "--set", "resources.limits.memory=768Mi",
    )  # fmt: skip
    second = rolled_out(env)
    assert second["metadata"]["generation"] > first["metadata"]["generation"]
    container = second["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["--log-level", "DEBUG"]
    assert container["resources"]["limits"]["memory"] == "768Mi"
    pods = get(env, "-n", NS, "pods", "-l", "app.kubernetes.io/name=ketch-operator")["items"]
    running = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert running and all(
        p["spec"]["containers"][0]["args"] == ["--log-level", "DEBUG"] for p in running
    )
    crd = get(env, "crd", "inferenceservices.serving.ketch.dev")["metadata"]
    assert crd["labels"]["example.com/chart"] == "newer"
    assert crd["annotations"]["helm.sh/resource-policy"] == "keep"
    history = json.loads(ok_helm(env, "history", "ketch", "-n", NS, "-o", "json"))
    assert [h["revision"] for h in history] == [1, 2]

    # ...which keeps reconciling: a spec change reaches the engine Deployment, and Ready again
    kubectl(
        env, "-n", "default", "patch", "inferenceservice", "tiny", "--type", "merge",
        "-p", '{"spec": {"roles": {"mixed": {"replicas": 1}}}}',
    )  # fmt: skip

    def scaled() -> bool:
        return get(env, "-n", "default", "deployment", "tiny-mixed")["spec"]["replicas"] == 1

    procs.wait_for(scaled, 120, "the upgraded operator to scale tiny-mixed to 1", interval=1)
    ready(env, "default")

    # uninstall removes the operator and its RBAC and peering object; leaves the CRDs (the
    # InferenceService one by helm.sh/resource-policy=keep, kopf's from crds/), the namespace
    # (--create-namespace made it) and so every InferenceService and its engine pods
    ok_helm(env, "uninstall", "ketch", "-n", NS, "--wait")
    assert not exists(env, "-n", NS, "deployment", "ketch-operator")
    assert not exists(env, "-n", NS, "serviceaccount", "ketch-operator")
    assert not exists(env, "clusterrole", "ketch-operator")
    assert not exists(env, "clusterrolebinding", "ketch-operator")
    assert not exists(env, "clusterkopfpeering", "ketch-operator")
    for crd in (
        "inferenceservices.serving.ketch.dev",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    ):
        assert exists(env, "crd", crd), crd
    assert exists(env, "namespace", NS)
    assert exists(env, "-n", "default", "inferenceservice", "tiny")
    assert exists(env, "-n", "default", "deployment", "tiny-mixed")
    kubectl(env, "delete", "-n", "default", "-f", "examples/mixed.yaml", "--wait=true")


def test_install_single_namespace(cluster_env):
    env = cluster_env
    kubectl(env, "create", "namespace", "llm")
    ok_helm(
        env, "install", "ketch", str(CHART), "-n", NS, "--create-namespace",
        "--set", "watchNamespace=llm",
    )  # fmt: skip
    rolled_out(env)
    assert exists(env, "-n", "llm", "kopfpeering", "ketch-operator")
    assert exists(env, "-n", "llm", "rolebinding", "ketch-operator")
    assert not exists(env, "clusterrole", "ketch-operator")
    kubectl(env, "apply", "-n", "llm", "-f", "examples/mixed.yaml")
    ready(env, "llm")
    kubectl(env, "delete", "-n", "llm", "-f", "examples/mixed.yaml", "--wait=true")
    ok_helm(env, "uninstall", "ketch", "-n", NS, "--wait")
    assert not exists(env, "-n", "llm", "role", "ketch-operator")
