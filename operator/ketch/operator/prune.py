"""Pruning: children an InferenceService owns that its spec no longer wants are deleted.

Only children whose controller reference is the InferenceService's uid are touched
(``ownership.controlled_by``), so an object of the same name that someone else made, or one
left by an earlier InferenceService of that name, stays; and the delete carries that uid as its
precondition, so an object that replaced the child since it was read is not deleted either.
"""

from __future__ import annotations

from ketch.operator.cache import ChildKey, Obj, Tracked
from ketch.operator.kube import KubeClient
from ketch.operator.ownership import controlled_by
from ketch.operator.spec.model import ServiceSpec

CHILD_KINDS = (
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "InferencePool",
    "HTTPRoute",
)
# Child kinds kopf does not watch (handlers.CHILD_RESOURCES): KEDA's ScaledObject is a custom
# kind that may not be installed, and a watch on a missing resource fails forever. Without
# events, a ScaledObject edited by hand is put back by the next full reconcile (resync) rather
# than at once, and pruning looks such children up by name (see ``prune_unwatched``).
# GAIE's InferencePool and Gateway API's HTTPRoute likewise (the operator watches its
# InferencePools itself, namespace by namespace: ``gateway_watch``).
UNWATCHED_KINDS = ("ScaledObject", "InferencePool", "HTTPRoute")


async def prune_watched(
    client: KubeClient, svc: ServiceSpec, live: dict[ChildKey, Obj], desired: dict[ChildKey, Obj]
) -> list[str]:
    """Deletes the watched children (``live``, from the cache) that ``desired`` lacks."""
    deleted = []
    for (kind, name), obj in list(live.items()):
        if (kind, name) in desired or kind not in CHILD_KINDS or not controlled_by(obj, svc.uid):
            continue
        if await client.delete(kind, svc.namespace, name, uid=_uid(obj)):
            deleted.append(f"{kind} {name}")
    return deleted


async def prune_unwatched(
    client: KubeClient, tracked: Tracked, svc: ServiceSpec, desired: dict[ChildKey, Obj]
) -> list[str]:
    """Deletes unwatched children (ScaledObjects, InferencePools, HTTPRoutes) no longer wanted.
    They are looked up by their names (``<name>-<role>``, ``<name>``), only where one may
    exist, and only where their kind is served."""
    deleted = []
    first = tracked.applied_generation is None
    for kind in UNWATCHED_KINDS:
        # After a start-up nothing is known: look at the spec's roles; else at what the
        # last applied generation had.
        if first:
            names = {svc.name} if kind != "ScaledObject" else {f"{svc.name}-{r}" for r in svc.roles}
        else:
            names = {n for k, n in tracked.desired if k == kind}
        for name in sorted(names):
            if (kind, name) in desired or kind in tracked.unserved:
                continue
            obj = await client.get(kind, svc.namespace, name)  # None: 404
            if not controlled_by(obj, svc.uid):
                continue
            if await client.delete(kind, svc.namespace, name, uid=_uid(obj)):
                deleted.append(f"{kind} {name}")
    return deleted


def _uid(obj: Obj | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("uid")
