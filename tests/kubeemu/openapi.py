"""OpenAPI v3 value validation of a custom resource, as kube-openapi's SchemaValidator does it,
with its errors converted the way kube-apiserver converts them (``kubeOpenAPIResultToFieldErrors``),
and the ``x-kubernetes-list-type`` set/map invariants (``structurallisttype``)."""

from __future__ import annotations

import json
import math
from typing import Any

from kubeemu.causes import (
    DUPLICATE,
    NIL,
    NOT_SUPPORTED,
    REQUIRED,
    TOO_LONG,
    TOO_MANY,
    TYPE_INVALID,
    cause,
    go_float,
    go_json,
    go_quote,
    invalid,
    render,
)
from kubeemu.formats import format_ok
from kubeemu.schema_node import SchemaNode


def _kind(v: Any) -> str:
    """The OpenAPI type name of a JSON value (what kube-openapi's type validator reports)."""
    t = type(v)
    if t is str:
        return "string"
    if t is bool:
        return "boolean"
    if t is int:
        return "integer"
    if t is float:
        return "number"
    if t is dict:
        return "object"
    if t is list:
        return "array"
    if v is None:
        return "null"
    return t.__name__


def canon(v: Any) -> str:
    """A key under which two JSON values are equal iff Go's reflect.DeepEqual says so."""
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _enum_has(enum: list, v: Any) -> bool:
    tv = type(v)
    for e in enum:
        te = type(e)
        if tv is bool or te is bool:
            if tv is te and v == e:
                return True
        elif tv in (int, float) and te in (int, float):
            if v == e:
                return True
        elif tv is te and v == e:
            return True
    return False


def _enum_values(enum: list) -> str:
    return ", ".join(go_quote(e if isinstance(e, str) else go_json(e)) for e in enum)


_INT_RANGES = {
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
    "": (-(2**63), 2**63 - 1),
    "int64": (-(2**63), 2**63 - 1),
}


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def validate(
    v: Any,
    node: SchemaNode,
    name: str,
    lpath: str,
    errs: list[dict],
    lerrs: list[dict] | None,
    skip: str | None = None,
) -> None:
    """kube-openapi's SchemaValidator, errors converted as the apiserver converts them.

    ``name`` is kube-openapi's path (map keys joined with "."), ``lpath`` the field.Path
    the list-type check reports (map keys as ``[key]``); ``lerrs`` collects the latter.
    """
    if v is None:
        if node.types and not node.nullable:
            tname = ",".join(node.types)
            errs.append(
                invalid(
                    name,
                    "null",
                    f'{name} in body must be of type {tname}: "null"',
                    TYPE_INVALID,
                )
            )
        if node.enum and not _enum_has(node.enum, v):
            errs.append(
                cause(
                    NOT_SUPPORTED,
                    name,
                    f"Unsupported value: null: supported values: {_enum_values(node.enum)}",
                )
            )
        return
    kind = _kind(v)
    types_ = node.types
    if (
        types_
        and kind not in types_
        and not (
            (kind == "integer" and "number" in types_)
            or (kind == "number" and "integer" in types_ and v.is_integer())
        )
    ):
        errs.append(
            invalid(
                name,
                kind,
                f"{name} in body must be of type {','.join(types_)}: {go_quote(kind)}",
                TYPE_INVALID,
            )
        )
    if node.any_of or node.one_of or node.all_of or node.not_ is not None:
        _validate_combinators(v, node, name, errs)
    if kind == "string":
        _validate_string(v, node, name, errs)
    elif kind in ("integer", "number"):
        _validate_number(v, node, name, errs)
    elif kind == "array":
        if lerrs is not None and node.list_type in ("set", "map"):
            _validate_list_type(v, node, lpath, lerrs)
        items = node.items
        if items is not None:
            for i, x in enumerate(v):
                validate(x, items, f"{name}[{i}]", f"{lpath}[{i}]", errs, lerrs)
        n = len(v)
        if node.min_items is not None and n < node.min_items:
            errs.append(
                invalid(name, n, f"{name} in body should have at least {node.min_items} items")
            )
        if node.max_items is not None and n > node.max_items:
            errs.append(
                cause(
                    TOO_MANY,
                    name,
                    f"Too many: {n}: must have at most "
                    f"{node.max_items} {_plural(node.max_items, 'item', 'items')}",
                )
            )
        if node.unique_items and len({canon(x) for x in v}) != n:
            errs.append(invalid(name, "", f"{name} in body shouldn't contain duplicates"))
    if node.enum and not _enum_has(node.enum, v):
        errs.append(
            cause(
                NOT_SUPPORTED,
                name,
                f"Unsupported value: {render(v)}: supported values: {_enum_values(node.enum)}",
            )
        )
    if kind == "object":
        _validate_object(v, node, name, lpath, errs, lerrs, skip)


def _validate_object(
    v: dict,
    node: SchemaNode,
    name: str,
    lpath: str,
    errs: list[dict],
    lerrs: list[dict] | None,
    skip: str | None,
) -> None:
    n = len(v)
    if node.min_properties is not None and n < node.min_properties:
        errs.append(
            invalid(
                name, n, f"{name} in body should have at least {node.min_properties} properties"
            )
        )
        return
    if node.max_properties is not None and n > node.max_properties:
        errs.append(
            cause(
                TOO_MANY,
                name,
                f"Too many: {n}: must have at most "
                f"{node.max_properties} "
                f"{_plural(node.max_properties, 'item', 'items')}",
            )
        )
        return
    props = node.properties or {}
    ap = node.additional
    if ap is not None:
        for k, x in v.items():
            if k not in props and k != skip:
                validate(x, ap, f"{name}.{k}" if name else k, f"{lpath}[{k}]", errs, lerrs)
    for k, child in props.items():
        if k in v and k != skip:
            if node.resource_root and k == "metadata":
                validate(v[k], child, k, k, errs, None)
                continue
            validate(
                v[k],
                child,
                f"{name}.{k}" if name else k,
                f"{lpath}.{k}" if lpath else k,
                errs,
                lerrs,
            )
    for k in node.required:
        if k not in v and k != skip:
            errs.append(cause(REQUIRED, f"{name}.{k}" if name else k, "Required value"))


def _validate_string(v: str, node: SchemaNode, name: str, errs: list[dict]) -> None:
    if node.max_length is not None and len(v) > node.max_length:
        errs.append(
            cause(
                TOO_LONG,
                name,
                f"Too long: may not be more than "
                f"{node.max_length} "
                f"{_plural(node.max_length, 'byte', 'bytes')}",
            )
        )
    elif node.min_length is not None and len(v) < node.min_length:
        errs.append(
            invalid(name, v, f"{name} in body should be at least {node.min_length} chars long")
        )
    elif node.pattern is not None and not node.pattern.search(v):
        errs.append(invalid(name, v, f"{name} in body should match '{node.pattern_src}'"))
    if node.format and not format_ok(node.format, v):
        errs.append(
            invalid(
                name,
                v,
                f"{name} in body must be of type {node.format}: {go_quote(v)}",
                TYPE_INVALID,
            )
        )


def _validate_number(v: int | float, node: SchemaNode, name: str, errs: list[dict]) -> None:
    if node.type == "integer":
        lo_hi = _INT_RANGES.get(node.format)
        if lo_hi is not None and (
            (type(v) is float and not v.is_integer()) or not lo_hi[0] <= v <= lo_hi[1]
        ):
            fmt = f" with format {node.format}" if node.format else ""
            errs.append(invalid(NIL, "", f"Checked value must be of type integer{fmt} in {name}"))
    m = node.multiple_of
    if m is not None:
        if type(v) is int and float(m).is_integer() and m != 0:
            if v % int(m):
                errs.append(invalid(name, v, f"{name} in body should be a multiple of {int(m)}"))
        elif m != 0:
            q = v / m
            if not (math.isfinite(q) and float(q).is_integer()):
                errs.append(
                    invalid(name, v, f"{name} in body should be a multiple of {_fmt_bound(v, m)}")
                )
    if node.maximum is not None:
        mx = node.maximum
        bad = v >= mx if node.exclusive_maximum else v > mx
        if bad:
            rel = "less than" if node.exclusive_maximum else "less than or equal to"
            errs.append(invalid(name, v, f"{name} in body should be {rel} {_fmt_bound(v, mx)}"))
    if node.minimum is not None:
        mn = node.minimum
        bad = v <= mn if node.exclusive_minimum else v < mn
        if bad:
            rel = "greater than" if node.exclusive_minimum else "greater than or equal to"
            errs.append(invalid(name, v, f"{name} in body should be {rel} {_fmt_bound(v, mn)}"))


def _validate_combinators(v: Any, node: SchemaNode, name: str, errs: list[dict]) -> None:
    if node.any_of:
        best: list[dict] | None = None
        for sub in node.any_of:
            sub_errs: list[dict] = []
            validate(v, sub, name, name, sub_errs, None)
            if not sub_errs:
                best = None
                break
            if best is None or len(sub_errs) < len(best):
                best = sub_errs
        else:
            errs.append(
                invalid(NIL, "", f"{go_quote(name)} must validate at least one schema (anyOf)")
            )
        if best:
            errs.extend(best)
    if node.one_of:
        valid = 0
        best = None
        for sub in node.one_of:
            sub_errs = []
            validate(v, sub, name, name, sub_errs, None)
            if not sub_errs:
                valid += 1
            elif valid == 0 and (best is None or len(sub_errs) < len(best)):
                best = sub_errs
        if valid != 1:
            extra = "Found none valid" if valid == 0 else f"Found {valid} valid alternatives"
            errs.append(
                invalid(
                    NIL,
                    "",
                    f"{go_quote(name)} must validate one and only one schema (oneOf). {extra}",
                )
            )
            if valid == 0 and best:
                errs.extend(best)
    if node.all_of:
        valid = 0
        for sub in node.all_of:
            sub_errs = []
            validate(v, sub, name, name, sub_errs, None)
            if not sub_errs:
                valid += 1
            errs.extend(sub_errs)
        if valid != len(node.all_of):
            extra = ". None validated" if valid == 0 else ""
            errs.append(
                invalid(NIL, "", f"{go_quote(name)} must validate all the schemas (allOf){extra}")
            )
    if node.not_ is not None:
        sub_errs = []
        validate(v, node.not_, name, name, sub_errs, None)
        if not sub_errs:
            errs.append(invalid(NIL, "", f"{go_quote(name)} must not validate the schema (not)"))


def _validate_list_type(v: list, node: SchemaNode, lpath: str, lerrs: list[dict]) -> None:
    """``x-kubernetes-list-type`` set/map invariants (structurallisttype in the server)."""
    if node.list_type == "set":
        seen: set[str] = set()
        for i, x in enumerate(v):
            key = canon(x)
            if key in seen:
                lerrs.append(cause(DUPLICATE, f"{lpath}[{i}]", f"Duplicate value: {render(x)}"))
            seen.add(key)
        return
    for i, x in enumerate(v):
        if x is not None and type(x) is not dict:
            lerrs.append(
                invalid(f"{lpath}[{i}]", x, "must be an object for an array of list-type map")
            )
            return
    keys = node.list_map_keys
    seen = set()
    for i, x in enumerate(v):
        kv = {k: x[k] for k in keys if k in x} if x else {}
        key = canon(kv)
        if key in seen:
            lerrs.append(cause(DUPLICATE, f"{lpath}[{i}]", f"Duplicate value: {render(kv)}"))
        seen.add(key)


def _fmt_bound(v: int | float, bound: int | float) -> str:
    """A min/max/multipleOf bound as kube-openapi prints it (int for int data, else %v)."""
    if type(v) is int and float(bound).is_integer():
        return str(int(bound))
    return go_float(float(bound))
