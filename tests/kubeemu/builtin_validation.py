"""Validation of built-in kinds: the handful of rules an operator bug is likely to trip
(selectors matching templates, pod specs, Service ports, immutable fields), in the server's
words."""

from __future__ import annotations

import re
from typing import Any

from kubeemu.crd_objects import validate_crd
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import match_selector_object
from kubeemu.object_names import DNS1123_LABEL, MSG_LABEL_1123, field_cause, quoted, validate_labels


def validate_builtin(
    rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None
) -> list[dict[str, str]]:
    """The handful of built-in validation rules an operator bug is likely to trip."""
    errs: list[dict[str, str]] = []
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else None
    if rt.key in (("apps", "deployments"), ("apps", "replicasets")):
        if spec is None:
            return [field_cause("spec", "FieldValueRequired", "Required value")]
        selector = spec.get("selector")
        template = spec.get("template") or {}
        tmpl_labels = (template.get("metadata") or {}).get("labels") or {}
        if not selector:
            errs.append(field_cause("spec.selector", "FieldValueRequired", "Required value"))
        elif not (selector.get("matchLabels") or selector.get("matchExpressions")):
            errs.append(
                field_cause(
                    "spec.selector",
                    "FieldValueInvalid",
                    "Invalid value: v1.LabelSelector{MatchLabels:map[string]string(nil), "
                    "MatchExpressions:[]v1.LabelSelectorRequirement(nil)}: empty selector is "
                    "invalid for deployment",
                )
            )
        elif not match_selector_object(selector, tmpl_labels):
            rendered = ", ".join(f'"{k}":"{v}"' for k, v in sorted(tmpl_labels.items()))
            errs.append(
                field_cause(
                    "spec.template.metadata.labels",
                    "FieldValueInvalid",
                    f"Invalid value: map[string]string{{{rendered}}}: `selector` does not match "
                    "template `labels`",
                )
            )
        errs += validate_labels(tmpl_labels, "spec.template.metadata.labels")
        replicas = spec.get("replicas")
        if isinstance(replicas, int) and replicas < 0:
            errs.append(
                field_cause(
                    "spec.replicas",
                    "FieldValueInvalid",
                    f"Invalid value: {replicas}: must be greater than or equal to 0",
                )
            )
        errs += _validate_pod_spec(template.get("spec"), "spec.template.spec")
        if old is not None and rt.key == ("apps", "deployments"):
            old_sel = (old.get("spec") or {}).get("selector")
            if old_sel is not None and selector is not None and old_sel != selector:
                errs.append(
                    field_cause(
                        "spec.selector",
                        "FieldValueInvalid",
                        "Invalid value: v1.LabelSelector{...}: field is immutable",
                    )
                )
    elif rt.key == ("", "pods"):
        errs += _validate_pod_spec(spec, "spec")
    elif rt.key == ("", "services") and spec is not None:
        if (
            spec.get("type", "ClusterIP") != "ExternalName"
            and not spec.get("ports")
            and (spec.get("clusterIP") != "None")
        ):
            errs.append(field_cause("spec.ports", "FieldValueRequired", "Required value"))
        seen = set()
        for i, p in enumerate(spec.get("ports") or []):
            if not isinstance(p, dict):
                continue
            if "port" not in p:
                errs.append(
                    field_cause(f"spec.ports[{i}].port", "FieldValueRequired", "Required value")
                )
            key = (p.get("port"), p.get("protocol", "TCP"))
            if key in seen:
                errs.append(
                    field_cause(
                        f"spec.ports[{i}]", "FieldValueDuplicate", f"Duplicate value: {p!r}"
                    )
                )
            seen.add(key)
            if len(spec.get("ports")) > 1 and not p.get("name"):
                errs.append(
                    field_cause(f"spec.ports[{i}].name", "FieldValueRequired", "Required value")
                )
        if old is not None:
            old_ip = (old.get("spec") or {}).get("clusterIP")
            if old_ip and spec.get("clusterIP") not in (None, old_ip):
                errs.append(
                    field_cause(
                        "spec.clusterIPs[0]",
                        "FieldValueInvalid",
                        f"Invalid value: []string{{{quoted(spec.get('clusterIP'))}}}: "
                        "may not change once set",
                    )
                )
    elif rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        errs += validate_crd(obj)
    return errs


def _validate_pod_spec(spec: Any, at: str) -> list[dict[str, str]]:
    if not isinstance(spec, dict):
        return [field_cause(at, "FieldValueRequired", "Required value")]
    errs = []
    containers = spec.get("containers")
    if not containers:
        errs.append(field_cause(f"{at}.containers", "FieldValueRequired", "Required value"))
    names = set()
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            if not isinstance(c, dict):
                continue
            name = c.get("name")
            if not name:
                errs.append(
                    field_cause(f"{at}.{key}[{i}].name", "FieldValueRequired", "Required value")
                )
            elif name in names:
                errs.append(
                    field_cause(
                        f"{at}.{key}[{i}].name",
                        "FieldValueDuplicate",
                        f"Duplicate value: {quoted(name)}",
                    )
                )
            else:
                names.add(name)
                if not re.fullmatch(DNS1123_LABEL, name) or len(name) > 63:
                    errs.append(
                        field_cause(
                            f"{at}.{key}[{i}].name",
                            "FieldValueInvalid",
                            f"Invalid value: {quoted(name)}: {MSG_LABEL_1123}",
                        )
                    )
            if not c.get("image") and key == "containers":
                errs.append(
                    field_cause(f"{at}.{key}[{i}].image", "FieldValueRequired", "Required value")
                )
    return errs
