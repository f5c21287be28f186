"""What the API server checks when an InferenceService is written, checked again in Python: the
CRD's structural schema (as JSON Schema) and its CEL rules, on a spec whose defaults are filled
in (``spec.defaults``). The schema is the generated CRD's own (``crd.document``).
"""

from __future__ import annotations

import functools
from typing import Any

from ketch.operator.crd.document import crd_document


@functools.cache
def openapi_schema() -> dict[str, Any]:
    """The CRD's root schema (``openAPIV3Schema``): ``metadata``, ``spec`` and ``status``."""
    return crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@functools.cache
def _json_schema_validator() -> Any:
    import jsonschema

    return jsonschema.Draft7Validator(_to_json_schema(openapi_schema()))


def _to_json_schema(schema: Any) -> Any:
    """OpenAPI v3 (Kubernetes structural) -> JSON Schema: drop the x-kubernetes-* extensions."""
    if isinstance(schema, dict):
        out = {k: _to_json_schema(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if schema.get("type") == "object" and "properties" in schema:
            out.setdefault("additionalProperties", False)
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            out.pop("additionalProperties", None)
        if "properties" in out:
            out["properties"] = {k: _to_json_schema(v) for k, v in schema["properties"].items()}
        return out
    if isinstance(schema, list):
        return [_to_json_schema(v) for v in schema]
    return schema


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def cel_problems(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Evaluates the CRD's CEL rules on ``value`` (already defaulted), depth first."""
    problems: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        if not evaluate_rule(rule["rule"], value):
            where = path + rule.get("fieldPath", "")
            problems.append(f"{where}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                problems += cel_problems(sub, value[name], f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += cel_problems(schema["items"], item, f"{path}[{i}]")
    return problems


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def evaluate_rule(rule: str, value: Any) -> bool:
    import celpy

    try:
        result = _program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except Exception:  # an evaluation error is a failed rule, as in the API server
        return False
    return bool(result) if not isinstance(result, Exception) else False


def structural_problems(spec: dict[str, Any]) -> list[str]:
    """Where a (defaulted) spec breaks the CRD's structural schema: types, enums, bounds,
    patterns, required and unknown fields, each as ``<path>: <message>``."""
    return [
        f"{_path(e.absolute_path)}: {e.message}"
        for e in sorted(
            _json_schema_validator().iter_errors({"spec": spec}), key=lambda e: list(e.path)
        )
    ]


def name_problems(name: str) -> list[str]:
    """The CRD's root rules (on ``metadata.name``) that ``name`` breaks."""
    return [
        f"metadata.name: {rule['message']}"
        for rule in openapi_schema().get("x-kubernetes-validations", [])
        if not evaluate_rule(rule["rule"], {"metadata": {"name": name}})
    ]
