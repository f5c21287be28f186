"""The child objects of an InferenceService: one module per kind, and the table of them.

Each module holds everything about its kind: its pure build (a validated InferenceService -> its
objects of that kind; no I/O and no clock, so the same spec always gives byte-identical children,
which lets ``ketch-operator render`` show exactly what the running operator applies and a
re-apply be a no-op on the server), and its ``KIND`` record (``kind.ChildKind``): where the API
serves it, whether kopf watches it, its apply stage, its hooks. ``KINDS`` lists them; the API
client's resource table, the watches, pruning and the apply stages all come from it, so a new
kind is one new module and one line here. Per InferenceService ``N``:

- ConfigMap ``N-config``, NetworkPolicy ``N``;
- per pod role (the engine roles, and ``router`` when disaggregated or with ``spec.gateway``):
  Service ``N-<role>`` (and headless ``N-<role>-peers`` for engine roles), PodDisruptionBudget
  ``N-<role>``, Deployment ``N-<role>``;
- per autoscaled role: HorizontalPodAutoscaler (``mode: hpa``) or KEDA ScaledObject
  (``mode: keda``) ``N-<role>``;
- with ``spec.gateway``: InferencePool ``N`` and, with ``gatewayRef``, HTTPRoute ``N``.
"""

from __future__ import annotations

from itertools import groupby

from ketch.operator.children import (
    configmap,
    deployment,
    horizontalpodautoscaler,
    httproute,
    inferencepool,
    networkpolicy,
    poddisruptionbudget,
    scaledobject,
    service,
)
from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.children.roles import pod_roles
from ketch.operator.spec.model import ServiceSpec

# In build order: within a stage, consecutive per-role kinds are built role by role.
KINDS: tuple[ChildKind, ...] = (
    configmap.KIND,
    networkpolicy.KIND,
    service.KIND,
    poddisruptionbudget.KIND,
    deployment.KIND,
    horizontalpodautoscaler.KIND,
    scaledobject.KIND,
    inferencepool.KIND,
    httproute.KIND,
)
BY_KIND: dict[str, ChildKind] = {k.kind: k for k in KINDS}
WATCHED: tuple[ChildKind, ...] = tuple(k for k in KINDS if k.watched)
UNWATCHED: tuple[ChildKind, ...] = tuple(k for k in KINDS if not k.watched)


def build(svc: ServiceSpec) -> list[Obj]:
    """Every child, in apply order: config first, then what selects pods, then the pods, then
    what targets them. Stage by stage; within one, ``KINDS``' order, a run of per-role kinds
    role by role (a role's Services, then its budget)."""
    roles = pod_roles(svc)
    children: list[Obj] = []
    for _, run in groupby(sorted(KINDS, key=lambda k: k.stage), key=_run_key):
        kinds = list(run)
        if kinds[0].per_role:
            children += [obj for role in roles for k in kinds for obj in k.build(svc, role)]
        else:
            children += [obj for k in kinds for obj in k.build(svc, None)]
    return children


def _run_key(kind: ChildKind) -> tuple[int, bool]:
    return kind.stage, kind.per_role


def stages(children: list[Obj]) -> list[list[Obj]]:
    """``children`` (in ``build`` order) cut into groups applied one after another; the children
    of one group are applied concurrently (one round trip, not one per child)."""
    groups: dict[int, list[Obj]] = {}
    for child in children:
        groups.setdefault(BY_KIND[child["kind"]].stage, []).append(child)
    return [groups[rank] for rank in sorted(groups)]
