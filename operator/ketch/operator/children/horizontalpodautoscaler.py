"""HorizontalPodAutoscaler ``N-<role>``, per role with ``autoscaling.mode: hpa`` (the default):
targets Deployment ``N-<role>``. Applied after the Deployments. The metric names come from
``autoscaling.metric_table``."""

from __future__ import annotations

from ketch.operator.autoscaling import metric_table
from ketch.operator.children.deployment import scale_target
from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.objects import labels, metadata
from ketch.operator.spec.model import ServiceSpec


def hpa(svc: ServiceSpec, role: str) -> Obj:
    """An ``autoscaling/v2`` HorizontalPodAutoscaler on the role's Deployment; engine metrics are
    ``Pods`` metrics under the names the prometheus-adapter rules (manifests/metrics) give them."""
    spec = svc.role(role)["autoscaling"]
    hpa_spec: Obj = {
        "scaleTargetRef": scale_target(svc, role),
        "minReplicas": spec["minReplicas"],
        "maxReplicas": spec["maxReplicas"],
        "metrics": [metric_table.hpa_metric(m) for m in spec["metrics"]],
    }
    behavior = metric_table.behavior(spec)
    if behavior:
        hpa_spec["behavior"] = behavior
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(svc, f"{svc.name}-{role}", labels(svc, role)),
        "spec": hpa_spec,
    }


def autoscaling_mode(svc: ServiceSpec, role: str) -> str | None:
    """The role's ``autoscaling.mode``; None when it is not autoscaled (or is the router)."""
    if role == "router":
        return None
    spec = svc.role(role).get("autoscaling")
    return spec["mode"] if spec else None


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    assert role is not None
    return [hpa(svc, role)] if autoscaling_mode(svc, role) == "hpa" else []


KIND = ChildKind(
    kind="HorizontalPodAutoscaler",
    api_version="autoscaling/v2",
    plural="horizontalpodautoscalers",
    build=build,
    stage=2,
    per_role=True,
)
