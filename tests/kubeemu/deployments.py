"""The Deployment controller, after kube-controller-manager's (pkg/controller/deployment).

A Deployment owns one ReplicaSet per pod template (named and labelled with the template's
`pod-template-hash`). A rollout moves one step per sync and waits for the ReplicaSets' pods to
report back before the next, so its intermediate states are there to see:

- RollingUpdate: scale the new ReplicaSet up while the pods of all ReplicaSets stay within
  replicas + maxSurge; scale old ones down while available pods stay at least
  replicas - maxUnavailable (unhealthy old pods first). maxSurge rounds up, maxUnavailable down,
  and both 0 means maxUnavailable 1, as `ResolveFenceposts` has it.
- Recreate: old ReplicaSets to 0, wait until their pods are gone, then the new one to replicas.

Status counts the pods of every ReplicaSet (`replicas` includes old pods), `updatedReplicas`
the new one's, `availableReplicas` pods ready for minReadySeconds; conditions Available and
Progressing carry the real controller's reasons (NewReplicaSetCreated, ReplicaSetUpdated,
NewReplicaSetAvailable, ProgressDeadlineExceeded). Not modelled: proportional scaling of a
scale-up in the middle of a rollout, adoption of orphaned ReplicaSets, `collisionCount`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from kubeemu.fieldsets import canon, dcopy
from kubeemu.kubelet import REPLICASETS
from kubeemu.replicasets import owner_ref
from kubeemu.rollout import DeploymentStatus, count, max_surge, max_unavailable, replicas
from kubeemu.store import CONTROLLER_MANAGER, Store

Obj = dict[str, Any]
DEPLOYMENTS = ("apps", "deployments")
HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
DESIRED = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"
_HASH_CHARS = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: Obj) -> str:
    """A stable `pod-template-hash` for a pod template (10 chars, like the real controller)."""
    digest = hashlib.sha256(canon(template).encode()).digest()
    return "".join(_HASH_CHARS[b % len(_HASH_CHARS)] for b in digest[:10])


class DeploymentController:
    """Rolls every Deployment's ReplicaSets and writes the Deployment's status."""

    def __init__(
        self, store: Store, schedule: Callable[[tuple[str, str], tuple[str, str], float], None]
    ) -> None:
        self.store = store
        self.schedule = schedule
        self.status = DeploymentStatus(schedule)

    def sync(self, ns: str, name: str) -> None:
        dep = self.store.peek(DEPLOYMENTS, ns, name)
        if dep is None:
            self.status.forget(ns, name)
            return
        if dep["metadata"].get("deletionTimestamp"):
            return
        tmpl_hash = template_hash((dep.get("spec") or {}).get("template") or {})
        new_rs, olds = self._replicasets(dep, tmpl_hash)
        created = False
        if not (dep.get("spec") or {}).get("paused"):
            recreate = ((dep.get("spec") or {}).get("strategy") or {}).get("type") == "Recreate"
            if new_rs is None and not recreate:
                new_rs, created = (
                    self._create_rs(dep, tmpl_hash, olds, self._surge_to(dep, olds)),
                    True,
                )
            elif new_rs is not None:
                new_rs = self._keep_settings(dep, new_rs, olds)
            if recreate:
                new_rs, olds, created = self._recreate(dep, tmpl_hash, new_rs, olds)
            else:
                assert new_rs is not None
                new_rs, olds = self._roll(dep, new_rs, olds)
            self._cleanup(dep, olds)
        self.status.write(self.store, dep, new_rs, olds, created)

    # ------------------------------------------------------------------------------------------
    # ReplicaSets

    def _replicasets(self, dep: Obj, tmpl_hash: str) -> tuple[Obj | None, list[Obj]]:
        """The new ReplicaSet (None if not created yet) and the old ones, oldest first."""
        new_rs, olds = None, []
        for key, ns, name in sorted(self.store.dependents.get(dep["metadata"]["uid"], ())):
            rs = self.store.peek(key, ns, name) if key == REPLICASETS else None
            if rs is None or rs["metadata"].get("deletionTimestamp"):
                continue
            if (rs["metadata"].get("labels") or {}).get(HASH_LABEL) == tmpl_hash:
                new_rs = rs
            else:
                olds.append(rs)
        olds.sort(key=lambda rs: (rs["metadata"].get("creationTimestamp", ""), _revision(rs)))
        return new_rs, olds

    def _surge_to(self, dep: Obj, olds: list[Obj]) -> int:
        """Replicas of a new ReplicaSet (NewRSNewReplicas with none yet)."""
        return self._new_replicas(dep, olds, 0)

    def _new_replicas(self, dep: Obj, olds: list[Obj], current_new: int) -> int:
        want = replicas(dep)
        pods = current_new + sum(replicas(rs) for rs in olds)
        most = want + max_surge(dep)
        if pods >= most:
            return current_new
        return current_new + min(most - pods, want - current_new)

    def _create_rs(self, dep: Obj, tmpl_hash: str, olds: list[Obj], count: int) -> Obj:
        meta, spec = dep["metadata"], dep.get("spec") or {}
        template = dcopy(spec.get("template") or {})
        tmeta = template.setdefault("metadata", {})
        tmeta["labels"] = {**(tmeta.get("labels") or {}), HASH_LABEL: tmpl_hash}
        selector = dcopy(spec.get("selector") or {})
        selector["matchLabels"] = {**(selector.get("matchLabels") or {}), HASH_LABEL: tmpl_hash}
        rs_meta: Obj = {
            "name": f"{meta['name']}-{tmpl_hash}",
            "namespace": meta["namespace"],
            "labels": dict(tmeta["labels"]),
            "annotations": self._annotations(dep, 1 + max(map(_revision, olds), default=0)),
            "ownerReferences": [owner_ref(dep)],
        }
        rs_spec: Obj = {"replicas": count, "selector": selector, "template": template}
        if spec.get("minReadySeconds"):
            rs_spec["minReadySeconds"] = spec["minReadySeconds"]
        body = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": rs_meta, "spec": rs_spec}
        rs, _ = self.store.create(
            self.store.rt(*REPLICASETS),
            meta["namespace"],
            body,
            manager=CONTROLLER_MANAGER,
            field_validation="Ignore",
        )
        return rs

    def _annotations(self, dep: Obj, revision: int) -> dict[str, str]:
        return {
            REVISION: str(revision),
            DESIRED: str(replicas(dep)),
            MAX_REPLICAS: str(replicas(dep) + max_surge(dep)),
        }

    def _keep_settings(self, dep: Obj, rs: Obj, olds: list[Obj]) -> Obj:
        """The new ReplicaSet keeps the Deployment's minReadySeconds and the newest revision
        (a template rolled back to gets a new revision)."""
        newest = max(map(_revision, olds), default=0)
        min_ready = (dep.get("spec") or {}).get("minReadySeconds") or 0
        spec = rs.get("spec") or {}
        if _revision(rs) > newest and (spec.get("minReadySeconds") or 0) == min_ready:
            return rs
        body = dcopy(rs)
        body["metadata"].setdefault("annotations", {})[REVISION] = str(
            max(_revision(rs), newest + 1)
        )
        if min_ready:
            body["spec"]["minReadySeconds"] = min_ready
        else:
            body["spec"].pop("minReadySeconds", None)
        return self._update(body)

    def _scale(self, dep: Obj, rs: Obj, count: int) -> Obj:
        if replicas(rs) == count:
            return rs
        body = dcopy(rs)
        body["spec"]["replicas"] = count
        annotations = body["metadata"].setdefault("annotations", {})
        annotations.update({k: v for k, v in self._annotations(dep, 0).items() if k != REVISION})
        return self._update(body)

    def _update(self, body: Obj) -> Obj:
        meta = body["metadata"]
        self.store.update(
            self.store.rt(*REPLICASETS),
            meta["namespace"],
            meta["name"],
            body,
            manager=CONTROLLER_MANAGER,
            field_validation="Ignore",
        )
        return self.store.peek(REPLICASETS, meta["namespace"], meta["name"]) or body

    # ------------------------------------------------------------------------------------------
    # strategies

    def _roll(self, dep: Obj, new_rs: Obj, olds: list[Obj]) -> tuple[Obj, list[Obj]]:
        """One step of a rolling update: scale the new ReplicaSet up, or else old ones down."""
        want = replicas(dep)
        if replicas(new_rs) > want:
            return self._scale(dep, new_rs, want), olds
        if replicas(new_rs) < want:
            target = self._new_replicas(dep, olds, replicas(new_rs))
            if target != replicas(new_rs):
                return self._scale(dep, new_rs, target), olds
        if not sum(replicas(rs) for rs in olds):
            return new_rs, olds
        min_available = want - max_unavailable(dep)
        new_unavailable = replicas(new_rs) - count(new_rs, "availableReplicas")
        all_pods = replicas(new_rs) + sum(replicas(rs) for rs in olds)
        room = all_pods - min_available - new_unavailable
        if room <= 0:
            return new_rs, olds
        olds = self._scale_down_unhealthy(dep, olds, room)
        available = count(new_rs, "availableReplicas")
        available += sum(count(rs, "availableReplicas") for rs in olds)
        if available > min_available:
            olds = self._scale_down_oldest(dep, olds, available - min_available)
        return new_rs, olds

    def _scale_down_unhealthy(self, dep: Obj, olds: list[Obj], room: int) -> list[Obj]:
        out, cleaned = [], 0
        for rs in olds:
            unhealthy = replicas(rs) - count(rs, "availableReplicas")
            if cleaned < room and unhealthy > 0:
                n = min(room - cleaned, unhealthy)
                rs = self._scale(dep, rs, replicas(rs) - n)
                cleaned += n
            out.append(rs)
        return out

    def _scale_down_oldest(self, dep: Obj, olds: list[Obj], budget: int) -> list[Obj]:
        out, done = [], 0
        for rs in olds:
            if done < budget and replicas(rs) > 0:
                n = min(replicas(rs), budget - done)
                rs = self._scale(dep, rs, replicas(rs) - n)
                done += n
            out.append(rs)
        return out

    def _recreate(
        self, dep: Obj, tmpl_hash: str, new_rs: Obj | None, olds: list[Obj]
    ) -> tuple[Obj | None, list[Obj], bool]:
        """Recreate: every old pod goes before the new ReplicaSet gets any."""
        if any(replicas(rs) for rs in olds):
            return new_rs, [self._scale(dep, rs, 0) for rs in olds], False
        if any(count(rs, "replicas") for rs in olds):
            return new_rs, olds, False  # old pods still running
        if new_rs is None:
            return self._create_rs(dep, tmpl_hash, olds, replicas(dep)), olds, True
        return self._scale(dep, new_rs, replicas(dep)), olds, False

    def _cleanup(self, dep: Obj, olds: list[Obj]) -> None:
        """Old ReplicaSets beyond revisionHistoryLimit go once they run nothing."""
        limit = int((dep.get("spec") or {}).get("revisionHistoryLimit", 10))
        idle = [rs for rs in olds if not replicas(rs) and not count(rs, "replicas")]
        for rs in idle[: max(len(idle) - limit, 0)]:
            meta = rs["metadata"]
            self.store.delete(self.store.rt(*REPLICASETS), meta["namespace"], meta["name"])


def _revision(rs: Obj) -> int:
    try:
        return int((rs["metadata"].get("annotations") or {}).get(REVISION, 0))
    except ValueError:
        return 0


__all__ = ["DEPLOYMENTS", "DeploymentController", "template_hash"]
