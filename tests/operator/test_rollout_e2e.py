"""End to end: the InferenceService status during a rollout, and a failing init container.

The operator runs for real (kopf's KopfRunner, as in test_e2e.py) against the test run's
control plane: the real Deployment controller rolls the engine pods by the rendered strategy
(maxSurge 1, maxUnavailable 0), each new pod turning ready when its engine's readiness probe
passes (10-20 s here), and the model-fetch init container really fails.
"""

from __future__ import annotations

import json
import time
from typing import Any

from test_e2e import cluster, condition, cpu_example, operator, ready, wait_for  # noqa: F401

from ketch.operator import api_names
from ketch.operator.labels import ANNOTATION_CONFIG_HASH, LABEL_INSTANCE
from watching import Recorder

Obj = dict[str, Any]


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
    selector = {"labelSelector": f"{LABEL_INSTANCE}={name}"}
    items = c.kube.get(path, params=selector).ok()["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _config_hash(pod: Obj) -> str:
    return pod["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]


def test_status_does_not_claim_completion_during_a_slow_rollout(cluster, operator):  # noqa: F811
    """Two replicas, the rendered strategy, a template change, new pods ready after a delay:
    while an old pod exists or a new one is unready, neither Ready nor Progressing says done;
    at the end both do."""
    name = "slowroll"
    cluster.apply(cpu_example(name))
    wait_for(lambda: ready(cluster, name), f"{name} Ready")
    ns = cluster.namespace
    isvc = f"/apis/{api_names.GROUP}/{api_names.VERSION}/namespaces/{ns}/{api_names.PLURAL}"
    start = cluster.kube.get(f"/api/v1/namespaces/{ns}/pods").ok()
    since = start["metadata"]["resourceVersion"]
    before = [p for p in start["items"] if p["metadata"]["labels"].get(LABEL_INSTANCE) == name]
    old_hash = _config_hash(before[0])
    patch = {"spec": {"engine": {"maxNumSeqs": 8}}}
    with Recorder(cluster.kube, [isvc, f"/api/v1/namespaces/{ns}/pods"], since=since) as record:
        cluster.run("patch", api_names.PLURAL, name, "--type", "merge", "-p", json.dumps(patch))
        seen_rolling = False
        deadline = time.monotonic() + 240
        while True:
            body = cluster.kube.get(f"{isvc}/{name}").ok()  # the status, then its pods
            pods = _pods(cluster, name)
            new = [p for p in pods if _config_hash(p) != old_hash]
            unfinished = len(new) < len(pods) or not all(_is_ready(p) for p in new)
            if body["metadata"]["generation"] == body["status"].get("observedGeneration"):
                if unfinished:
                    # The pods are read after the status: an old pod now existed then too (old
                    # pods only go away), but a new pod found unready may have turned so after
                    # the status was written (a probe timing out on a loaded machine). The
                    # replay below, in resourceVersion order, checks readiness exactly.
                    old_left = len(new) < len(pods)
                    assert not (old_left and _claims_complete(body)), (
                        body["status"],
                        len(pods),
                        len(new),
                    )
                    seen_rolling = seen_rolling or bool(new)
                elif _claims_complete(body) and len(new) == 2:
                    break
            assert time.monotonic() < deadline, f"no completion: {body['status']}"
            time.sleep(0.05)
    assert seen_rolling, "the rollout was never seen under way"
    assert condition(body, "Progressing")["reason"] == "Complete"
    assert body["status"]["replicas"] == "2/2"
    _check_every_status_version(record.sorted(), before, old_hash, name)
    cluster.run("delete", api_names.PLURAL, name)


def _check_every_status_version(events: list[Obj], before: list[Obj], old_hash: str, name: str):
    """The same, for every status the operator wrote (every version the API server sent from
    when the pods were `before`, merged with the pods' in resourceVersion order): no version
    claims completion early."""
    events = [
        ev
        for ev in events
        if ev["object"]["metadata"]["name"] == name
        or (ev["object"]["metadata"].get("labels") or {}).get(LABEL_INSTANCE) == name
    ]
    live = {p["metadata"]["name"]: p for p in before}
    versions = 0
    for ev in events:
        obj = ev["object"]
        if obj["kind"] == "Pod":
            # a terminating pod (draining behind its preStop) no longer counts, as for
            # `kubectl rollout status` and the live check above
            if ev["type"] == "DELETED" or obj["metadata"].get("deletionTimestamp"):
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
    """The model-fetch init container cannot reach the hub (cluster DNS answers nothing outside
    the cluster): it exits non-zero, the node agent retries it with back-off, and the status
    names it. Switching to the built-in model (no fetch) makes the service Ready."""
    name = "fetchfail"
    body = cpu_example(name)
    body["spec"]["roles"]["mixed"]["replicas"] = 1
    body["spec"]["model"]["uri"] = "hf://org/a-model"  # fetched by the model-fetch init container
    cluster.apply(body)
    isvc = wait_for(
        lambda: (
            (b := cluster.get(api_names.PLURAL, name))
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
    body["spec"]["model"]["uri"] = "tiny"
    cluster.apply(body)
    wait_for(lambda: ready(cluster, name), f"{name} Ready with a model that needs no fetch")
    cluster.run("delete", api_names.PLURAL, name)
