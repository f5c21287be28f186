"""Pruning and defaulting of a custom resource (``structuralpruning`` and ``structuraldefaulting``
in the apiserver): unknown fields are dropped and reported, non-nullable nulls dropped (or
defaulted), ``default`` applied recursively, including inside defaults, array items and
``additionalProperties`` maps."""

from __future__ import annotations

from typing import Any

from kubeemu.schema_node import SchemaNode


def copy_json(v: Any) -> Any:
    t = type(v)
    if t is dict:
        return {k: copy_json(x) for k, x in v.items()}
    if t is list:
        return [copy_json(x) for x in v]
    return v


def normalize(
    v: Any,
    node: SchemaNode | None,
    path: str,
    unknown: list[str] | None,
    skip: str | None = None,
) -> Any:
    """Copy ``v``, dropping unknown fields and non-nullable nulls, applying defaults."""
    if node is None:
        return copy_json(v)
    t = type(v)
    if t is dict:
        props = node.properties
        ap = node.additional
        keep = node.preserve_unknown or node.additional_true
        out: dict[str, Any] = {}
        for k, x in v.items():
            if k == skip or (node.resource_root and k in ("apiVersion", "kind", "metadata")):
                out[k] = copy_json(x)
                continue
            child = props.get(k) if props is not None else None
            if child is None:
                child = ap
                if child is None:
                    if keep:
                        out[k] = copy_json(x)
                    elif unknown is not None:
                        unknown.append(f"{path}.{k}" if path else k)
                    continue
            if x is None and not child.nullable:
                if not child.has_default:
                    continue  # PruneNonNullableNullsWithoutDefaults
                out[k] = normalize(
                    copy_json(child.default), child, f"{path}.{k}" if path else k, None
                )
                continue
            out[k] = normalize(x, child, f"{path}.{k}" if path else k, unknown)
        for k, child in node.defaulted:
            if k not in out and k != skip:
                out[k] = normalize(
                    copy_json(child.default), child, f"{path}.{k}" if path else k, None
                )
        return out
    if t is list:
        items = node.items
        if items is None:
            return copy_json(v)
        res = []
        for i, x in enumerate(v):
            if x is None and not items.nullable and items.has_default:
                res.append(normalize(copy_json(items.default), items, f"{path}[{i}]", None))
            else:
                res.append(normalize(x, items, f"{path}[{i}]", unknown))
        return res
    if t is float and node.type == "integer" and v.is_integer():
        return int(v)  # Go's JSON round trip stores 1.0 as 1
    return v
