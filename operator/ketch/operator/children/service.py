"""Services, per pod role: ``N-<role>`` (the API; the router's also serves the gateway's
endpoint picker on ``grpc-epp``) and, for engine roles, the headless ``N-<role>-peers``."""

from __future__ import annotations

from ketch.operator import gateway
from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.objects import labels, metadata, selector
from ketch.operator.port_names import (
    EPP_APP_PROTOCOL,
    EPP_PORT_NAME,
    PORT_HTTP,
    PORT_KV_TRANSFER,
    PORT_PD_COMM,
)
from ketch.operator.spec.model import ServiceSpec


def _service_port(name: str, port: int) -> Obj:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def api_service(svc: ServiceSpec, role: str) -> Obj:
    ports = [_service_port("http", svc.ports["http"])]
    if svc.ports.get("metrics") is not None and role != "router":
        ports.append(_service_port("metrics", svc.ports["metrics"]))
    if role == "router" and gateway.router_picks(svc):
        epp = _service_port(EPP_PORT_NAME, gateway.epp_port(svc))
        ports.append({**epp, "appProtocol": EPP_APP_PROTOCOL})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(svc, f"{svc.name}-{role}", labels(svc, role)),
        "spec": {"type": "ClusterIP", "selector": selector(svc, role), "ports": ports},
    }


def peers_service(svc: ServiceSpec, role: str) -> Obj:
    """Headless: DNS lists every pod of the role, ready or not, for the router and peers.

    Prefill/decode roles also name their pd-comm port (decode engines connect to prefill
    engines) and their sidecars' kv-transfer port (prefill sidecars push KV blocks to decode
    sidecars), so SRV records find both.
    """
    ports = [_service_port(PORT_HTTP, svc.ports["http"])]
    if role != "mixed":
        ports.append(_service_port(PORT_PD_COMM, svc.ports["pdComm"]))
        if svc.spec["cacheManager"]["enabled"]:
            ports.append(_service_port(PORT_KV_TRANSFER, svc.ports["kvTransfer"]))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(svc, f"{svc.name}-{role}-peers", labels(svc, role)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(svc, role),
            "ports": ports,
        },
    }


def service_url(svc: ServiceSpec) -> str:
    """Where clients reach the InferenceService: the router's Service, else the mixed one's."""
    entry = "router" if svc.disaggregated else "mixed"
    return f"http://{svc.name}-{entry}.{svc.namespace}.svc.cluster.local:{svc.ports['http']}"


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    assert role is not None
    if role == "router":
        return [api_service(svc, role)]
    return [api_service(svc, role), peers_service(svc, role)]


KIND = ChildKind(kind="Service", api_version="v1", plural="services", build=build, per_role=True)
