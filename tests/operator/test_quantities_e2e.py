"""Quantities in an InferenceService that the API server stores in another spelling
("0.5" CPU is kept as "500m", "1.5Gi" as "1536Mi"): the operator renders them, the pods carry
them, and the operator settles instead of taking the server's spelling for drift."""

from __future__ import annotations

import json
import time
from typing import Any

import operator_rbac
from test_e2e import (  # noqa: F401  (fixtures)
    Cluster,
    children,
    cluster,
    condition,
    cpu_example,
    operator,
    ready,
    settle,
    wait_for,
)

from ketch.operator import api_names
from ketch.operator.workqueue import Work

QUIET_SECONDS = 4.0
_ENGINE_CPU_LIMIT = "/spec/template/spec/containers/0/resources/limits/cpu"


def _odd_quantities(name: str) -> dict[str, Any]:
    body = cpu_example(name)
    body["spec"]["engine"]["shmSize"] = "1024Mi"
    mixed = body["spec"]["roles"]["mixed"]
    mixed["resources"].update({"cpu": "0.5", "memory": "1.5Gi"})
    mixed.pop("replicas", None)
    mixed["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "metrics": [{"type": "KVCacheUsage", "target": "0.8"}],
    }
    return body


def _operator_writes(cluster: Cluster, plural: str) -> int:  # noqa: F811
    """The operator's writes of ``plural`` in the namespace since ``kube.mark()``, from the API
    server's audit log (the operator signs in as its ServiceAccount)."""
    return sum(
        1
        for event in cluster.kube.requests(
            user=operator_rbac.USER, resource=plural, namespace=cluster.namespace
        )
        if event["verb"] in ("patch", "update", "create")
    )


def test_non_canonical_quantities_settle(cluster, operator):  # noqa: F811
    cluster.kube.mark()
    cluster.apply(_odd_quantities("quant"))
    wait_for(lambda: ready(cluster, "quant"), "quant Ready")
    settle(operator)
    # one apply each from creation to Ready: the stored "500m" was not taken for drift
    assert _operator_writes(cluster, "deployments") == 1
    cluster.kube.mark()
    time.sleep(QUIET_SECONDS)  # a quiet period: nothing may happen in it
    writes = {p: _operator_writes(cluster, p) for p in ("deployments", "horizontalpodautoscalers")}
    assert writes == {"deployments": 0, "horizontalpodautoscalers": 0}
    body = cluster.get(api_names.PLURAL, "quant")
    assert condition(body, "Ready")["status"] == "True"
    assert not condition(body, "Degraded") or condition(body, "Degraded")["status"] == "False"

    deployment = children(cluster, "quant")[("Deployment", "quant-mixed")]
    pods = cluster.items("pods", "app.kubernetes.io/instance=quant")
    assert pods
    for pod_spec in [deployment["spec"]["template"]["spec"]] + [p["spec"] for p in pods]:
        engine = next(c for c in pod_spec["containers"] if c["name"] == "engine")
        assert engine["resources"]["limits"] == {"cpu": "500m", "memory": "1536Mi"}
        assert engine["resources"]["requests"] == {"cpu": "500m", "memory": "1536Mi"}
        shm = next(v for v in pod_spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["sizeLimit"] == "1Gi"
    hpa = cluster.get("horizontalpodautoscalers", "quant-mixed")
    target = hpa["spec"]["metrics"][0]["pods"]["target"]
    assert target["averageValue"] == "800m"


def test_full_reconcile_of_non_canonical_quantities_writes_nothing(cluster, operator):  # noqa: F811
    wait_for(lambda: ready(cluster, "quant"), "quant Ready")
    settle(operator)

    def full_reconcile() -> None:
        operator.loop.call_soon_threadsafe(
            operator.enqueue, (cluster.namespace, "quant"), Work(full=True, status=True)
        )
        settle(operator)

    # The first full apply after creation hands the autoscaled Deployment's birth replica count
    # over to the autoscaler (one write, by design); from then on a full reconcile writes nothing.
    full_reconcile()
    before = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster, "quant").items()}
    full_reconcile()
    after = {k: v["metadata"]["resourceVersion"] for k, v in children(cluster, "quant").items()}
    assert after == before


def test_hand_edited_quantity_is_put_back_in_the_servers_spelling(cluster, operator):  # noqa: F811
    cluster.apply(_odd_quantities("quant-edit"))
    wait_for(lambda: ready(cluster, "quant-edit"), "quant-edit Ready")
    settle(operator)
    patch = [{"op": "replace", "path": _ENGINE_CPU_LIMIT, "value": "1"}]
    cluster.run(
        "patch", "deployment", "quant-edit-mixed", "--type", "json", "-p", json.dumps(patch)
    )

    def restored() -> bool:
        live = cluster.get("deployments", "quant-edit-mixed") or {}
        engine = next(
            c for c in live["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
        )
        return engine["resources"]["limits"]["cpu"] == "500m"

    wait_for(restored, "the CPU limit put back")
    wait_for(lambda: ready(cluster, "quant-edit"), "quant-edit Ready again")
    settle(operator)
    cluster.kube.mark()
    time.sleep(QUIET_SECONDS / 2)
    assert _operator_writes(cluster, "deployments") == 0
