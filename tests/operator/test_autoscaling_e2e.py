"""Autoscaling end to end: the operator running for real against the API-server emulator.

GitOps contract: re-applying an InferenceService never resets the replica count an autoscaler
chose. KEDA mode: the operator copes without KEDA's CRD and switches between HPA and KEDA.
"""

from __future__ import annotations

import copy
import json

import yaml
from test_e2e import Cluster, cluster, operator, settle, wait_for  # noqa: F401 (fixtures)

from ketch.operator import api_names
from ketch.operator.workqueue import Work

SCALED_OBJECT_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {
            "plural": "scaledobjects",
            "singular": "scaledobject",
            "kind": "ScaledObject",
            "listKind": "ScaledObjectList",
        },
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                # Minimal: the test checks the fields itself (see test_autoscaling.py).
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
                "subresources": {"status": {}},
            }
        ],
    },
}


def autoscaled(name: str, **scaling) -> dict:
    from test_e2e import cpu_example

    body = cpu_example(name)
    role = body["spec"]["roles"]["mixed"]
    role.pop("replicas", None)
    role["autoscaling"] = {"minReplicas": 1, "maxReplicas": 5, **scaling}
    return body


def full_reconcile(cluster: Cluster, operator, name: str) -> None:  # noqa: F811
    operator.loop.call_soon_threadsafe(
        operator.enqueue, (cluster.namespace, name), Work(full=True, status=True)
    )
    settle(operator)


def replicas(cluster: Cluster, name: str) -> int | None:  # noqa: F811
    dep = cluster.get("deployments", name)
    return None if dep is None else dep["spec"].get("replicas")


def test_reapplying_does_not_reset_replicas_the_autoscaler_set(cluster, operator):  # noqa: F811
    body = autoscaled("scaled")
    cluster.apply(body)
    hpa = wait_for(lambda: cluster.get("hpa", "scaled-mixed"), "the HPA")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "scaled-mixed",
    }
    assert hpa["metadata"]["ownerReferences"][0]["name"] == "scaled"
    wait_for(lambda: replicas(cluster, "scaled-mixed") is not None, "the Deployment")
    settle(operator)
    # What the HPA does: a write to the Deployment's scale subresource.
    cluster.run("scale", "deployment/scaled-mixed", "--replicas", "3")
    assert replicas(cluster, "scaled-mixed") == 3
    # GitOps re-applies the InferenceService from Git: client-side, then server-side.
    cluster.apply(body)
    cluster.apply(body, "--server-side", "--force-conflicts", "--field-manager", "argocd")
    full_reconcile(cluster, operator, "scaled")
    assert replicas(cluster, "scaled-mixed") == 3
    # A new generation (the pod template changes) is applied and still leaves replicas alone.
    changed = copy.deepcopy(body)
    changed["spec"]["engine"]["maxNumSeqs"] = 16
    cluster.apply(changed)
    wait_for(
        lambda: (
            (cluster.get(api_names.PLURAL, "scaled").get("status") or {}).get("observedGeneration")
            == 2
        ),
        "generation 2 observed",
    )
    settle(operator)
    full_reconcile(cluster, operator, "scaled")
    assert replicas(cluster, "scaled-mixed") == 3
    dep = cluster.get("deployments", "scaled-mixed")
    assert "maxNumSeqs" not in json.dumps(dep)  # sanity: the change went into the ConfigMap
    config = cluster.get("configmaps", "scaled-config")
    assert yaml.safe_load(config["data"]["mixed.yaml"])["max_num_seqs"] == 16
    # Editing the HPA by hand is drift: the operator puts it back.
    cluster.run("patch", "hpa", "scaled-mixed", "--type=merge", "-p", '{"spec":{"maxReplicas":9}}')
    wait_for(lambda: cluster.get("hpa", "scaled-mixed")["spec"]["maxReplicas"] == 5, "HPA restored")
    cluster.run("delete", api_names.PLURAL, "scaled")


def test_keda_mode_without_and_with_the_keda_crd(cluster, operator):  # noqa: F811
    keda = {"mode": "keda", "prometheusAddress": "http://prometheus.monitoring.svc:9090"}
    body = autoscaled("kedasvc", **keda)
    other = autoscaled("hpasvc")
    cluster.apply(body)
    cluster.apply(other)
    # No KEDA: everything else is applied, a warning says why, other services are unaffected.
    wait_for(lambda: cluster.get("deployments", "kedasvc-mixed"), "kedasvc Deployment")
    wait_for(lambda: cluster.get("hpa", "hpasvc-mixed"), "hpasvc HPA")
    events = wait_for(
        lambda: [
            e
            for e in json.loads(cluster.run("get", "events", "-o", "json").stdout)["items"]
            if e["reason"] == "AutoscalerUnavailable" and e["involvedObject"]["name"] == "kedasvc"
        ],
        "an AutoscalerUnavailable event",
    )
    assert "KEDA" in events[0]["message"]
    assert cluster.get("hpa", "kedasvc-mixed") is None
    settle(operator)
    cluster.run("apply", "-f", "-", ns=False, input=yaml.safe_dump(SCALED_OBJECT_CRD))
    try:
        wait_for(
            lambda: cluster.run("get", "scaledobjects.keda.sh", check=False).returncode == 0,
            "scaledobjects served",
        )
        full_reconcile(cluster, operator, "kedasvc")  # what the next resync does
        so = wait_for(lambda: cluster.get("scaledobjects.keda.sh", "kedasvc-mixed"), "the SO")
        assert so["spec"]["scaleTargetRef"]["name"] == "kedasvc-mixed"
        assert so["metadata"]["ownerReferences"][0]["name"] == "kedasvc"
        assert so["spec"]["triggers"][0]["metadata"]["query"].startswith(
            "sum(ketch:num_requests_waiting{"
        )
        # Switching to HPA mode: the ScaledObject goes, an HPA comes.
        hpa_mode = copy.deepcopy(body)
        hpa_mode["spec"]["roles"]["mixed"]["autoscaling"]["mode"] = "hpa"
        cluster.apply(hpa_mode)
        wait_for(lambda: cluster.get("hpa", "kedasvc-mixed"), "the HPA after the switch")
        wait_for(
            lambda: cluster.get("scaledobjects.keda.sh", "kedasvc-mixed") is None,
            "the ScaledObject pruned",
        )
        # and back: the HPA goes (watched kinds are pruned as before).
        cluster.apply(body)
        wait_for(lambda: cluster.get("scaledobjects.keda.sh", "kedasvc-mixed"), "SO again")
        wait_for(lambda: cluster.get("hpa", "kedasvc-mixed") is None, "the HPA pruned")
        # A restarted operator (nothing known yet) still prunes a ScaledObject no longer wanted.
        settle(operator)
        tracked = operator.cache.tracked[(cluster.namespace, "kedasvc")]
        tracked.applied_generation = None
        tracked.applied = {}
        cluster.apply(hpa_mode)
        wait_for(
            lambda: cluster.get("scaledobjects.keda.sh", "kedasvc-mixed") is None,
            "the ScaledObject pruned after a restart",
        )
    finally:
        for name in ("kedasvc", "hpasvc"):
            cluster.run("delete", api_names.PLURAL, name, check=False)
        cluster.run("delete", "crd", "scaledobjects.keda.sh", ns=False, check=False)
