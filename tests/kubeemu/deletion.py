"""Deletion: finalizers, namespaces and CRDs that terminate before they go, and the garbage
collector (owner references: background cascade, orphaning, children whose owner is gone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kubeemu.errors import conflict, not_found
from kubeemu.fieldsets import dcopy
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import FieldRequirement, Requirement
from kubeemu.timefmt import now_rfc3339

if TYPE_CHECKING:
    from kubeemu.store import Store


def delete(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    name: str,
    *,
    propagation: str | None = None,
    preconditions: dict[str, Any] | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    old = store.peek(rt.key, ns, name)
    if old is None:
        raise not_found(rt, name)
    meta = old["metadata"]
    pre = preconditions or {}
    if pre.get("uid") and pre["uid"] != meta["uid"]:
        raise conflict(
            rt,
            name,
            f"Precondition failed: UID in precondition: {pre['uid']}, "
            f"UID in object meta: {meta['uid']}",
        )
    if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
        raise conflict(
            rt,
            name,
            "Precondition failed: ResourceVersion in precondition: "
            f"{pre['resourceVersion']}, ResourceVersion in object meta: "
            f"{meta['resourceVersion']}",
        )
    policy = propagation or "Background"
    if rt.key == ("", "namespaces") or rt.key == (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
    ):
        return store._delete_container(rt, old, dry_run)
    if meta.get("finalizers"):
        if meta.get("deletionTimestamp"):
            return store.view(rt, old)
        new = dict(old)
        new["metadata"] = {
            **meta,
            "deletionTimestamp": now_rfc3339(),
            "deletionGracePeriodSeconds": 0,
            "generation": meta.get("generation", 1) + 1,
        }
        if dry_run:
            return store.view(rt, new)
        return store.view(rt, store._commit(rt, old, new))
    if dry_run:
        return store.view(rt, old)
    return store.view(rt, store._remove(rt, old, policy))


def delete_container(
    store: Store, rt: ResourceType, old: dict[str, Any], dry_run: bool
) -> dict[str, Any]:
    """Namespaces and CRDs: terminate (delete contents), then go away once empty."""
    meta = old["metadata"]
    if meta.get("deletionTimestamp"):
        return store.view(rt, old)
    new = dict(old)
    new["metadata"] = {
        **meta,
        "deletionTimestamp": now_rfc3339(),
        "deletionGracePeriodSeconds": 0,
    }
    if rt.key == ("", "namespaces"):
        new["status"] = {**(old.get("status") or {}), "phase": "Terminating"}
    else:
        new["metadata"]["finalizers"] = ["customresourcecleanup.apiextensions.k8s.io"]
        conds = [
            c
            for c in (old.get("status") or {}).get("conditions") or []
            if c.get("type") != "Terminating"
        ]
        conds.append(
            {
                "type": "Terminating",
                "status": "True",
                "lastTransitionTime": now_rfc3339(),
                "reason": "InstanceDeletionInProgress",
                "message": "CustomResource deletion is in progress",
            }
        )
        new["status"] = {**(old.get("status") or {}), "conditions": conds}
    if dry_run:
        return store.view(rt, new)
    stored = store._commit(rt, old, new)
    for key, ns, name in store._contents(rt, old):
        obj = store.peek(key, ns, name)
        if obj is not None and not obj["metadata"].get("deletionTimestamp"):
            store.delete(store.storage_rt(key), ns or None, name)
    return store.view(rt, store._finalize_container(rt, stored) or stored)


def crd_keys(store: Store, crd_name: str) -> list[tuple[str, str]]:
    return [k for k, v in store.types.items() if any(r.crd_name == crd_name for r in v.values())]


def contents(
    store: Store, rt: ResourceType, container: dict[str, Any]
) -> list[tuple[Any, str, str]]:
    name = container["metadata"]["name"]
    out = []
    if rt.key == ("", "namespaces"):
        if not store.ns_counts.get(name):
            return []
        for key, objs in store.objects.items():
            out.extend((key, ns, oname) for (ns, oname) in objs if ns == name)
    else:
        for key in store._crd_keys(name):
            out.extend((key, ns, oname) for (ns, oname) in store.objects.get(key, {}))
    return out


def is_empty(store: Store, rt: ResourceType, container: dict[str, Any]) -> bool:
    name = container["metadata"]["name"]
    if rt.key == ("", "namespaces"):
        return not store.ns_counts.get(name)
    return not any(store.objects.get(key) for key in store._crd_keys(name))


def finalize_container(
    store: Store, rt: ResourceType, container: dict[str, Any]
) -> dict[str, Any] | None:
    if not store._is_empty(rt, container):
        return None
    if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        for key in store._crd_keys(container["metadata"]["name"]):
            store._unregister(key)
    return store._remove(rt, container, "Background")


def remove(store: Store, rt: ResourceType, obj: dict[str, Any], policy: str) -> dict[str, Any]:
    """Delete for real: DELETED event, then garbage-collect dependents."""
    meta = obj["metadata"]
    key = rt.key
    ns, name = meta.get("namespace", ""), meta["name"]
    if store.objects.get(key, {}).get((ns, name)) is not obj:
        return obj
    store.rv += 1
    final = dict(obj)
    final["metadata"] = {**meta, "resourceVersion": str(store.rv)}
    del store.objects[key][(ns, name)]
    store._index(key, obj, None)
    store._emit(key, "DELETED", final, None)
    uid = meta["uid"]
    for dkey, dns, dname in sorted(store.dependents.get(uid, ())):
        dep = store.peek(dkey, dns, dname)
        if dep is None or dkey not in store.types:
            continue
        drt = store.storage_rt(dkey)
        if policy == "Orphan":
            refs = [r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
            new = dcopy(dep)
            if refs:
                new["metadata"]["ownerReferences"] = refs
            else:
                new["metadata"].pop("ownerReferences", None)
            store._write(
                drt,
                dep,
                new,
                verb="gc",
                manager="kube-controller-manager",
                subresource=None,
                dry_run=False,
                field_validation="Ignore",
            )
        elif not store._has_live_owner(dep):
            store.delete(drt, dns or None, dname, propagation="Background")
    if ns and key != ("", "namespaces"):
        ns_obj = store.peek(("", "namespaces"), None, ns)
        if ns_obj is not None and ns_obj["metadata"].get("deletionTimestamp"):
            store._finalize_container(store.rt("", "namespaces"), ns_obj)
    if rt.crd_name:
        crd = store.peek(("apiextensions.k8s.io", "customresourcedefinitions"), None, rt.crd_name)
        if crd is not None and crd["metadata"].get("deletionTimestamp"):
            store._finalize_container(
                store.rt("apiextensions.k8s.io", "customresourcedefinitions"), crd
            )
    return final


def has_live_owner(store: Store, obj: dict[str, Any]) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r.get("uid") in store.uids for r in refs)


def collect_if_orphaned(store: Store, key: tuple[str, str], ns: str | None, name: str) -> None:
    """The garbage collector's view of a child whose owners do not exist (any more)."""
    obj = store.peek(key, ns, name)
    if obj is None or key not in store.types:
        return
    meta = obj["metadata"]
    if (
        meta.get("ownerReferences")
        and not store._has_live_owner(obj)
        and not meta.get("deletionTimestamp")
    ):
        store.delete(store.storage_rt(key), ns or None, name)


def later(store: Store, fn: Callable[..., None], *args: Any) -> None:
    if store.loop is not None:
        store.loop.call_later(0.05, fn, *args)
    else:
        fn(*args)


def delete_collection(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    labels: list[Requirement],
    fields: list[FieldRequirement],
    *,
    propagation: str | None = None,
    dry_run: bool = False,
) -> list[dict[str, Any]]:
    items, _, _, _ = store.list(rt, ns, labels, fields)
    out = []
    for obj in items:
        meta = obj["metadata"]
        if store.peek(rt.key, meta.get("namespace"), meta["name"]) is None:
            continue
        out.append(
            store.delete(
                rt,
                meta.get("namespace"),
                meta["name"],
                propagation=propagation,
                dry_run=dry_run,
            )
        )
    return out
