"""Pod status as a kubelet reports it, for each way a test can make a pod behave.

Pure functions: `pod_status(pod, mode, ready, ip, now)` gives the whole `.status` of a pod whose
containers are in `mode` (see `POD_MODES`); `ready` says whether the readiness probe passes yet.
Init containers run before the containers; an init failure keeps the pod Pending with the
failing container named in `initContainerStatuses` and in the `Initialized` condition, as on a
node.
"""

from __future__ import annotations

import hashlib
from typing import Any

Obj = dict[str, Any]

POD_MODES = (
    "ready",  # containers run; ready once the readiness delay has passed
    "never-ready",  # containers run; the readiness probe never passes
    "crashloop",  # the first container keeps crashing (CrashLoopBackOff)
    "imagepull",  # the images cannot be pulled (ImagePullBackOff)
    "unschedulable",  # no node fits (PodScheduled False / Unschedulable)
    "pending",  # scheduled, containers still being created
    "init-error",  # an init container exited non-zero (kubectl: Init:Error)
    "init-crashloop",  # an init container keeps failing (kubectl: Init:CrashLoopBackOff)
)
RUNNING_MODES = ("ready", "never-ready", "crashloop")
INIT_FAILURES = ("init-error", "init-crashloop")
NODE_NAME = "kubeemu-node-1"
HOST_IP = "172.18.0.2"


def pod_status(pod: Obj, mode: str, ready: bool, ip: str, now: str, failing_init: str = "") -> Obj:
    """The `.status` of `pod` (its previous status keeps transition times that did not move).

    failing_init: the init container that fails in an init-* mode ("" = the first one)."""
    old = pod.get("status") or {}
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    conds = _Conditions(old, now)
    if mode == "unschedulable":
        return {
            "phase": "Pending",
            "qosClass": qos_class(containers),
            "conditions": [conds.set("PodScheduled", False, "Unschedulable", _unschedulable(spec))],
        }
    start = old.get("startTime") or pod["metadata"].get("creationTimestamp") or now
    init_statuses, blocked = _init_statuses(pod, mode, inits, failing_init, start, now)
    statuses = [
        _container_status(pod, c, i, "init-blocked" if blocked else mode, ready, start, now)
        for i, c in enumerate(containers)
    ]
    all_ready = bool(statuses) and all(cs["ready"] for cs in statuses)
    names = " ".join(c.get("name", "") for c in containers)
    unready = (None, None) if all_ready else ("ContainersNotReady", _unready_msg(names))
    init_msg = (None, None)
    if blocked:
        init_msg = ("ContainersNotInitialized", f"containers with incomplete status: [{blocked}]")
    status: Obj = {
        "phase": "Running" if mode in RUNNING_MODES else "Pending",
        "conditions": [
            conds.set("PodReadyToStartContainers", mode != "pending"),
            conds.set("Initialized", not blocked, *init_msg),
            conds.set("Ready", all_ready, *unready),
            conds.set("ContainersReady", all_ready, *unready),
            conds.set("PodScheduled", True),
        ],
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "qosClass": qos_class(containers),
        "startTime": start,
    }
    if init_statuses:
        status["initContainerStatuses"] = init_statuses
    status["containerStatuses"] = statuses
    return status


class _Conditions:
    """Pod conditions whose lastTransitionTime moves only when their status does."""

    def __init__(self, old: Obj, now: str) -> None:
        self.old = {c.get("type"): c for c in old.get("conditions") or []}
        self.now = now

    def set(self, ctype: str, ok: bool, reason: str | None = None, message: str | None = None):
        prev = self.old.get(ctype)
        value = "True" if ok else "False"
        same = prev is not None and prev.get("status") == value
        cond: Obj = {
            "type": ctype,
            "status": value,
            "lastProbeTime": None,
            "lastTransitionTime": prev["lastTransitionTime"] if same and prev else self.now,
        }
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        return cond


def _init_statuses(
    pod: Obj, mode: str, inits: list[Obj], failing: str, start: str, now: str
) -> tuple[list[Obj], str]:
    """initContainerStatuses, and the name of the init container the pod waits on ("" = none)."""
    if not inits:
        return [], ""
    names = [c.get("name", "") for c in inits]
    fail_at = names.index(failing) if failing in names else 0
    out, blocked = [], ""
    for i, c in enumerate(inits):
        cs = _base_status(c)
        if mode in ("pending", "imagepull") or (mode in INIT_FAILURES and i > fail_at):
            reason = "ImagePullBackOff" if mode == "imagepull" and i == 0 else "PodInitializing"
            cs["state"] = {"waiting": _waiting(reason, c.get("image", ""))}
            blocked = blocked or names[i]
        elif mode in INIT_FAILURES and i == fail_at:
            cs.update(_image_fields(pod, c))
            failed = _terminated(pod, c, 1, "Error", start, now)
            if mode == "init-error":
                cs.update(state={"terminated": failed}, restartCount=0)
            else:
                waiting = {"reason": "CrashLoopBackOff", "message": _backoff_msg(pod, c)}
                cs.update(state={"waiting": waiting}, lastState={"terminated": failed})
                cs["restartCount"] = 3
            blocked = names[i]
        else:
            cs.update(_image_fields(pod, c))
            cs["state"] = {"terminated": _terminated(pod, c, 0, "Completed", start, start)}
            cs["ready"] = True
        out.append(cs)
    return out, blocked


def _container_status(
    pod: Obj, c: Obj, index: int, mode: str, ready: bool, start: str, now: str
) -> Obj:
    cs = _base_status(c)
    prev = {s.get("name"): s for s in (pod.get("status") or {}).get("containerStatuses") or []}
    running_since = (((prev.get(c.get("name")) or {}).get("state") or {}).get("running") or {}).get(
        "startedAt"
    ) or now
    running = {"running": {"startedAt": running_since}}
    if mode in ("ready", "never-ready") or (mode == "crashloop" and index > 0):
        cs.update(_image_fields(pod, c), started=True, state=running)
        cs["ready"] = mode == "crashloop" or (mode == "ready" and ready)
    elif mode == "crashloop":
        cs.update(_image_fields(pod, c), restartCount=5)
        cs["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": _backoff_msg(pod, c)}}
        cs["lastState"] = {"terminated": _terminated(pod, c, 1, "Error", start, start)}
    elif mode == "imagepull":
        cs["state"] = {"waiting": _waiting("ImagePullBackOff", c.get("image", ""))}
    elif mode == "pending":
        cs["state"] = {"waiting": _waiting("ContainerCreating", "")}
    else:  # an init container has not finished: the containers wait on it
        cs["state"] = {"waiting": _waiting("PodInitializing", "")}
    return cs


def _base_status(c: Obj) -> Obj:
    return {
        "name": c.get("name", ""),
        "image": c.get("image", ""),
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "lastState": {},
    }


def _image_fields(pod: Obj, c: Obj) -> Obj:
    return {
        "containerID": _container_id(pod, c),
        "imageID": f"{c.get('image', '')}@sha256:{'0' * 64}",
    }


def _container_id(pod: Obj, c: Obj) -> str:
    key = f"{pod['metadata'].get('uid')}/{c.get('name', '')}"
    return "containerd://" + hashlib.sha256(key.encode()).hexdigest()


def _terminated(pod: Obj, c: Obj, code: int, reason: str, started: str, finished: str) -> Obj:
    return {
        "exitCode": code,
        "reason": reason,
        "startedAt": started,
        "finishedAt": finished,
        "containerID": _container_id(pod, c),
    }


def _waiting(reason: str, image: str) -> Obj:
    if reason == "ImagePullBackOff":
        return {"reason": reason, "message": f'Back-off pulling image "{image}"'}
    return {"reason": reason}


def _backoff_msg(pod: Obj, c: Obj) -> str:
    meta = pod["metadata"]
    return (
        f"back-off 5m0s restarting failed container={c.get('name', '')} "
        f"pod={meta['name']}_{meta.get('namespace', '')}({meta.get('uid')})"
    )


def _unready_msg(names: str) -> str:
    return f"containers with unready status: [{names}]"


def _unschedulable(spec: Obj) -> str:
    resource = _extended_resource(spec.get("containers") or []) or "nvidia.com/gpu"
    return (
        f"0/3 nodes are available: 3 Insufficient {resource}. preemption: 0/3 nodes "
        "are available: 3 No preemption victims found for incoming pod."
    )


def _extended_resource(containers: list[Obj]) -> str | None:
    for c in containers:
        res = c.get("resources") or {}
        for section in ("limits", "requests"):
            for name in res.get(section) or {}:
                if "/" in name:
                    return name
    return None


def qos_class(containers: list[Obj]) -> str:
    any_res = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_res = True
        if (
            not lim
            or any(req.get(k, lim[k]) != lim[k] for k in lim)
            or not {"cpu", "memory"} <= set(lim)
        ):
            guaranteed = False
    if not any_res:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def is_ready(pod: Obj | None) -> bool:
    """The pod's Ready condition is True."""
    for c in ((pod or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False
