"""The resource types the emulator serves: the built-in kinds and those a CRD adds.

Defaulting and validation of the objects live in ``builtin_defaults``, ``builtin_validation``,
``object_names`` (names and labels) and ``crd_objects`` (CustomResourceDefinitions themselves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubeemu.fieldsets import Resolver, builtin_resolver, schema_resolver

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
