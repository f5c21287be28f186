"""Status from observed children: pure functions, so every reason is testable without a cluster.

Three conditions, as Kubernetes API conventions have them:

- ``Ready``: every role's rollout is complete, decided as ``kubectl rollout status`` decides
  (``rollout_wait``): the Deployment controller has seen the current spec, every desired pod
  runs the current template, no old pod is left, and every updated pod is available. Ready
  pods alone are not enough: in the last step of a rolling update (``replicas 3, updated 2,
  ready 2``) an old pod still serves while a new one starts.
- ``Progressing``: a rollout or scale-up is under way (``Updating``).
- ``Degraded``: something needs a person: ``InvalidSpec`` (the spec can't be deployed),
  ``CrashLoop`` (a container keeps crashing), ``ImagePullError`` (the image can't be pulled),
  ``InsufficientCapacity`` (pods can't be scheduled, e.g. no free GPUs), ``ModelFetchFailed``
  (the model-fetch init container fails) or ``InitContainerFailed`` (another init container),
  and ``ChildConflict``: an object the InferenceService does not control holds a child's name
  (``ownership``); nothing of the generation is applied, and all three conditions say so.

``lastTransitionTime`` only moves when a condition's status changes, so recomputing the status of
an unchanged deployment gives an identical object and the operator writes nothing.
"""

from __future__ import annotations

import datetime
from typing import Any

from ketch.operator.pod_layout import MODEL_FETCH

Obj = dict[str, Any]


def now() -> str:
    """The timestamp format of conditions and events (RFC 3339, UTC, whole seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


IMAGE_PULL_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull")
CRASH_REASONS = ("CrashLoopBackOff",)


def _condition(kind: str, status: bool, reason: str, message: str, generation: int) -> Obj:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def pod_problem(pod: Obj) -> tuple[str, str] | None:
    """(reason, message) for a pod that needs attention, or None."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            detail = cond.get("message") or "no node fits the pod"
            return (
                "InsufficientCapacity",
                f"pod {name} cannot be scheduled: {detail} Free GPUs on matching nodes, lower "
                "roles.*.resources.gpus, or relax roles.*.scheduling.",
            )
    for cs in status.get("initContainerStatuses") or []:
        failed = init_failure(name, cs)
        if failed:
            return failed
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in IMAGE_PULL_REASONS:
            detail = waiting.get("message") or f"cannot pull image {cs.get('image')}"
            return (
                "ImagePullError",
                f"pod {name} container {cs.get('name')}: {reason}: {detail}. Check "
                "spec.engine.image and the image pull secrets.",
            )
        if reason in CRASH_REASONS:
            last = (cs.get("lastState") or {}).get("terminated") or {}
            exit_info = ""
            if last:
                exit_info = f" (last exit code {last.get('exitCode')}"
                exit_info += f", {last.get('reason')})" if last.get("reason") else ")"
            return (
                "CrashLoop",
                f"pod {name} container {cs.get('name')} is crash-looping after "
                f"{cs.get('restartCount', 0)} restarts{exit_info}. See "
                f"'kubectl logs {name} -c {cs.get('name')} --previous'.",
            )
    return None


def init_failure(pod: str, cs: Obj) -> tuple[str, str] | None:
    """(reason, message) for an init container that exited non-zero or keeps doing so: the pod
    stays Pending (kubectl shows Init:Error or Init:CrashLoopBackOff)."""
    state = cs.get("state") or {}
    ended = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    if not (ended and ended.get("exitCode") != 0) and waiting.get("reason") not in CRASH_REASONS:
        return None
    last = ended or (cs.get("lastState") or {}).get("terminated") or {}
    container = cs.get("name") or "?"
    how = f"exit code {last.get('exitCode')}" if last else "no exit code"
    if last.get("reason"):
        how += f", {last['reason']}"
    restarts = int(cs.get("restartCount") or 0)
    message = (
        f"pod {pod} init container {container} failed ({how}, {restarts} restarts), so the pod "
        f"cannot start. See 'kubectl logs {pod} -c {container} --previous'."
    )
    if container == MODEL_FETCH:
        return "ModelFetchFailed", message + " Check spec.model.uri and model.credentialsSecretRef."
    return "InitContainerFailed", message


def rollout_wait(role: str, deployment: Obj | None) -> str | None:
    """What a role's rollout still waits for, or None once it is complete.

    The checks and their order are those of ``kubectl rollout status``
    (kubectl/pkg/polymorphichelpers/rollout_status.go): the controller has observed the
    generation, the progress deadline is not exceeded, updatedReplicas >= replicas, no old
    replicas left (status.replicas == updatedReplicas), every updated replica available."""
    if deployment is None:
        return f"{role}: Deployment not created yet"
    meta = deployment.get("metadata") or {}
    status = deployment.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 1):
        return f"{role}: rollout starting"
    desired = int((deployment.get("spec") or {}).get("replicas", 1))
    total = int(status.get("replicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    available = int(status.get("availableReplicas") or 0)
    progressing = condition(status, "Progressing") or {}
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        return (
            f"{role}: rollout exceeded its progress deadline ({updated} of {desired} pods "
            f"updated, {available} available)"
        )
    if updated < desired:
        return f"{role}: {updated} of {desired} pods updated"
    if total > updated:
        return f"{role}: {total - updated} old pods pending termination"
    if available < updated:
        return f"{role}: {available} of {updated} updated pods available"
    return None


def role_counts(deployment: Obj | None, generation_current: bool) -> Obj:
    if deployment is None:
        return {"desired": 0, "ready": 0, "updated": 0}
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0) if generation_current else 0
    return {
        "desired": desired,
        "ready": int(status.get("readyReplicas") or 0),
        "updated": updated,
    }


def compute(
    *,
    generation: int,
    mode: str,
    url: str,
    deployments: dict[str, Obj | None],
    pods: list[Obj],
    old: Obj | None,
    now: str,
    conflict: str | None = None,
) -> Obj:
    """The InferenceService's status. ``deployments`` maps every role (and router) to its live
    Deployment or None when it doesn't exist yet. ``conflict``: why the generation was not
    applied (``ownership.summary``), which then decides all three conditions."""
    roles: dict[str, Obj] = {}
    rolling: list[str] = []
    for role, dep in deployments.items():
        current = dep is not None and int(
            (dep.get("status") or {}).get("observedGeneration") or 0
        ) >= int((dep.get("metadata") or {}).get("generation") or 1)
        roles[role] = role_counts(dep, current)
        waiting = rollout_wait(role, dep)
        if waiting:
            rolling.append(waiting)
    problems = [p for p in (pod_problem(pod) for pod in pods) if p]
    ready_pods = sum(r["ready"] for r in roles.values())
    desired_pods = sum(r["desired"] for r in roles.values())
    if problems:
        reason, message = sorted(problems)[0]
        degraded = _condition("Degraded", True, reason, message, generation)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "no problems seen", generation)
    if rolling:
        progressing = _condition("Progressing", True, "Updating", "; ".join(rolling), generation)
        ready_reason = (problems and sorted(problems)[0][0]) or "Updating"
        ready = _condition("Ready", False, ready_reason, "; ".join(rolling), generation)
    else:
        progressing = _condition(
            "Progressing", False, "Complete", "every role runs the current spec", generation
        )
        ready = _condition(
            "Ready", True, "AllReplicasReady", f"{ready_pods}/{desired_pods} pods ready", generation
        )
    if conflict:
        reason = "ChildConflict"
        degraded = _condition("Degraded", True, reason, conflict, generation)
        ready = _condition("Ready", False, reason, conflict, generation)
        waiting = "not applied while a child's name is taken (retried with backoff)"
        progressing = _condition("Progressing", False, reason, waiting, generation)
    return {
        "observedGeneration": generation,
        "mode": mode,
        "url": url,
        "replicas": f"{ready_pods}/{desired_pods}",
        "roles": roles,
        "conditions": with_times([ready, progressing, degraded], old, now),
    }


def invalid(*, generation: int, message: str, old: Obj | None, now: str) -> Obj:
    """Status of a spec that can't be deployed: children are left as they were."""
    base = dict(old or {})
    base.pop("conditions", None)
    conditions = [
        _condition("Ready", False, "InvalidSpec", message, generation),
        _condition("Progressing", False, "InvalidSpec", "waiting for a valid spec", generation),
        _condition("Degraded", True, "InvalidSpec", message, generation),
    ]
    base["observedGeneration"] = generation
    base["conditions"] = with_times(conditions, old, now)
    return base


def with_times(conditions: list[Obj], old: Obj | None, now: str) -> list[Obj]:
    previous = {c.get("type"): c for c in (old or {}).get("conditions") or []}
    out = []
    for cond in conditions:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same and before else None
        out.append({**cond, "lastTransitionTime": stamp or now})
    return out


def condition(status: Obj | None, kind: str) -> Obj | None:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None
