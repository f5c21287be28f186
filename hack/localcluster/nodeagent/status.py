"""Pod status as the kubelet computes it (pure functions of the containers' statuses).

``phase`` follows the kubelet's ``getPhase``: Failed when an init container failed and
``restartPolicy`` is Never; Pending while init containers have not all succeeded or a container
waits without having run; Running while one runs; once none runs, Running (restartPolicy Always,
or OnFailure with failures), Succeeded (all exited 0) or Failed (Never) - and for a pod that was
deleted, Succeeded or Failed by exit codes. ``conditions`` gives PodReadyToStartContainers,
Initialized, ContainersReady and Ready with the kubelet's reasons and messages, keeping the
transition time of a condition whose status did not change and every condition the agent does
not own (PodScheduled, DisruptionTarget, readiness gates' own conditions).
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def phase(spec: Obj, init_statuses: list[Obj], statuses: list[Obj], terminal: bool) -> str:
    policy = spec.get("restartPolicy", "Always")
    by_name = {s["name"]: s for s in [*init_statuses, *statuses]}
    pending_init = failed_init = 0
    for c in spec.get("initContainers", []):
        if c.get("restartPolicy") == "Always":  # a sidecar: counted once it started
            s = by_name.get(c["name"])
            pending_init += not (s and s.get("started"))
            continue
        s = by_name.get(c["name"])
        state = (s or {}).get("state", {})
        last = (s or {}).get("lastState", {}).get("terminated")
        if "terminated" in state:
            failed_init += state["terminated"]["exitCode"] != 0
        elif "waiting" in state and last:
            failed_init += last["exitCode"] != 0
        else:
            pending_init += 1
    running = waiting = stopped = succeeded = unknown = 0
    for c in spec.get("containers", []):
        s = by_name.get(c["name"])
        if not s:
            unknown += 1
            continue
        state = s.get("state", {})
        if "running" in state:
            running += 1
        elif "terminated" in state:
            stopped += 1
            succeeded += state["terminated"]["exitCode"] == 0
        elif "waiting" in state and s.get("lastState", {}).get("terminated"):
            stopped += 1
        elif "waiting" in state:
            waiting += 1
        else:
            unknown += 1
    if failed_init and policy == "Never":
        return "Failed"
    if pending_init or waiting:
        return "Pending"
    if running and not unknown:
        return "Running"
    if not running and stopped and not unknown:
        if terminal:
            return "Succeeded" if stopped == succeeded else "Failed"
        if policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if policy == "Never" else "Running"
    return "Pending"


def _condition(kind: str, ok: bool, reason: str = "", message: str = "") -> Obj:
    cond: Obj = {"type": kind, "status": "True" if ok else "False"}
    if not ok and reason:
        cond["reason"] = reason
        if message:
            cond["message"] = message
    return cond


def conditions(
    old: list[Obj],
    spec: Obj,
    init_statuses: list[Obj],
    statuses: list[Obj],
    pod_phase: str,
    sandbox_ready: bool,
    now: str,
    generation: int | None = None,
) -> list[Obj]:
    inits = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") != "Always"]
    init_by_name = {s["name"]: s for s in init_statuses}
    incomplete = [
        c["name"]
        for c in inits
        if init_by_name.get(c["name"], {}).get("state", {}).get("terminated", {}).get("exitCode")
        != 0
    ]
    initialized = _condition(
        "Initialized", not incomplete or pod_phase == "Succeeded", "ContainersNotInitialized",
        f"containers with incomplete status: [{' '.join(incomplete)}]",
    )  # fmt: skip
    by_name = {s["name"]: s for s in statuses}
    unknown = [c["name"] for c in spec.get("containers", []) if c["name"] not in by_name]
    unready = [
        c["name"] for c in spec.get("containers", []) if not by_name.get(c["name"], {}).get("ready")
    ]
    if pod_phase == "Succeeded" and not unknown:
        ready = _condition("ContainersReady", False, "PodCompleted")
    elif unknown:
        ready = _condition(
            "ContainersReady", False, "ContainersNotReady",
            f"containers with unknown status: [{' '.join(unknown)}]",
        )  # fmt: skip
    elif unready:
        ready = _condition(
            "ContainersReady", False, "ContainersNotReady",
            f"containers with unready status: [{' '.join(unready)}]",
        )  # fmt: skip
    else:
        ready = _condition("ContainersReady", True)
    pod_ready = {**ready, "type": "Ready"}
    if ready["status"] == "True":
        gates = [g["conditionType"] for g in spec.get("readinessGates", [])]
        have = {c["type"]: c.get("status") for c in old}
        missing = [g for g in gates if have.get(g) != "True"]
        if missing:
            pod_ready = _condition(
                "Ready", False, "ReadinessGatesNotReady",
                f"corresponding condition of pod readiness gate \"{missing[0]}\" does not exist.",
            )  # fmt: skip
    new = [_condition("PodReadyToStartContainers", sandbox_ready), initialized, ready, pod_ready]
    previous = {c["type"]: c for c in old}
    out = [c for c in old if c["type"] not in OWN_CONDITIONS]
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        cond["lastProbeTime"] = None
        cond["lastTransitionTime"] = before.get("lastTransitionTime") if same else now
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return out


def qos_class(spec: Obj) -> str:
    """Guaranteed (cpu and memory limits equal to requests everywhere), BestEffort (none set)
    or Burstable; the API server sets it on creation, this is for pods that lack it."""
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    any_set = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        if limits or requests:
            any_set = True
        for key in ("cpu", "memory"):
            if key not in limits or requests.get(key, limits[key]) != limits[key]:
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"
