"""Status conditions and reasons from observed Deployments and Pods (pure functions)."""

from __future__ import annotations

from ketch.operator import status
from ketch.operator.reconcile.compare import contains

NOW = "2026-12-01T00:00:00Z"
LATER = "2026-12-01T01:00:00Z"


def deployment(
    replicas=2, ready=2, updated=2, generation=1, observed=1, total=None, available=None, **extra
):
    """A Deployment's spec.replicas and status (total = status.replicas: old and new pods)."""
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": updated if total is None else total,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "availableReplicas": ready if available is None else available,
            **extra,
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


def test_last_step_of_a_rolling_update_is_not_complete():
    """maxSurge 1, maxUnavailable 0, 2 replicas: one old pod still serves while the second new
    one starts. Two pods are ready and both desired pods are updated, but the rollout is not
    done (kubectl rollout status: "1 old replicas are pending termination")."""
    st = compute({"mixed": deployment(replicas=2, total=3, updated=2, ready=2)})
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ("False", "Updating")
    assert cond(st, "Progressing")["status"] == "True"
    assert cond(st, "Progressing")["reason"] == "Updating"
    assert "1 old pods pending termination" in cond(st, "Progressing")["message"]


def test_complete_only_as_kubectl_rollout_status_decides():
    waits = {
        "spec not observed": deployment(generation=4, observed=3),
        "a new pod missing": deployment(total=3, updated=1, ready=2),
        "an old pod left": deployment(total=3, updated=2, ready=3),
        "ready, not yet available (minReadySeconds)": deployment(ready=2, available=1),
        "progress deadline exceeded": deployment(
            conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]
        ),
    }
    for case, dep in waits.items():
        st = compute({"mixed": dep})
        assert cond(st, "Ready")["status"] == "False", case
        assert cond(st, "Progressing")["reason"] == "Updating", case
    late = compute({"mixed": waits["progress deadline exceeded"]})
    assert "exceeded its progress deadline" in cond(late, "Ready")["message"]
    # scaling down: more updated pods than desired, all available, none old: complete
    st = compute({"mixed": deployment(replicas=1, total=2, updated=2, ready=2)})
    assert cond(st, "Ready")["status"] == "True"


def _pod(name="x-mixed-abc", **state):
    return {"metadata": {"name": name}, "status": state}


def _init(name, state, **extra):
    return _pod(phase="Pending", initContainerStatuses=[{"name": name, "state": state, **extra}])


def test_failing_model_fetch_init_container_degrades_naming_it():
    crashing = _init(
        "model-fetch",
        {"waiting": {"reason": "CrashLoopBackOff"}},
        restartCount=3,
        lastState={"terminated": {"exitCode": 1, "reason": "Error"}},
    )
    exited = _init("model-fetch", {"terminated": {"exitCode": 2, "reason": "Error"}})
    for pod in (crashing, exited):
        st = compute({"mixed": deployment(ready=0, available=0)}, [pod])
        degraded = cond(st, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "ModelFetchFailed")
        assert "init container model-fetch failed" in degraded["message"]
        assert "x-mixed-abc" in degraded["message"] and "spec.model.uri" in degraded["message"]
        assert cond(st, "Ready")["reason"] == "ModelFetchFailed"
    assert (
        "exit code 2, Error"
        in cond(compute({"mixed": deployment()}, [exited]), "Degraded")["message"]
    )
    other = _init("wait-for-db", {"terminated": {"exitCode": 1, "reason": "Error"}})
    degraded = cond(compute({"mixed": deployment()}, [other]), "Degraded")
    assert degraded["reason"] == "InitContainerFailed" and "wait-for-db" in degraded["message"]
    done = _init("model-fetch", {"terminated": {"exitCode": 0, "reason": "Completed"}})
    assert cond(compute({"mixed": deployment()}, [done]), "Degraded")["status"] == "False"


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
    from ketch.operator.reconcile.compare import project

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


def test_only_progress_waits_for_the_next_status():
    """status_patch holds back a change that only moves a rollout along; settled states,
    changed reasons and a new generation are written at once."""
    from ketch.operator.status_patch import progress_only

    starting = compute({"mixed": None})
    halfway = compute({"mixed": deployment(ready=1, updated=1)}, old=starting)
    ready = compute({"mixed": deployment()}, old=halfway)
    assert progress_only({}, starting)  # a new object's first status, still starting
    assert progress_only(starting, halfway)  # only the message and the counts moved
    assert not progress_only(halfway, ready)  # Ready turned True
    assert not progress_only({}, ready)
    crashing = {"status": {"containerStatuses": [{"name": "engine", "state": {}}]}}
    crashing["status"]["containerStatuses"][0]["state"]["waiting"] = {"reason": "CrashLoopBackOff"}
    degraded = compute({"mixed": deployment(ready=0, updated=1)}, pods=[crashing], old=halfway)
    assert not progress_only(halfway, degraded)  # Degraded turned True
    assert not progress_only(ready, compute({"mixed": deployment(ready=1)}, old=ready))
    newer = {**halfway, "observedGeneration": 4}
    assert not progress_only(halfway, newer)
