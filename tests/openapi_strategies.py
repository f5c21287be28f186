"""Hypothesis strategies for request bodies, built from a server's own OpenAPI document.

``body_strategy(document, path)`` draws JSON bodies for ``POST path``: values of the declared
types (and enums, bounds and nested models), with some fields replaced by an extreme value of
the wrong type or size. The schema comes from the running server (``GET /openapi.json``), so a
field added to the request models is fuzzed without touching this file.
"""

from __future__ import annotations

from typing import Any

from hostile import EXTREMES
from hypothesis import strategies as st

_JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
ANY_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
# Values that break a field: the shared extremes, and a few of every JSON type.
BREAKERS = st.sampled_from(EXTREMES) | ANY_JSON


def _resolve(schema: dict[str, Any], document: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    name = ref.removeprefix("#/components/schemas/")
    return document["components"]["schemas"][name]


def from_schema(schema: dict[str, Any], document: dict[str, Any], depth: int = 0) -> Any:
    """A strategy for values ``schema`` allows (bounded in size)."""
    schema = _resolve(schema, document)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, document, depth) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, document, depth) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.integers(min_value=low, max_value=high) | st.integers(-3, 300)
    if kind == "number":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.floats(min_value=low, max_value=high, allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=min(schema.get("maxLength", 40), 40))
    if kind == "array":
        if depth > 3:
            return st.just([])
        items = from_schema(schema.get("items", {}), document, depth + 1)
        return st.lists(items, max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" or "properties" in schema:
        if depth > 3:
            return st.just({})
        properties = schema.get("properties", {})
        props = {k: from_schema(v, document, depth + 1) for k, v in properties.items()}
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties")
        base = st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
        if isinstance(extra, dict) and not props:
            return st.dictionaries(st.text(max_size=8), from_schema(extra, document, depth + 1))
        return base
    return ANY_JSON


@st.composite
def body_strategy(
    draw: Any, document: dict[str, Any], path: str, fixed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A body for ``POST path``: either a few schema-typed fields (often a valid request), or
    every field drawn with up to two broken. ``fixed`` values (e.g. the served model's name) are
    set first and may be broken like any other field."""
    operation = document["paths"][path]["post"]
    schema = _resolve(operation["requestBody"]["content"]["application/json"]["schema"], document)
    properties = schema.get("properties", {})
    names = sorted(properties)
    if draw(st.booleans()):
        chosen = set(schema.get("required", [])) | set(
            draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
        )
        body = {n: draw(from_schema(properties[n], document, 1)) for n in sorted(chosen)}
        body.update(fixed or {})
        return body
    body = draw(from_schema(schema, document))
    body.update(fixed or {})
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[name] = draw(BREAKERS)
    return body
