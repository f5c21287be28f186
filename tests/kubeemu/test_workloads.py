"""The emulator's controllers behave like kube-controller-manager and a kubelet where the operator
depends on them: Deployments own ReplicaSets, rollouts follow the strategy step by step, pods
become ready when their behaviour says so, init containers can fail.

Rollouts are checked by replaying the watch history (one resourceVersion sequence across kinds),
so every intermediate state the API served is looked at, not only the ones a poll happened to
catch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import procs
from kubeemu import Emulator, kubectl
from kubeemu.rollout import fenceposts

Obj = dict[str, Any]


def wait_for(fn: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    return procs.wait_for(fn, timeout, what, interval=0.03)


def deployment(name: str, image: str = "app:v1", replicas: int = 1, **spec: Any) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "main", "image": image}]},
            },
            **spec,
        },
    }


def rolling(surge: Any, unavailable: Any) -> Obj:
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
    }


class Apps:
    """Deployments, ReplicaSets and pods of one namespace."""

    def __init__(self, emu: Emulator, namespace: str) -> None:
        self.emu = emu
        self.ns = namespace
        self.deployments = f"/apis/apps/v1/namespaces/{namespace}/deployments"
        self.replicasets = f"/apis/apps/v1/namespaces/{namespace}/replicasets"
        self.pods = f"/api/v1/namespaces/{namespace}/pods"
        self.start: dict[str, Obj] = {}

    def create(self, body: Obj) -> None:
        self.emu.post(self.deployments, body).ok()

    def get(self, name: str) -> Obj:
        return self.emu.get(f"{self.deployments}/{name}").ok()

    def pod_list(self, app: str) -> list[Obj]:
        return self.emu.get(self.pods, params={"labelSelector": f"app={app}"}).ok()["items"]

    def rs_list(self, app: str) -> list[Obj]:
        return self.emu.get(self.replicasets, params={"labelSelector": f"app={app}"}).ok()["items"]

    def set_image(self, name: str, image: str) -> None:
        patch = {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": image}]}}}}
        self.emu.patch(f"{self.deployments}/{name}", patch, kind="strategic").ok()

    def settled(self, name: str) -> Obj:
        """The Deployment once its rollout is complete (kubectl rollout status's test)."""

        def done() -> Obj | None:
            d = self.get(name)
            s, want = d.get("status") or {}, d["spec"]["replicas"]
            ok = (
                s.get("observedGeneration", 0) >= d["metadata"]["generation"]
                and s.get("updatedReplicas", 0) == want
                and s.get("replicas", 0) == want
                and s.get("availableReplicas", 0) == want
            )
            return d if ok else None

        return wait_for(done, what=f"{name} rolled out")

    def rv(self) -> str:
        """Now: where a history starts (the pods that exist now are its first state)."""
        listed = self.emu.get(self.pods).ok()
        self.start = {p["metadata"]["name"]: p for p in listed["items"]}
        return listed["metadata"]["resourceVersion"]

    def history(self, since: str) -> list[tuple[int, str, Obj]]:
        """Every Deployment, ReplicaSet and Pod event since `since`, in resourceVersion order."""
        out = []
        for path in (self.deployments, self.replicasets, self.pods):
            for ev in self.emu.watch(path, {"resourceVersion": since, "timeoutSeconds": "0.3"}):
                obj = ev["object"]
                out.append((int(obj["metadata"]["resourceVersion"]), obj["kind"], ev))
        return sorted(out, key=lambda item: item[0])


def replay(apps: Apps, since: str) -> Iterator[tuple[Obj, dict[str, Obj], Obj]]:
    """(event, live pods by name, latest Deployment status) after every event since `since`,
    starting from the pods there were then."""
    pods = dict(apps.start)
    status: Obj = {}
    for _, kind, ev in apps.history(since):
        obj = ev["object"]
        if kind == "Pod":
            if ev["type"] == "DELETED" or obj["metadata"].get("deletionTimestamp"):
                pods.pop(obj["metadata"]["name"], None)
            else:
                pods[obj["metadata"]["name"]] = obj
        elif kind == "Deployment":
            status = obj.get("status") or {}
        yield ev, pods, status


def ready(pod: Obj) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def image(pod: Obj) -> str:
    return pod["spec"]["containers"][0]["image"]


def conditions(obj: Obj) -> dict[str, tuple[str, str]]:
    return {
        c["type"]: (c["status"], c.get("reason", ""))
        for c in (obj.get("status") or {}).get("conditions", [])
    }


@pytest.fixture
def apps(emu: Emulator, namespace: str) -> Apps:
    return Apps(emu, namespace)


# ----------------------------------------------------------------------------------------------
# ownership and status


def test_deployment_owns_a_replicaset_that_owns_the_pods(apps: Apps) -> None:
    apps.create(deployment("web", replicas=2))
    d = apps.settled("web")
    assert d["status"]["observedGeneration"] == 1 and d["status"]["readyReplicas"] == 2
    assert conditions(d) == {
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("True", "NewReplicaSetAvailable"),
    }
    [rs] = apps.rs_list("web")
    hash_ = rs["metadata"]["labels"]["pod-template-hash"]
    assert rs["metadata"]["name"] == f"web-{hash_}"
    assert [(o["kind"], o["name"], o["controller"]) for o in rs["metadata"]["ownerReferences"]] == [
        ("Deployment", "web", True)
    ]
    assert rs["spec"]["selector"]["matchLabels"] == {"app": "web", "pod-template-hash": hash_}
    assert rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "1"
    assert rs["status"]["replicas"] == 2 and rs["status"]["availableReplicas"] == 2
    pods = apps.pod_list("web")
    assert len(pods) == 2
    for pod in pods:
        assert pod["metadata"]["name"].startswith(f"web-{hash_}-")
        assert pod["metadata"]["labels"]["pod-template-hash"] == hash_
        assert [(o["kind"], o["name"]) for o in pod["metadata"]["ownerReferences"]] == [
            ("ReplicaSet", rs["metadata"]["name"])
        ]
        assert pod["status"]["phase"] == "Running" and ready(pod)
    # a deleted pod is replaced by the ReplicaSet
    gone = pods[0]["metadata"]["name"]
    apps.emu.delete(f"{apps.pods}/{gone}").ok()
    wait_for(
        lambda: (
            len(names := {p["metadata"]["name"] for p in apps.pod_list("web")}) == 2
            and gone not in names
        ),
        what="a replacement pod",
    )
    # a new template gets a new ReplicaSet; the old one stays, scaled to 0, as history
    apps.set_image("web", "app:v2")
    d = apps.settled("web")
    assert d["status"]["observedGeneration"] == 2
    assert {image(p) for p in apps.pod_list("web")} == {"app:v2"}
    by_revision = {
        r["metadata"]["annotations"]["deployment.kubernetes.io/revision"]: r
        for r in apps.rs_list("web")
    }
    assert by_revision["1"]["spec"]["replicas"] == 0 and by_revision["2"]["spec"]["replicas"] == 2
    # scale to zero, then delete: ReplicaSets and pods are garbage-collected with their owner
    apps.emu.patch(f"{apps.deployments}/web", {"spec": {"replicas": 0}}).ok()
    wait_for(lambda: not apps.pod_list("web"), what="scaled to zero")
    d = wait_for(lambda: "replicas" not in (o := apps.get("web"))["status"] and o, what="zero")
    assert conditions(d)["Available"] == ("True", "MinimumReplicasAvailable")
    apps.emu.delete(f"{apps.deployments}/web").ok()
    wait_for(lambda: not apps.rs_list("web"), what="ReplicaSets collected")


def test_status_writes_are_not_churning(apps: Apps) -> None:
    apps.create(deployment("calm"))
    d = apps.settled("calm")
    events = list(
        apps.emu.watch(
            apps.deployments,
            {"resourceVersion": d["metadata"]["resourceVersion"], "timeoutSeconds": "1"},
        )
    )
    assert events == []


# ----------------------------------------------------------------------------------------------
# rollouts


def test_rolling_update_surges_one_and_keeps_every_replica_available(apps: Apps) -> None:
    """maxSurge 1, maxUnavailable 0 (what the operator renders), 2 replicas, new pods ready
    after a delay: never more than 3 pods, never fewer than 2 ready, and the Deployment claims
    completion only once every pod is new and ready."""
    apps.create(deployment("roll", replicas=2, strategy=rolling(1, 0)))
    apps.settled("roll")
    apps.emu.set_pod_behaviour(image="app:v2", ready_delay=0.5)
    since = apps.rv()
    apps.set_image("roll", "app:v2")
    apps.settled("roll")
    seen = set()
    for _, pods, status in replay(apps, since):
        assert len(pods) <= 3
        assert sum(ready(p) for p in pods.values()) >= 2
        counts = (
            status.get("replicas"),
            status.get("updatedReplicas"),
            status.get("readyReplicas"),
        )
        seen.add(counts)
        done = counts[0] == counts[1] == 2 and status.get("availableReplicas") == 2
        if done and status.get("observedGeneration") == 2:
            assert all(image(p) == "app:v2" and ready(p) for p in pods.values())
    assert (3, 1, 2) in seen  # the surge pod is starting
    assert (3, 2, 2) in seen  # the last step: one old pod serving, one new pod starting


def test_percentages_round_like_the_real_controller() -> None:
    def resolve(surge: Any, unavailable: Any, replicas: int) -> tuple[int, int]:
        return fenceposts({"spec": {"replicas": replicas, "strategy": rolling(surge, unavailable)}})

    assert resolve("25%", "25%", 10) == (3, 2)  # surge rounds up, unavailable down
    assert resolve("25%", "25%", 1) == (1, 0)
    assert resolve("50%", "50%", 3) == (2, 1)
    assert resolve(0, 0, 4) == (0, 1)  # both zero: one may be unavailable
    assert resolve("0%", "10%", 4) == (0, 1)  # 10% of 4 rounds down to 0: both zero again
    assert resolve(2, "100%", 3) == (2, 3)


@pytest.mark.parametrize(
    ("strategy", "most", "fewest_ready"),
    [(rolling("25%", "25%"), 5, 3), (rolling(0, "50%"), 4, 2)],
    ids=["25%-25%", "0-50%"],
)
def test_rolling_update_bounds_follow_the_strategy(
    apps: Apps, strategy: Obj, most: int, fewest_ready: int
) -> None:
    apps.create(deployment("pct", replicas=4, strategy=strategy))
    apps.settled("pct")
    apps.emu.set_pod_behaviour(image="app:v2", ready_delay=0.3)
    since = apps.rv()
    apps.set_image("pct", "app:v2")
    apps.settled("pct")
    sizes, ready_counts = [], []
    for _, pods, _ in replay(apps, since):
        sizes.append(len(pods))
        ready_counts.append(sum(ready(p) for p in pods.values()))
    assert max(sizes) == most and min(ready_counts) == fewest_ready


def test_recreate_removes_every_old_pod_before_a_new_one(apps: Apps) -> None:
    apps.create(deployment("rec", replicas=2, strategy={"type": "Recreate"}))
    apps.settled("rec")
    since = apps.rv()
    apps.set_image("rec", "app:v2")
    apps.settled("rec")
    sizes = []
    for _, pods, _ in replay(apps, since):
        assert len({image(p) for p in pods.values()}) <= 1, "old and new pods at once"
        sizes.append(len(pods))
    assert 0 in sizes
    assert {image(p) for p in apps.pod_list("rec")} == {"app:v2"}


def test_min_ready_seconds_holds_availability(apps: Apps) -> None:
    apps.create(deployment("slowly", minReadySeconds=1))
    since = apps.rv()
    d = apps.settled("slowly")
    assert conditions(d)["Available"][0] == "True"
    states = [
        (status.get("readyReplicas"), status.get("availableReplicas"))
        for _, _, status in replay(apps, since)
    ]
    assert (1, None) in states  # ready, not yet available
    assert states[-1] == (1, 1)


def test_kubectl_rollout_status_waits_for_the_last_pod(apps: Apps) -> None:
    apps.create(deployment("ks", replicas=2, strategy=rolling(1, 0)))
    apps.settled("ks")
    # long enough for kubectl to start and see the last step (one old pod pending termination)
    apps.emu.set_pod_behaviour(image="app:v2", ready_delay=1.5)
    apps.set_image("ks", "app:v2")
    out = kubectl(apps.emu, "rollout", "status", "deployment/ks", "-n", apps.ns, "--timeout=30s")
    assert out.returncode == 0 and "successfully rolled out" in out.stdout, out.stderr
    assert "old replicas are pending termination" in out.stdout
    pods = apps.pod_list("ks")
    assert len(pods) == 2 and all(image(p) == "app:v2" and ready(p) for p in pods)


def test_progress_deadline_exceeded(apps: Apps) -> None:
    apps.emu.set_fault(apps.ns, "stuck", "imagepull")
    apps.create(deployment("stuck", progressDeadlineSeconds=1))
    d = wait_for(
        lambda: conditions(o := apps.get("stuck")).get("Progressing", ("",))[0] == "False" and o,
        what="progress deadline",
    )
    assert conditions(d)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert conditions(d)["Available"][0] == "False"


# ----------------------------------------------------------------------------------------------
# pods: readiness and faults


@pytest.mark.parametrize("mode", ["crashloop", "imagepull", "unschedulable", "pending"])
def test_fault_modes_shape_pod_and_deployment_status(apps: Apps, mode: str) -> None:
    apps.emu.set_fault(apps.ns, "flaky", mode)
    apps.create(deployment("flaky", image="repo/model:v9"))
    d = wait_for(
        lambda: (
            conditions(o := apps.get("flaky")).get("Progressing") == ("True", "ReplicaSetUpdated")
            and o
        ),
        what="a rollout under way",
    )
    assert conditions(d)["Available"] == ("False", "MinimumReplicasUnavailable")
    assert d["status"]["unavailableReplicas"] == 1 and "readyReplicas" not in d["status"]
    pod = wait_for(
        lambda: [p for p in apps.pod_list("flaky") if p["status"].get("conditions")],
        what="pod status",
    )[0]
    status = pod["status"]
    if mode == "crashloop":
        cs = status["containerStatuses"][0]
        assert status["phase"] == "Running"
        assert cs["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert cs["restartCount"] >= 3 and cs["lastState"]["terminated"]["exitCode"] == 1
    elif mode == "imagepull":
        cs = status["containerStatuses"][0]
        assert status["phase"] == "Pending"
        assert cs["state"]["waiting"]["reason"] == "ImagePullBackOff"
        assert "repo/model:v9" in cs["state"]["waiting"]["message"]
    elif mode == "unschedulable":
        assert status["phase"] == "Pending" and "nodeName" not in pod["spec"]
        sched = next(c for c in status["conditions"] if c["type"] == "PodScheduled")
        assert (sched["status"], sched["reason"]) == ("False", "Unschedulable")
        assert sched["message"].startswith(
            "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        )
    else:
        assert status["phase"] == "Pending"
    apps.emu.set_fault(apps.ns, "flaky", "ready")
    d = apps.settled("flaky")
    assert conditions(d)["Available"][0] == "True"


def test_ready_delay_holds_readiness(apps: Apps) -> None:
    apps.emu.set_fault(apps.ns, "slow", "ready", ready_delay=1.0)
    apps.create(deployment("slow"))
    pod = wait_for(
        lambda: [p for p in apps.pod_list("slow") if p["status"].get("conditions")],
        what="pod status",
    )[0]
    assert pod["status"]["phase"] == "Running" and not ready(pod)  # well before a second
    assert pod["status"]["containerStatuses"][0]["state"]["running"]
    apps.settled("slow")


def test_one_pod_that_never_turns_ready(apps: Apps) -> None:
    apps.create(deployment("half", replicas=2, strategy=rolling(1, 0)))
    apps.settled("half")
    victim = apps.pod_list("half")[0]["metadata"]["name"]
    apps.emu.set_pod_behaviour(apps.ns, pod=victim, mode="never-ready")
    d = wait_for(
        lambda: (o := apps.get("half"))["status"].get("readyReplicas") == 1 and o,
        what="one pod unready",
    )
    assert d["status"]["replicas"] == 2 and d["status"]["unavailableReplicas"] == 1
    assert conditions(d)["Available"] == ("False", "MinimumReplicasUnavailable")
    pod = apps.emu.get(f"{apps.pods}/{victim}").ok()
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert (cond["status"], cond["reason"]) == ("False", "ContainersNotReady")
    assert pod["status"]["containerStatuses"][0]["started"] is True


def with_init(name: str) -> Obj:
    body = deployment(name)
    body["spec"]["template"]["spec"]["initContainers"] = [
        {"name": "model-fetch", "image": "app:v1", "command": ["ketch", "fetch-model"]}
    ]
    return body


def test_init_containers_complete_before_the_pod_runs(apps: Apps) -> None:
    apps.create(with_init("init-ok"))
    apps.settled("init-ok")
    [pod] = apps.pod_list("init-ok")
    [init] = pod["status"]["initContainerStatuses"]
    assert init["name"] == "model-fetch"
    assert init["state"]["terminated"]["reason"] == "Completed"
    assert init["state"]["terminated"]["exitCode"] == 0
    assert ("Initialized", "True") in {
        (c["type"], c["status"]) for c in pod["status"]["conditions"]
    }


@pytest.mark.parametrize(
    ("mode", "shown"), [("init-error", "Init:Error"), ("init-crashloop", "Init:CrashLoopBackOff")]
)
def test_a_failing_init_container_keeps_the_pod_pending(apps: Apps, mode: str, shown: str) -> None:
    apps.emu.set_pod_behaviour(
        apps.ns, deployment="init-bad", mode=mode, init_container="model-fetch"
    )
    apps.create(with_init("init-bad"))
    pod = wait_for(
        lambda: [p for p in apps.pod_list("init-bad") if p["status"].get("initContainerStatuses")],
        what="init container status",
    )[0]
    status = pod["status"]
    assert status["phase"] == "Pending"
    [init] = status["initContainerStatuses"]
    if mode == "init-error":
        assert init["state"]["terminated"]["reason"] == "Error"
        assert init["state"]["terminated"]["exitCode"] == 1
    else:
        assert init["state"]["waiting"]["reason"] == "CrashLoopBackOff"
        assert init["lastState"]["terminated"]["exitCode"] == 1 and init["restartCount"] > 0
    initialized = next(c for c in status["conditions"] if c["type"] == "Initialized")
    assert initialized["status"] == "False"
    assert initialized["message"] == "containers with incomplete status: [model-fetch]"
    assert status["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    table = kubectl(apps.emu, "get", "pods", "-n", apps.ns, "-l", "app=init-bad")
    assert shown in table.stdout, table.stdout
    listed = kubectl(apps.emu, "get", "rs", "-n", apps.ns, "-l", "app=init-bad", "-o", "json")
    assert json.loads(listed.stdout)["items"][0]["status"]["replicas"] == 1
