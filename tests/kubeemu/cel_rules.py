"""The CEL ``x-kubernetes-validations`` rules of a custom resource: evaluated parents first over
the object (``oldSelf`` from the stored object for transition rules, list items correlated by
their map keys), with kube-apiserver's messages for failures and evaluation errors."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from celpy import celtypes
from celpy.evaluation import CELEvalError

from kubeemu.causes import DUPLICATE, FORBIDDEN, NIL, REQUIRED, cause, invalid, render
from kubeemu.cel_runtime import INT64_MAX, INT64_MIN, FastMap, FastStr, eval_error_text
from kubeemu.openapi import canon
from kubeemu.schema_node import Rule, SchemaNode


def run_rules(
    v: Any,
    node: SchemaNode,
    path: str,
    cv: Any,
    old: Any,
    old_cv: Any,
    errs: list[dict],
    skip: str | None = None,
) -> None:
    """Evaluate the rules at ``node`` then below it (parents first, like the server)."""
    if v is None:
        return  # rules only see non-null values
    if node.rules:
        if cv is None:
            cv = to_cel(v, node)
        for rule in node.rules:
            if rule.uses_old:
                if old is None:
                    continue  # transition rules need an old value at this path
                if old_cv is None:
                    old_cv = to_cel(old, node)
                variables = {"self": cv, "oldSelf": old_cv}
            else:
                variables = {"self": cv}
            _run_rule(rule, node, path, variables, errs)
    t = type(v)
    if t is dict:
        props = node.properties
        ap = node.additional
        old_d = old if type(old) is dict and not node.map_atomic else None
        for k, x in v.items():
            if k == skip:
                continue
            child = props.get(k) if props is not None else None
            if child is not None:
                if not child.rules_below:
                    continue
                ck = node.escaped.get(k)
                sub = f"{path}.{k}" if path else k
            elif ap is not None and ap.rules_below:
                child, ck, sub = ap, k, f"{path}[{k}]"
            else:
                continue
            ccv = dict.get(cv, ck) if cv is not None and ck is not None else None
            oldx = old_d.get(k) if old_d is not None else None
            run_rules(x, child, sub, ccv, oldx, None, errs)
    elif t is list:
        items = node.items
        if items is None or not items.rules_below:
            return
        olds: dict[str, Any] = {}
        if node.list_type == "map" and type(old) is list:
            keys = node.list_map_keys
            for o in old:
                if type(o) is dict:
                    olds[canon({k: o.get(k) for k in keys})] = o
        for i, x in enumerate(v):
            oldx = None
            if olds and type(x) is dict:
                oldx = olds.get(canon({k: x.get(k) for k in node.list_map_keys}))
            ccv = cv[i] if cv is not None else None
            run_rules(x, items, f"{path}[{i}]", ccv, oldx, None, errs)


def _run_rule(
    rule: Rule, node: SchemaNode, path: str, variables: dict[str, Any], errs: list[dict]
) -> None:
    res = rule.program.run(variables)
    err_field = path or NIL
    rule_str = rule.message or rule.rule.strip()
    if isinstance(res, CELEvalError):
        text = eval_error_text(res)
        if text == "no such overload":
            detail = (
                "'no such overload': call arguments did not match a supported "
                f"operator, function or macro signature for rule: {rule_str}"
            )
        else:
            detail = f"{text} evaluating rule: {rule_str}"
        errs.append(invalid(err_field, node.type, detail))
        return
    if type(res) is celtypes.BoolType or type(res) is bool:
        if res:
            return
    else:
        errs.append(invalid(err_field, node.type, f"rule did not evaluate to a bool: {rule_str}"))
        return
    fld = path
    if rule.field_suffix:
        fld = f"{path}.{rule.field_suffix}" if path else rule.field_suffix
    detail = ""
    if rule.message_program is not None:
        m = rule.message_program.run(variables)
        if isinstance(m, str) and m.strip() and "\n" not in m.strip():
            detail = m.strip()
    if not detail:
        detail = rule.message or f"failed rule: {rule.rule.strip()}"
    fld = fld or NIL
    if rule.reason == FORBIDDEN:
        errs.append(cause(FORBIDDEN, fld, f"Forbidden: {detail}"))
    elif rule.reason == REQUIRED:
        errs.append(cause(REQUIRED, fld, f"Required value: {detail}"))
    elif rule.reason == DUPLICATE:
        errs.append(cause(DUPLICATE, fld, f"Duplicate value: {render(node.type)}"))
    else:
        errs.append(invalid(fld, node.type, detail))


# JSON -> CEL values, following the schema (escaped property names, typed formats).

_StringType = FastStr
_IntType = celtypes.IntType
_DoubleType = celtypes.DoubleType
_MapType = FastMap
_ListType = celtypes.ListType
_TRUE = celtypes.BoolType(True)
_FALSE = celtypes.BoolType(False)
_META_VISIBLE = ("name", "generateName")
_new_str = str.__new__
_new_int = int.__new__
_new_float = float.__new__


def to_cel(v: Any, node: SchemaNode | None) -> Any:
    """JSON value -> CEL value (constructors bypassed: celpy's are slow for plain values)."""
    t = type(v)
    if t is str:
        if node is not None and node.format in ("date-time", "date", "duration", "byte"):
            return _typed_string(v, node.format)
        return _new_str(_StringType, v)
    if t is bool:
        return _TRUE if v else _FALSE
    if t is int:
        if (node is not None and node.type == "number") or not INT64_MIN <= v <= INT64_MAX:
            return _new_float(_DoubleType, v)
        return _new_int(_IntType, v)
    if t is float:
        return _new_float(_DoubleType, v)
    if t is dict:
        m = _MapType()
        if node is None:
            for k, x in v.items():
                m[_new_str(_StringType, k)] = to_cel(x, None)
            return m
        props = node.properties
        ap = node.additional
        esc = node.escaped
        root = node.resource_root
        for k, x in v.items():
            if root and k == "metadata" and type(x) is dict:
                m[_new_str(_StringType, k)] = to_cel(
                    {n: x[n] for n in _META_VISIBLE if n in x}, None
                )
                continue
            child = props.get(k) if props is not None else None
            if child is not None:
                ck = esc[k]
                if ck is None:
                    continue  # a property CEL cannot name is left out, as in the server
                m[_new_str(_StringType, ck)] = to_cel(x, child)
            else:
                m[_new_str(_StringType, k)] = to_cel(x, ap)
        return m
    if t is list:
        items = node.items if node is not None else None
        return _ListType([to_cel(x, items) for x in v])
    return v  # None


def _typed_string(s: str, fmt: str) -> Any:
    """Kubernetes gives CEL ``format: date-time/date`` as timestamp, ``duration``, ``byte``."""
    try:
        if fmt == "byte":
            return celtypes.BytesType(base64.b64decode(s))
        if fmt == "duration":
            return celtypes.DurationType(s)
        if fmt == "date":
            return celtypes.TimestampType(f"{s}T00:00:00Z")
        return celtypes.TimestampType(s)
    except (ValueError, TypeError, binascii.Error):
        return _StringType(s)
