"""``spec.gateway``: what the children it adds share (the router as the pool's endpoint
picker, its port, the role a gateway serves; the pool and route themselves are
``children.inferencepool`` and ``children.httproute``), and the ``GatewayReady`` condition that
reports how a gateway took them.

Pure. The condition comes from the pool's ``status.parents[].conditions`` (``Accepted``,
``ResolvedRefs``), which the gateway implementation writes.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.spec.model import ServiceSpec

Obj = dict[str, Any]

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"
ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
GATEWAY_GROUP = "gateway.networking.k8s.io"
CONDITION = "GatewayReady"
POOL_CONDITIONS = ("Accepted", "ResolvedRefs")
CRD_MISSING = "InferencePoolCRDMissing"
ROUTE_CRD_MISSING = "HTTPRouteCRDMissing"


def enabled(svc: ServiceSpec) -> bool:
    return "gateway" in svc.spec


def router_picks(svc: ServiceSpec) -> bool:
    """True when the router is the pool's endpoint picker (the default)."""
    return enabled(svc) and "endpointPicker" not in svc.spec["gateway"]["inferencePool"]


def epp_port(svc: ServiceSpec) -> int:
    return int(svc.spec["gateway"]["inferencePool"]["eppPort"])


def serving_role(svc: ServiceSpec) -> str:
    """The role whose pods a gateway sends requests to."""
    return "decode" if svc.disaggregated else "mixed"


# --------------------------------------------------------------------------- status


def condition(
    svc: ServiceSpec, pool: Obj | None, unserved: set[str], generation: int
) -> Obj | None:
    """``GatewayReady`` (without ``lastTransitionTime``), or None without ``spec.gateway``.

    ``unserved``: the GAIE kinds the API server does not serve (their CRDs are missing).
    True once at least one gateway lists the pool in ``status.parents`` and every parent
    reports ``Accepted`` and ``ResolvedRefs`` True; otherwise False with the first problem."""
    if not enabled(svc):
        return None

    def cond(ok: bool, reason: str, message: str) -> Obj:
        status = "True" if ok else "False"
        return {
            "type": CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
        }

    if "InferencePool" in unserved:
        return cond(
            False,
            CRD_MISSING,
            f"the API server does not serve {POOL_API_VERSION} InferencePools: install the "
            "Gateway API Inference Extension CRDs (see docs/gateway.md); everything else is "
            "served",
        )
    if "HTTPRoute" in unserved:
        return cond(
            False,
            ROUTE_CRD_MISSING,
            f"spec.gateway.gatewayRef needs {ROUTE_API_VERSION} HTTPRoutes, which the API "
            "server does not serve: install the Gateway API CRDs (see docs/gateway.md)",
        )
    if pool is None:
        return cond(False, "Pending", f"InferencePool {svc.name} not created yet")
    parents = [p for p in (pool.get("status") or {}).get("parents") or [] if isinstance(p, dict)]
    accepted = [p for p in parents if _parent_kind(p) == "Gateway"]
    if not accepted:
        return cond(
            False,
            "NotAccepted",
            f"no gateway lists InferencePool {svc.name} in its status yet: is an HTTPRoute "
            "from a Gateway of a GAIE-capable implementation pointing at it?",
        )
    for parent in accepted:
        name = _parent_name(parent)
        for kind in POOL_CONDITIONS:
            found = _find(parent, kind)
            if found is None or found.get("status") != "True":
                reason = (found or {}).get("reason") or f"{kind}Unknown"
                detail = (found or {}).get("message") or f"no {kind} condition yet"
                return cond(False, str(reason), f"gateway {name}: {kind}: {detail}")
    names = ", ".join(_parent_name(p) for p in accepted)
    return cond(True, "Accepted", f"InferencePool {svc.name} accepted by gateway {names}")


def _parent_kind(parent: Obj) -> str:
    # GAIE writes a placeholder parent of kind Status while no gateway has taken the pool.
    return str((parent.get("parentRef") or {}).get("kind") or "Gateway")


def _parent_name(parent: Obj) -> str:
    ref = parent.get("parentRef") or {}
    namespace = ref.get("namespace")
    return f"{namespace}/{ref.get('name')}" if namespace else str(ref.get("name"))


def _find(parent: Obj, kind: str) -> Obj | None:
    for cond in parent.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == kind:
            return cond
    return None
