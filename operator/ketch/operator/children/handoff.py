"""Handing a Deployment's ``spec.replicas`` over to an autoscaler without a drop to 1: the
Deployment kind's ``prepare`` hook.

When a role switches from fixed ``replicas`` to ``autoscaling``, its Deployment is applied
without ``replicas``. Under server-side apply a field that its only manager stops applying is
removed, and the API server then defaults a Deployment's replicas to 1: the role would fall to
one pod until the autoscaler acts. Kubernetes documents the way out ("Transferring ownership"
in the server-side apply reference): before the applier drops the field, a private field manager
applies ``replicas`` alone, at the value it has. The operator's apply then leaves the field to
that manager; the autoscaler's first scale (an update of the ``scale`` subresource) takes the
field from it, and its entry disappears from ``managedFields``.

The hand-over is decided from the live object, not from the previous spec, so it also happens
when the operator restarts between the two applies, and never twice. A new autoscaled Deployment
is created with its autoscaler's ``minReplicas``, handed over the same way on the next apply (or
taken by the autoscaler's first scale).
"""

from __future__ import annotations

from ketch.operator.children.kind import Obj, Prepared
from ketch.operator.managers import FIELD_MANAGER, HANDOFF_FIELD_MANAGER
from ketch.operator.spec.model import ServiceSpec


def owns_replicas(live: Obj, manager: str = FIELD_MANAGER) -> bool:
    """True when ``manager``'s apply owns the live object's ``spec.replicas``."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if (entry.get("manager"), entry.get("operation")) != (manager, "Apply"):
            continue
        if entry.get("subresource"):
            continue
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            return True
    return False


def needs_handoff(desired: Obj, live: Obj | None) -> bool:
    """True when applying ``desired`` would take ``replicas`` away from a live Deployment that
    the operator still sets them on."""
    return (
        desired["kind"] == "Deployment"
        and "replicas" not in (desired.get("spec") or {})
        and live is not None
        and owns_replicas(live)
    )


def replicas_only(desired: Obj, live: Obj) -> Obj:
    """The live replica count, alone: what ``HANDOFF_FIELD_MANAGER`` applies."""
    meta = desired["metadata"]
    return {
        "apiVersion": desired["apiVersion"],
        "kind": desired["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": _replicas(live)},
    }


def prepare(svc: ServiceSpec, child: Obj, live: Obj | None) -> Prepared:
    """The Deployment to apply. Without ``replicas`` (its role is autoscaled): created with the
    autoscaler's ``minReplicas``; or, live, after a hand-over when the operator still owns them.
    ``live``: the Deployment as it is now (this InferenceService's, or None)."""
    if "replicas" in child["spec"]:
        return Prepared(child)
    if live is None:
        initial = _initial_replicas(svc, child["metadata"]["name"])
        if initial is None:
            return Prepared(child)
        return Prepared({**child, "spec": {**child["spec"], "replicas": initial}})
    if not needs_handoff(child, live):
        return Prepared(child)
    note = f"{_replicas(live)} replicas handed over to the autoscaler"
    return Prepared(child, replicas_only(child, live), HANDOFF_FIELD_MANAGER, note)


def _replicas(live: Obj) -> int:
    return int((live.get("spec") or {}).get("replicas", 1))


def _initial_replicas(svc: ServiceSpec, name: str) -> int | None:
    """``minReplicas`` of the autoscaled role whose Deployment is ``name``; None otherwise."""
    for role in svc.roles:
        autoscaling = svc.role(role).get("autoscaling")
        if autoscaling and name == f"{svc.name}-{role}":
            return int(autoscaling.get("minReplicas", 1))
    return None
