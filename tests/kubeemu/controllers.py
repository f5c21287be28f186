"""A small kube-controller-manager with a kubelet: Deployments own ReplicaSets, ReplicaSets own
Pods, and pods get the status their containers would have (what tests set, see kubelet.py).

Event-driven: the store calls `on_event` synchronously for every change; a background task
works off what changed in passes: pods first (kubelet), then ReplicaSets, then Deployments.
Every step of a rollout needs the pods and ReplicaSets to report back first, so a rollout
takes several passes and its intermediate states are stored and watched like any others.
Only changed statuses are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kubeemu.deployments import DEPLOYMENTS, DeploymentController, template_hash
from kubeemu.kubelet import PODS, REPLICASETS, Behaviours, Kubelet, PodBehaviour, controller_of
from kubeemu.podstatus import POD_MODES
from kubeemu.replicasets import ReplicaSetController
from kubeemu.store import ApiError, Store

log = logging.getLogger("kubeemu.controllers")

POD_IP_PREFIX = "10.244"  # server.py --pod-ip-prefix: e.g. 127.3 makes pods reachable on lo
FAULT_MODES = POD_MODES
Key = tuple[str, str]


class ControllerManager:
    """Runs the kubelet, the ReplicaSet and the Deployment controllers over the store."""

    def __init__(self, store: Store, pod_ip_prefix: str = POD_IP_PREFIX) -> None:
        self.store = store
        self.behaviours = Behaviours()
        self.kubelet = Kubelet(store, self.behaviours, self._schedule, pod_ip_prefix)
        self.replicasets = ReplicaSetController(store, self.kubelet, self._schedule)
        self.deployments = DeploymentController(store, self._schedule)
        self._sync = {
            PODS: self.kubelet.sync,
            REPLICASETS: self.replicasets.sync,
            DEPLOYMENTS: self.deployments.sync,
        }
        self.dirty: dict[Key, set[Key]] = {kind: set() for kind in self._sync}
        self.timers: dict[tuple[Key, Key], asyncio.TimerHandle] = {}
        self.wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        store.listeners.append(self.on_event)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for timer in self.timers.values():
            timer.cancel()

    # ------------------------------------------------------------------------------------------
    # what tests set

    def set_behaviour(self, scope: str, namespace: str, name: str, behaviour: PodBehaviour) -> None:
        """Pods of `scope` ("pod", "deployment" or "image") `name` behave so from now on."""
        self.behaviours.set(scope, namespace, name, behaviour)
        for ns, pod in list(self.store.objects.get(PODS, {})):
            if scope == "image" or ns == namespace:
                self._mark(PODS, (ns, pod))

    def set_fault(self, namespace: str, deployment: str, mode: str, ready_delay: float = 0) -> None:
        """The pods of a Deployment are `mode` (podstatus.POD_MODES)."""
        self.set_behaviour(
            "deployment", namespace, deployment, PodBehaviour(mode, float(ready_delay or 0))
        )

    def reset(self) -> None:
        self.behaviours.rules.clear()

    # ------------------------------------------------------------------------------------------
    # events and passes

    def on_event(self, key: Key, etype: str, obj: dict[str, Any], prev: Any) -> None:
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        if key == PODS:
            if etype == "DELETED":
                self.kubelet.forget(meta.get("uid", ""))
            else:
                self._mark(PODS, (ns, meta["name"]))
            owner = controller_of(obj, "ReplicaSet")
            if owner:
                self._mark(REPLICASETS, (ns, owner))
        elif key == REPLICASETS:
            if etype != "DELETED":
                self._mark(REPLICASETS, (ns, meta["name"]))
            owner = controller_of(obj, "Deployment")
            if owner:
                self._mark(DEPLOYMENTS, (ns, owner))
        elif key == DEPLOYMENTS:
            self._mark(DEPLOYMENTS, (ns, meta["name"]))

    def _mark(self, kind: Key, key: Key) -> None:
        self.dirty[kind].add(key)
        self.wake.set()

    def _schedule(self, kind: Key, key: Key, delay: float) -> None:
        """Look at an object again after `delay` seconds (a readiness delay, a deadline)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(delay, 0.01)
        old = self.timers.get((kind, key))
        if old is not None and not old.cancelled() and loop.time() < old.when() <= when:
            return
        if old is not None:
            old.cancel()
        self.timers[(kind, key)] = loop.call_at(when, self._fire, kind, key)

    def _fire(self, kind: Key, key: Key) -> None:
        self.timers.pop((kind, key), None)
        self._mark(kind, key)

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(0.02)  # let a burst of writes settle into one pass
            for kind, sync in self._sync.items():
                batch, self.dirty[kind] = self.dirty[kind], set()
                for ns, name in sorted(batch):
                    try:
                        sync(ns, name)
                    except ApiError as exc:
                        log.warning("%s %s/%s: %s", kind[1], ns, name, exc.message)
                    except Exception:
                        log.exception("%s %s/%s failed", kind[1], ns, name)


def describe_faults(manager: ControllerManager) -> list[dict[str, Any]]:
    """The pod behaviours set (GET /_emulator/faults)."""
    return manager.behaviours.describe()


__all__ = [
    "FAULT_MODES",
    "POD_IP_PREFIX",
    "ControllerManager",
    "PodBehaviour",
    "describe_faults",
    "template_hash",
]
