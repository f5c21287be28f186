"""KEDA ScaledObject ``N-<role>``, per role with ``autoscaling.mode: keda``: targets Deployment
``N-<role>``; KEDA runs the PromQL itself (no prometheus-adapter) and manages an HPA of its own.

KEDA may not be installed: the kind is not watched (a kopf watch of a resource that is not
served fails for ever), so a ScaledObject edited by hand is put back by the next full reconcile
rather than at once, and pruning looks ScaledObjects up by name. An apply answered 404 leaves
the rest of the InferenceService applied (``optional``).
"""

from __future__ import annotations

from ketch.operator.autoscaling import metric_table
from ketch.operator.children.deployment import scale_target
from ketch.operator.children.horizontalpodautoscaler import autoscaling_mode
from ketch.operator.children.kind import ChildKind, Obj, OptionalCRD
from ketch.operator.objects import labels, metadata
from ketch.operator.spec.model import ServiceSpec

API_VERSION = "keda.sh/v1alpha1"


def scaled_object(svc: ServiceSpec, role: str) -> Obj:
    spec = svc.role(role)["autoscaling"]
    deployment_name = f"{svc.name}-{role}"
    so_spec: Obj = {
        "scaleTargetRef": scale_target(svc, role),
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
        "apiVersion": API_VERSION,
        "kind": "ScaledObject",
        "metadata": metadata(svc, deployment_name, labels(svc, role)),
        "spec": so_spec,
    }


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    assert role is not None
    return [scaled_object(svc, role)] if autoscaling_mode(svc, role) == "keda" else []


KIND = ChildKind(
    kind="ScaledObject",
    api_version=API_VERSION,
    plural="scaledobjects",
    build=build,
    stage=2,
    per_role=True,
    watched=False,
    optional=OptionalCRD("AutoscalerUnavailable", "is KEDA installed?"),
    # After a restart: one per engine role may be left.
    unwatched_names=lambda svc: {f"{svc.name}-{role}" for role in svc.roles},
)
