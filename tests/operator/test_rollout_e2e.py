"""End to end: the InferenceService status during a slow rollout, and a failing init container.

The operator runs for real (kopf's KopfRunner, as in test_e2e.py) against the API-server
emulator, whose Deployment controller rolls pods step by step by the rendered strategy
(maxSurge 1, maxUnavailable 0) and whose pods turn ready when the test says. Both tests need the
emulator's pod behaviours (they skip on a real cluster).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from test_e2e import cluster, condition, cpu_example, operator, ready, wait_for  # noqa: F401

from ketch.operator import crd, objects

Obj = dict[str, Any]
READY_DELAY = 1.5  # seconds a new pod of the rollout takes to pass its readiness probe


def _emulator_only(c) -> None:
    if not getattr(c.kube, "is_emulator", False):
        pytest.skip("pod behaviours exist only in the emulator")


def _is_ready(pod: Obj) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def _claims_complete(body: Obj) -> bool:
    gen = body["metadata"].get("generation")
    return body["status"].get("observedGeneration") == gen and (
        condition(body, "Ready").get("status") == "True"
        or condition(body, "Progressing").get("reason") == "Complete"
    )


def _pods(c, name: str) -> list[Obj]:
    path = f"/api/v1/namespaces/{c.namespace}/pods"
    selector = {"labelSelector": f"{objects.LABEL_INSTANCE}={name}"}
    items = c.kube.get(path, params=selector).ok()["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _config_hash(pod: Obj) -> str:
    return pod["metadata"]["annotations"][objects.ANNOTATION_CONFIG_HASH]


def test_status_does_not_claim_completion_during_a_slow_rollout(cluster, operator):  # noqa: F811
    """Two replicas, the rendered strategy, a template change, new pods ready after a delay:
    while an old pod exists or a new one is unready, neither Ready nor Progressing says done;
    at the end both do."""
    _emulator_only(cluster)
    name = "slowroll"
    cluster.apply(cpu_example(name))
    wait_for(lambda: ready(cluster, name), f"{name} Ready")
    cluster.kube.set_fault(cluster.namespace, f"{name}-mixed", "ready", ready_delay=READY_DELAY)
    isvc = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{cluster.namespace}/{crd.PLURAL}/{name}"
    start = cluster.kube.get(f"/api/v1/namespaces/{cluster.namespace}/pods").ok()
    since = start["metadata"]["resourceVersion"]
    before = [
        p for p in start["items"] if p["metadata"]["labels"].get(objects.LABEL_INSTANCE) == name
    ]
    old_hash = _config_hash(before[0])
    patch = {"spec": {"engine": {"maxNumSeqs": 8}}}
    cluster.run("patch", crd.PLURAL, name, "--type", "merge", "-p", json.dumps(patch))

    seen_rolling = False
    deadline = time.monotonic() + 60
    while True:
        body = cluster.kube.get(isvc).ok()  # the status first, then the pods it describes
        pods = _pods(cluster, name)
        new = [p for p in pods if _config_hash(p) != old_hash]
        unfinished = len(new) < len(pods) or not all(_is_ready(p) for p in new)
        if body["metadata"]["generation"] == body["status"].get("observedGeneration"):
            if unfinished:
                assert not _claims_complete(body), (body["status"], len(pods), len(new))
                seen_rolling = seen_rolling or bool(new)
            elif _claims_complete(body) and len(new) == 2:
                break
        assert time.monotonic() < deadline, f"no completion: {body['status']}"
        time.sleep(0.05)
    assert seen_rolling, "the rollout was never seen under way"
    assert condition(body, "Progressing")["reason"] == "Complete"
    assert body["status"]["replicas"] == "2/2"
    _check_every_status_version(cluster, since, before, old_hash, name)
    cluster.run("delete", crd.PLURAL, name)


def _check_every_status_version(c, since: str, before: list[Obj], old_hash: str, name: str):
    """The same, for every status the operator wrote (the watch history from `since`, when the
    pods were `before`, merged with the pods' by resourceVersion): no version claims completion
    early."""
    ns = c.namespace
    events = []
    for path in (
        f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{ns}/{crd.PLURAL}",
        f"/api/v1/namespaces/{ns}/pods",
    ):
        for ev in c.kube.watch(path, {"resourceVersion": since, "timeoutSeconds": "0.3"}):
            meta = ev["object"]["metadata"]
            if (
                meta["name"] == name
                or (meta.get("labels") or {}).get(objects.LABEL_INSTANCE) == name
            ):
                events.append((int(meta["resourceVersion"]), ev))
    live = {p["metadata"]["name"]: p for p in before}
    versions = 0
    for _, ev in sorted(events, key=lambda item: item[0]):
        obj = ev["object"]
        if obj["kind"] == "Pod":
            if ev["type"] == "DELETED":
                live.pop(obj["metadata"]["name"], None)
            else:
                live[obj["metadata"]["name"]] = obj
            continue
        versions += 1
        new = [p for p in live.values() if _config_hash(p) != old_hash]
        unfinished = len(new) < 2 or len(live) > 2 or not all(_is_ready(p) for p in new)
        if _claims_complete(obj) and obj["metadata"]["generation"] > 1:
            assert not unfinished, obj["status"]
    assert versions > 1


def test_a_failing_model_fetch_init_container_degrades_naming_it(cluster, operator):  # noqa: F811
    _emulator_only(cluster)
    name = "fetchfail"
    body = cpu_example(name)
    body["spec"]["model"]["uri"] = "hf://org/a-model"  # fetched by the model-fetch init container
    cluster.kube.set_pod_behaviour(
        cluster.namespace,
        deployment=f"{name}-mixed",
        mode="init-crashloop",
        init_container="model-fetch",
    )
    cluster.apply(body)
    isvc = wait_for(
        lambda: (
            (b := cluster.get(crd.PLURAL, name))
            and condition(b, "Degraded").get("reason") == "ModelFetchFailed"
            and b
        ),
        "Degraded/ModelFetchFailed",
    )
    degraded = condition(isvc, "Degraded")
    assert degraded["status"] == "True"
    assert "init container model-fetch failed" in degraded["message"]
    assert "kubectl logs" in degraded["message"] and "spec.model.uri" in degraded["message"]
    assert condition(isvc, "Ready")["status"] == "False"
    events = json.loads(cluster.run("get", "events", "-o", "json").stdout)["items"]
    assert any(
        e["reason"] == "ModelFetchFailed" and e["involvedObject"]["name"] == name for e in events
    )
    cluster.kube.set_pod_behaviour(cluster.namespace, deployment=f"{name}-mixed", mode="ready")
    wait_for(lambda: ready(cluster, name), f"{name} Ready once the fetch works")
    cluster.run("delete", crd.PLURAL, name)
