"""The operator runs with the RBAC of manifests/ and nothing more, so a verb missing from the
Role shows here as it would on any cluster: the call fails with kube-apiserver's 403 (its RBAC
authorizer, on the session's real control plane), and the operator says which call (its log,
/healthz's last API error) and keeps retrying.

Every e2e test already runs the operator this way (test_e2e.py's `operator` fixture); this file
removes one verb at a time from a copy of the Role."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import operator_rbac
import pytest
from test_e2e import (
    Cluster,
    children,
    condition,
    cpu_example,
    fresh_namespace,
    ready,
    running_operator,
    wait_for,
)

from ketch.operator import api_names
from ketch.operator.cli import render_object


@pytest.fixture
def refusals() -> Iterator[operator_rbac.Refusals]:
    with operator_rbac.Refusals().watching() as handler:
        yield handler


@pytest.fixture
def cluster(kube) -> Iterator[Cluster]:
    with fresh_namespace(kube, "rbac") as c:
        yield c


def forbidden(cluster: Cluster, verb: str, resource: str, group: str, name: str) -> str:
    qualified = f"{resource.split('/')[0]}.{group}" if group else resource.split("/")[0]
    return (
        f'{qualified} "{name}" is forbidden: User "{operator_rbac.USER}" cannot {verb} resource '
        f'"{resource}" in API group "{group}" in the namespace "{cluster.namespace}"'
    )


def test_the_operator_signs_in_as_its_service_account(cluster: Cluster, tmp_path: Path):
    kubeconfig = operator_rbac.install(cluster.kube, cluster.namespace, tmp_path)

    def as_operator(*args: str) -> subprocess.CompletedProcess[str]:
        command = ["kubectl", "--kubeconfig", str(kubeconfig), "-n", cluster.namespace, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert as_operator("get", api_names.PLURAL).returncode == 0
    secrets = as_operator("get", "secrets")  # the API key and peer key stay unread
    assert secrets.returncode != 0
    assert (
        f'secrets is forbidden: User "{operator_rbac.USER}" cannot list resource "secrets" in '
        f'API group "" in the namespace "{cluster.namespace}"'
    ) in secrets.stderr
    elsewhere = as_operator("get", "deployments", "-n", "default")
    assert "is forbidden" in elsewhere.stderr  # a Role: rights in the served namespace only


@pytest.mark.parametrize(
    ("without", "verb", "resource", "group", "child"),
    [
        (("apps", "deployments", "create"), "create", "deployments", "apps", "-mixed"),
        (("", "configmaps", "patch"), "patch", "configmaps", "", "-config"),
        (
            (api_names.GROUP, f"{api_names.PLURAL}/status", "patch"),
            "patch",
            f"{api_names.PLURAL}/status",
            api_names.GROUP,
            "",
        ),
    ],
    ids=["create-deployments", "patch-configmaps", "patch-status"],
)
def test_a_verb_missing_from_the_role_fails_with_the_403_named(
    cluster: Cluster, tmp_path: Path, refusals, without, verb, resource, group, child
):
    kubeconfig = operator_rbac.install(cluster.kube, cluster.namespace, tmp_path, without=without)
    name = "denied"
    expected = forbidden(cluster, verb, resource, group, name + child)
    with running_operator(cluster, kubeconfig) as controller:
        cluster.apply(cpu_example(name))
        wait_for(
            lambda: expected in (controller.last_api_error or ""),
            f"the operator to report: {expected}",
        )
        wait_for(
            lambda: any(
                "reconcile failed (Forbidden)" in m and expected in m for m in refusals.messages
            ),
            "the operator's log line",
        )
        body = cluster.get(api_names.PLURAL, name)
        assert condition(body, "Ready").get("status") != "True"
    if cluster.kube.layout is not None:  # the API server's own record (its audit log)
        answers = [
            e["responseStatus"]
            for e in cluster.kube.requests(
                since_mark=False,
                user=operator_rbac.USER,
                namespace=cluster.namespace,
                subresource=None,
            )
        ]
        assert any(a.get("code") == 403 and expected in a.get("message", "") for a in answers)
        assert all(a.get("code") != 403 or expected in a.get("message", "") for a in answers)


def test_cluster_wide_the_clusterrole_is_enough(tmp_path: Path, refusals):
    """The cluster-wide overlay's ClusterRole, on a cluster of this test's own (a
    ClusterRoleBinding would widen what every other test's operator may do): the operator
    serving every namespace applies the children and writes status with no call refused, and
    with a node (not KETCH_TEST_NODE_AGENT=0) the service gets Ready. One small engine pod:
    the node offers this machine's CPUs (examples/mixed.yaml asks for 2 pods of 2 CPUs)."""
    body = cpu_example("wide")
    body["spec"]["roles"]["mixed"]["replicas"] = 1
    body["spec"]["roles"]["mixed"]["resources"] = {"gpus": 0, "cpu": "500m", "memory": "1Gi"}
    wanted = {(c["kind"], c["metadata"]["name"]) for c in render_object(body)}
    with (
        operator_rbac.own_cluster("binds a ClusterRole") as kube,
        fresh_namespace(kube, "wide") as cluster,
    ):
        kubeconfig = operator_rbac.install(kube, cluster.namespace, tmp_path, cluster_wide=True)
        with running_operator(cluster, kubeconfig, scope=["--all-namespaces"]):
            cluster.apply(body)
            wait_for(lambda: set(children(cluster, "wide")) == wanted, "wide's children")

            def observed() -> bool:
                got = cluster.get(api_names.PLURAL, "wide") or {"metadata": {}}
                seen = (got.get("status") or {}).get("observedGeneration")
                return seen is not None and seen == got["metadata"].get("generation")

            wait_for(observed, "wide's status written")
            if operator_rbac.with_node():  # the engine loads its model: allow a few minutes
                ok = wait_for(lambda: ready(cluster, "wide"), "wide Ready", timeout=240)
                assert condition(ok, "Degraded")["status"] == "False"
        assert refusals.messages == []
