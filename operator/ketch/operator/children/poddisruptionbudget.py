"""PodDisruptionBudget ``N-<role>``, per pod role: a drain takes at most one pod at a time."""

from __future__ import annotations

from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.objects import labels, metadata, selector
from ketch.operator.spec.model import ServiceSpec


def disruption_budget(svc: ServiceSpec, role: str) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(svc, f"{svc.name}-{role}", labels(svc, role)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(svc, role)}},
    }


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    assert role is not None
    return [disruption_budget(svc, role)]


KIND = ChildKind(
    kind="PodDisruptionBudget",
    api_version="policy/v1",
    plural="poddisruptionbudgets",
    build=build,
    per_role=True,
)
