"""Status conditions and reasons from observed Deployments and Pods (pure functions)."""

from __future__ import annotations

from ketch.operator import status
from ketch.operator.controller import contains

NOW = "2026-12-01T00:00:00Z"
LATER = "2026-12-01T01:00:00Z"


def deployment(replicas=2, ready=2, updated=2, generation=1, observed=1):
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "readyReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def compute(deployments, pods=(), old=None, now=NOW):
    return status.compute(
        generation=3,
        mode="mixed",
        url="http://x-mixed.ns.svc.cluster.local:8000",
        deployments=deployments,
        pods=list(pods),
        old=old,
        now=now,
    )


def cond(st, kind):
    return status.condition(st, kind)


def test_all_ready():
    st = compute({"mixed": deployment()})
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Progressing")["status"] == "False"
    assert cond(st, "Degraded")["status"] == "False"
    assert st["replicas"] == "2/2" and st["observedGeneration"] == 3
    assert st["roles"] == {"mixed": {"desired": 2, "ready": 2, "updated": 2}}


def test_rollout_in_progress_is_updating():
    st = compute({"mixed": deployment(ready=2, updated=1)})
    assert cond(st, "Ready")["reason"] == "Updating"
    assert cond(st, "Progressing")["status"] == "True"
    # a Deployment whose controller has not seen the new template yet is not "updated"
    st = compute({"mixed": deployment(generation=2, observed=1)})
    assert cond(st, "Progressing")["reason"] == "Updating"
    assert "rollout starting" in cond(st, "Progressing")["message"]
    st = compute({"mixed": None})
    assert "not created yet" in cond(st, "Ready")["message"]


def _pod(name="x-mixed-abc", **state):
    return {"metadata": {"name": name}, "status": state}


def test_crash_loop():
    pod = _pod(
        containerStatuses=[
            {
                "name": "engine",
                "restartCount": 5,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
            }
        ]
    )
    st = compute({"mixed": deployment(ready=1)}, [pod])
    degraded = cond(st, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoop")
    assert "x-mixed-abc" in degraded["message"] and "kubectl logs" in degraded["message"]
    assert cond(st, "Ready")["reason"] == "CrashLoop"


def test_image_pull_and_capacity():
    pull = _pod(
        containerStatuses=[
            {"name": "engine", "image": "bad:1", "state": {"waiting": {"reason": "ErrImagePull"}}}
        ]
    )
    st = compute({"mixed": deployment(ready=0)}, [pull])
    assert cond(st, "Degraded")["reason"] == "ImagePullError"
    assert "spec.engine.image" in cond(st, "Degraded")["message"]
    pending = _pod(
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        ],
    )
    st = compute({"mixed": deployment(ready=0)}, [pending])
    assert cond(st, "Degraded")["reason"] == "InsufficientCapacity"
    assert "Insufficient nvidia.com/gpu" in cond(st, "Degraded")["message"]


def test_transition_times_move_only_on_change():
    first = compute({"mixed": deployment(ready=1)})
    same = compute({"mixed": deployment(ready=1)}, old=first, now=LATER)
    assert same == first  # nothing changed -> identical object -> the operator writes nothing
    ready = compute({"mixed": deployment()}, old=first, now=LATER)
    assert cond(ready, "Ready")["lastTransitionTime"] == LATER
    assert cond(ready, "Degraded")["lastTransitionTime"] == NOW


def test_invalid_keeps_other_fields():
    first = compute({"mixed": deployment()})
    st = status.invalid(generation=4, message="spec.x: bad", old=first, now=LATER)
    assert cond(st, "Degraded")["reason"] == "InvalidSpec"
    assert cond(st, "Ready")["status"] == "False"
    assert st["observedGeneration"] == 4 and st["url"] == first["url"]


def test_contains_is_a_subset_check():
    desired = {"spec": {"ports": [{"name": "http", "port": 80}], "replicas": 2}}
    live = {"spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP"}], "replicas": 2}}
    assert contains(desired, live)
    assert not contains(desired, {"spec": {"ports": [{"name": "http", "port": 81}], "replicas": 2}})
    assert not contains(desired, {"spec": {"ports": [], "replicas": 2}})
    assert not contains({"a": {"b": 1}}, {"a": {}})


def test_drift_is_judged_against_what_the_server_stored():
    from ketch.operator.controller import project

    desired = {"spec": {"cpu": "0.5", "ports": [{"port": 80}], "env": [{"name": "A"}]}}
    stored = {
        "spec": {"cpu": "500m", "ports": [{"port": 80, "protocol": "TCP"}], "env": []},
        "status": {},
    }
    expected = project(desired, stored)
    assert expected == {"spec": {"cpu": "500m", "ports": [{"port": 80}], "env": [{"name": "A"}]}}
    assert contains(
        expected, {"spec": {"cpu": "500m", "ports": [{"port": 80}], "env": [{"name": "A"}]}}
    )
    assert not contains(expected, {"spec": {"cpu": "0.5", "ports": [{"port": 80}], "env": []}})
