"""Unknown fields of built-in kinds, as kube-apiserver's decoder sees them.

The real server decodes built-in objects into Go structs: fields the struct lacks are dropped
(fieldValidation=Ignore/Warn, Warn adding a `Warning` header) or rejected (Strict, 400
`strict decoding error: unknown field "spec.foo"`). We walk the object along the OpenAPI schemas
that the `kubernetes-validate` package ships (Kubernetes 1.32, strict flavour).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

_PREFERRED = "v1.32.0-local-strict"


@lru_cache(maxsize=1)
def _definitions() -> dict[str, Any] | None:
    try:
        import kubernetes_validate
    except ImportError:
        return None
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    candidates = sorted(
        (p for p in root.glob("v*-local-strict") if (p / "_definitions.json").exists()),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)],
    )
    if not candidates:
        return None
    chosen = next((p for p in candidates if p.name == _PREFERRED), candidates[-1])
    return json.loads((chosen / "_definitions.json").read_text())["$defs"]


@lru_cache(maxsize=1)
def _by_gvk() -> dict[tuple[str, str, str], str]:
    defs = _definitions() or {}
    out = {}
    for name, schema in defs.items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            out[(gvk.get("group", ""), gvk.get("version", ""), gvk.get("kind", ""))] = name
    return out


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    defs = _definitions() or {}
    while "$ref" in schema:
        schema = defs.get(schema["$ref"].rsplit("/", 1)[-1], {})
    return schema


def _walk(value: Any, schema: dict[str, Any], path: str, unknown: list[str]) -> None:
    schema = _resolve(schema)
    if not schema or schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and not isinstance(extra, dict):
            return  # free-form (RawExtension, FieldsV1, ...)
        for key in list(value):
            sub = path + "." + key if path else key
            if props is not None and key in props:
                _walk(value[key], props[key], sub, unknown)
            elif isinstance(extra, dict):
                _walk(value[key], extra, sub, unknown)
            elif extra is False or props is not None:
                unknown.append(sub)
                del value[key]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _walk(item, schema["items"], f"{path}[{i}]", unknown)


def prune_unknown(group: str, version: str, kind: str, obj: dict[str, Any]) -> list[str]:
    """Drop the fields the kind's schema does not declare (in place); return their paths."""
    name = _by_gvk().get((group, version, kind))
    if name is None:
        return []
    unknown: list[str] = []
    _walk(obj, {"$ref": name}, "", unknown)
    return unknown
