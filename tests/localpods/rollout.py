"""How a Deployment replaces its pods: the decisions of kube-controller-manager's Deployment
controller (``pkg/controller/deployment``, rolling.go and recreate.go), as pure functions.

The cluster (``cluster.py``) calls ``next_step`` on every tick of a rollout with what it sees of
the Deployment's pods and carries out the answer: start so many new pods, delete these old ones.
As in the controller, a pod being deleted counts for nothing (its ReplicaSet no longer counts
it), except that ``Recreate`` waits until every old pod is gone before it starts a new one; a
pod is *available* once it has been ready (its readiness probe passing) for
``minReadySeconds``.

RollingUpdate, one sync: first scale the new pods up to ``desired + maxSurge`` in all; only when
nothing was started, delete old pods: the unavailable ones first, then available ones while
the available pods stay at least ``desired - maxUnavailable``. ``maxSurge`` and
``maxUnavailable`` are counts or percentages of ``desired``: surge rounds up, unavailable
rounds down, and both 0 means unavailable 1 (``ResolveFenceposts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

ROLLING_UPDATE = "RollingUpdate"
RECREATE = "Recreate"
_DEFAULT_SURGE = _DEFAULT_UNAVAILABLE = "25%"  # apps/v1 defaults


@dataclass(frozen=True)
class Strategy:
    """A Deployment's ``strategy`` and ``minReadySeconds``, resolved for its replica count."""

    kind: str
    max_surge: int
    max_unavailable: int
    min_ready_s: float

    @classmethod
    def of(cls, deployment: Obj) -> Strategy:
        spec = deployment["spec"]
        desired = spec.get("replicas", 1)
        strategy = spec.get("strategy") or {}
        kind = strategy.get("type", ROLLING_UPDATE)
        if kind not in (ROLLING_UPDATE, RECREATE):
            raise ValueError(f"Deployment strategy type {kind!r} is neither of the two")
        rolling = strategy.get("rollingUpdate") or {}
        surge = scaled_value(rolling.get("maxSurge", _DEFAULT_SURGE), desired, round_up=True)
        unavailable = scaled_value(
            rolling.get("maxUnavailable", _DEFAULT_UNAVAILABLE), desired, round_up=False
        )
        if surge == 0 and unavailable == 0:
            unavailable = 1  # the controller's fencepost: a rollout must be able to progress
        return cls(kind, surge, unavailable, float(spec.get("minReadySeconds", 0)))


def scaled_value(value: int | str, total: int, round_up: bool) -> int:
    """``intstr.GetScaledValueFromIntOrPercent``: an int as is, ``"N%"`` of ``total``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not an int or a percentage")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit():
        exact = int(value[:-1]) * total / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    raise ValueError(f"{value!r} is not an int or a percentage")


@dataclass(frozen=True)
class PodView:
    """What the controller knows of one pod that is not being deleted."""

    name: str
    ready: bool
    available: bool


@dataclass(frozen=True)
class Step:
    """What to do now: start ``create`` new pods, delete the ``delete`` ones (old or extra)."""

    create: int = 0
    delete: list[str] = field(default_factory=list)


def next_step(
    strategy: Strategy, desired: int, new: list[PodView], old: list[PodView], old_running: bool
) -> Step:
    """One sync of the Deployment. ``new``/``old``: its pods of the current template and of
    earlier ones, deletions excluded; ``old_running``: whether any old pod (deleted or not)
    still has a process."""
    if len(new) > desired:  # scaled down: the least ready go first
        return Step(delete=[p.name for p in _deletion_order(new)[: len(new) - desired]])
    if strategy.kind == RECREATE:
        return _recreate(desired, new, old, old_running)
    return _rolling(strategy, desired, new, old)


def complete(desired: int, new: list[PodView], old: list[PodView]) -> bool:
    """``kubectl rollout status``'s "successfully rolled out": every replica new and available,
    no old one left (pods being deleted are not counted, as in ``status.replicas``)."""
    return not old and len(new) == desired and all(p.available for p in new)


def _recreate(desired: int, new: list[PodView], old: list[PodView], old_running: bool) -> Step:
    if old:
        return Step(delete=[p.name for p in old])
    if old_running:  # recreate.go: new pods only once no old pod runs
        return Step()
    return Step(create=desired - len(new))


def _rolling(strategy: Strategy, desired: int, new: list[PodView], old: list[PodView]) -> Step:
    total = len(new) + len(old)
    if len(new) < desired:  # reconcileNewReplicaSet
        create = min(desired + strategy.max_surge - total, desired - len(new))
        if create > 0:
            return Step(create=create)
    # reconcileOldReplicaSets
    min_available = desired - strategy.max_unavailable
    new_unavailable = sum(not p.available for p in new)
    max_scaled_down = total - min_available - new_unavailable
    if not old or max_scaled_down <= 0:
        return Step()
    unhealthy = [p for p in _deletion_order(old) if not p.available][:max_scaled_down]
    healthy = [p for p in _deletion_order(old) if p.available]
    available = sum(p.available for p in new) + len(healthy)
    return Step(delete=[p.name for p in unhealthy + healthy[: max(0, available - min_available)]])


def _deletion_order(pods: list[PodView]) -> list[PodView]:
    """The ReplicaSet controller's preference, reduced to what is modelled: not ready first,
    then ready but not yet available, then the rest (newest first)."""
    return sorted(reversed(pods), key=lambda p: (p.ready, p.available))
