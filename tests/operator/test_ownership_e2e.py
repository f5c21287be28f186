"""End to end (security review M1): the operator takes over nothing it did not create.

On the test run's real control plane (tests/kubecluster.py), with the operator signed in as its
ServiceAccount under the manifests' RBAC: a ConfigMap and a Service that someone else made under
the names an InferenceService's children take (``<name>-config``, ``<name>-mixed``) stay exactly
as they were (same resourceVersion, data and selector, no owner reference), the InferenceService
goes ``Degraded/ChildConflict`` naming them, and deleting it leaves them: the garbage collector
has no owner reference to follow.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import operator_rbac
import pytest
from test_e2e import Cluster, condition, cpu_example, fresh_namespace, running_operator, wait_for

from ketch.operator import api_names
from ketch.operator.controller import Controller

NAME = "own"


@pytest.fixture(scope="module")
def cluster(kube) -> Iterator[Cluster]:
    with fresh_namespace(kube, "own") as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[Controller]:
    kubeconfig = operator_rbac.install(
        cluster.kube, cluster.namespace, tmp_path_factory.mktemp("operator")
    )
    refusals = operator_rbac.Refusals()
    with refusals.watching(), running_operator(cluster, kubeconfig) as controller:
        yield controller
    assert not refusals.messages, "\n".join(refusals.messages)


def someone_elses() -> list[dict[str, Any]]:
    """What a team made before anyone created the InferenceService (kubectl apply, no owner)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{NAME}-config", "labels": {"team": "search"}},
            "data": {"app.properties": "color=blue\n"},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{NAME}-mixed"},
            "spec": {"selector": {"app": "search"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ]


def snapshot(cluster: Cluster) -> dict[str, Any]:
    """What must not change: each object's uid, resourceVersion, owners, labels and content."""
    out = {}
    for kind, name in (("configmaps", f"{NAME}-config"), ("services", f"{NAME}-mixed")):
        obj = cluster.get(kind, name)
        assert obj is not None, f"{kind}/{name} is gone"
        meta = obj["metadata"]
        out[kind] = {
            "uid": meta["uid"],
            "resourceVersion": meta["resourceVersion"],
            "ownerReferences": meta.get("ownerReferences"),
            "labels": meta.get("labels"),
            "data": obj.get("data"),
            "selector": (obj.get("spec") or {}).get("selector"),
            "ports": (obj.get("spec") or {}).get("ports"),
        }
    return out


def test_objects_it_did_not_create_are_left_alone_and_outlive_the_service(cluster, operator):
    for obj in someone_elses():
        cluster.apply(obj)
    before = snapshot(cluster)
    assert before["configmaps"]["ownerReferences"] is None

    cluster.apply(cpu_example(NAME))

    def conflicted() -> dict[str, Any] | None:
        body = cluster.get(api_names.PLURAL, NAME)
        degraded = condition(body, "Degraded")
        return body if degraded.get("reason") == "ChildConflict" else None

    # Whichever comes first: the conflict reported, or either object touched.
    wait_for(
        lambda: conflicted() or snapshot(cluster) != before,
        f"{NAME} Degraded/ChildConflict",
        timeout=60,
    )
    assert snapshot(cluster) == before
    body = wait_for(conflicted, f"{NAME} Degraded/ChildConflict", timeout=10)
    ns = cluster.namespace
    degraded = condition(body, "Degraded")
    assert degraded["status"] == "True"
    assert f"ConfigMap {ns}/{NAME}-config exists and is not controlled" in degraded["message"]
    assert f"Service {ns}/{NAME}-mixed exists and is not controlled" in degraded["message"]
    assert condition(body, "Ready")["status"] == "False"
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]
    events = json.loads(cluster.run("get", "events", "-o", "json").stdout)["items"]
    warnings = [
        e
        for e in events
        if e["involvedObject"]["name"] == NAME
        and (e["type"], e["reason"]) == ("Warning", "ChildConflict")
    ]
    assert warnings and f"ConfigMap {ns}/{NAME}-config" in warnings[0]["message"]

    # The retries (backoff) change nothing either; nothing of the generation was applied.
    time.sleep(4)
    assert snapshot(cluster) == before
    assert cluster.get("deployments", f"{NAME}-mixed") is None
    assert cluster.get("configmaps", f"{NAME}-config")["data"] == {"app.properties": "color=blue\n"}

    # Deleting the InferenceService leaves them: no owner reference for the garbage collector.
    uid = body["metadata"]["uid"]
    cluster.run("delete", api_names.PLURAL, NAME, "--wait=true")
    wait_for(lambda: cluster.get(api_names.PLURAL, NAME) is None, f"{NAME} deleted", timeout=60)
    time.sleep(5)  # the garbage collector acts within a second or two on what it owns
    assert snapshot(cluster) == before
    leftovers = [
        o
        for kind in ("configmaps", "services", "deployments", "networkpolicies")
        for o in json.loads(cluster.run("get", kind, "-o", "json").stdout)["items"]
        if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
    ]
    assert leftovers == []  # and nothing anywhere points to the deleted InferenceService
