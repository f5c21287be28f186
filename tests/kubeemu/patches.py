"""PATCH: JSON merge, JSON and strategic merge patches, and server-side apply."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jsonpatch
import yaml

from kubeemu.admission import check_identity
from kubeemu.errors import ApiError, bad_request, conflict, details_of, not_found
from kubeemu.kinds import ResourceType
from kubeemu.managed_fields import ApplyConflict, apply_config
from kubeemu.patch_formats import merge_patch, strategic_merge
from kubeemu.timefmt import now_rfc3339

if TYPE_CHECKING:
    from kubeemu.store import Store

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def decode_yaml_or_json(raw: bytes) -> Any:
    """An apply body: JSON (what most clients send) or YAML."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return yaml.load(raw.decode("utf-8"), Loader=_YAML_LOADER)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise bad_request(f"error decoding YAML: {exc}") from exc


def patch(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    name: str,
    raw: bytes,
    content_type: str,
    *,
    manager: str | None,
    subresource: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    field_validation: str = "Warn",
) -> tuple[dict[str, Any], list[str], bool]:
    """Returns (object, warnings, created)."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == APPLY_PATCH:
        return store.apply(
            rt,
            ns,
            name,
            raw,
            manager=manager,
            subresource=subresource,
            force=force,
            dry_run=dry_run,
            field_validation=field_validation,
        )
    if ctype not in (MERGE_PATCH, JSON_PATCH, STRATEGIC_PATCH):
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types "
            f"include: {JSON_PATCH}, {MERGE_PATCH}, {APPLY_PATCH}"
            + ("" if rt.is_crd else f", {STRATEGIC_PATCH}"),
        )
    if force:
        raise bad_request("force may not be set for non-apply patch requests")
    old = store.peek(rt.key, ns, name)
    if old is None:
        raise not_found(rt, name)
    try:
        patch = json.loads(raw or b"null")
    except ValueError as exc:
        raise bad_request(f"error decoding patch: {exc}") from exc
    current: dict[str, Any] = store.view(rt, old)
    if subresource == "scale":
        current = store._scale_of(rt, old)
    if ctype == MERGE_PATCH:
        if not isinstance(patch, dict):
            raise bad_request("a merge patch must be a JSON object")
        patched = merge_patch(current, patch)
    elif ctype == JSON_PATCH:
        if not isinstance(patch, list):
            raise bad_request("a JSON patch must be a list of operations")
        try:
            patched = jsonpatch.apply_patch(current, patch)
        except jsonpatch.InvalidJsonPatch as exc:
            raise bad_request(str(exc)) from exc
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
    else:
        if rt.is_crd:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"strategic merge patch is not supported for {rt.api_version}, Kind={rt.kind}",
            )
        if not isinstance(patch, dict):
            raise bad_request("a strategic merge patch must be a JSON object")
        patched = strategic_merge(current, patch, (), rt.resolver)
    if not isinstance(patched, dict):
        raise bad_request("the patched object must be a JSON object")
    pmeta = patched.get("metadata") or {}
    if (
        pmeta.get("resourceVersion")
        and pmeta["resourceVersion"] != old["metadata"]["resourceVersion"]
    ):
        raise conflict(rt, name)
    if subresource == "scale":
        obj, warnings = store._write_scale(
            rt, old, patched, manager=manager or "unknown", dry_run=dry_run, verb="patch"
        )
        return obj, warnings, False
    new = store._compose(rt, old, patched, subresource)
    obj, warnings = store._write(
        rt,
        old,
        new,
        verb="patch",
        manager=manager or "unknown",
        subresource=subresource,
        dry_run=dry_run,
        field_validation=field_validation,
        request_managed=pmeta.get("managedFields"),
    )
    return obj, warnings, False


def apply(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    name: str,
    raw: bytes,
    *,
    manager: str | None,
    subresource: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    field_validation: str = "Warn",
) -> tuple[dict[str, Any], list[str], bool]:
    cfg = decode_yaml_or_json(raw)
    store.apply_log.append(
        {
            "seq": len(store.apply_log) + 1,
            "time": now_rfc3339(),
            "manager": manager,
            "apiVersion": cfg.get("apiVersion") if isinstance(cfg, dict) else None,
            "kind": cfg.get("kind") if isinstance(cfg, dict) else None,
            "namespace": ns,
            "name": name,
            "subresource": subresource,
            "force": force,
            "dryRun": dry_run,
            "body": cfg,
        }
    )
    if not manager:
        raise bad_request("PATCH, application/apply-patch+yaml requests must have a fieldManager")
    if not isinstance(cfg, dict):
        raise bad_request("the apply configuration must be an object")
    if subresource == "scale":
        raise ApiError(405, "MethodNotAllowed", "apply is not supported on the scale subresource")
    if not cfg.get("apiVersion") or not cfg.get("kind"):
        raise bad_request("apiVersion and kind must be set in an apply configuration")
    store._check_type(rt, cfg)
    meta = cfg.get("metadata") or {}
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    check_identity(rt, ns, name, meta)
    old = store.peek(rt.key, ns, name)
    if old is None and subresource:
        raise not_found(rt, name)
    scope = "status" if subresource == "status" else rt.scope
    base: dict[str, Any]
    if old is not None:
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        base = store.view(rt, old)
    else:
        base_meta: dict[str, Any] = {"name": name}
        if ns:
            base_meta["namespace"] = ns
        base = {"apiVersion": rt.api_version, "kind": rt.kind, "metadata": base_meta}
    try:
        merged, entries = apply_config(
            base,
            cfg,
            manager=manager,
            api_version=rt.api_version,
            subresource=subresource or "",
            scope=scope,
            force=force,
            resolver=rt.resolver,
            now=now_rfc3339(),
        )
    except ApplyConflict as exc:
        details = details_of(rt, name)
        details["causes"] = exc.causes()
        raise ApiError(409, "Conflict", exc.message(), details) from exc
    if old is None:
        merged.setdefault("metadata", {})
        obj, warnings = store.create(
            rt,
            ns,
            merged,
            manager=manager,
            dry_run=dry_run,
            field_validation=field_validation,
            entries=entries,
        )
        return obj, warnings, True
    new = store._compose(rt, old, merged, subresource)
    obj, warnings = store._write(
        rt,
        old,
        new,
        verb="apply",
        manager=manager,
        subresource=subresource,
        dry_run=dry_run,
        field_validation=field_validation,
        entries=entries,
    )
    return obj, warnings, False
