"""Gateway API HTTPRoute ``N`` (``gateway.networking.k8s.io/v1``), with ``spec.gateway.gatewayRef``:
that Gateway as parent, the InferencePool as the one backend. Applied after the pool it names;
its CRD is optional, like the pool's."""

from __future__ import annotations

from ketch.operator import gateway
from ketch.operator.children.kind import ChildKind, Obj, OptionalCRD
from ketch.operator.objects import instance_labels, metadata
from ketch.operator.spec.model import ServiceSpec


def http_route(svc: ServiceSpec) -> Obj | None:
    section = svc.spec["gateway"]
    ref = section.get("gatewayRef")
    if ref is None:
        return None
    parent: Obj = {"group": gateway.GATEWAY_GROUP, "kind": "Gateway", "name": ref["name"]}
    for key in ("namespace", "sectionName"):
        if key in ref:
            parent[key] = ref[key]
    spec: Obj = {"parentRefs": [parent]}
    if section.get("hostnames"):
        spec["hostnames"] = list(section["hostnames"])
    spec["rules"] = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": section["path"]}}],
            "backendRefs": [
                {"group": gateway.POOL_GROUP, "kind": "InferencePool", "name": svc.name}
            ],
        }
    ]
    return {
        "apiVersion": gateway.ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": metadata(svc, svc.name, instance_labels(svc)),
        "spec": spec,
    }


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    route = http_route(svc) if gateway.enabled(svc) else None
    return [route] if route else []


KIND = ChildKind(
    kind="HTTPRoute",
    api_version=gateway.ROUTE_API_VERSION,
    plural="httproutes",
    build=build,
    stage=3,
    watched=False,
    optional=OptionalCRD("GatewayAPIUnavailable", "are the Gateway API CRDs installed?"),
    unwatched_names=lambda svc: {svc.name},
)
