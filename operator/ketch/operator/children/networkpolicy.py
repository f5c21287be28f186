"""NetworkPolicy ``N``: ingress to the InferenceService's pods. Applied before the pods."""

from __future__ import annotations

from ketch.operator import gateway
from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.labels import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGER
from ketch.operator.objects import instance_labels, metadata
from ketch.operator.spec.model import ServiceSpec


def network_policy(svc: ServiceSpec) -> Obj:
    """Ingress to the InferenceService's pods: the API, metrics and cache-manager HTTP ports are
    open; the pod-to-pod ports of disaggregated serving (pd-comm, kv-transfer) only to this
    InferenceService's own pods; nothing else (the worker and cache queues are Unix sockets).
    """
    pods = {"matchLabels": {LABEL_INSTANCE: svc.name, LABEL_MANAGED_BY: MANAGER}}
    ports = svc.ports
    cache_manager = svc.spec["cacheManager"]["enabled"]
    public = [_policy_port(ports["http"])]
    if ports.get("metrics") is not None:
        public.append(_policy_port(ports["metrics"]))
    if cache_manager:  # the sidecar's /health and /metrics, like the engine's
        public.append(_policy_port(ports["cacheManager"]))
    if gateway.router_picks(svc):  # the gateway's proxies call the router's endpoint picker
        public.append(_policy_port(gateway.epp_port(svc)))
    ingress: list[Obj] = []
    if svc.disaggregated:  # decode -> prefill pd-comm; prefill sidecar -> decode kv-transfer
        internal = [_policy_port(ports["pdComm"])]
        if cache_manager:
            internal.append(_policy_port(ports["kvTransfer"]))
        ingress.append({"from": [{"podSelector": pods}], "ports": internal})
    ingress.append({"ports": public})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(svc, svc.name, instance_labels(svc)),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _policy_port(port: int) -> Obj:
    return {"port": port, "protocol": "TCP"}


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    return [network_policy(svc)]


KIND = ChildKind(
    kind="NetworkPolicy",
    api_version="networking.k8s.io/v1",
    plural="networkpolicies",
    build=build,
)
