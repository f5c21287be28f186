"""Records the InferenceService statuses of a real run for the Argo CD health check's tests
(test_argocd_health.py), into tests/data/argocd/*.json. Not collected by a plain ``pytest``
run (the name does not start with ``test_``); run it by its path:

    python -m pytest -q -p no:cacheprovider tests/operator/record_argocd_statuses.py

The real operator (KopfRunner) runs against the test control plane, with the fake engine
image of test_coordinated_e2e.py (its pods start in seconds and report the load the test sets,
so the operator's own autoscaler scales them). Every version of the InferenceService the API
server sends is recorded, per phase:

- ``create``: created, then Ready (Progressing, then Healthy);
- ``rollout``: a spec change rolls the pods (generation bumped: Progressing, then Healthy);
- ``autoscale``: load makes the autoscaler scale 1 -> 3 pods (Progressing, then Healthy);
- ``bad-image``: an image no node has (Progressing, then Degraded/ImagePullError);
- ``invalid-spec``: a spec the operator refuses (Degraded/InvalidSpec);
- ``zero``: another InferenceService with 0 replicas (Suspended).

Each version is stored with the health ``argocd_health.expected`` gives it (the operator's
conditions read in Python), and each phase must show the healths listed above, in that order,
or nothing is written.
"""

from __future__ import annotations

import json
from typing import Any

from argocd_health import DATA, expected, health
from test_coordinated_e2e import FAKE_IMAGE, base, ketch_role, metrics  # noqa: F401 (fixture)
from test_e2e import cluster, condition, operator, ready, wait_for  # noqa: F401 (fixtures)

from ketch.operator import api_names
from watching import Recorder

Obj = dict[str, Any]
NAME = "argo"
ZERO = "argozero"
KEEP = ("name", "namespace", "generation", "uid", "creationTimestamp", "labels")


def _spec() -> Obj:
    body = base(NAME)
    body["spec"]["roles"]["mixed"] = ketch_role(
        minReplicas=1,
        maxReplicas=3,
        metrics=[{"type": "RequestsWaiting", "target": 4}],
        behavior={"scaleDown": {"stabilizationWindowSeconds": 600}},
    )
    body["spec"]["autoscaling"] = {"syncPeriodSeconds": 1, "cooldownSeconds": 1}
    return body


def _trim(obj: Obj) -> Obj:
    """The object as Argo CD's health check sees it, without what only makes it bulky."""
    meta = {k: v for k, v in obj["metadata"].items() if k in KEEP}
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": meta,
        "spec": obj["spec"],
        **({"status": obj["status"]} if "status" in obj else {}),
    }


def _healths(versions: list[Obj]) -> list[str]:
    """The expected healths of ``versions`` with repeats collapsed."""
    out: list[str] = []
    for v in versions:
        if not out or out[-1] != v["expected"]:
            out.append(v["expected"])
    return out


def _phase(cluster, isvc: str, name: str, act, until, what: str) -> list[Obj]:  # noqa: F811
    """Every distinct version of ``name`` from ``act()`` until ``until(body)`` is true."""
    since = cluster.kube.get(isvc).ok()["metadata"]["resourceVersion"]
    with Recorder(cluster.kube, [isvc], since=since) as record:
        act()
        wait_for(lambda: until(cluster.get(api_names.PLURAL, name)), what, timeout=180)
    out: list[Obj] = []
    seen: set[str] = set()
    for obj in record.objects(name):
        trimmed = _trim(obj)
        key = json.dumps([trimmed["metadata"]["generation"], trimmed.get("status")])
        if key in seen:
            continue
        seen.add(key)
        out.append({"expected": expected(trimmed), "object": trimmed})
    return out


def _healthy(cluster, name: str):  # noqa: F811
    body = ready(cluster, name)
    return body and expected(body) == "Healthy"


def test_record(cluster, operator, metrics):  # noqa: F811
    ns = cluster.namespace
    isvc = f"/apis/{api_names.GROUP}/{api_names.VERSION}/namespaces/{ns}/{api_names.PLURAL}"
    metrics.load["mixed"] = 0
    body = _spec()
    phases: dict[str, list[Obj]] = {}

    phases["create"] = _phase(
        cluster, isvc, NAME, lambda: cluster.apply(body), lambda b: _healthy(cluster, NAME), "Ready"
    )
    body["spec"]["engine"]["maxNumSeqs"] = 8
    phases["rollout"] = _phase(
        cluster,
        isvc,
        NAME,
        lambda: cluster.apply(body),
        lambda b: b["metadata"]["generation"] == 2 and _healthy(cluster, NAME),
        "the rollout done",
    )
    metrics.load["mixed"] = 12
    phases["autoscale"] = _phase(
        cluster,
        isvc,
        NAME,
        lambda: None,
        lambda b: (
            (b["status"].get("roles") or {}).get("mixed", {}).get("desired") == 3
            and _healthy(cluster, NAME)
        ),
        "scaled to 3 and Ready",
    )
    body["spec"]["engine"]["image"] = "registry.invalid/ketch/none:1"
    phases["bad-image"] = _phase(
        cluster,
        isvc,
        NAME,
        lambda: cluster.apply(body),
        lambda b: condition(b, "Degraded").get("reason") == "ImagePullError",
        "Degraded/ImagePullError",
    )
    body["spec"]["engine"]["kvCacheMemory"] = "0MiB"
    phases["invalid-spec"] = _phase(
        cluster,
        isvc,
        NAME,
        lambda: cluster.apply(body),
        lambda b: condition(b, "Degraded").get("reason") == "InvalidSpec",
        "Degraded/InvalidSpec",
    )
    metrics.load["mixed"] = 0
    cluster.run("delete", api_names.PLURAL, NAME, "--wait=false")
    zero = base(ZERO)
    zero["spec"]["roles"]["mixed"] = {**ketch_role(), "replicas": 0}
    del zero["spec"]["roles"]["mixed"]["autoscaling"]
    phases["zero"] = _phase(
        cluster,
        isvc,
        ZERO,
        lambda: cluster.apply(zero),
        lambda b: (r := ready(cluster, ZERO)) and expected(r) == "Suspended",
        "Ready with 0 replicas",
    )

    want = {
        "create": ["Progressing", "Healthy"],
        "rollout": ["Progressing", "Healthy"],
        "autoscale": ["Progressing", "Healthy"],
        "bad-image": ["Progressing", "Degraded"],
        "invalid-spec": ["Progressing", "Degraded"],
        "zero": ["Progressing", "Suspended"],
    }
    for phase, versions in phases.items():
        got = _healths(versions)
        # the first version of a phase may still be the previous phase's last state
        if phase != "create" and len(got) > len(want[phase]):
            got = got[len(got) - len(want[phase]) :]
        assert got == want[phase], (phase, [v["expected"] for v in versions])
        gens = {v["object"]["metadata"]["generation"] for v in versions}
        if phase == "rollout":
            assert 2 in gens, gens
        for v in versions:  # the script agrees (the test repeats this from the files)
            assert health(v["object"])[0] == v["expected"], v
    DATA.mkdir(parents=True, exist_ok=True)
    for phase, versions in phases.items():
        path = DATA / f"{phase}.json"
        path.write_text(json.dumps({"phase": phase, "versions": versions}, indent=1) + "\n")
    cluster.run("delete", api_names.PLURAL, ZERO, "--wait=false")
