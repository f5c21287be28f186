"""Rollout arithmetic and the Deployment status, as kube-controller-manager computes them
(pkg/controller/deployment/util and sync.go / progress.go).

`DeploymentStatus.write` sums the ReplicaSets into the Deployment's counts and moves its
conditions the way the real controller does: a condition changes only when its status or reason
does; Progressing gets NewReplicaSetCreated when a new ReplicaSet is made, ReplicaSetUpdated on
every step of progress (which restarts the progress deadline), NewReplicaSetAvailable once
complete (kept after that until the next rollout), ProgressDeadlineExceeded when no progress
was made for progressDeadlineSeconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from kubeemu.store import Store
from kubeemu.timefmt import now_rfc3339

Obj = dict[str, Any]
DEPLOYMENTS = ("apps", "deployments")
MAX_INT32 = 2**31 - 1
NEW_RS_CREATED = "NewReplicaSetCreated"
RS_UPDATED = "ReplicaSetUpdated"
NEW_RS_AVAILABLE = "NewReplicaSetAvailable"
TIMED_OUT = "ProgressDeadlineExceeded"


def replicas(obj: Obj) -> int:
    """spec.replicas (1 when left out, as defaulting has it)."""
    return int((obj.get("spec") or {}).get("replicas", 1) or 0)


def count(rs: Obj | None, field: str) -> int:
    """A count from a ReplicaSet's status (0 when absent)."""
    return int(((rs or {}).get("status") or {}).get(field) or 0)


def scaled_value(value: Any, total: int, round_up: bool) -> int:
    """An int-or-percent of `total` (intstr.GetScaledValueFromIntOrPercent)."""
    if isinstance(value, str) and value.endswith("%"):
        try:
            exact = int(value[:-1]) * total / 100
        except ValueError:
            return 0
        return math.ceil(exact) if round_up else math.floor(exact)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def fenceposts(dep: Obj) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) resolved against replicas (ResolveFenceposts): surge rounds
    up, unavailable down, and both 0 makes maxUnavailable 1."""
    rolling = (((dep.get("spec") or {}).get("strategy") or {}).get("rollingUpdate")) or {}
    want = replicas(dep)
    surge = scaled_value(rolling.get("maxSurge", "25%"), want, True)
    unavailable = scaled_value(rolling.get("maxUnavailable", "25%"), want, False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def max_surge(dep: Obj) -> int:
    return fenceposts(dep)[0] if _strategy(dep) == "RollingUpdate" else 0


def max_unavailable(dep: Obj) -> int:
    """How many pods below replicas a rollout may go (0 for Recreate or 0 replicas)."""
    want = replicas(dep)
    if _strategy(dep) != "RollingUpdate" or want == 0:
        return 0
    return min(fenceposts(dep)[1], want)


def _strategy(dep: Obj) -> str:
    return ((dep.get("spec") or {}).get("strategy") or {}).get("type", "RollingUpdate")


def complete(dep: Obj, status: Obj) -> bool:
    """DeploymentComplete: every desired pod updated and available, no old pod left."""
    want = replicas(dep)
    return (
        status.get("updatedReplicas", 0) == want
        and status.get("replicas", 0) == want
        and status.get("availableReplicas", 0) == want
        and status.get("observedGeneration", 0) >= dep["metadata"].get("generation", 1)
    )


def progressed(old: Obj, new: Obj) -> bool:
    """DeploymentProgressing: more updated, ready or available pods, or fewer old ones."""

    def olds(s: Obj) -> int:
        return s.get("replicas", 0) - s.get("updatedReplicas", 0)

    return (
        new.get("updatedReplicas", 0) > old.get("updatedReplicas", 0)
        or olds(new) < olds(old)
        or new.get("readyReplicas", 0) > old.get("readyReplicas", 0)
        or new.get("availableReplicas", 0) > old.get("availableReplicas", 0)
    )


class DeploymentStatus:
    """Writes Deployment statuses; remembers when each one last made progress."""

    def __init__(self, schedule: Callable[[tuple[str, str], tuple[str, str], float], None]):
        self.schedule = schedule
        self.progress_at: dict[tuple[str, str], float] = {}

    def forget(self, ns: str, name: str) -> None:
        self.progress_at.pop((ns, name), None)

    def write(
        self, store: Store, dep: Obj, new_rs: Obj | None, olds: list[Obj], created: bool
    ) -> None:
        meta = dep["metadata"]
        key = (meta["namespace"], meta["name"])
        old = dep.get("status") or {}
        new = counts(dep, new_rs, olds)
        conds = Conditions(old.get("conditions") or [], now_rfc3339())
        if new.get("availableReplicas", 0) >= replicas(dep) - max_unavailable(dep):
            conds.set(
                "Available",
                True,
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
            )
        else:
            conds.set(
                "Available",
                False,
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
            )
        deadline = (dep.get("spec") or {}).get("progressDeadlineSeconds", 600)
        if isinstance(deadline, int) and deadline != MAX_INT32:
            self._progressing(key, dep, old, new, new_rs, conds, created, deadline)
        else:
            conds.remove("Progressing")
        if conds.items:
            new["conditions"] = conds.items
        store.internal_status(DEPLOYMENTS, key[0], key[1], new)

    def _progressing(
        self,
        key: tuple[str, str],
        dep: Obj,
        old: Obj,
        new: Obj,
        new_rs: Obj | None,
        conds: Conditions,
        created: bool,
        deadline: int,
    ) -> None:
        now = time.monotonic()
        rs_name = new_rs["metadata"]["name"] if new_rs else ""
        what = f'ReplicaSet "{rs_name}"' if new_rs else f'Deployment "{key[1]}"'
        if created:
            conds.set("Progressing", True, NEW_RS_CREATED, f'Created new replica set "{rs_name}"')
            self.progress_at[key] = now
        current = conds.get("Progressing")
        done = (
            new.get("replicas", 0) == new.get("updatedReplicas", 0)
            and current is not None
            and current.get("reason") == NEW_RS_AVAILABLE
        )
        if done:
            return
        if complete(dep, new):
            conds.set("Progressing", True, NEW_RS_AVAILABLE, f"{what} has successfully progressed.")
            return
        if progressed(old, new):
            conds.replace("Progressing", True, RS_UPDATED, f"{what} is progressing.")
            self.progress_at[key] = now
        elif current is not None and self._timed_out(key, current, deadline, now):
            conds.set("Progressing", False, TIMED_OUT, f"{what} has timed out progressing.")
            return
        since = self.progress_at.setdefault(key, now)
        self.schedule(DEPLOYMENTS, key, since + deadline - now + 0.01)

    def _timed_out(self, key: tuple[str, str], current: Obj, deadline: int, now: float) -> bool:
        if current.get("reason") == TIMED_OUT:
            return True
        return now - self.progress_at.setdefault(key, now) > deadline


def counts(dep: Obj, new_rs: Obj | None, olds: list[Obj]) -> Obj:
    """The Deployment's counts summed over its ReplicaSets (zeros left out, as Go omits them)."""
    every = ([new_rs] if new_rs is not None else []) + olds
    available = sum(count(rs, "availableReplicas") for rs in every)
    out: Obj = {"observedGeneration": dep["metadata"].get("generation", 1)}
    for field, value in (
        ("replicas", sum(count(rs, "replicas") for rs in every)),
        ("updatedReplicas", count(new_rs, "replicas")),
        ("readyReplicas", sum(count(rs, "readyReplicas") for rs in every)),
        ("availableReplicas", available),
        ("unavailableReplicas", max(sum(replicas(rs) for rs in every) - available, 0)),
    ):
        if value:
            out[field] = value
    return out


class Conditions:
    """Deployment conditions, changed as SetDeploymentCondition changes them."""

    def __init__(self, items: list[Obj], now: str) -> None:
        self.items = [dict(c) for c in items]
        self.now = now

    def get(self, ctype: str) -> Obj | None:
        return next((c for c in self.items if c.get("type") == ctype), None)

    def set(self, ctype: str, ok: bool, reason: str, message: str) -> None:
        """No change when status and reason are the same; else replace (the transition time
        stays when the status does)."""
        current = self.get(ctype)
        value = "True" if ok else "False"
        if (
            current is not None
            and current.get("status") == value
            and current.get("reason") == reason
        ):
            return
        self._put(ctype, value, reason, message, current)

    def replace(self, ctype: str, ok: bool, reason: str, message: str) -> None:
        """Always replace (lastUpdateTime moves), keeping the transition time of a True one."""
        self._put(ctype, "True" if ok else "False", reason, message, self.get(ctype))

    def remove(self, ctype: str) -> None:
        self.items = [c for c in self.items if c.get("type") != ctype]

    def _put(self, ctype: str, value: str, reason: str, message: str, current: Obj | None) -> None:
        same = current is not None and current.get("status") == value
        self.remove(ctype)
        self.items.append(
            {
                "type": ctype,
                "status": value,
                "lastUpdateTime": self.now,
                "lastTransitionTime": current["lastTransitionTime"]
                if same and current
                else self.now,
                "reason": reason,
                "message": message,
            }
        )
