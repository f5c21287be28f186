"""A CRD schema compiled for admission: one :class:`SchemaNode` per schema node, with its value
constraints, its children and its CEL rules compiled once (:class:`Rule`).

Compilation refuses what kube-apiserver refuses at CRD creation: rules that do not parse,
select fields the schema does not declare, name an invalid ``fieldPath``, or use a reason the
server does not support (and, emulator-only, CEL functions it does not implement).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubeemu.causes import INVALID, RULE_REASONS, CRDSchemaError, go_quote
from kubeemu.cel_runtime import CelProgram
from kubeemu.cel_types import cel_escape


@dataclass
class Rule:
    rule: str
    program: CelProgram
    message: str
    message_program: CelProgram | None
    field_suffix: str  # normalised fieldPath, "" when none
    reason: str
    uses_old: bool


class SchemaNode:
    """One schema node, with everything admission needs precomputed."""

    def __init__(self, schema: dict, where: str, *, resource_root: bool = False) -> None:
        if not isinstance(schema, dict):
            raise CRDSchemaError(f"{where}: schema must be an object")
        self.where = where
        self.type: str = schema.get("type") or ""
        self.int_or_string = bool(schema.get("x-kubernetes-int-or-string"))
        self.types: tuple[str, ...] = (
            ("integer", "string") if self.int_or_string else (self.type,) if self.type else ()
        )
        self.nullable = bool(schema.get("nullable"))
        self.preserve_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        self.embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        self.resource_root = resource_root or self.embedded
        self.has_default = "default" in schema
        self.default = schema.get("default")
        self.format: str = schema.get("format") or ""
        self.enum: list | None = schema.get("enum")
        self.maximum = schema.get("maximum")
        self.minimum = schema.get("minimum")
        self.exclusive_maximum = bool(schema.get("exclusiveMaximum"))
        self.exclusive_minimum = bool(schema.get("exclusiveMinimum"))
        self.multiple_of = schema.get("multipleOf")
        self.max_length = schema.get("maxLength")
        self.min_length = schema.get("minLength")
        pattern = schema.get("pattern")
        try:
            self.pattern = re.compile(pattern) if pattern is not None else None
        except re.error as ex:
            raise CRDSchemaError(f"{where}.pattern: {pattern!r}: {ex}") from ex
        self.pattern_src = pattern
        self.max_items = schema.get("maxItems")
        self.min_items = schema.get("minItems")
        self.unique_items = bool(schema.get("uniqueItems"))
        self.max_properties = schema.get("maxProperties")
        self.min_properties = schema.get("minProperties")
        self.required: list[str] = list(schema.get("required") or [])
        self.list_type: str = schema.get("x-kubernetes-list-type") or ""
        self.list_map_keys: list[str] = list(schema.get("x-kubernetes-list-map-keys") or [])
        self.map_atomic = schema.get("x-kubernetes-map-type") == "atomic"

        props = schema.get("properties")
        self.properties: dict[str, SchemaNode] | None = (
            {k: SchemaNode(v, f"{where}.properties[{k}]") for k, v in props.items()}
            if props
            else None
        )
        self.defaulted = [(k, n) for k, n in (self.properties or {}).items() if n.has_default]
        self.escaped = {k: cel_escape(k) for k in (self.properties or {})}
        ap = schema.get("additionalProperties")
        self.additional: SchemaNode | None = None
        self.additional_true = ap is True
        if isinstance(ap, dict):
            self.additional = SchemaNode(ap, f"{where}.additionalProperties")
        items = schema.get("items")
        self.items: SchemaNode | None = (
            SchemaNode(items, f"{where}.items") if isinstance(items, dict) else None
        )
        self.all_of = [
            SchemaNode(s, f"{where}.allOf[{i}]") for i, s in enumerate(schema.get("allOf") or [])
        ]
        self.any_of = [
            SchemaNode(s, f"{where}.anyOf[{i}]") for i, s in enumerate(schema.get("anyOf") or [])
        ]
        self.one_of = [
            SchemaNode(s, f"{where}.oneOf[{i}]") for i, s in enumerate(schema.get("oneOf") or [])
        ]
        self.not_: SchemaNode | None = (
            SchemaNode(schema["not"], f"{where}.not") if "not" in schema else None
        )

        if self.list_type == "map":
            if not self.list_map_keys:
                raise CRDSchemaError(
                    f"{where}: x-kubernetes-list-map-keys must be set for "
                    "x-kubernetes-list-type: map"
                )
        elif self.list_map_keys:
            raise CRDSchemaError(
                f"{where}: x-kubernetes-list-map-keys requires x-kubernetes-list-type: map"
            )
        if self.list_type and self.list_type not in ("atomic", "set", "map"):
            raise CRDSchemaError(f"{where}: unsupported x-kubernetes-list-type {self.list_type!r}")

        self.rules = [
            self._compile_rule(r, i)
            for i, r in enumerate(schema.get("x-kubernetes-validations") or [])
        ]
        children = [*(self.properties or {}).values()]
        if self.additional is not None:
            children.append(self.additional)
        if self.items is not None:
            children.append(self.items)
        self.rules_below = bool(self.rules) or any(c.rules_below for c in children)
        self.listtype_below = bool(self.list_type in ("set", "map")) or any(
            c.listtype_below for c in children
        )

    def _compile_rule(self, spec: dict, i: int) -> Rule:
        where = f"{self.where}.x-kubernetes-validations[{i}]"
        rule = spec.get("rule")
        if not isinstance(rule, str) or not rule.strip():
            raise CRDSchemaError(f"{where}.rule: Required value")
        program = CelProgram(rule, f"{where}.rule", self._field_check(f"{where}.rule"))
        msg_expr = spec.get("messageExpression")
        msg_program = (
            CelProgram(
                msg_expr,
                f"{where}.messageExpression",
                self._field_check(f"{where}.messageExpression"),
            )
            if msg_expr
            else None
        )
        reason = spec.get("reason") or INVALID
        if reason not in RULE_REASONS:
            raise CRDSchemaError(f"{where}.reason: Unsupported value: {go_quote(reason)}")
        if spec.get("optionalOldSelf"):
            raise CRDSchemaError(
                f"{where}.optionalOldSelf: not supported by the emulator (needs CEL optional types)"
            )
        message = (spec.get("message") or "").strip()
        suffix = (
            self._field_path(spec["fieldPath"], f"{where}.fieldPath")
            if spec.get("fieldPath")
            else ""
        )
        uses_old = "oldSelf" in program.idents or (
            msg_program is not None and "oldSelf" in msg_program.idents
        )
        return Rule(rule, program, message, msg_program, suffix, reason, uses_old)

    def _field_check(self, where: str) -> Callable[[Any], None]:
        return lambda ast: _check_fields(ast, self, where)

    def _field_path(self, path: str, where: str) -> str:
        """Validate a rule's fieldPath against the schema; return it normalised (``a.b[k]``)."""
        tokens = re.findall(r"\.([^.\[\]]+)|\['((?:[^'\\]|\\.)*)'\]|(.)", path)
        node: SchemaNode | None = self
        out = ""
        for named, quoted, junk in tokens:
            if junk or node is None:
                raise CRDSchemaError(
                    f"{where}: Invalid value: {go_quote(path)}: fieldPath must be a valid path"
                )
            name = named or quoted.replace("\\'", "'").replace("\\\\", "\\")
            if node.properties is not None:
                if name not in node.properties:
                    raise CRDSchemaError(
                        f"{where}: Invalid value: {go_quote(path)}: fieldPath "
                        "must be a valid path: does not refer to a valid field"
                    )
                out += ("." if out else "") + name
                node = node.properties[name]
            elif node.additional is not None:
                out += f"[{name}]"
                node = node.additional
            else:
                raise CRDSchemaError(
                    f"{where}: Invalid value: {go_quote(path)}: fieldPath "
                    "must be a valid path: does not refer to a valid field"
                )
        return out

    def child(self, key: str) -> SchemaNode | None:
        if self.properties is not None:
            n = self.properties.get(key)
            if n is not None:
                return n
        return self.additional


_DYNAMIC = object()  # a value whose schema is unknown to the static check
_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def _schema_of(tree: Any, node: SchemaNode) -> Any:
    """The schema node a CEL member expression reads (``self.a[0].b``), or _DYNAMIC."""
    data = getattr(tree, "data", None)
    if data in ("member", "primary"):
        return _schema_of(tree.children[0], node)
    if data == "ident":
        return node if tree.children[0].value in ("self", "oldSelf") else _DYNAMIC
    if data == "member_dot":
        parent = _schema_of(tree.children[0], node)
        if not isinstance(parent, SchemaNode):
            return _DYNAMIC
        name = tree.children[1].value
        if parent.resource_root and name in _ROOT_FIELDS:
            return _DYNAMIC
        if parent.properties is not None:
            for prop, escaped in parent.escaped.items():
                if escaped == name:
                    return parent.properties[prop]
            return _DYNAMIC if parent.preserve_unknown else None
        return parent.additional if parent.additional is not None else _DYNAMIC
    if data == "member_index":
        parent = _schema_of(tree.children[0], node)
        if isinstance(parent, SchemaNode):
            if parent.items is not None:
                return parent.items
            if parent.additional is not None:
                return parent.additional
        return _DYNAMIC
    return _DYNAMIC


def _check_fields(ast: Any, node: SchemaNode, where: str) -> None:
    """Reject ``self.field`` selections the schema does not declare, like the server's CEL type
    check does at CRD creation (so a typo in a rule fails fast instead of at every request)."""
    for sub in ast.iter_subtrees_topdown():
        if sub.data == "member_dot" and _schema_of(sub, node) is None:
            name = sub.children[1].value
            raise CRDSchemaError(f"{where}: compilation failed: undefined field '{name}'")
