"""The CRD schema's defaults, filled in as the API server fills them in."""

from __future__ import annotations

import copy
from typing import Any


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fills in schema defaults as the API server does (absent properties only, recursively)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(out) - set(schema.get("properties", {})):
                out[name] = apply_defaults(extra, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value
