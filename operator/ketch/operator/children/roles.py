"""The pod roles of an InferenceService: its engine roles, and the router when it has one."""

from __future__ import annotations

from ketch.operator import gateway
from ketch.operator.spec.model import ServiceSpec


def has_router(svc: ServiceSpec) -> bool:
    """Disaggregated serving needs the router; so does a gateway (its endpoint picker)."""
    return svc.disaggregated or gateway.router_picks(svc)


def pod_roles(svc: ServiceSpec) -> list[str]:
    """Every role that runs pods, in build order: the engine roles, then ``router``."""
    roles = list(svc.roles)
    return [*roles, "router"] if has_router(svc) else roles
