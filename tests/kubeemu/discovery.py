"""Discovery: the server's version, the API groups and resource lists kubectl and clients ask
for, and just enough OpenAPI v3 for kubectl (fieldValidation, custom resources' schemas)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from aiohttp import web

from kubeemu.http_wire import generic_not_found, json_response
from kubeemu.kinds import ResourceType
from kubeemu.store import Store

VERSION_INFO = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-kubeemu",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def version_key(v: str) -> tuple[int, int, int, str]:
    """Kubernetes version priority: GA before beta before alpha, higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", v)
    if not m:
        return (3, 0, 0, v)
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (stage, -int(m.group(1)), -int(m.group(3) or 0), v)


def served_groups(store: Store) -> dict[str, list[str]]:
    groups: dict[str, set[str]] = {}
    for rt in store.served():
        if rt.group:
            groups.setdefault(rt.group, set()).add(rt.version)
    return {g: sorted(vs, key=version_key) for g, vs in sorted(groups.items())}


def group_info(store: Store, name: str) -> dict[str, Any] | None:
    versions = served_groups(store).get(name)
    if not versions:
        return None
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def group_list(store: Store) -> dict[str, Any]:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [group_info(store, g) for g in served_groups(store)],
    }


def resource_list(store: Store, group: str, version: str) -> web.Response:
    types = sorted(
        (rt for rt in store.served() if rt.group == group and rt.version == version),
        key=lambda r: r.plural,
    )
    if not types:
        raise generic_not_found()
    resources: list[dict[str, Any]] = []
    for rt in types:
        entry: dict[str, Any] = {
            "name": rt.plural,
            "singularName": rt.singular,
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": list(rt.verbs),
        }
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        if rt.categories:
            entry["categories"] = list(rt.categories)
        resources.append(entry)
        if rt.status:
            resources.append(
                {
                    "name": f"{rt.plural}/status",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        if rt.scale is not None:
            resources.append(
                {
                    "name": f"{rt.plural}/scale",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": ["get", "patch", "update"],
                }
            )
    gv = f"{group}/{version}" if group else version
    return json_response(
        {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": resources,
        }
    )


def openapi_v3(store: Store, gv_parts: list[str]) -> web.Response:
    """Just enough OpenAPI v3 for kubectl: which PATCH endpoints take `fieldValidation`.

    kubectl (>= 1.27) asks this before choosing server-side field validation; without it
    kubectl falls back to client-side validation that needs full schemas.
    """
    gvs: dict[str, list[ResourceType]] = {}
    for rt in store.served():
        gv = f"apis/{rt.group}/{rt.version}" if rt.group else f"api/{rt.version}"
        gvs.setdefault(gv, []).append(rt)
    if not gv_parts:
        paths = {}
        for gv, types in sorted(gvs.items()):
            digest = (
                hashlib.sha256(
                    json.dumps(sorted((t.plural, t.kind, t.namespaced) for t in types)).encode()
                )
                .hexdigest()[:16]
                .upper()
            )
            paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
        return json_response({"paths": paths})
    gv = "/".join(gv_parts)
    if gv not in gvs:
        raise generic_not_found()
    params = [
        {"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
        for n in ("dryRun", "fieldManager", "fieldValidation", "force")
    ]
    out_paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    for rt in sorted(gvs[gv], key=lambda r: r.plural):
        if rt.schema:  # custom resources: their schema, so that `kubectl explain` works
            dotted = ".".join(reversed(rt.group.split(".")))
            schemas[f"{dotted}.{rt.version}.{rt.kind}"] = {
                **rt.schema,
                "x-kubernetes-group-version-kind": [
                    {"group": rt.group, "version": rt.version, "kind": rt.kind}
                ],
            }
        base = f"/{gv}/namespaces/{{namespace}}" if rt.namespaced else f"/{gv}"
        gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
        for verb in ("patch", "put", "post"):
            path = f"{base}/{rt.plural}" + ("" if verb == "post" else "/{name}")
            out_paths.setdefault(path, {})[verb] = {
                "operationId": f"{verb}{rt.kind}",
                "x-kubernetes-action": {"put": "put", "post": "post"}.get(verb, "patch"),
                "x-kubernetes-group-version-kind": gvk,
                "parameters": params,
                "responses": {"200": {"description": "OK"}},
            }
    return json_response(
        {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
            "paths": out_paths,
            "components": {"schemas": schemas},
        }
    )
