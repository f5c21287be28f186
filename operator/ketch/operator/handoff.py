"""Handing a Deployment's ``spec.replicas`` over to an autoscaler without a drop to 1.

When a role switches from fixed ``replicas`` to ``autoscaling``, its Deployment is applied
without ``replicas``. Under server-side apply a field that its only manager stops applying is
removed, and the API server then defaults a Deployment's replicas to 1: the role would fall to
one pod until the autoscaler acts. Kubernetes documents the way out ("Transferring ownership"
in the server-side apply reference): before the applier drops the field, a private field manager
applies ``replicas`` alone, at the value it has. The operator's apply then leaves the field to
that manager; the autoscaler's first scale (an update of the ``scale`` subresource) takes the
field from it, and its entry disappears from ``managedFields``.

The hand-over is decided from the live object, not from the previous spec, so it also happens
when the operator restarts between the two applies, and never twice.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.kube import FIELD_MANAGER, HANDOFF_FIELD_MANAGER, ApiError, KubeClient

Obj = dict[str, Any]


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


async def hand_over(client: KubeClient, desired: Obj, live: Obj) -> bool:
    """Applies the live replica count under ``HANDOFF_FIELD_MANAGER``. False when the autoscaler
    already owns the field with another value (a conflict: nothing to hand over)."""
    meta = desired["metadata"]
    replicas_only = {
        "apiVersion": desired["apiVersion"],
        "kind": desired["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": int((live.get("spec") or {}).get("replicas", 1))},
    }
    try:
        await client.apply(replicas_only, force=False, manager=HANDOFF_FIELD_MANAGER)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return False
    return True
