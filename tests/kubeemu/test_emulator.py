"""The Kubernetes API-server emulator behaves as kube-apiserver does where operators depend on it.

Everything goes over HTTP to the emulator subprocess (the `emu` fixture), with kubectl and kopf
as real clients. The controllers (Deployments, ReplicaSets, pods) are tested in test_workloads.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import procs
from kubeemu import Emulator, kubectl, start_emulator


def wait_for(fn: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll `fn` until it returns something truthy (the emulator's controllers are async)."""
    return procs.wait_for(fn, timeout, what, interval=0.03)


def cm(name: str, data: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, **meta},
        "data": data or {"k": "v"},
    }


def deployment(name: str, image: str = "nginx:1.25", replicas: int = 1, **extra: Any):
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": image,
                            "ports": [{"containerPort": 8000}],
                            **extra,
                        }
                    ]
                },
            },
        },
    }


def rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


def managers(obj: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (e["manager"], e["operation"]): e["fieldsV1"]
        for e in obj["metadata"].get("managedFields", [])
    }


def noop(emu: Emulator, verb: str, call: Callable[[], Any]) -> Any:
    """Run a write and return its result; fail unless the server counted it as a no-op."""
    before = emu.stats()["noop_writes"].get(verb, 0)
    result = call()
    assert emu.stats()["noop_writes"].get(verb, 0) == before + 1, f"{verb} changed the object"
    return result


def watch_events(emu: Emulator, path: str, since: str, timeout: int = 1, **params: str):
    return list(
        emu.watch(path, {"resourceVersion": since, "timeoutSeconds": str(timeout), **params})
    )


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wd"],
            "categories": ["all"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {
                        "name": "Ready",
                        "type": "string",
                        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                    },
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1},
                                    "replicas": {"type": "integer"},
                                    "tags": {"type": "array", "items": {"type": "string"}},
                                    "ports": {
                                        "type": "array",
                                        "x-kubernetes-list-type": "map",
                                        "x-kubernetes-list-map-keys": ["name"],
                                        "items": {
                                            "type": "object",
                                            "properties": {
                                                "name": {"type": "string"},
                                                "port": {"type": "integer"},
                                            },
                                        },
                                    },
                                },
                            },
                            "status": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            },
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def widgets(emu: Emulator) -> str:
    """The widgets.example.com CRD, installed once for this module."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    if emu.get(f"{crds}/widgets.example.com").status == 404:
        emu.post(crds, WIDGET_CRD).ok()
    return "/apis/example.com/v1"


# ----------------------------------------------------------------------------------------------
# discovery


def test_discovery_lists_builtins_with_subresources(emu: Emulator) -> None:
    assert emu.get("/version").ok()["major"] == "1"
    assert emu.get("/api").ok()["versions"] == ["v1"]
    groups = {g["name"]: g for g in emu.get("/apis").ok()["groups"]}
    for name in (
        "apps",
        "policy",
        "networking.k8s.io",
        "autoscaling",
        "rbac.authorization.k8s.io",
        "coordination.k8s.io",
        "events.k8s.io",
        "apiextensions.k8s.io",
    ):
        assert name in groups
    assert groups["autoscaling"]["preferredVersion"]["version"] == "v2"
    apps = {r["name"]: r for r in emu.get("/apis/apps/v1").ok()["resources"]}
    assert apps["deployments"]["kind"] == "Deployment"
    assert apps["deployments"]["namespaced"] is True
    assert "deploy" in apps["deployments"]["shortNames"]
    assert set(apps["deployments"]["verbs"]) >= {"create", "get", "list", "watch", "patch"}
    assert apps["deployments/scale"]["kind"] == "Scale"
    assert apps["deployments/scale"]["group"] == "autoscaling"
    assert "deployments/status" in apps
    core = {r["name"]: r for r in emu.get("/api/v1").ok()["resources"]}
    assert core["namespaces"]["namespaced"] is False
    for plural in (
        "configmaps",
        "secrets",
        "services",
        "serviceaccounts",
        "pods",
        "events",
        "endpoints",
    ):
        assert core[plural]["namespaced"] is True
    rbac = {r["name"]: r for r in emu.get("/apis/rbac.authorization.k8s.io/v1").ok()["resources"]}
    assert rbac["clusterroles"]["namespaced"] is False
    assert emu.get("/apis/nope.example.com/v1").status == 404


# ----------------------------------------------------------------------------------------------
# CRUD, metadata, errors


def test_create_sets_metadata_and_errors_look_like_kube(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    created = emu.post(base, cm("one"))
    assert created.status == 201
    meta = created.body["metadata"]
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"])
    assert meta["generation"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert meta["namespace"] == namespace
    assert created.body["kind"] == "ConfigMap" and created.body["apiVersion"] == "v1"
    assert meta["managedFields"][0]["manager"] == "kubeemu-tests"
    assert meta["managedFields"][0]["operation"] == "Update"
    assert "f:data" in meta["managedFields"][0]["fieldsV1"]

    second = emu.post(base, cm("two")).ok()
    assert rv(second) > rv(created.body)

    dup = emu.post(base, cm("one"))
    assert dup.status == 409
    assert dup.body["reason"] == "AlreadyExists"
    assert dup.body["message"] == 'configmaps "one" already exists'

    missing = emu.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/nope")
    assert missing.status == 404
    assert missing.body["kind"] == "Status" and missing.body["status"] == "Failure"
    assert missing.body["message"] == 'deployments.apps "nope" not found'
    assert missing.body["details"] == {"name": "nope", "group": "apps", "kind": "deployments"}

    no_ns = emu.post("/api/v1/namespaces/does-not-exist/configmaps", cm("x"))
    assert no_ns.status == 404
    assert no_ns.body["message"] == 'namespaces "does-not-exist" not found'

    bad_name = emu.post(base, cm("Bad_Name"))
    assert bad_name.status == 422
    assert bad_name.body["reason"] == "Invalid"
    assert bad_name.body["message"].startswith(
        'ConfigMap "Bad_Name" is invalid: metadata.name: '
        'Invalid value: "Bad_Name": a lowercase RFC 1123'
    )
    assert bad_name.body["details"]["causes"][0]["field"] == "metadata.name"

    bad_label = emu.post(base, cm("lbl", labels={"app": "x" * 64}))
    assert bad_label.status == 422
    assert "must be no more than 63 characters" in bad_label.body["message"]

    generated = emu.post(base, {"metadata": {"generateName": "gen-"}, "data": {}}).ok()
    assert re.fullmatch(r"gen-[a-z0-9]{5}", generated["metadata"]["name"])


def test_service_defaults_and_kept_cluster_ip(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/services"
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "api"},
        "spec": {"selector": {"app": "api"}, "ports": [{"name": "http", "port": 80}]},
    }
    made = emu.apply(f"{base}/api", svc, manager="ketch").ok()
    spec = made["spec"]
    assert spec["type"] == "ClusterIP"
    assert re.fullmatch(r"10\.96\.\d+\.\d+", spec["clusterIP"]) and spec["clusterIPs"] == [
        spec["clusterIP"]
    ]
    assert spec["ports"] == [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}]
    noop(emu, "apply", lambda: emu.apply(f"{base}/api", svc, manager="ketch").ok())
    replaced = emu.put(f"{base}/api", svc).ok()  # no clusterIP in the body: the old one stays
    assert replaced["spec"]["clusterIP"] == spec["clusterIP"]
    headless = emu.post(
        base,
        {"metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "selector": {"app": "x"}}},
    ).ok()
    assert headless["spec"]["clusterIPs"] == ["None"]
    changed = emu.patch(f"{base}/api", {"spec": {"clusterIP": "10.96.99.99"}})
    assert changed.status == 422 and "may not change once set" in changed.body["message"]


def test_put_conflict_on_stale_resource_version(emu: Emulator, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps/c"
    first = emu.post(f"/api/v1/namespaces/{namespace}/configmaps", cm("c")).ok()
    updated = emu.put(path, {**first, "data": {"k": "v2"}}).ok()
    assert rv(updated) > rv(first)
    stale = emu.put(path, {**first, "data": {"k": "v3"}})
    assert stale.status == 409
    assert stale.body["reason"] == "Conflict"
    assert stale.body["message"] == (
        'Operation cannot be fulfilled on configmaps "c": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    unconditional = dict(updated, data={"k": "v4"})
    unconditional["metadata"] = {
        k: v for k, v in updated["metadata"].items() if k != "resourceVersion"
    }
    assert emu.put(path, unconditional).ok()["data"] == {"k": "v4"}
    assert emu.put(f"/api/v1/namespaces/{namespace}/configmaps/zzz", cm("zzz")).status == 404


def test_generation_counts_spec_changes_only(emu: Emulator, namespace: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    d = emu.post(base, deployment("gen")).ok()
    assert d["metadata"]["generation"] == 1
    assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"]["type"] == "RollingUpdate"
    labelled = emu.patch(f"{base}/gen", {"metadata": {"labels": {"x": "y"}}}).ok()
    assert labelled["metadata"]["generation"] == 1
    assert rv(labelled) > rv(d)
    scaled = emu.patch(f"{base}/gen", {"spec": {"replicas": 2}}).ok()
    assert scaled["metadata"]["generation"] == 2
    # .status is ignored on the main endpoint of a resource with a status subresource
    sneaky = emu.patch(f"{base}/gen", {"status": {"replicas": 42}}).ok()
    assert sneaky.get("status", {}).get("replicas") != 42
    assert sneaky["metadata"]["generation"] == 2
    assert emu.get(f"{base}/gen").ok().get("status", {}).get("replicas") != 42


def test_noop_writes_keep_resource_version_and_emit_nothing(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    obj = emu.post(base, cm("same", {"a": "1"})).ok()
    before = obj["metadata"]["resourceVersion"]
    assert emu.put(f"{base}/same", obj).ok()["metadata"]["resourceVersion"] == before
    assert (
        emu.patch(f"{base}/same", {"data": {"a": "1"}}).ok()["metadata"]["resourceVersion"]
        == before
    )
    assert (
        emu.patch(
            f"{base}/same", [{"op": "replace", "path": "/data/a", "value": "1"}], kind="json"
        ).ok()["metadata"]["resourceVersion"]
        == before
    )
    assert watch_events(emu, base, before) == []
    changed = emu.patch(f"{base}/same", {"data": {"a": "2"}}).ok()
    events = watch_events(emu, base, before)
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in events] == [
        ("MODIFIED", changed["metadata"]["resourceVersion"])
    ]


def test_status_subresource_changes_only_status(emu: Emulator, namespace: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    emu.post(base, deployment("st", replicas=0)).ok()
    current = emu.get(f"{base}/st/status").ok()
    body = json.loads(json.dumps(current))
    body["spec"]["replicas"] = 5
    body["metadata"]["labels"] = {"changed": "yes"}
    body["status"] = {"observedGeneration": 99}
    body["metadata"].pop("resourceVersion")
    out = emu.put(f"{base}/st/status", body).ok()
    assert out["status"] == {"observedGeneration": 99}
    assert out["spec"]["replicas"] == 0
    assert out["metadata"]["labels"] == {"app": "st"}
    assert out["metadata"]["generation"] == 1
    status_entry = [e for e in out["metadata"]["managedFields"] if e.get("subresource")]
    assert status_entry and status_entry[0]["subresource"] == "status"


def test_scale_subresource(emu: Emulator, namespace: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    emu.post(base, deployment("sc", replicas=1)).ok()
    scale = emu.get(f"{base}/sc/scale").ok()
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
    assert scale["spec"] == {"replicas": 1}
    assert scale["status"]["selector"] == "app=sc"
    out = emu.patch(f"{base}/sc/scale", {"spec": {"replicas": 3}}).ok()
    assert out["spec"]["replicas"] == 3
    assert emu.get(f"{base}/sc").ok()["spec"]["replicas"] == 3
    wait_for(lambda: emu.get(f"{base}/sc/scale").ok()["status"]["replicas"] == 3, what="3 pods")
    bad = emu.patch(f"{base}/sc/scale", {"spec": {"replicas": -1}})
    assert bad.status == 422


# ----------------------------------------------------------------------------------------------
# list and watch


def test_list_selectors_and_pagination(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    for name, labels in [
        ("a", {"tier": "web", "env": "prod"}),
        ("b", {"tier": "db"}),
        ("c", {"tier": "web"}),
        ("d", {}),
    ]:
        emu.post(base, cm(name, labels=labels)).ok()

    def names(**params: str) -> list[str]:
        return [o["metadata"]["name"] for o in emu.get(base, params=params).ok()["items"]]

    assert names() == ["a", "b", "c", "d"]
    assert names(labelSelector="tier=web") == ["a", "c"]
    assert names(labelSelector="tier==web,env=prod") == ["a"]
    assert names(labelSelector="tier!=web") == ["b", "d"]
    assert names(labelSelector="tier in (db, web)") == ["a", "b", "c"]
    assert names(labelSelector="tier notin (web)") == ["b", "d"]
    assert names(labelSelector="env") == ["a"]
    assert names(labelSelector="!tier") == ["d"]
    assert names(fieldSelector="metadata.name=b") == ["b"]
    assert names(fieldSelector="metadata.name!=b,metadata.namespace=" + namespace) == [
        "a",
        "c",
        "d",
    ]
    assert emu.get(base, params={"labelSelector": "a in (b"}).status == 400

    page = emu.get(base, params={"limit": "3"}).ok()
    assert [o["metadata"]["name"] for o in page["items"]] == ["a", "b", "c"]
    assert page["metadata"]["remainingItemCount"] == 1
    rest = emu.get(base, params={"limit": "3", "continue": page["metadata"]["continue"]}).ok()
    assert [o["metadata"]["name"] for o in rest["items"]] == ["d"]
    assert "continue" not in rest["metadata"]

    gone = emu.delete(base, params={"labelSelector": "tier=web"}).ok()  # deletecollection
    assert sorted(o["metadata"]["name"] for o in gone["items"]) == ["a", "c"]
    assert names() == ["b", "d"]

    everywhere = emu.get("/api/v1/configmaps", params={"labelSelector": "tier=db"}).ok()
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in everywhere["items"]] == [
        (namespace, "b")
    ]
    assert everywhere["kind"] == "ConfigMapList"


def test_watch_from_resource_version_with_timeout(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    listed = emu.get(base).ok()["metadata"]["resourceVersion"]
    emu.post(base, cm("w1")).ok()
    emu.patch(f"{base}/w1", {"data": {"k": "v2"}}).ok()
    emu.delete(f"{base}/w1").ok()
    events = watch_events(emu, base, listed)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    rvs = [rv(e["object"]) for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    # without a resourceVersion: synthetic ADDED for what exists now
    emu.post(base, cm("w2")).ok()
    initial = list(emu.watch(base, {"timeoutSeconds": "1"}))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in initial] == [("ADDED", "w2")]
    # sendInitialEvents ends the initial burst with a bookmark
    streamed = list(
        emu.watch(
            base,
            {
                "timeoutSeconds": "1",
                "sendInitialEvents": "true",
                "allowWatchBookmarks": "true",
                "resourceVersionMatch": "NotOlderThan",
            },
        )
    )
    assert streamed[0]["type"] == "ADDED"
    assert streamed[1]["type"] == "BOOKMARK"
    assert streamed[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_watch_live_events_arrive_while_streaming(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    since = emu.get(base).ok()["metadata"]["resourceVersion"]
    got: list[dict[str, Any]] = []

    def consume() -> None:
        for ev in emu.watch(base, {"resourceVersion": since, "timeoutSeconds": "5"}):
            got.append(ev)
            if len(got) == 2:
                return

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.2)
    emu.post(base, cm("live1")).ok()
    emu.post(base, cm("live2")).ok()
    t.join(10)
    assert [e["object"]["metadata"]["name"] for e in got] == ["live1", "live2"]


def test_label_selector_watch_sees_objects_leave_and_enter(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    emu.post(base, cm("sel", labels={"team": "a"})).ok()
    since = emu.get(base).ok()["metadata"]["resourceVersion"]
    emu.patch(f"{base}/sel", {"metadata": {"labels": {"team": "b"}}}).ok()
    emu.patch(f"{base}/sel", {"data": {"k": "other"}}).ok()
    emu.patch(f"{base}/sel", {"metadata": {"labels": {"team": "a"}}}).ok()
    events = watch_events(emu, base, since, labelSelector="team=a")
    assert [e["type"] for e in events] == ["DELETED", "ADDED"]
    assert events[0]["object"]["metadata"]["labels"] == {"team": "a"}  # as it was last seen
    assert rv(events[0]["object"]) > int(since)


def test_watch_too_old_resource_version_gets_410() -> None:
    with start_emulator(watch_history=5) as small:
        base = "/api/v1/namespaces/default/configmaps"
        start = small.get(base).ok()["metadata"]["resourceVersion"]
        for i in range(8):
            small.post(base, cm(f"h{i}")).ok()
        events = list(small.watch(base, {"resourceVersion": start, "timeoutSeconds": "1"}))
        assert len(events) == 1 and events[0]["type"] == "ERROR"
        assert events[0]["object"]["code"] == 410
        assert events[0]["object"]["reason"] == "Expired"
        recent = small.get(base).ok()["metadata"]["resourceVersion"]
        assert watch_events(small, base, recent) == []


# ----------------------------------------------------------------------------------------------
# patches


def test_merge_json_and_strategic_patches(emu: Emulator, namespace: str, widgets: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    emu.post(base, deployment("p", env=[{"name": "A", "value": "1"}])).ok()
    smp = emu.patch(
        f"{base}/p",
        {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "main", "env": [{"name": "B", "value": "2"}]},
                            {"name": "sidecar", "image": "busybox"},
                        ]
                    }
                }
            }
        },
        kind="strategic",
    ).ok()
    containers = smp["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["main", "sidecar"]
    assert containers[0]["image"] == "nginx:1.25"
    assert containers[0]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    deleted = emu.patch(
        f"{base}/p",
        {"spec": {"template": {"spec": {"containers": [{"name": "sidecar", "$patch": "delete"}]}}}},
        kind="strategic",
    ).ok()
    assert [c["name"] for c in deleted["spec"]["template"]["spec"]["containers"]] == ["main"]

    merge = emu.patch(
        f"{base}/p",
        {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "nginx:2"}]}}}},
    ).ok()  # merge patch replaces lists
    assert merge["spec"]["template"]["spec"]["containers"][0].get("env") is None

    # JSON patch with kopf's optimistic lock (a ConfigMap: no controller writes in between)
    cm_path = f"/api/v1/namespaces/{namespace}/configmaps/jp"
    current = emu.post(f"/api/v1/namespaces/{namespace}/configmaps", cm("jp")).ok()["metadata"][
        "resourceVersion"
    ]
    ok = emu.patch(
        cm_path,
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": current},
            {"op": "add", "path": "/metadata/annotations", "value": {"a": "b"}},
        ],
        kind="json",
    )
    assert ok.ok()["metadata"]["annotations"] == {"a": "b"}
    stale = emu.patch(
        cm_path,
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": current},
            {"op": "add", "path": "/metadata/annotations/c", "value": "d"},
        ],
        kind="json",
    )
    assert stale.status == 422
    assert emu.patch(f"{base}/missing", {"a": 1}).status == 404

    emu.post(
        f"{widgets}/namespaces/{namespace}/widgets",
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "w"},
            "spec": {"size": 1},
        },
    ).ok()
    unsupported = emu.patch(
        f"{widgets}/namespaces/{namespace}/widgets/w", {"spec": {}}, kind="strategic"
    )
    assert unsupported.status == 415


# ----------------------------------------------------------------------------------------------
# server-side apply


def test_apply_creates_and_records_field_ownership(emu: Emulator, namespace: str) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/ssa"
    body = deployment("ssa", replicas=2)
    created = emu.apply(path, body, manager="ketch")
    assert created.status == 201
    obj = created.body
    entries = managers(obj)
    assert list(entries) == [("ketch", "Apply")]
    fields = entries[("ketch", "Apply")]
    assert fields["f:spec"]["f:replicas"] == {}
    container = fields["f:spec"]["f:template"]["f:spec"]["f:containers"]['k:{"name":"main"}']
    assert container["."] == {} and container["f:image"] == {}
    assert 'k:{"containerPort":8000}' in container["f:ports"]
    assert "f:strategy" not in fields["f:spec"]  # defaulted fields have no owner
    entry = obj["metadata"]["managedFields"][0]
    assert entry["fieldsType"] == "FieldsV1" and entry["apiVersion"] == "apps/v1"
    assert "subresource" not in entry

    again = noop(emu, "apply", lambda: emu.apply(path, body, manager="ketch").ok())
    assert managers(again)[("ketch", "Apply")] == managers(obj)[("ketch", "Apply")]

    as_yaml = (
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: ssa\n" + "spec:\n  replicas: 3\n"
    )
    assert emu.apply(path, as_yaml, manager="other").status == 409  # ketch owns replicas

    log = emu.applied(manager="ketch", namespace=namespace)
    assert [e["body"] for e in log] == [body, body]
    assert log[0]["kind"] == "Deployment" and log[0]["name"] == "ssa"
    assert emu.apply(path, body, manager="").status == 400


def test_apply_removes_fields_the_manager_stopped_applying(emu: Emulator, namespace: str) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/prune"
    full = deployment("prune", env=[{"name": "A", "value": "1"}, {"name": "B", "value": "2"}])
    full["metadata"]["labels"]["extra"] = "yes"
    full["metadata"]["annotations"] = {"note": "x"}
    emu.apply(path, full, manager="ketch").ok()
    slim = deployment("prune", env=[{"name": "A", "value": "1"}])
    out = emu.apply(path, slim, manager="ketch").ok()
    assert out["metadata"]["labels"] == {"app": "prune"}
    assert "annotations" not in out["metadata"]
    assert out["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    # a field another manager also set survives when the applier drops it
    emu.patch(path, {"metadata": {"labels": {"shared": "v"}}}, params={"fieldManager": "human"})
    emu.apply(
        path,
        {**slim, "metadata": {**slim["metadata"], "labels": {"app": "prune", "shared": "v"}}},
        manager="ketch",
    ).ok()
    kept = emu.apply(path, slim, manager="ketch").ok()
    assert kept["metadata"]["labels"] == {"app": "prune", "shared": "v"}


def test_apply_conflicts_and_force(emu: Emulator, namespace: str) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/cf"
    emu.apply(path, deployment("cf", image="app:v1"), manager="ketch").ok()
    # someone `kubectl edit`s the image: an Update that takes ownership of that field
    edit = emu.patch(
        path,
        {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "app:hacked"}]}}}},
        kind="strategic",
        params={"fieldManager": "kubectl-edit"},
    ).ok()
    owners = managers(edit)
    assert ("kubectl-edit", "Update") in owners
    ketch_fields = owners[("ketch", "Apply")]
    assert (
        "f:image"
        not in ketch_fields["f:spec"]["f:template"]["f:spec"]["f:containers"]['k:{"name":"main"}']
    )
    # re-apply without force: 409 naming the field and the manager
    refused = emu.apply(path, deployment("cf", image="app:v1"), manager="ketch")
    assert refused.status == 409
    assert refused.body["reason"] == "Conflict"
    assert refused.body["message"] == (
        'Apply failed with 1 conflict: conflict with "kubectl-edit" using apps/v1: '
        '.spec.template.spec.containers[name="main"].image'
    )
    assert refused.body["details"]["causes"][0]["field"] == (
        '.spec.template.spec.containers[name="main"].image'
    )
    # applying the same value as the other owner is not a conflict (shared ownership)
    same = emu.apply(path, deployment("cf", image="app:hacked"), manager="other-applier")
    assert same.status == 200
    # force puts it back and takes the field over
    forced = emu.apply(path, deployment("cf", image="app:v1"), manager="ketch", force=True).ok()
    assert forced["spec"]["template"]["spec"]["containers"][0]["image"] == "app:v1"
    owners = managers(forced)
    assert ("kubectl-edit", "Update") not in owners  # it owned nothing else
    assert 'k:{"name":"main"}' not in json.dumps(
        owners.get(("other-applier", "Apply"), {})
    ) or "f:image" not in json.dumps(owners.get(("other-applier", "Apply"), {}))
    noop(
        emu,
        "apply",
        lambda: emu.apply(path, deployment("cf", image="app:v1"), manager="ketch", force=True).ok(),
    )


def test_managed_fields_can_be_rewritten_or_cleared(emu: Emulator, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps/mf"
    emu.apply(path, cm("mf", {"a": "1"}), manager="one").ok()
    current = emu.get(path).ok()
    renamed = json.loads(json.dumps(current["metadata"]["managedFields"]).replace('"one"', '"two"'))
    out = emu.patch(path, {"metadata": {"managedFields": renamed}}).ok()
    assert [e["manager"] for e in out["metadata"]["managedFields"]] == ["two"]
    cleared = emu.patch(path, {"metadata": {"managedFields": [{}]}}).ok()
    assert "managedFields" not in cleared["metadata"]
    # status writes cannot rewrite them: the live ones are the base there
    deploy = f"/apis/apps/v1/namespaces/{namespace}/deployments/mfd"
    emu.apply(deploy, deployment("mfd", replicas=0), manager="one").ok()
    live = emu.get(deploy).ok()
    st = emu.patch(
        f"{deploy}/status",
        {"metadata": {"managedFields": [{}]}, "status": {"observedGeneration": 5}},
    )
    assert ("one", "Apply") in managers(st.ok()), live["metadata"]["managedFields"]


def test_apply_merges_keyed_lists_with_other_managers(emu: Emulator, namespace: str) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/keyed"
    emu.apply(path, deployment("keyed"), manager="ketch").ok()
    emu.patch(
        path,
        {
            "spec": {
                "template": {"spec": {"containers": [{"name": "injected", "image": "sidecar:1"}]}}
            }
        },
        kind="strategic",
        params={"fieldManager": "mesh-injector"},
    ).ok()
    out = emu.apply(path, deployment("keyed", image="nginx:2"), manager="ketch").ok()
    containers = {c["name"]: c["image"] for c in out["spec"]["template"]["spec"]["containers"]}
    assert containers == {"main": "nginx:2", "injected": "sidecar:1"}


def test_apply_on_status_subresource_and_custom_resources(
    emu: Emulator, namespace: str, widgets: str
) -> None:
    path = f"{widgets}/namespaces/{namespace}/widgets/applied"
    w = {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "applied"},
        "spec": {"size": 2, "tags": ["a", "b"], "ports": [{"name": "http", "port": 80}]},
        "status": {"phase": "ignored"},
    }
    created = emu.apply(path, w, manager="user").ok()
    assert "status" not in created  # status is reset on the main endpoint
    emu.apply(
        path,
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "applied"},
            "spec": {"tags": ["c"], "ports": [{"name": "grpc", "port": 90}]},
        },
        manager="other",
        force=True,
    ).ok()
    merged = emu.get(path).ok()
    assert merged["spec"]["tags"] == ["c"]  # atomic list: replaced whole
    assert merged["spec"]["ports"] == [{"name": "http", "port": 80}, {"name": "grpc", "port": 90}]
    st = emu.apply(
        f"{path}/status",
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "applied"},
            "status": {"phase": "Ready"},
        },
        manager="operator",
    ).ok()
    assert st["status"] == {"phase": "Ready"}
    entry = next(e for e in st["metadata"]["managedFields"] if e["manager"] == "operator")
    assert entry["subresource"] == "status" and entry["operation"] == "Apply"


# ----------------------------------------------------------------------------------------------
# deletion


def test_garbage_collection_cascades_and_orphans(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    owner = emu.post(base, cm("owner")).ok()

    def ref(o: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": o["metadata"]["name"],
            "uid": o["metadata"]["uid"],
        }

    child = emu.post(base, cm("child", ownerReferences=[ref(owner)])).ok()
    emu.post(base, cm("grandchild", ownerReferences=[ref(child)])).ok()
    other = emu.post(base, cm("other-owner")).ok()
    emu.post(base, cm("two-owners", ownerReferences=[ref(owner), ref(other)])).ok()
    deleted = emu.delete(f"{base}/owner")
    assert deleted.status == 200
    left = {o["metadata"]["name"] for o in emu.get(base).ok()["items"]}
    assert left == {"other-owner", "two-owners"}

    keep = emu.post(base, cm("keeper")).ok()
    emu.post(base, cm("orphan", ownerReferences=[ref(keep)])).ok()
    emu.delete(f"{base}/keeper", params={"propagationPolicy": "Orphan"}).ok()
    orphan = emu.get(f"{base}/orphan").ok()
    assert "ownerReferences" not in orphan["metadata"]

    dangling = emu.post(
        base,
        cm(
            "dangling",
            ownerReferences=[
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "name": "ghost",
                    "uid": "00000000-0000-0000-0000-000000000000",
                }
            ],
        ),
    ).ok()
    assert dangling["metadata"]["name"] == "dangling"
    wait_for(lambda: emu.get(f"{base}/dangling").status == 404, what="dangling child collected")


def test_finalizers_hold_deletion(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    created = emu.post(base, cm("fin", finalizers=["example.com/hold"])).ok()
    pending = emu.delete(f"{base}/fin").ok()
    assert pending["metadata"]["deletionTimestamp"]
    assert rv(pending) > rv(created)
    assert emu.get(f"{base}/fin").ok()["metadata"]["deletionTimestamp"]
    more = emu.patch(f"{base}/fin", {"metadata": {"finalizers": ["example.com/hold", "new"]}})
    assert more.status == 422 and "no new finalizers" in more.body["message"]
    since = pending["metadata"]["resourceVersion"]
    emu.patch(f"{base}/fin", {"metadata": {"finalizers": None}}).ok()
    assert emu.get(f"{base}/fin").status == 404
    assert [e["type"] for e in watch_events(emu, base, since)] == ["DELETED"]
    precondition = emu.post(base, cm("pre")).ok()
    wrong = emu.delete(f"{base}/pre", body={"preconditions": {"uid": "nope"}})
    assert wrong.status == 409 and "Precondition failed" in wrong.body["message"]
    assert (
        emu.delete(
            f"{base}/pre", body={"preconditions": {"uid": precondition["metadata"]["uid"]}}
        ).status
        == 200
    )


def test_namespace_deletion_removes_its_objects(emu: Emulator) -> None:
    ns = "doomed-ns"
    emu.post("/api/v1/namespaces", {"metadata": {"name": ns}}).ok()
    emu.post(f"/api/v1/namespaces/{ns}/configmaps", cm("x")).ok()
    emu.post(f"/api/v1/namespaces/{ns}/configmaps", cm("held", finalizers=["a/b"])).ok()
    out = emu.delete(f"/api/v1/namespaces/{ns}").ok()
    assert out["status"]["phase"] == "Terminating"
    assert emu.get(f"/api/v1/namespaces/{ns}/configmaps/x").status == 404
    refused = emu.post(f"/api/v1/namespaces/{ns}/configmaps", cm("late"))
    assert refused.status == 403 and "being terminated" in refused.body["message"]
    emu.patch(f"/api/v1/namespaces/{ns}/configmaps/held", {"metadata": {"finalizers": []}}).ok()
    assert emu.get(f"/api/v1/namespaces/{ns}").status == 404


def test_dry_run_persists_nothing(emu: Emulator, namespace: str) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    dry = {"dryRun": "All"}
    made = emu.post(base, cm("dry"), params=dry)
    assert made.status == 201 and made.body["metadata"]["name"] == "dry"
    assert emu.get(f"{base}/dry").status == 404
    real = emu.post(base, cm("real")).ok()
    start = real["metadata"]["resourceVersion"]
    assert emu.patch(f"{base}/real", {"data": {"k": "dry"}}, params=dry).ok()["data"] == {
        "k": "dry"
    }
    assert emu.apply(
        f"{base}/real", cm("real", {"k": "applied"}), manager="m", force=True, params=dry
    ).ok()["data"] == {"k": "applied"}
    assert emu.apply(f"{base}/new", cm("new"), manager="m", params=dry).status == 201
    assert emu.delete(f"{base}/real", params=dry).status == 200
    after = emu.get(f"{base}/real").ok()
    assert after["data"] == {"k": "v"} and after["metadata"]["resourceVersion"] == start
    assert emu.get(f"{base}/new").status == 404
    assert watch_events(emu, base, start) == []


def test_builtin_unknown_fields_are_dropped_or_refused(emu: Emulator, namespace: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    typo = deployment("typo")
    typo["spec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    typo["spec"]["bogus"] = 1
    strict = emu.post(base, typo, params={"fieldValidation": "Strict"})
    assert strict.status == 400
    assert strict.body["message"] == (
        'Deployment in version "v1" cannot be handled as a Deployment: strict decoding error: '
        'unknown field "spec.template.spec.containers[0].imagee", unknown field "spec.bogus"'
    )  # in the order the decoder meets them
    warned = emu.post(base, typo)  # no fieldValidation: Warn, like the real default
    assert warned.status == 201
    assert "bogus" not in warned.body["spec"]
    assert "imagee" not in warned.body["spec"]["template"]["spec"]["containers"][0]
    assert '299 - "unknown field \\"spec.bogus\\""' in warned.warnings
    out = kubectl(emu, "apply", "-n", namespace, "-f", "-", input=json.dumps(typo))
    assert out.returncode != 0 and 'unknown field "spec.bogus"' in out.stderr


# ----------------------------------------------------------------------------------------------
# custom resources


def test_crd_serves_its_resource_at_once(emu: Emulator, namespace: str, widgets: str) -> None:
    crd = emu.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com")
    conds = {c["type"]: c["status"] for c in crd.ok()["status"]["conditions"]}
    assert conds == {"NamesAccepted": "True", "Established": "True"}
    assert crd.body["status"]["acceptedNames"]["kind"] == "Widget"
    resources = {r["name"]: r for r in emu.get(widgets).ok()["resources"]}
    assert resources["widgets"]["shortNames"] == ["wd"]
    assert {"widgets/status", "widgets/scale"} <= set(resources)
    base = f"{widgets}/namespaces/{namespace}/widgets"
    w = emu.post(
        base,
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "w1"},
            "spec": {"size": 3, "replicas": 2},
            "status": {"phase": "dropped"},
        },
    ).ok()
    assert "status" not in w
    assert emu.put(f"{base}/w1/status", {**w, "status": {"phase": "Ready"}}).ok()["status"] == {
        "phase": "Ready"
    }
    assert emu.get(f"{base}/w1/scale").ok()["spec"]["replicas"] == 2
    table = emu.get(
        base, headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}
    ).ok()
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Phase", "Ready"]
    assert table["rows"][0]["cells"][:3] == ["w1", 3, "Ready"]
    wrong_kind = emu.post(
        base, {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "g"}}
    )
    assert wrong_kind.status == 400


def test_deleting_a_crd_removes_resource_and_objects(emu: Emulator, namespace: str) -> None:
    crd = json.loads(json.dumps(WIDGET_CRD).replace("widget", "gizmo").replace("Widget", "Gizmo"))
    crd["spec"]["names"]["shortNames"] = ["gz"]
    emu.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd).ok()
    base = f"/apis/example.com/v1/namespaces/{namespace}/gizmos"
    emu.post(
        base,
        {"apiVersion": "example.com/v1", "kind": "Gizmo", "metadata": {"name": "g"}, "spec": {}},
    ).ok()
    emu.delete("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gizmos.example.com").ok()
    assert emu.get(base).status == 404
    names = [r["name"] for r in emu.get("/apis/example.com/v1").ok()["resources"]]
    assert "gizmos" not in names


def test_custom_resource_validation_errors_reach_the_client(
    emu: Emulator, namespace: str, widgets: str
) -> None:
    pytest.importorskip("kubeemu.validation", reason="the CRD validation module is not there yet")
    base = f"{widgets}/namespaces/{namespace}/widgets"
    bad = emu.post(
        base,
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "bad"},
            "spec": {"size": 0},
        },
    )
    assert bad.status == 422
    assert bad.body["reason"] == "Invalid"
    assert bad.body["message"].startswith('Widget.example.com "bad" is invalid: spec.size')
    assert bad.body["details"]["causes"][0]["field"] == "spec.size"
    unknown = {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "unk"},
        "spec": {"size": 1, "foo": 1},
    }
    strict = emu.post(base, unknown, params={"fieldValidation": "Strict"})
    assert strict.status == 400
    assert strict.body["message"] == 'strict decoding error: unknown field "spec.foo"'
    warned = emu.post(base, unknown, params={"fieldValidation": "Warn"})
    assert warned.status == 201 and "foo" not in warned.body["spec"]
    assert any("spec.foo" in w for w in warned.warnings)


# ----------------------------------------------------------------------------------------------
# real clients: kubectl and kopf


def test_kubectl_round_trip(emu: Emulator, namespace: str, tmp_path: Path) -> None:
    manifest = tmp_path / "app.yaml"
    manifest.write_text(
        textwrap.dedent(f"""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: settings
          namespace: {namespace}
        data:
          mode: fast
        ---
        apiVersion: apps/v1
        kind: Deployment
        metadata:
          name: api
          namespace: {namespace}
        spec:
          replicas: 1
          selector:
            matchLabels: {{app: api}}
          template:
            metadata:
              labels: {{app: api}}
            spec:
              containers:
              - name: main
                image: nginx:1.25
        """)
    )
    applied = kubectl(emu, "apply", "-f", str(manifest))
    assert applied.returncode == 0, applied.stderr
    assert "configmap/settings created" in applied.stdout
    assert "deployment.apps/api created" in applied.stdout
    again = kubectl(emu, "apply", "-f", str(manifest))
    assert "configmap/settings unchanged" in again.stdout, again.stderr
    waited = kubectl(
        emu, "wait", "--for=condition=Available", "deployment/api", "-n", namespace, "--timeout=20s"
    )
    assert waited.returncode == 0, waited.stderr
    rollout = kubectl(emu, "rollout", "status", "deployment/api", "-n", namespace, "--timeout=20s")
    assert rollout.returncode == 0 and "successfully rolled out" in rollout.stdout, rollout.stderr
    got = kubectl(emu, "get", "configmap", "settings", "-n", namespace, "-o", "json")
    assert json.loads(got.stdout)["data"] == {"mode": "fast"}
    table = kubectl(emu, "get", "deployments", "-n", namespace)
    assert re.search(r"^api\s+1/1\s+1\s+1\s+", table.stdout, re.M), table.stdout
    ssa = kubectl(emu, "apply", "--server-side", "-f", str(manifest))
    assert ssa.returncode == 0, ssa.stderr
    assert "serverside-applied" in ssa.stdout
    yaml_out = kubectl(
        emu, "get", "deployment", "api", "-n", namespace, "-o", "yaml", "--show-managed-fields"
    )
    assert "manager: kubectl" in yaml_out.stdout and "operation: Apply" in yaml_out.stdout
    # kubectl migrated the client-side apply ownership to its server-side manager
    assert "kubectl-client-side-apply" not in yaml_out.stdout
    scaled = kubectl(emu, "scale", "deployment/api", "--replicas=2", "-n", namespace)
    assert scaled.returncode == 0, scaled.stderr
    missing = kubectl(emu, "get", "deployment", "nope", "-n", namespace)
    assert missing.returncode != 0
    assert 'deployments.apps "nope" not found' in missing.stderr
    deleted = kubectl(emu, "delete", "-f", str(manifest))
    assert deleted.returncode == 0, deleted.stderr
    assert 'configmap "settings" deleted' in deleted.stdout
    assert kubectl(emu, "get", "configmap", "settings", "-n", namespace).returncode != 0


def test_kubectl_with_custom_resources(
    emu: Emulator, namespace: str, widgets: str, tmp_path: Path
) -> None:
    manifest = tmp_path / "w.yaml"
    manifest.write_text(
        textwrap.dedent("""\
        apiVersion: example.com/v1
        kind: Widget
        metadata:
          name: from-kubectl
        spec:
          size: 4
        """)
    )
    out = kubectl(emu, "apply", "-n", namespace, "-f", str(manifest))
    assert out.returncode == 0 and "widget.example.com/from-kubectl created" in out.stdout, (
        out.stderr
    )
    listed = kubectl(emu, "get", "wd", "-n", namespace)
    assert re.search(r"^from-kubectl\s+4\s", listed.stdout, re.M), listed.stdout + listed.stderr
    manifest.write_text(manifest.read_text().replace("size: 4", "size: 5"))
    out = kubectl(emu, "apply", "-n", namespace, "-f", str(manifest))
    assert out.returncode == 0 and "configured" in out.stdout, out.stderr
    ssa = kubectl(emu, "apply", "--server-side", "-n", namespace, "-f", str(manifest))
    assert ssa.returncode == 0, ssa.stderr
    out = kubectl(emu, "delete", "widget", "from-kubectl", "-n", namespace)
    assert out.returncode == 0, out.stderr


KOPF_OPERATOR = """
import json
import subprocess
import os
import urllib.request

import kopf

URL = os.environ["KUBEEMU_TEST_URL"]


@kopf.on.login()
def login(**kwargs):  # a fresh registry lacks kopf's built-in ones; this is the KUBECONFIG one
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.create("example.com", "v1", "widgets")
def create_fn(spec, name, namespace, body, patch, **_):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
          "data": {"size": str(spec.get("size"))}}
    kopf.adopt(cm, owner=body)
    req = urllib.request.Request(
        f"{URL}/api/v1/namespaces/{namespace}/configmaps", data=json.dumps(cm).encode(),
        method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
    patch.status["phase"] = "Created"
    kopf.info(body, reason="Configured", message="the ConfigMap is there")
    return {"configmap": f"{name}-config"}


@kopf.on.delete("example.com", "v1", "widgets")
def delete_fn(name, namespace, **_):
    mark = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-deleted"}}
    req = urllib.request.Request(
        f"{URL}/api/v1/namespaces/{namespace}/configmaps", data=json.dumps(mark).encode(),
        method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
"""


def test_kopf_operator_round_trip(
    emu: Emulator, namespace: str, widgets: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf
    from kopf.testing import KopfRunner

    script = tmp_path / "widget_operator.py"
    script.write_text(KOPF_OPERATOR)
    monkeypatch.setenv("KUBECONFIG", emu.kubeconfig)
    monkeypatch.setenv("KUBEEMU_TEST_URL", emu.url)
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    base = f"{widgets}/namespaces/{namespace}/widgets"
    with KopfRunner(
        ["run", "--standalone", "--namespace", namespace, "--verbose", str(script)],
        registry=kopf.OperatorRegistry(),
        settings=settings,
        timeout=30,
    ) as runner:
        emu.post(
            base,
            {
                "apiVersion": "example.com/v1",
                "kind": "Widget",
                "metadata": {"name": "kw"},
                "spec": {"size": 7},
            },
        ).ok()
        done = wait_for(
            lambda: (o := emu.get(f"{base}/kw").ok()).get("status", {}).get("create_fn") and o,
            timeout=30,
            what="kopf handled the widget",
        )
        configmap = emu.get(f"/api/v1/namespaces/{namespace}/configmaps/kw-config").ok()
        events = wait_for(
            lambda: [
                (e["reason"], e["type"])
                for e in emu.get(f"/api/v1/namespaces/{namespace}/events").ok()["items"]
                if e["involvedObject"]["name"] == "kw"
            ],
            what="kopf's event",
        )
        # deleting runs the delete handler (kopf holds a finalizer), then GC takes the ConfigMap
        emu.delete(f"{base}/kw").ok()
        wait_for(lambda: emu.get(f"{base}/kw").status == 404, timeout=30, what="widget gone")
    assert runner.exit_code == 0, runner.output
    assert done["status"]["phase"] == "Created"
    assert "kopf.zalando.org/KopfFinalizerMarker" in done["metadata"]["finalizers"]
    assert emu.get(f"/api/v1/namespaces/{namespace}/configmaps/kw-deleted").status == 200
    assert done["status"]["create_fn"] == {"configmap": "kw-config"}
    assert configmap["data"] == {"size": "7"}
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == done["metadata"]["uid"]
    assert emu.get(f"/api/v1/namespaces/{namespace}/configmaps/kw-config").status == 404
    assert events == [("Configured", "Normal")]
    assert "Traceback" not in runner.output, runner.output


def test_kubectl_imperative_create_and_get_watch(emu: Emulator, namespace: str) -> None:
    # `kubectl create <kind>` sends protobuf bodies; these simple kinds are decoded
    for args in (
        ["create", "configmap", "imp", "--from-literal=a=b"],
        ["create", "secret", "generic", "pw", "--from-literal=pw=hunter2"],
        ["create", "serviceaccount", "robot"],
    ):
        out = kubectl(emu, *args, "-n", namespace)
        assert out.returncode == 0, out.stderr
    assert emu.get(f"/api/v1/namespaces/{namespace}/configmaps/imp").ok()["data"] == {"a": "b"}
    secret = emu.get(f"/api/v1/namespaces/{namespace}/secrets/pw").ok()
    assert secret["data"] == {"pw": "aHVudGVyMg=="} and secret["type"] == "Opaque"
    watcher = subprocess.Popen(
        ["kubectl", "--kubeconfig", emu.kubeconfig, "get", "configmaps", "-w", "-n", namespace],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: emu.stats()["watchers"] > 0, what="kubectl watching")
        emu.post(
            f"/api/v1/namespaces/{namespace}/configmaps", cm("watched", {"x": "1", "y": "2"})
        ).ok()
        time.sleep(0.5)
    finally:
        watcher.terminate()
        out, err = watcher.communicate(timeout=10)
    assert re.search(r"^watched\s+2\s", out, re.M), out + err  # server-side table rows
