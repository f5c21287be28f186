"""Building blocks of the InferenceService CRD's OpenAPI schema, and the bounds they apply.

Typed property constructors (``string``, ``integer``, ``boolean``, ``obj`` with its CEL rules,
``free_form``, ``string_map``), the pattern of a Kubernetes quantity, and the length and size
bounds every string, list and map of the spec carries.
"""

from __future__ import annotations

from typing import Any

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"

# Bounds on every string, list and map of the spec. kube-apiserver prices each CEL rule at CRD
# creation, sizing what a rule may read without maxLength/maxItems/maxProperties from the 3 MiB
# request limit, and the root's rules may read anything. The real API server's estimator decides:
# tests/operator/test_crd.py creates the CRD on one (and sees a rule over unbounded strings
# refused), and keeps the spec bounded.
NAME_MAX_LENGTH = 253  # DNS-1123 subdomain: object names, Secret keys, extended resource names
LABEL_VALUE_MAX_LENGTH = 63
QUANTITY_MAX_LENGTH = 64
TEXT_MAX_LENGTH = 1024  # URIs, image references, flags
ENV_VALUE_MAX_LENGTH = 32768
MAX_ENV = 256
MAX_TOLERATIONS = 64
MAX_NODE_SELECTOR = 64


def _prop(kind: str, description: str, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind, "description": description}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def string(description: str, **extra: Any) -> dict[str, Any]:
    return _prop("string", description, **extra)


def integer(description: str, **extra: Any) -> dict[str, Any]:
    return _prop("integer", description, **extra)


def boolean(description: str, **extra: Any) -> dict[str, Any]:
    return _prop("boolean", description, **extra)


def obj(
    description: str,
    properties: dict[str, Any],
    *,
    required: tuple[str, ...] = (),
    rules: tuple[tuple[str, str] | tuple[str, str, str], ...] = (),
    default: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An object schema. ``rules`` are CEL rules: (rule, message[, fieldPath])."""
    out: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if required:
        out["required"] = list(required)
    if default is not None:
        out["default"] = default
    if rules:
        out["x-kubernetes-validations"] = [cel_rule(*r) for r in rules]
    return out


def cel_rule(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def free_form(description: str) -> dict[str, Any]:
    """A Kubernetes-typed value (affinity, toleration, valueFrom): kept as given."""
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


def string_map(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {
            "type": "string",
            "description": "A label value.",
            "maxLength": LABEL_VALUE_MAX_LENGTH,
        },
        "maxProperties": MAX_NODE_SELECTOR,
    }
