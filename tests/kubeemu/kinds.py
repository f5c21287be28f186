"""The resource types the emulator serves, their defaulting and the validation operators hit."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kubeemu.fieldsets import Resolver, builtin_resolver, schema_resolver
from kubeemu.labelsel import match_selector_object

STANDARD_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass
class ScaleSpec:
    """Where a resource keeps the numbers its /scale subresource exposes (CRD `subresources`)."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False
    scale: ScaleSpec | None = None
    crd_name: str | None = None  # set for custom resources
    validator: Any = None
    schema: dict[str, Any] | None = None
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    storage_version: str = ""
    resolver: Resolver = builtin_resolver
    verbs: tuple[str, ...] = STANDARD_VERBS

    def __post_init__(self) -> None:
        self.singular = self.singular or self.kind.lower()
        self.storage_version = self.storage_version or self.version

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_api_version(self) -> str:
        v = self.storage_version
        return f"{self.group}/{v}" if self.group else v

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def qualified(self) -> str:
        """`deployments.apps` / `pods`: how NotFound/AlreadyExists messages name a resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """`Deployment.apps` / `Pod`: how Invalid messages name a kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def is_crd(self) -> bool:
        return self.crd_name is not None

    @property
    def scope(self) -> str:
        """Which part of an object writes on the main endpoint may change (see tracked_view)."""
        return "main" if self.status else "all"


def _t(group: str, version: str, plural: str, kind: str, namespaced: bool = True, **kw: Any):
    return ResourceType(group, version, plural, kind, namespaced, **kw)


BUILTIN_TYPES: list[ResourceType] = [
    _t("", "v1", "namespaces", "Namespace", False, short_names=("ns",), status=True),
    _t("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    _t("", "v1", "secrets", "Secret"),
    _t("", "v1", "services", "Service", short_names=("svc",), categories=("all",), status=True),
    _t("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _t("", "v1", "pods", "Pod", short_names=("po",), categories=("all",), status=True),
    _t("", "v1", "events", "Event", short_names=("ev",)),
    _t("", "v1", "endpoints", "Endpoints", short_names=("ep",)),
    _t(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short_names=("deploy",),
        categories=("all",),
        status=True,
        scale=ScaleSpec(label_selector=".status.selector"),
    ),
    _t(
        "apps",
        "v1",
        "replicasets",
        "ReplicaSet",
        short_names=("rs",),
        categories=("all",),
        status=True,
        scale=ScaleSpec(label_selector=".status.selector"),
    ),
    _t(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        short_names=("pdb",),
        status=True,
    ),
    _t("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    _t(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=("hpa",),
        categories=("all",),
        status=True,
    ),
    _t("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _t("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _t("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    _t("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _t("coordination.k8s.io", "v1", "leases", "Lease"),
    _t("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    _t(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        short_names=("crd", "crds"),
        categories=("api-extensions",),
        status=True,
    ),
]


def crd_types(crd: dict[str, Any], validator_factory: Any) -> list[ResourceType]:
    """One ResourceType per served version of a CRD (all share the storage)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group", "")
    versions = spec.get("versions") or []
    storage = next((v["name"] for v in versions if v.get("storage")), None)
    if storage is None and versions:
        storage = versions[0]["name"]
    out = []
    for ver in versions:
        if not ver.get("served", True):
            continue
        subs = ver.get("subresources") or {}
        scale = None
        if "scale" in subs:
            s = subs["scale"] or {}
            scale = ScaleSpec(
                s.get("specReplicasPath", ".spec.replicas"),
                s.get("statusReplicasPath", ".status.replicas"),
                s.get("labelSelectorPath"),
            )
        schema = (ver.get("schema") or {}).get("openAPIV3Schema")
        validator = validator_factory(crd, ver["name"]) if validator_factory else None
        out.append(
            ResourceType(
                group=group,
                version=ver["name"],
                plural=names.get("plural", ""),
                kind=names.get("kind", ""),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular", ""),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                status="status" in subs,
                scale=scale,
                crd_name=(crd.get("metadata") or {}).get("name"),
                validator=validator,
                schema=schema,
                printer_columns=list(ver.get("additionalPrinterColumns") or []),
                storage_version=storage or ver["name"],
                resolver=schema_resolver(schema),
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# names and labels

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"

MSG_SUBDOMAIN = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    f"regex used for validation is '{_DNS1123_SUBDOMAIN}')"
)
MSG_LABEL_1123 = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    f"regex used for validation is '{_DNS1123_LABEL}')"
)
MSG_LABEL_1035 = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
    "an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    f"'abc-123', regex used for validation is '{_DNS1035_LABEL}')"
)


def _cause(field_path: str, reason: str, message: str) -> dict[str, str]:
    return {"reason": reason, "field": field_path, "message": message}


def _go_quote(value: Any) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def validate_name(rt: ResourceType, name: str) -> list[dict[str, str]]:
    if rt.plural == "namespaces":
        pattern, msg, limit = _DNS1123_LABEL, MSG_LABEL_1123, 63
    elif rt.plural == "services":
        pattern, msg, limit = _DNS1035_LABEL, MSG_LABEL_1035, 63
    else:
        pattern, msg, limit = _DNS1123_SUBDOMAIN, MSG_SUBDOMAIN, 253
    errs = []
    if len(name) > limit:
        errs.append(
            _cause(
                "metadata.name",
                "FieldValueInvalid",
                f"Invalid value: {_go_quote(name)}: must be no more than {limit} characters",
            )
        )
    if not re.fullmatch(pattern, name):
        errs.append(
            _cause("metadata.name", "FieldValueInvalid", f"Invalid value: {_go_quote(name)}: {msg}")
        )
    return errs


def validate_labels(labels: Any, field_path: str) -> list[dict[str, str]]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [_cause(field_path, "FieldValueInvalid", "Invalid value: must be a map")]
    errs = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        bad_key = (
            not name
            or len(name) > 63
            or not re.fullmatch(_QUALIFIED_NAME, name)
            or (prefix and (len(prefix) > 253 or not re.fullmatch(_DNS1123_SUBDOMAIN, prefix)))
        )
        if bad_key:
            errs.append(
                _cause(
                    field_path,
                    "FieldValueInvalid",
                    f"Invalid value: {_go_quote(key)}: name part must consist of alphanumeric "
                    "characters, '-', '_' or '.', and must start and end with an alphanumeric "
                    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
                    f"validation is '{_QUALIFIED_NAME}')",
                )
            )
        if not isinstance(value, str):
            errs.append(_cause(field_path, "FieldValueInvalid", "Invalid value: must be a string"))
            continue
        if len(value) > 63:
            errs.append(
                _cause(
                    field_path,
                    "FieldValueInvalid",
                    f"Invalid value: {_go_quote(value)}: must be no more than 63 characters",
                )
            )
        if not re.fullmatch(_LABEL_VALUE, value):
            errs.append(
                _cause(
                    field_path,
                    "FieldValueInvalid",
                    f"Invalid value: {_go_quote(value)}: a valid label must be an empty string "
                    "or consist of alphanumeric characters, '-', '_' or '.', and must start and "
                    "end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                    f"'12345', regex used for validation is '{_LABEL_VALUE}')",
                )
            )
    return errs


# ----------------------------------------------------------------------------------------------
# defaulting of built-in kinds (the fields operators usually meet)


def _image_pull_policy(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def _default_container(c: dict[str, Any]) -> None:
    for p in c.get("ports") or []:
        if isinstance(p, dict):
            p.setdefault("protocol", "TCP")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    if isinstance(c.get("image"), str):
        c.setdefault("imagePullPolicy", _image_pull_policy(c["image"]))
    c.setdefault("resources", {})
    for env in c.get("env") or []:
        ref = (env.get("valueFrom") or {}).get("fieldRef") if isinstance(env, dict) else None
        if isinstance(ref, dict):
            ref.setdefault("apiVersion", "v1")


def default_pod_spec(spec: dict[str, Any]) -> None:
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            if isinstance(c, dict):
                _default_container(c)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for v in spec.get("volumes") or []:
        if not isinstance(v, dict):
            continue
        for src in ("configMap", "secret"):
            if isinstance(v.get(src), dict):
                v[src].setdefault("defaultMode", 420)
        if "emptyDir" in v and v["emptyDir"] is None:
            v["emptyDir"] = {}


def apply_defaults(rt: ResourceType, obj: dict[str, Any], ip_alloc: Any = None) -> None:
    """Modest, deterministic defaulting of built-in kinds, in place."""
    if rt.is_crd:
        return
    key = rt.key
    spec = obj.get("spec")
    if key == ("apps", "deployments") and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
        strategy = spec.setdefault("strategy", {})
        if isinstance(strategy, dict):
            strategy.setdefault("type", "RollingUpdate")
            if strategy["type"] == "RollingUpdate":
                ru = strategy.setdefault("rollingUpdate", {})
                ru.setdefault("maxUnavailable", "25%")
                ru.setdefault("maxSurge", "25%")
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        tmpl_spec = (spec.get("template") or {}).get("spec")
        if isinstance(tmpl_spec, dict):
            default_pod_spec(tmpl_spec)
    elif key == ("apps", "replicasets") and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
        tmpl_spec = (spec.get("template") or {}).get("spec")
        if isinstance(tmpl_spec, dict):
            default_pod_spec(tmpl_spec)
    elif key == ("", "pods"):
        if isinstance(spec, dict):
            default_pod_spec(spec)
            spec.setdefault("serviceAccountName", "default")
            spec.setdefault("enableServiceLinks", True)
            spec.setdefault("priority", 0)
        obj.setdefault("status", {}).setdefault("phase", "Pending")
    elif key == ("", "services") and isinstance(spec, dict):
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        for p in spec.get("ports") or []:
            if isinstance(p, dict):
                p.setdefault("protocol", "TCP")
                if "port" in p:
                    p.setdefault("targetPort", p["port"])
        if spec["type"] != "ExternalName":
            if "clusterIP" not in spec and ip_alloc is not None:
                spec["clusterIP"] = ip_alloc()
            if "clusterIP" in spec:
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
            spec.setdefault("ipFamilies", ["IPv4"])
            spec.setdefault("ipFamilyPolicy", "SingleStack")
            spec.setdefault("internalTrafficPolicy", "Cluster")
        obj.setdefault("status", {}).setdefault("loadBalancer", {})
    elif key == ("", "secrets"):
        obj.setdefault("type", "Opaque")
        string_data = obj.pop("stringData", None)
        if isinstance(string_data, dict):
            import base64

            data = obj.setdefault("data", {})
            for k, v in string_data.items():
                data[k] = base64.b64encode(str(v).encode()).decode()
    elif key == ("", "namespaces"):
        name = (obj.get("metadata") or {}).get("name")
        if name:
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")
    elif key == ("networking.k8s.io", "networkpolicies") and isinstance(spec, dict):
        spec.setdefault("policyTypes", ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])


def keep_allocated_service_fields(old: dict[str, Any], new: dict[str, Any]) -> None:
    """An update that leaves out the allocated cluster IP keeps it (as the real server does)."""
    old_spec, spec = old.get("spec") or {}, new.get("spec")
    if not isinstance(spec, dict):
        return
    for key in ("clusterIP", "clusterIPs"):
        if key not in spec and key in old_spec:
            spec[key] = old_spec[key]


def validate_builtin(
    rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None
) -> list[dict[str, str]]:
    """The handful of built-in validation rules an operator bug is likely to trip."""
    errs: list[dict[str, str]] = []
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else None
    if rt.key in (("apps", "deployments"), ("apps", "replicasets")):
        if spec is None:
            return [_cause("spec", "FieldValueRequired", "Required value")]
        selector = spec.get("selector")
        template = spec.get("template") or {}
        tmpl_labels = (template.get("metadata") or {}).get("labels") or {}
        if not selector:
            errs.append(_cause("spec.selector", "FieldValueRequired", "Required value"))
        elif not (selector.get("matchLabels") or selector.get("matchExpressions")):
            errs.append(
                _cause(
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
                _cause(
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
                _cause(
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
                    _cause(
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
            errs.append(_cause("spec.ports", "FieldValueRequired", "Required value"))
        seen = set()
        for i, p in enumerate(spec.get("ports") or []):
            if not isinstance(p, dict):
                continue
            if "port" not in p:
                errs.append(_cause(f"spec.ports[{i}].port", "FieldValueRequired", "Required value"))
            key = (p.get("port"), p.get("protocol", "TCP"))
            if key in seen:
                errs.append(
                    _cause(f"spec.ports[{i}]", "FieldValueDuplicate", f"Duplicate value: {p!r}")
                )
            seen.add(key)
            if len(spec.get("ports")) > 1 and not p.get("name"):
                errs.append(_cause(f"spec.ports[{i}].name", "FieldValueRequired", "Required value"))
        if old is not None:
            old_ip = (old.get("spec") or {}).get("clusterIP")
            if old_ip and spec.get("clusterIP") not in (None, old_ip):
                errs.append(
                    _cause(
                        "spec.clusterIPs[0]",
                        "FieldValueInvalid",
                        f"Invalid value: []string{{{_go_quote(spec.get('clusterIP'))}}}: "
                        "may not change once set",
                    )
                )
    elif rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        errs += validate_crd(obj)
    return errs


def _validate_pod_spec(spec: Any, at: str) -> list[dict[str, str]]:
    if not isinstance(spec, dict):
        return [_cause(at, "FieldValueRequired", "Required value")]
    errs = []
    containers = spec.get("containers")
    if not containers:
        errs.append(_cause(f"{at}.containers", "FieldValueRequired", "Required value"))
    names = set()
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            if not isinstance(c, dict):
                continue
            name = c.get("name")
            if not name:
                errs.append(_cause(f"{at}.{key}[{i}].name", "FieldValueRequired", "Required value"))
            elif name in names:
                errs.append(
                    _cause(
                        f"{at}.{key}[{i}].name",
                        "FieldValueDuplicate",
                        f"Duplicate value: {_go_quote(name)}",
                    )
                )
            else:
                names.add(name)
                if not re.fullmatch(_DNS1123_LABEL, name) or len(name) > 63:
                    errs.append(
                        _cause(
                            f"{at}.{key}[{i}].name",
                            "FieldValueInvalid",
                            f"Invalid value: {_go_quote(name)}: {MSG_LABEL_1123}",
                        )
                    )
            if not c.get("image") and key == "containers":
                errs.append(
                    _cause(f"{at}.{key}[{i}].image", "FieldValueRequired", "Required value")
                )
    return errs


def validate_crd(crd: dict[str, Any]) -> list[dict[str, str]]:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    errs = []
    name = (crd.get("metadata") or {}).get("name", "")
    for f in ("plural", "kind"):
        if not names.get(f):
            errs.append(_cause(f"spec.names.{f}", "FieldValueRequired", "Required value"))
    if not spec.get("group"):
        errs.append(_cause("spec.group", "FieldValueRequired", "Required value"))
    if names.get("plural") and spec.get("group"):
        expected = f"{names['plural']}.{spec['group']}"
        if name != expected:
            errs.append(
                _cause(
                    "metadata.name",
                    "FieldValueInvalid",
                    f'Invalid value: {_go_quote(name)}: must be spec.names.plural+"."+spec.group',
                )
            )
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errs.append(
            _cause(
                "spec.scope",
                "FieldValueNotSupported",
                f"Unsupported value: {_go_quote(spec.get('scope'))}: supported values: "
                '"Cluster", "Namespaced"',
            )
        )
    versions = spec.get("versions") or []
    if not versions:
        errs.append(
            _cause(
                "spec.versions",
                "FieldValueInvalid",
                "Invalid value: must have exactly one version marked as storage version",
            )
        )
    elif sum(1 for v in versions if v.get("storage")) != 1:
        errs.append(
            _cause(
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
