"""Pruning: children an InferenceService owns that its spec no longer wants are deleted.

Only children whose controller reference is the InferenceService's uid are touched
(``ownership.controlled_by``), so an object of the same name that someone else made, or one
left by an earlier InferenceService of that name, stays; and the delete carries that uid as its
precondition, so an object that replaced the child since it was read is not deleted either.
"""

from __future__ import annotations

from ketch.operator import children
from ketch.operator.cache import ChildKey, Obj, ServiceState
from ketch.operator.kube import KubeClient
from ketch.operator.ownership import controlled_by
from ketch.operator.spec.model import ServiceSpec


async def prune_watched(
    client: KubeClient, svc: ServiceSpec, live: dict[ChildKey, Obj], desired: dict[ChildKey, Obj]
) -> list[str]:
    """Deletes the watched children (``live``, from the cache) that ``desired`` lacks."""
    deleted = []
    for (kind, name), obj in list(live.items()):
        if (
            (kind, name) in desired
            or kind not in children.BY_KIND
            or not controlled_by(obj, svc.uid)
        ):
            continue
        if await client.delete(kind, svc.namespace, name, uid=_uid(obj)):
            deleted.append(f"{kind} {name}")
    return deleted


async def prune_unwatched(
    client: KubeClient, state: ServiceState, svc: ServiceSpec, desired: dict[ChildKey, Obj]
) -> list[str]:
    """Deletes the children of kinds kopf does not watch (``children.UNWATCHED``: custom kinds
    whose CRDs may be missing) that are no longer wanted. They are looked up by name, only
    where one may exist, and only where their kind is served."""
    deleted = []
    first = state.applied_generation is None
    for unwatched in children.UNWATCHED:
        kind = unwatched.kind
        # After a start-up nothing is known: the names the spec allows; else what the last
        # applied generation had.
        if first:
            assert unwatched.unwatched_names is not None
            names = unwatched.unwatched_names(svc)
        else:
            names = {n for k, n in state.applied if k == kind}
        for name in sorted(names):
            if (kind, name) in desired or kind in state.unserved:
                continue
            obj = await client.get(kind, svc.namespace, name)  # None: 404
            if not controlled_by(obj, svc.uid):
                continue
            if await client.delete(kind, svc.namespace, name, uid=_uid(obj)):
                deleted.append(f"{kind} {name}")
    return deleted


def _uid(obj: Obj | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("uid")
