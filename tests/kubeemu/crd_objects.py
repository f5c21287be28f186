"""CustomResourceDefinition objects themselves: their validation, their defaulting and the
status the apiextensions controllers would give them."""

from __future__ import annotations

from typing import Any

from kubeemu.object_names import field_cause, quoted


def validate_crd(crd: dict[str, Any]) -> list[dict[str, str]]:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    errs = []
    name = (crd.get("metadata") or {}).get("name", "")
    for f in ("plural", "kind"):
        if not names.get(f):
            errs.append(field_cause(f"spec.names.{f}", "FieldValueRequired", "Required value"))
    if not spec.get("group"):
        errs.append(field_cause("spec.group", "FieldValueRequired", "Required value"))
    if names.get("plural") and spec.get("group"):
        expected = f"{names['plural']}.{spec['group']}"
        if name != expected:
            errs.append(
                field_cause(
                    "metadata.name",
                    "FieldValueInvalid",
                    f'Invalid value: {quoted(name)}: must be spec.names.plural+"."+spec.group',
                )
            )
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errs.append(
            field_cause(
                "spec.scope",
                "FieldValueNotSupported",
                f"Unsupported value: {quoted(spec.get('scope'))}: supported values: "
                '"Cluster", "Namespaced"',
            )
        )
    versions = spec.get("versions") or []
    if not versions:
        errs.append(
            field_cause(
                "spec.versions",
                "FieldValueInvalid",
                "Invalid value: must have exactly one version marked as storage version",
            )
        )
    elif sum(1 for v in versions if v.get("storage")) != 1:
        errs.append(
            field_cause(
                "spec.versions",
                "FieldValueInvalid",
                "Invalid value: []apiextensions.CustomResourceDefinitionVersion{...}: must have "
                "exactly one version marked as storage version",
            )
        )
    return errs


def crd_status(crd: dict[str, Any], now: str, old_status: dict[str, Any] | None) -> dict[str, Any]:
    """Status the apiextensions controllers would settle on: names accepted, established."""
    spec = crd.get("spec") or {}
    names = dict(spec.get("names") or {})
    names.setdefault("singular", names.get("kind", "").lower())
    names.setdefault("listKind", names.get("kind", "") + "List")
    storage = [v["name"] for v in spec.get("versions") or [] if v.get("storage")]
    old_status = old_status or {}
    old_conds = {c.get("type"): c for c in old_status.get("conditions") or []}

    def cond(ctype: str, reason: str, message: str) -> dict[str, Any]:
        prev = old_conds.get(ctype)
        when = prev.get("lastTransitionTime") if prev and prev.get("status") == "True" else now
        return {
            "type": ctype,
            "status": "True",
            "lastTransitionTime": when,
            "reason": reason,
            "message": message,
        }

    stored = list(old_status.get("storedVersions") or [])
    for v in storage:
        if v not in stored:
            stored.append(v)
    return {
        "conditions": [
            cond("NamesAccepted", "NoConflicts", "no conflicts found"),
            cond("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ],
        "acceptedNames": names,
        "storedVersions": stored,
    }


def default_crd(crd: dict[str, Any]) -> None:
    spec = crd.get("spec")
    if not isinstance(spec, dict):
        return
    names = spec.get("names")
    if isinstance(names, dict) and names.get("kind"):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    spec.setdefault("conversion", {"strategy": "None"})
