"""GAIE InferencePool ``N`` (``inference.networking.k8s.io/v1``), with ``spec.gateway``: selects
exactly the pods a gateway may send requests to — the mixed pods, or the decode pods when
disaggregated (the endpoint picker pairs each request with a prefill pod itself) — on the
engines' HTTP port; its endpoint picker is the router Service ``N-router``'s ``grpc-epp`` port.

Applied after the router Service it names. GAIE's CRDs are optional: kopf does not watch the
kind (the operator watches its pools itself, namespace by namespace: ``gateway_watch``), and an
apply answered 404 leaves the rest applied (``optional``; ``GatewayReady`` says so).
"""

from __future__ import annotations

from ketch.operator import gateway
from ketch.operator.children.kind import ChildKind, Obj, OptionalCRD
from ketch.operator.objects import instance_labels, metadata, selector
from ketch.operator.spec.model import ServiceSpec


def inference_pool(svc: ServiceSpec) -> Obj:
    pool = svc.spec["gateway"]["inferencePool"]
    other = pool.get("endpointPicker")
    picker = (
        (other["serviceName"], other["port"])
        if other
        else (f"{svc.name}-router", gateway.epp_port(svc))
    )
    return {
        "apiVersion": gateway.POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": metadata(svc, svc.name, instance_labels(svc)),
        "spec": {
            # The role's Deployment selector: exactly its pods, never another role's.
            "selector": {"matchLabels": selector(svc, gateway.serving_role(svc))},
            "targetPorts": [{"number": svc.ports["http"]}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker[0],
                "port": {"number": picker[1]},
                "failureMode": pool["failureMode"],
            },
        },
    }


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    return [inference_pool(svc)] if gateway.enabled(svc) else []


KIND = ChildKind(
    kind="InferencePool",
    api_version=gateway.POOL_API_VERSION,
    plural="inferencepools",
    build=build,
    stage=2,
    watched=False,
    optional=OptionalCRD(
        "GatewayAPIUnavailable", "are the Gateway API Inference Extension CRDs installed?"
    ),
    unwatched_names=lambda svc: {svc.name},
)
