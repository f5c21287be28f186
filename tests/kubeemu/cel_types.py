"""CEL declaration types of a CRD schema, sized the way kube-apiserver sizes them for its CEL
cost estimate (``apiserver/pkg/cel/common/schemas.go``, ``apiextensions-apiserver/.../model``).

Each :class:`DeclType` carries ``max_elements`` (the largest ``size()`` a value may have: string
length, list items, map entries) and ``min_size`` (the shortest JSON a value can serialise to).
What a schema does not bound is sized from the 3 MiB request limit: a string without
``maxLength`` may be ``3 MiB - 2`` characters, a list ``(3 MiB - 2) / (item size + 1)`` items.
A declared ``maxLength`` counts four times (it is in runes; the estimate is in bytes).

Resource roots get ``apiVersion``, ``kind`` and ``metadata.{name,generateName}`` added unless the
schema declares all of them. This follows kube-apiserver up to v1.36, where an undeclared
``metadata.name`` is an unbounded string (v1.37 caps it at 253): the higher of the two estimates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024
MAX_DURATION_SIZE_JSON = 32
MAX_DATETIME_SIZE_JSON = 32
MIN_DURATION_SIZE_JSON = 3
JSON_DATE_SIZE = 12
MIN_DATETIME_SIZE_JSON = 21
MIN_STRING_SIZE = 2
MIN_BOOL_SIZE = 4
MIN_NUMBER_SIZE = 1

# CEL kinds of the types below. "object" is a struct in cel-go's terms; "quantity" is the
# Kubernetes quantity library's type.
SCALAR_KINDS = frozenset({"bool", "double", "duration", "int", "timestamp", "uint"})


@dataclass(eq=False)
class DeclType:
    """A CEL type as the cost estimator sees it (``apiservercel.DeclType``)."""

    kind: str  # object map list string bytes int uint double bool null dyn timestamp ...
    max_elements: int = 0
    min_size: int = 0
    fields: dict[str, DeclType] = field(default_factory=dict)  # object: CEL-escaped names
    elem: DeclType | None = None  # list items, map values
    key: DeclType | None = None  # map keys

    def __repr__(self) -> str:
        if self.kind == "list":
            return f"list({self.elem!r})"
        if self.kind == "map":
            return f"map({self.key!r}, {self.elem!r})"
        return self.kind


def simple(kind: str, min_size: int = 0) -> DeclType:
    return DeclType(kind, min_size=min_size)


def list_of(elem: DeclType, max_items: int = 0) -> DeclType:
    return DeclType("list", max_elements=max_items, min_size=2, elem=elem)


def map_of(key: DeclType, elem: DeclType, max_properties: int = 0) -> DeclType:
    return DeclType("map", max_elements=max_properties, min_size=2, key=key, elem=elem)


STRING = simple("string", MIN_STRING_SIZE)
INT = simple("int", MIN_NUMBER_SIZE)
DYN = simple("dyn", 1)

# --------------------------------------------------------------------------- escaping

_RESERVED = frozenset(
    {
        "true",
        "false",
        "null",
        "in",
        "as",
        "break",
        "const",
        "continue",
        "else",
        "for",
        "function",
        "if",
        "import",
        "let",
        "loop",
        "package",
        "namespace",
        "return",
        "var",
        "void",
        "while",
    }
)
_ESCAPES = {"__": "__underscores__", ".": "__dot__", "-": "__dash__", "/": "__slash__"}
_ESCAPE_RE = re.compile(r"__|[./-]")
_IDENT_CHARS = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")


def cel_escape(name: str) -> str | None:
    """A property name as CEL sees it (``foo-bar`` -> ``foo__dash__bar``); None if CEL cannot
    name it (such a property is left out of the type)."""
    if name in _RESERVED:
        return f"__{name}__"
    if not _IDENT_CHARS.match(name):
        return None
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], name)


# --------------------------------------------------------------------------- schemas


def _zero_if_negative(v: int) -> int:
    return max(v, 0)


def _max_string_length(s: dict) -> int:
    """estimateMaxStringLengthPerRequest: the format's longest value, else the request size."""
    fmt = s.get("format")
    if not s.get("x-kubernetes-int-or-string"):
        if fmt == "duration":
            return MAX_DURATION_SIZE_JSON
        if fmt == "date":
            return JSON_DATE_SIZE
        if fmt == "date-time":
            return MAX_DATETIME_SIZE_JSON
    return MAX_REQUEST_SIZE_BYTES - 2


def _from_max_length(s: dict) -> int:
    # maxLength counts runes; a rune may take four bytes of the request.
    return _zero_if_negative(int(s["maxLength"])) * 4


def _is_string(s: dict | None) -> bool:
    return isinstance(s, dict) and s.get("type") == "string"


def with_type_and_object_meta(s: dict) -> dict:
    """A resource root's schema with apiVersion, kind and metadata.{name,generateName} as CEL
    sees them: kept when all are declared, else plain (unbounded) strings."""
    props = s.get("properties") or {}
    meta = props.get("metadata") or {}
    meta_props = meta.get("properties") or {}
    if (
        _is_string(props.get("kind"))
        and _is_string(props.get("apiVersion"))
        and meta.get("type") == "object"
        and _is_string(meta_props.get("name"))
        and _is_string(meta_props.get("generateName"))
    ):
        return s
    plain = {"type": "string"}
    metadata = {"type": "object", "properties": {"name": plain, "generateName": plain}}
    return {**s, "properties": {**props, "kind": plain, "apiVersion": plain, "metadata": metadata}}


def schema_decl_type(s: dict, resource_root: bool = False) -> DeclType | None:
    """The CEL type of values of schema ``s``, or None where CEL does not see them."""
    if not isinstance(s, dict):
        return None
    if s.get("x-kubernetes-int-or-string"):
        size = _from_max_length(s) if "maxLength" in s else _max_string_length(s)
        return DeclType("dyn", max_elements=size, min_size=1)
    if resource_root:
        s = with_type_and_object_meta(s)
    kind = s.get("type")
    if kind == "array":
        return _array(s)
    if kind == "object":
        return _object(s)
    if kind == "string":
        return _string(s)
    return {
        "boolean": simple("bool", MIN_BOOL_SIZE),
        "number": simple("double", MIN_NUMBER_SIZE),
        "integer": simple("int", MIN_NUMBER_SIZE),
    }.get(kind or "")


def _embedded(s: dict) -> bool:
    return bool(s.get("x-kubernetes-embedded-resource"))


def _array(s: dict) -> DeclType | None:
    items = s.get("items")
    if not isinstance(items, dict):
        return None
    item = schema_decl_type(items, _embedded(items))
    if item is None:
        return None
    if "maxItems" in s:
        max_items = _zero_if_negative(int(s["maxItems"]))
    else:
        max_items = (MAX_REQUEST_SIZE_BYTES - 2) // (item.min_size + 1)
    return list_of(item, max_items)


def _object(s: dict) -> DeclType | None:
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        value = schema_decl_type(extra, _embedded(extra))
        if value is None:
            return None
        if "maxProperties" in s:
            max_props = _zero_if_negative(int(s["maxProperties"]))
        else:
            # key (at least "") + colon + comma + the smallest value
            max_props = (MAX_REQUEST_SIZE_BYTES - 2) // (value.min_size + 6)
        return map_of(STRING, value, max_props)
    required = set(s.get("required") or ())
    fields: dict[str, DeclType] = {}
    min_size = 2  # {}
    for name, prop in (s.get("properties") or {}).items():
        ft = schema_decl_type(prop, _embedded(prop) if isinstance(prop, dict) else False)
        if ft is None:
            continue
        escaped = cel_escape(name)
        if escaped is not None:
            fields[escaped] = ft
        # Required properties without a default are always serialised (defaults are filled in
        # server-side, so a client may leave those out).
        if name in required and "default" not in prop:
            min_size += len(name) + ft.min_size + 4
    return DeclType("object", min_size=min_size, fields=fields)


def _string(s: dict) -> DeclType:
    fmt = s.get("format")
    if fmt == "byte":
        size = _zero_if_negative(int(s["maxLength"])) if "maxLength" in s else _max_string_length(s)
        return DeclType("bytes", max_elements=size, min_size=MIN_STRING_SIZE)
    if fmt == "duration":
        return DeclType("duration", _max_string_length(s), MIN_DURATION_SIZE_JSON)
    if fmt == "date":
        return DeclType("timestamp", _max_string_length(s), JSON_DATE_SIZE)
    if fmt == "date-time":
        return DeclType("timestamp", _max_string_length(s), MIN_DATETIME_SIZE_JSON)
    if "maxLength" in s:
        size = _from_max_length(s)
    elif s.get("enum"):
        size = max((len(v.encode()) for v in s["enum"] if isinstance(v, str)), default=0)
    else:
        size = _max_string_length(s)
    return DeclType("string", max_elements=size, min_size=MIN_STRING_SIZE)
