"""Pure builders of the autoscaler child of an autoscaled role: a HorizontalPodAutoscaler
(``mode: hpa``, the default) or a KEDA ScaledObject (``mode: keda``), each named ``N-<role>``
and targeting Deployment ``N-<role>``; none for ``mode: ketch``, where the operator scales the
Deployment itself. The metric names and queries come from ``metric_table``."""

from __future__ import annotations

from ketch.operator.autoscaling import metric_table
from ketch.operator.objects import Obj, labels, metadata
from ketch.operator.spec.model import ServiceSpec

SCALED_OBJECT_API_VERSION = "keda.sh/v1alpha1"


def _scale_target(svc: ServiceSpec, role: str) -> Obj:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{svc.name}-{role}"}


def hpa(svc: ServiceSpec, role: str) -> Obj:
    """An ``autoscaling/v2`` HorizontalPodAutoscaler on the role's Deployment; engine metrics are
    ``Pods`` metrics under the names the prometheus-adapter rules (manifests/metrics) give them."""
    spec = svc.role(role)["autoscaling"]
    hpa_spec: Obj = {
        "scaleTargetRef": _scale_target(svc, role),
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


def scaled_object(svc: ServiceSpec, role: str) -> Obj:
    """A KEDA ``ScaledObject`` on the role's Deployment: KEDA runs the PromQL itself (no
    prometheus-adapter) and manages an HPA of its own."""
    spec = svc.role(role)["autoscaling"]
    deployment_name = f"{svc.name}-{role}"
    so_spec: Obj = {
        "scaleTargetRef": _scale_target(svc, role),
        "minReplicaCount": spec["minReplicas"],
        "maxReplicaCount": spec["maxReplicas"],
    }
    behavior = metric_table.behavior(spec)
    if behavior:
        so_spec["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": behavior}}
    so_spec["triggers"] = [
        metric_table.keda_trigger(m, svc.namespace, deployment_name, spec.get("prometheusAddress"))
        for m in spec["metrics"]
    ]
    return {
        "apiVersion": SCALED_OBJECT_API_VERSION,
        "kind": "ScaledObject",
        "metadata": metadata(svc, deployment_name, labels(svc, role)),
        "spec": so_spec,
    }


def autoscaler(svc: ServiceSpec, role: str) -> Obj | None:
    spec = svc.role(role).get("autoscaling")
    if not spec or spec["mode"] == "ketch":  # the operator scales it itself: no autoscaler object
        return None
    return scaled_object(svc, role) if spec["mode"] == "keda" else hpa(svc, role)
