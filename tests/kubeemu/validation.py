"""Custom-resource admission the way kube-apiserver does it for a structural CRD schema.

The emulator's server calls :class:`CRDValidator` for every create/update of a custom resource.
It mirrors the apiserver's pipeline so that operator tests (and ``kubectl apply`` users of the
emulator) see the same objects and the same error messages as on a real cluster (v1.32):

1. pruning of fields the schema does not know (reported, like the server's
   ``unknown field "spec.foo"`` warnings, so the caller can honour ``fieldValidation``);
2. dropping of non-nullable ``null`` values and defaulting (``default`` applied recursively,
   including inside defaults, array items and ``additionalProperties`` maps);
3. OpenAPI v3 value validation with kube-openapi's messages, converted to ``field.Error``
   causes the way ``kubeOpenAPIResultToFieldErrors`` does;
4. ``x-kubernetes-list-type`` set/map uniqueness;
5. CEL ``x-kubernetes-validations`` rules (with ``oldSelf`` transition rules), skipped like the
   server does when a "blocking" schema error (type/required/enum/too long/too many) exists.

The steps live in their own modules: :mod:`kubeemu.schema_node` (the compiled schema and its
rules), :mod:`kubeemu.defaulting` (1-2), :mod:`kubeemu.openapi` and :mod:`kubeemu.formats` (3-4),
:mod:`kubeemu.cel_rules` (5) on :mod:`kubeemu.cel_runtime` and :mod:`kubeemu.cel_library` (CEL
parsed and transpiled to Python by ``celpy`` once per rule), and :mod:`kubeemu.causes` (the
server's wording). The static CEL cost budget is checked at CRD create/update by
:mod:`kubeemu.crd_budget`, not here.

Known differences from the real server: no validation ratcheting on update, no runtime CEL cost
limit, CEL type checking at construction only covers field selections on ``self``/``oldSelf``
(a wrong type in a rule shows up as an evaluation error instead), no ``optionalOldSelf``, and
the CEL libraries for URLs, IPs/CIDRs, semver and string formatting are absent (a rule using
them fails :class:`CRDValidator` construction). Embedded resources keep their
``apiVersion``/``kind``/``metadata`` as given (no ObjectMeta checks).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kubeemu.causes import BLOCKED_MSG, BLOCKING, NIL, CRDSchemaError, format_causes, invalid
from kubeemu.cel_rules import run_rules
from kubeemu.defaulting import copy_json, normalize
from kubeemu.openapi import validate
from kubeemu.schema_node import SchemaNode

__all__ = ["AdmitResult", "CRDSchemaError", "CRDValidator", "format_causes"]


@dataclass
class AdmitResult:
    """What admission produced: the object to store and why it must be rejected, if it must."""

    obj: dict
    causes: list[dict] = field(default_factory=list)
    unknown_fields: list[str] = field(default_factory=list)


class CRDValidator:
    """Admission of one version of one CRD: prune, default, validate (schema, list types, CEL).

    Construction compiles every CEL rule and raises :class:`CRDSchemaError` for anything the
    real server would have refused at CRD creation (syntax errors, invalid ``fieldPath``) and for
    CEL functions this emulator does not implement.
    """

    def __init__(self, crd: dict, version: str) -> None:
        spec = crd.get("spec") or {}
        versions = spec.get("versions") or []
        ver = next((v for v in versions if v.get("name") == version), None)
        if ver is None:
            names = [v.get("name") for v in versions]
            raise CRDSchemaError(f"CRD has no version {version!r} (versions: {names})")
        schema = (ver.get("schema") or {}).get("openAPIV3Schema") or (
            spec.get("validation") or {}
        ).get("openAPIV3Schema")
        if not isinstance(schema, dict):
            raise CRDSchemaError(f"version {version!r} has no openAPIV3Schema")
        self.kind = ((spec.get("names") or {}).get("kind")) or ""
        self.version = version
        subresources = ver.get("subresources") or spec.get("subresources") or {}
        self.has_status = "status" in subresources
        self.root = SchemaNode(schema, "openAPIV3Schema", resource_root=True)
        self._lock = threading.Lock()  # transpiled rules share one globals dict each

    def admit(
        self,
        obj: dict,
        old: dict | None,
        *,
        field_validation: str = "Strict",
        subresource: str | None = None,
    ) -> AdmitResult:
        """Prune + default a copy of ``obj`` and validate it (see the module docstring).

        ``subresource="status"`` admits only ``.status``; otherwise ``.status`` is left as is
        when the CRD has a status subresource. ``old`` (the stored object on update) feeds
        ``oldSelf`` in transition rules. ``field_validation`` is the caller's business:
        unknown fields are always pruned and reported.
        """
        del field_validation  # the caller decides what unknown fields mean
        if subresource not in (None, "status"):
            raise ValueError(f"unsupported subresource {subresource!r}")
        unknown: list[str] = []
        if subresource == "status":
            out = {k: copy_json(v) for k, v in obj.items() if k != "status"}
            node = (self.root.properties or {}).get("status")
            if "status" in obj:
                out["status"] = normalize(obj["status"], node, "status", unknown)
            roots = [("status", node)]
        else:
            skip = "status" if self.has_status else None
            out = normalize(obj, self.root, "", unknown, skip=skip)
            roots = [("", self.root)]

        causes: list[dict] = []
        name = (obj.get("metadata") or {}).get("name")
        if isinstance(name, str) and len(name) > 253:
            causes.append(invalid("metadata.name", name, "must be no more than 253 characters"))
        list_causes: list[dict] = []
        for key, node in roots:
            if node is None:
                continue
            if key:
                if key in out:
                    validate(out[key], node, key, key, causes, list_causes)
            else:
                validate(
                    out,
                    node,
                    "",
                    "",
                    causes,
                    list_causes,
                    skip="status" if self.has_status else None,
                )
        causes.extend(list_causes)

        if any(c["reason"] in BLOCKING for c in causes):
            if self.root.rules_below:
                causes.append(invalid(NIL, None, BLOCKED_MSG))
            return AdmitResult(out, causes, unknown)

        if self.root.rules_below:
            with self._lock:
                for key, node in roots:
                    if node is None or not node.rules_below:
                        continue
                    if key:
                        if key in out:
                            old_v = old.get(key) if isinstance(old, dict) else None
                            run_rules(out[key], node, key, None, old_v, None, causes)
                    else:
                        run_rules(
                            out,
                            node,
                            "",
                            None,
                            old,
                            None,
                            causes,
                            skip="status" if self.has_status else None,
                        )
        return AdmitResult(out, causes, unknown)
