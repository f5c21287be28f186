"""The ReplicaSet controller: a ReplicaSet runs `spec.replicas` pods, and reports how many are
ready and how many available (ready for at least `minReadySeconds`), which is what the
Deployment controller rolls by.

Extra pods go in the real controller's order: unscheduled before scheduled, pending before
running, unready before ready, ready for a shorter time first, more restarts first, newest first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubeemu.fieldsets import dcopy
from kubeemu.kubelet import PODS, REPLICASETS, Kubelet, controller_of
from kubeemu.podstatus import NODE_NAME, is_ready
from kubeemu.store import CONTROLLER_MANAGER, Store

Obj = dict[str, Any]


class ReplicaSetController:
    """Creates and deletes the pods of every ReplicaSet and writes its status."""

    def __init__(
        self,
        store: Store,
        kubelet: Kubelet,
        schedule: Callable[[tuple[str, str], tuple[str, str], float], None],
    ) -> None:
        self.store = store
        self.kubelet = kubelet
        self.schedule = schedule

    def sync(self, ns: str, name: str) -> None:
        rs = self.store.peek(REPLICASETS, ns, name)
        if rs is None or rs["metadata"].get("deletionTimestamp"):
            return
        want = int((rs.get("spec") or {}).get("replicas", 1) or 0)
        pods = self.pods_of(rs)
        if len(pods) < want:
            pods += [self._create_pod(rs) for _ in range(want - len(pods))]
        elif len(pods) > want:
            now = time.monotonic()
            ranked = sorted(pods, key=lambda p: self._deletion_rank(p, now))
            for pod in ranked[: len(pods) - want]:
                self.store.delete(self.store.rt(*PODS), ns, pod["metadata"]["name"])
            pods = ranked[len(pods) - want :]
        self._write_status(rs, pods)

    def pods_of(self, rs: Obj) -> list[Obj]:
        """The ReplicaSet's pods that are not terminating."""
        out = []
        for key, ns, name in sorted(self.store.dependents.get(rs["metadata"]["uid"], ())):
            pod = self.store.peek(key, ns, name) if key == PODS else None
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                out.append(pod)
        return out

    def _create_pod(self, rs: Obj) -> Obj:
        meta = rs["metadata"]
        template = (rs.get("spec") or {}).get("template") or {}
        tmeta = template.get("metadata") or {}
        pod_meta: Obj = {
            "generateName": f"{meta['name']}-",
            "namespace": meta["namespace"],
            "labels": dict(tmeta.get("labels") or {}),
            "ownerReferences": [owner_ref(rs)],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        spec = dcopy(template.get("spec") or {})
        probe = {"metadata": {"namespace": meta["namespace"], "name": ""}, "spec": spec}
        deployment = controller_of(rs, "Deployment")
        if self.kubelet.behaviours.of(probe, deployment).mode != "unschedulable":
            spec["nodeName"] = NODE_NAME  # the scheduler's binding, folded into the create
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": spec}
        pod, _ = self.store.create(
            self.store.rt(*PODS),
            meta["namespace"],
            body,
            manager=CONTROLLER_MANAGER,
            field_validation="Ignore",
        )
        return pod

    def _deletion_rank(self, pod: Obj, now: float) -> tuple[Any, ...]:
        status = pod.get("status") or {}
        restarts = sum(int(c.get("restartCount", 0)) for c in status.get("containerStatuses") or [])
        ready_for = self.kubelet.ready_for(pod, now)
        return (
            bool((pod.get("spec") or {}).get("nodeName")),
            {"Pending": 0, "Unknown": 1, "Running": 2}.get(status.get("phase", "Pending"), 0),
            is_ready(pod),
            ready_for or 0.0,
            -restarts,
            -_created(pod),
        )

    def _write_status(self, rs: Obj, pods: list[Obj]) -> None:
        meta = rs["metadata"]
        min_ready = int((rs.get("spec") or {}).get("minReadySeconds") or 0)
        now = time.monotonic()
        ready = available = 0
        wait: float | None = None
        for pod in pods:
            live = self.store.peek(PODS, meta["namespace"], pod["metadata"]["name"])
            ready_for = self.kubelet.ready_for(live, now) if live is not None else None
            if ready_for is None:
                continue
            ready += 1
            if ready_for >= min_ready:
                available += 1
            else:
                wait = min(wait or min_ready, min_ready - ready_for)
        status: Obj = {"replicas": len(pods)}
        for key, value in (
            ("fullyLabeledReplicas", len(pods)),
            ("readyReplicas", ready),
            ("availableReplicas", available),
            ("observedGeneration", meta.get("generation", 1)),
        ):
            if value:
                status[key] = value
        self.store.internal_status(REPLICASETS, meta["namespace"], meta["name"], status)
        if wait is not None:
            self.schedule(REPLICASETS, (meta["namespace"], meta["name"]), wait + 0.01)


def owner_ref(owner: Obj) -> Obj:
    """A controller owner reference to `owner` (what the GC cascades along)."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _created(obj: Obj) -> float:
    stamp = obj["metadata"].get("creationTimestamp") or "1970-01-01T00:00:00Z"
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


__all__ = ["ReplicaSetController", "owner_ref"]
