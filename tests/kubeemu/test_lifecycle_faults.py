"""The emulator's lifecycle faults and the apply semantics a replica handoff depends on.

- ``expire_watches``: etcd compaction reaching open watches (410 Expired), as kopf must survive;
- holds: a request that waits at the server, so a test can stop a client mid-way;
- server-side apply field ownership of ``spec.replicas`` when an applier stops setting it, with
  and without a second manager holding it (Kubernetes' documented handover to an HPA).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from typing import Any

from kubeemu import Emulator


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def config_map(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"a": "1"}}


def deployment(name: str, replicas: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": name}},
        "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": "main", "image": "app:v1"}]},
        },
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": spec}


def replicas_owners(obj: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(manager, operation, subresource) of every managedFields entry that owns spec.replicas."""
    return {
        (e["manager"], e["operation"], e.get("subresource", ""))
        for e in obj["metadata"].get("managedFields") or []
        if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})
    }


class Watch(threading.Thread):
    """Collects one watch stream's events in a thread, until the server ends it."""

    def __init__(self, emu: Emulator, path: str, params: dict[str, Any]):
        super().__init__(daemon=True)
        self.emu, self.path, self.params = emu, path, params
        self.events: list[dict[str, Any]] = []
        self.start()

    def run(self) -> None:
        self.events.extend(self.emu.watch(self.path, self.params, timeout=30))


# ----------------------------------------------------------------------------------------------
# watch expiry


def test_expired_watches_get_410_and_a_fresh_list_resumes(emu: Emulator, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    emu.post(path, config_map("before")).ok()
    listed = emu.get(path).ok()["metadata"]["resourceVersion"]
    watch = Watch(emu, path, {"resourceVersion": listed, "timeoutSeconds": 20})
    wait_for(lambda: emu.stats()["watchers"] >= 1, "the watch to be registered")
    emu.post(path, config_map("seen")).ok()
    wait_for(lambda: watch.events, "the watch to see the new ConfigMap")

    assert emu.expire_watches("configmaps") >= 1
    watch.join(10)
    assert not watch.is_alive(), "an expired watch must end"
    assert [e["type"] for e in watch.events] == ["ADDED", "ERROR"]
    error = watch.events[-1]["object"]
    assert (error["kind"], error["code"], error["reason"]) == ("Status", 410, "Expired")
    assert error["message"] == "The resourceVersion for the provided watch is too old."

    # resuming from a version before the compaction is refused: that history is gone
    again = list(emu.watch(path, {"resourceVersion": listed, "timeoutSeconds": 2}))
    assert [e["type"] for e in again] == ["ERROR"]
    assert again[0]["object"]["code"] == 410
    assert again[0]["object"]["message"].startswith("too old resource version")

    # a fresh list gives a version to watch from, and changes after it arrive
    fresh = emu.get(path).ok()
    assert {i["metadata"]["name"] for i in fresh["items"]} == {"before", "seen"}
    resumed = Watch(emu, path, {"resourceVersion": fresh["metadata"]["resourceVersion"]})
    wait_for(lambda: emu.stats()["watchers"] >= 1, "the new watch")
    emu.post(path, config_map("after")).ok()
    wait_for(lambda: resumed.events, "the resumed watch to see a change")
    assert resumed.events[0]["type"] == "ADDED"
    assert resumed.events[0]["object"]["metadata"]["name"] == "after"
    emu.expire_watches("configmaps")  # ends it
    resumed.join(10)


def test_expiring_one_type_leaves_other_watches_open(emu: Emulator, namespace: str) -> None:
    secrets = f"/api/v1/namespaces/{namespace}/secrets"
    rv = emu.get(secrets).ok()["metadata"]["resourceVersion"]
    watch = Watch(emu, secrets, {"resourceVersion": rv, "timeoutSeconds": 20})
    wait_for(lambda: emu.stats()["watchers"] >= 1, "the watch")
    emu.expire_watches("configmaps", "deployments.apps")
    emu.post(secrets, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}).ok()
    wait_for(lambda: watch.events, "the secrets watch to go on")
    assert watch.events[0]["type"] == "ADDED"
    emu.expire_watches("secrets")
    watch.join(10)


# ----------------------------------------------------------------------------------------------
# holds


def test_a_held_request_waits_until_released(emu: Emulator, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    emu.hold(verb="create", resource="configmaps", namespace=namespace)
    answers: list[int] = []
    writer = threading.Thread(
        target=lambda: answers.append(emu.post(path, config_map("held")).status), daemon=True
    )
    writer.start()
    try:
        wait_for(lambda: emu.holds()[0]["waiting"] == 1, "the create to be held")
        assert emu.get(f"{path}/held").status == 404  # reads are not held
        assert emu.post(f"/api/v1/namespaces/{namespace}/secrets", {"metadata": {"name": "x"}}).ok()
    finally:
        emu.release()
    writer.join(10)
    assert answers == [201]
    assert emu.get(f"{path}/held").ok()["data"] == {"a": "1"}
    assert emu.holds() == []


def test_a_held_request_whose_client_left_is_never_served(emu: Emulator, namespace: str) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/gone"
    emu.hold(verb="apply", resource="deployments", namespace=namespace)
    url = urllib.parse.urlsplit(emu.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request(
            "PATCH",
            f"{path}?fieldManager=quitter",
            body=json.dumps(deployment("gone", 2)),
            headers={
                "Content-Type": "application/apply-patch+yaml",
                "Authorization": "Bearer kubeemu-token",
            },
        )
        wait_for(lambda: emu.holds()[0]["waiting"] == 1, "the apply to be held")
    finally:
        conn.close()  # the client dies with its request in flight
    try:
        wait_for(lambda: emu.holds()[0]["waiting"] == 0, "the held apply to be dropped")
        assert emu.holds()[0]["caught"] == 1
    finally:
        emu.release()
    time.sleep(0.2)
    assert emu.get(path).status == 404


# ----------------------------------------------------------------------------------------------
# spec.replicas between an applier and an autoscaler


def test_replicas_fall_to_the_default_when_their_only_manager_drops_them(
    emu: Emulator, namespace: str
) -> None:
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/drop"
    emu.apply(path, deployment("drop", 3), manager="op").ok()
    out = emu.apply(path, deployment("drop", None), manager="op").ok()
    assert out["spec"]["replicas"] == 1  # removed, then defaulted, as kube-apiserver does
    assert replicas_owners(out) == set()


def test_replicas_handed_over_stay_and_go_to_the_autoscaler(emu: Emulator, namespace: str) -> None:
    """Kubernetes' documented handover ("Transferring ownership", server-side apply): a
    replicas-only apply by a private manager keeps the field while the applier drops it; the
    autoscaler's first scale takes it, and the private manager's entry disappears."""
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/hand"
    emu.apply(path, deployment("hand", 3), manager="op").ok()
    only = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "hand"},
        "spec": {"replicas": 3},
    }
    shared = emu.apply(path, only, manager="handover").ok()  # same value: shared, no conflict
    assert replicas_owners(shared) == {("op", "Apply", ""), ("handover", "Apply", "")}
    out = emu.apply(path, deployment("hand", None), manager="op").ok()
    assert out["spec"]["replicas"] == 3
    assert replicas_owners(out) == {("handover", "Apply", "")}

    scaled = emu.patch(
        f"{path}/scale", {"spec": {"replicas": 5}}, params={"fieldManager": "hpa"}
    ).ok()
    assert scaled["spec"]["replicas"] == 5
    live = emu.get(path).ok()
    assert replicas_owners(live) == {("hpa", "Update", "scale")}
    assert "handover" not in {e["manager"] for e in live["metadata"]["managedFields"]}
    again = emu.apply(path, deployment("hand", None), manager="op").ok()
    assert again["spec"]["replicas"] == 5

    # once the autoscaler owns it, a handover with another value is a conflict (not forced)
    refused = emu.apply(path, {**only, "spec": {"replicas": 2}}, manager="handover")
    assert refused.status == 409
    assert 'conflict with "hpa" with subresource "scale"' in refused.body["message"]
