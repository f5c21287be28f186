"""The /scale subresource of Deployments and of custom resources that declare one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubeemu.errors import ApiError, not_found
from kubeemu.fieldsets import dcopy
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import selector_to_string

if TYPE_CHECKING:
    from kubeemu.store import Store


def scale_of(store: Store, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    if rt.scale is None:
        raise not_found(rt, obj["metadata"]["name"])
    meta = obj["metadata"]
    status: dict[str, Any] = {"replicas": get_path(obj, rt.scale.status_replicas) or 0}
    if rt.is_crd:
        if rt.scale.label_selector:
            sel = get_path(obj, rt.scale.label_selector)
            if sel:
                status["selector"] = sel
    else:
        sel = selector_to_string((obj.get("spec") or {}).get("selector"))
        if sel:
            status["selector"] = sel
    out_meta = {
        k: meta[k]
        for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
        if k in meta
    }
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": out_meta,
        "spec": {"replicas": get_path(obj, rt.scale.spec_replicas) or 0},
        "status": status,
    }


def get_scale(store: Store, rt: ResourceType, ns: str | None, name: str) -> dict[str, Any]:
    obj = store.peek(rt.key, ns, name)
    if obj is None or rt.scale is None:
        raise not_found(rt, name)
    return store._scale_of(rt, obj)


def write_scale(
    store: Store,
    rt: ResourceType,
    old: dict[str, Any],
    scale: dict[str, Any],
    *,
    manager: str,
    dry_run: bool,
    verb: str,
) -> tuple[dict[str, Any], list[str]]:
    assert rt.scale is not None
    replicas = (scale.get("spec") or {}).get("replicas")
    name = old["metadata"]["name"]
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ApiError(
            422,
            "Invalid",
            f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid value: '
            f"{replicas}: must be greater than or equal to 0",
            {
                "name": name,
                "group": "autoscaling",
                "kind": "Scale",
                "causes": [
                    {
                        "reason": "FieldValueInvalid",
                        "field": "spec.replicas",
                        "message": f"Invalid value: {replicas}: must be greater than or equal to 0",
                    }
                ],
            },
        )
    new = dcopy(store.view(rt, old))
    set_path(new, rt.scale.spec_replicas, replicas)
    new = store._compose(rt, old, new, None)
    obj, warnings = store._write(
        rt,
        old,
        new,
        verb=verb,
        manager=manager,
        subresource="scale",
        dry_run=dry_run,
        field_validation="Ignore",
    )
    return store._scale_of(rt, obj), warnings


def get_path(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.strip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value
