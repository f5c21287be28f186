"""The write path: create, update, and the composition and commit every write shares
(managed fields recorded, generation bumped on spec changes, no-op writes store nothing)."""

from __future__ import annotations

import json
import random
import uuid
from typing import TYPE_CHECKING, Any

from kubeemu import object_names
from kubeemu.admission import check_identity
from kubeemu.errors import already_exists, bad_request, conflict, invalid, not_found
from kubeemu.fieldsets import canon, dcopy, flatten, tracked_view
from kubeemu.kinds import ResourceType
from kubeemu.managed_fields import parse_managed, record_update, serialize_managed
from kubeemu.timefmt import now_rfc3339

if TYPE_CHECKING:
    from kubeemu.store import Store

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"


def random_suffix(n: int = 5) -> str:
    return "".join(random.choice(_NAME_CHARS) for _ in range(n))


def create(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    body: Any,
    *,
    manager: str,
    dry_run: bool = False,
    field_validation: str = "Warn",
    entries: list[Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    if not isinstance(body, dict):
        raise bad_request("the body of the request must be a JSON object")
    store._check_type(rt, body)
    meta = body.get("metadata") or {}
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    if rt.namespaced:
        body_ns = meta.get("namespace")
        if body_ns and ns and body_ns != ns:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent "
                "on the request"
            )
        ns = ns or body_ns
        if not ns:
            raise bad_request("the namespace of the object must be set")
    else:
        ns = None
    name = meta.get("name") or ""
    if not name and meta.get("generateName"):
        for _ in range(10):
            name = meta["generateName"] + random_suffix()
            if store.peek(rt.key, ns, name) is None:
                break
    if not name:
        raise invalid(
            rt,
            "",
            [
                {
                    "reason": "FieldValueRequired",
                    "field": "metadata.name",
                    "message": "Required value: name or generateName is required",
                }
            ],
        )
    if meta.get("resourceVersion"):
        raise bad_request("resourceVersion should not be set on objects to be created")
    store._check_namespace(rt, ns, name)
    name_errs = object_names.validate_name(rt, name)
    if name_errs:
        raise invalid(rt, name, name_errs)
    if store.peek(rt.key, ns, name) is not None:
        raise already_exists(rt, name)

    new = dcopy(body)
    new["apiVersion"] = rt.api_version
    new["kind"] = rt.kind
    new_meta = new.setdefault("metadata", {})
    for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
        new_meta.pop(k, None)
    new_meta["name"] = name
    if ns:
        new_meta["namespace"] = ns
    else:
        new_meta.pop("namespace", None)
    new_meta["uid"] = str(uuid.uuid4())
    new_meta["creationTimestamp"] = now_rfc3339()
    new_meta["generation"] = 1
    if rt.status:
        new.pop("status", None)
    request_managed = new_meta.pop("managedFields", None)
    new, warnings = store._admit(rt, new, None, subresource=None, field_validation=field_validation)
    new_meta = new["metadata"]
    if entries is None:
        if explicit_managed(request_managed):
            entries = (
                []
                if request_managed == [{}]
                else parse_managed({"metadata": {"managedFields": request_managed}})
            )
        else:
            entries = record_update(
                [],
                manager=manager,
                api_version=rt.api_version,
                subresource="",
                old_flat={},
                new_flat=flatten(tracked_view(new, rt.scope), rt.resolver),
                now=now_rfc3339(),
            )
    managed = serialize_managed(entries)
    if managed:
        new_meta["managedFields"] = managed
    if dry_run:
        return store.view(rt, new), warnings
    stored = store._commit(rt, None, new)
    if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        store._sync_crd_types(stored)
    if stored["metadata"].get("ownerReferences"):
        store._later(store._collect_if_orphaned, rt.key, ns, name)
    return store.view(rt, stored), warnings


def compose(
    store: Store,
    rt: ResourceType,
    old: dict[str, Any],
    body: dict[str, Any],
    subresource: str | None,
) -> dict[str, Any]:
    """The object a write would store, before admission: subresource rules applied."""
    if subresource == "status":
        new = dict(old)
        new["metadata"] = dict(old["metadata"])
        if body.get("status") is None:
            new.pop("status", None)
        else:
            new["status"] = dcopy(body["status"])
        return new
    new = dcopy(body)
    new["apiVersion"] = rt.api_version
    new["kind"] = rt.kind
    meta = new.get("metadata")
    if not isinstance(meta, dict):
        meta = new["metadata"] = {}
    old_meta = old["metadata"]
    for k in (
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "generation",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ):
        if k in old_meta:
            meta[k] = old_meta[k]
        else:
            meta.pop(k, None)
    if rt.status:
        if "status" in old:
            new["status"] = old["status"]
        else:
            new.pop("status", None)
    return new


def write(
    store: Store,
    rt: ResourceType,
    old: dict[str, Any],
    new: dict[str, Any],
    *,
    verb: str,
    manager: str,
    subresource: str | None,
    dry_run: bool,
    field_validation: str,
    request_managed: Any = None,
    entries: list[Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    new, warnings = store._admit(
        rt, new, old, subresource=subresource, field_validation=field_validation
    )
    meta = new["metadata"]
    old_meta = old["metadata"]
    if old_meta.get("deletionTimestamp"):
        added = [
            f for f in meta.get("finalizers") or [] if f not in (old_meta.get("finalizers") or [])
        ]
        if added:
            raise invalid(
                rt,
                meta["name"],
                [
                    {
                        "reason": "FieldValueForbidden",
                        "field": "metadata.finalizers",
                        "message": "Forbidden: no new finalizers can be added if the object "
                        "is being deleted, found new finalizers "
                        f"[]string{{{', '.join(json.dumps(f) for f in added)}}}",
                    }
                ],
            )
    scope = "status" if subresource == "status" else rt.scope
    if entries is None:
        # like the real field manager: managedFields sent with a main-resource write are the
        # base the update is recorded on (that is how clients rewrite them, e.g. kubectl's
        # client-side -> server-side apply migration; [{}] clears them); else the live ones
        old_managed = old_meta.get("managedFields")
        if (
            not subresource
            and explicit_managed(request_managed)
            and canon(request_managed) != canon(old_managed)
        ):
            base = (
                []
                if request_managed == [{}]
                else parse_managed({"metadata": {"managedFields": request_managed}})
            )
        else:
            base = parse_managed(old)
        entries = record_update(
            base,
            manager=manager,
            api_version=rt.api_version,
            subresource=subresource or "",
            old_flat=flatten(tracked_view(old, scope), rt.resolver),
            new_flat=flatten(tracked_view(new, scope), rt.resolver),
            now=now_rfc3339(),
        )
    managed = serialize_managed(entries)
    if managed:
        meta["managedFields"] = managed
    else:
        meta.pop("managedFields", None)
    meta["generation"] = old_meta.get("generation", 1)
    if spec_changed(rt, old, new):
        meta["generation"] += 1
    meta["resourceVersion"] = old_meta.get("resourceVersion")
    new["apiVersion"] = old["apiVersion"]
    if canon(new) == canon(old):
        return store.view(rt, old), warnings
    if old_meta.get("deletionTimestamp") and not meta.get("finalizers"):
        # the last finalizer went: the object is deleted, not updated (one DELETED event,
        # carrying the last stored state, as etcd reports it)
        if dry_run:
            return store.view(rt, new), warnings
        final = store._remove(rt, old, "Background")
        new["metadata"]["resourceVersion"] = final["metadata"]["resourceVersion"]
        return store.view(rt, new), warnings
    if dry_run:
        return store.view(rt, new), warnings
    stored = store._commit(rt, old, new)
    if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        store._sync_crd_types(stored)
    if canon(meta.get("ownerReferences")) != canon(old_meta.get("ownerReferences")):
        store._later(store._collect_if_orphaned, rt.key, meta.get("namespace"), meta["name"])
    return store.view(rt, stored), warnings


def update(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    name: str,
    body: Any,
    *,
    manager: str,
    subresource: str | None = None,
    dry_run: bool = False,
    field_validation: str = "Warn",
) -> tuple[dict[str, Any], list[str]]:
    old = store.peek(rt.key, ns, name)
    if old is None:
        raise not_found(rt, name)
    if not isinstance(body, dict):
        raise bad_request("the body of the request must be a JSON object")
    store._check_type(rt, body)
    meta = body.get("metadata") or {}
    check_identity(rt, ns, name, meta)
    rv = meta.get("resourceVersion")
    if rv and rv != old["metadata"]["resourceVersion"]:
        raise conflict(rt, name)
    if subresource == "scale":
        return store._write_scale(rt, old, body, manager=manager, dry_run=dry_run, verb="update")
    new = store._compose(rt, old, body, subresource)
    return store._write(
        rt,
        old,
        new,
        verb="update",
        manager=manager,
        subresource=subresource,
        dry_run=dry_run,
        field_validation=field_validation,
        request_managed=meta.get("managedFields"),
    )


def explicit_managed(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0


def spec_changed(rt: ResourceType, old: dict[str, Any], new: dict[str, Any]) -> bool:
    skip = {"metadata", "apiVersion", "kind"} | ({"status"} if rt.status else set())
    a = {k: v for k, v in old.items() if k not in skip}
    b = {k: v for k, v in new.items() if k not in skip}
    return canon(a) != canon(b)
