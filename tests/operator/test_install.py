"""The install steps of docs/operator.md, run as written on a real cluster of the test's own.

Each install starts its own cluster (tests/kubecluster.py, ~10 s): the steps create cluster-wide
objects (CRDs, the ketch-system namespace, a ClusterRole bound to the operator's ServiceAccount,
an operator Deployment that would serve every namespace) that must not reach the session's
cluster, and each section is meant for a cluster without Ketch. With a node (the default) the
operator's pods run and `kubectl rollout status` waits for them as it would on any cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import operator_rbac
import pytest

import procs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operator.md"


def doc_commands(after: str) -> list[str]:
    """The first ```bash block after the line containing ``after``, joined continuation lines."""
    text = DOC.read_text()
    start = text.index(after)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block after {after!r} in {DOC}"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture
def fresh_cluster() -> Iterator[dict[str, str]]:
    """A new cluster per test; yields the environment kubectl runs in (its KUBECONFIG)."""
    with operator_rbac.own_cluster("installs cluster-wide objects") as kube:
        yield {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}


def run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert command.startswith("kubectl "), command
    return subprocess.run(
        command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize(
    "section", ["Apply the CRDs first", "To serve one namespace instead"], ids=["cluster", "ns"]
)
def test_documented_install_works(fresh_cluster, section):
    commands = doc_commands(section)
    waits = [c for c in commands if " rollout status " in c]
    node = operator_rbac.with_node()
    for command in commands:
        if command in waits and not node:
            continue  # no node: the operator's pods stay Pending
        result = run(command, fresh_cluster)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    got = run("kubectl -n ketch-system get deployment ketch-operator -o json", fresh_cluster)
    assert got.returncode == 0, got.stderr
    deployment = json.loads(got.stdout)
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == operator_rbac.OPERATOR

    def operator_pods() -> list[dict]:
        listed = run(
            "kubectl -n ketch-system get pods -l app.kubernetes.io/name=ketch-operator -o json",
            fresh_cluster,
        )
        assert listed.returncode == 0, listed.stderr
        items = json.loads(listed.stdout)["items"]
        return items if len(items) == deployment["spec"]["replicas"] else []

    # the controllers made its pods, and they passed admission
    items = procs.wait_for(operator_pods, 60, "the operator's pods", interval=0.2)
    if waits and not node:
        pytest.skip(f"KETCH_TEST_NODE_AGENT=0 starts no node: not run: {', '.join(waits)}")
    if waits:  # rolled out: every pod ran the operator until /healthz answered
        assert deployment["status"].get("availableReplicas") == len(items), deployment["status"]
    if section != "Apply the CRDs first" or not waits:
        return
    # Acceptance of the real control plane (issue 27): the operator pod, signed in as its
    # ServiceAccount with the manifests' ClusterRole, makes examples/mixed.yaml Ready, and its
    # Service (ClusterIP, through the cluster's service proxy) answers the openai client.
    assert run("kubectl apply -f examples/mixed.yaml", fresh_cluster).returncode == 0
    ready = run(
        "kubectl wait --for condition=Ready --timeout 240s inferenceservice/tiny", fresh_cluster
    )
    assert ready.returncode == 0, ready.stdout + ready.stderr
    svc = run("kubectl get service tiny-mixed -o jsonpath={.spec.clusterIP}", fresh_cluster)
    client = openai.OpenAI(
        base_url=f"http://{svc.stdout.strip()}:8000/v1", api_key="unused", max_retries=0
    )
    out = client.completions.create(model="tiny", prompt="Alice was", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens
    assert run("kubectl delete -f examples/mixed.yaml --wait=true", fresh_cluster).returncode == 0
