"""Admission: the checks and defaulting every write goes through before it is stored
(type and namespace checks, pruning, defaulting, built-in and CRD-schema validation, Pod
Security admission)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kubeemu import (
    builtin_defaults,
    builtin_schema,
    crd_budget,
    crd_objects,
    object_names,
    quantity,
)
from kubeemu.builtin_validation import validate_builtin
from kubeemu.errors import ApiError, bad_request, details_of, invalid, namespace_not_found
from kubeemu.kinds import ResourceType
from kubeemu.podsecurity import admit as pod_security
from kubeemu.timefmt import now_rfc3339

if TYPE_CHECKING:
    from kubeemu.store import Store


def check_namespace(store: Store, rt: ResourceType, ns: str | None, name: str) -> None:
    if not rt.namespaced:
        return
    ns_obj = store.peek(("", "namespaces"), None, ns or "")
    if ns_obj is None:
        raise namespace_not_found(ns or "")
    if ns_obj["metadata"].get("deletionTimestamp"):
        raise ApiError(
            403,
            "Forbidden",
            f'{rt.qualified} "{name}" is forbidden: unable to create new content in '
            f"namespace {ns} because it is being terminated",
            {
                **details_of(rt, name),
                "causes": [
                    {
                        "reason": "NamespaceTerminating",
                        "message": f"namespace {ns} is being terminated",
                        "field": "metadata.namespace",
                    }
                ],
            },
        )


def check_type(store: Store, rt: ResourceType, body: dict[str, Any]) -> None:
    av, kind = body.get("apiVersion"), body.get("kind")
    if av and av != rt.api_version:
        raise bad_request(
            f"the API version in the data ({av}) does not match the expected API version "
            f"({rt.api_version})"
        )
    if kind and kind != rt.kind:
        raise bad_request(
            f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})"
        )


def admit(
    store: Store,
    rt: ResourceType,
    new: dict[str, Any],
    old: dict[str, Any] | None,
    *,
    subresource: str | None,
    field_validation: str,
) -> tuple[dict[str, Any], list[str]]:
    """Defaulting, pruning and validation; returns the admitted object and warnings."""
    warnings: list[str] = []
    name = new["metadata"].get("name", "")
    causes: list[dict[str, str]] = []
    if rt.is_crd:
        if rt.validator is not None:
            meta = new["metadata"]
            result = rt.validator.admit(
                new, old, field_validation=field_validation, subresource=subresource
            )
            if result.unknown_fields:
                if field_validation == "Strict":
                    raise bad_request(
                        "strict decoding error: "
                        + ", ".join(f'unknown field "{f}"' for f in result.unknown_fields)
                    )
                if field_validation == "Warn":
                    warnings += [f'unknown field "{f}"' for f in result.unknown_fields]
            causes += list(result.causes)
            new = dict(result.obj)
            new["metadata"] = meta
    else:
        quantity.canonicalize(rt, new)  # decoding: bad quantities fail before anything else
        unknown = builtin_schema.prune_unknown(rt.group, rt.version, rt.kind, new)
        if unknown and field_validation == "Strict":
            raise bad_request(
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                "strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in unknown)
            )
        if unknown and field_validation == "Warn":
            warnings += [f'unknown field "{f}"' for f in unknown]
        if rt.key == ("", "services") and old is not None:
            builtin_defaults.keep_allocated_service_fields(old, new)
        builtin_defaults.apply_defaults(rt, new, store._alloc_ip)
        causes += validate_builtin(rt, new, old)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            crd_objects.default_crd(new)
    if subresource != "status":
        causes += object_names.validate_labels(new["metadata"].get("labels"), "metadata.labels")
    if causes:
        raise invalid(rt, name, causes)
    warnings += pod_security(store, rt, new, old, subresource)  # a 403, or Warning headers
    if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        store._build_validators(new)
        over_budget = crd_budget.crd_cost_causes(new, old)  # CEL cost limits, as the apiserver
        if over_budget:
            raise invalid(rt, name, over_budget)
        new["status"] = crd_objects.crd_status(new, now_rfc3339(), (old or {}).get("status"))
    return new, warnings


def alloc_ip(store: Store) -> str:
    n = store._ip_next
    store._ip_next += 1
    return f"10.96.{(n // 250) % 250}.{n % 250 + 1}"


def build_validators(store: Store, crd: dict[str, Any]) -> None:
    """Fail a CRD write (422) whose schema the validation module cannot compile."""
    if store.validator_factory is None:
        return
    crd_rt = store.rt("apiextensions.k8s.io", "customresourcedefinitions")
    for i, ver in enumerate((crd.get("spec") or {}).get("versions") or []):
        try:
            store.validator_factory(crd, ver.get("name"))
        except Exception as exc:
            raise invalid(
                crd_rt,
                crd["metadata"].get("name", ""),
                [
                    {
                        "reason": "FieldValueInvalid",
                        "field": f"spec.versions[{i}].schema.openAPIV3Schema",
                        "message": f"Invalid value: {exc}",
                    }
                ],
            ) from exc


def check_identity(rt: ResourceType, ns: str | None, name: str, meta: dict[str, Any]) -> None:
    if meta.get("name") and meta["name"] != name:
        raise bad_request(
            f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
        )
    if rt.namespaced and meta.get("namespace") and meta["namespace"] != ns:
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
