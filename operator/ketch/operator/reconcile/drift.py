"""Drift repair: a child that was deleted, or no longer holds what the operator applied
(``compare.drifted``), is put back by ``reconcile_child``, and an Event says so — only onto
objects this InferenceService controls: one that was deleted and then made again by someone else
under that name is a conflict (``ownership``).
"""

from __future__ import annotations

import logging

from ketch.operator import ownership
from ketch.operator.cache import Cache, ChildKey, Key, ServiceState
from ketch.operator.events import EventRecorder
from ketch.operator.kube import KubeClient
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.reconcile.child import ChildReconciler
from ketch.operator.reconcile.compare import contains

logger = logging.getLogger("ketch.operator")


class DriftRepair:
    """Puts drifted children back by applying them again."""

    def __init__(
        self, client: KubeClient, cache: Cache, events: EventRecorder, metrics: OperatorMetrics
    ):
        self.client = client
        self.cache = cache
        self.events = events
        self.metrics = metrics
        self.children = ChildReconciler(client, cache, metrics)

    async def restore(self, key: Key, state: ServiceState, drift: set[ChildKey]) -> None:
        """Puts the drifted children back; ``ChildConflict`` (noted in ``state.conflicts``)
        for those whose name an object this InferenceService does not control now holds."""
        conflicts = {}
        for child in sorted(drift):
            try:
                await self._restore_one(key, state, child)
            except ownership.ChildConflict as exc:
                conflicts.update(exc.conflicts)
        if conflicts:
            state.conflicts.update(conflicts)
            raise ownership.ChildConflict(state.conflicts)

    async def _restore_one(self, key: Key, state: ServiceState, child: ChildKey) -> None:
        svc = state.svc
        assert svc is not None
        applied = state.applied.get(child)
        cached = self.cache.live(key).get(child)
        if applied is None or (cached is not None and contains(applied.wanted, cached)):
            return  # already put back, or no longer wanted
        live = await self.children.find(key, svc.uid, child)
        if live is not None and not ownership.controlled_by(live, svc.uid):
            description = ownership.describe(child[0], svc.namespace, child[1], live)
            raise ownership.ChildConflict({child: description})
        outcome = await self.children.reconcile_child(
            key, state, applied.desired, live, state.applied
        )
        if outcome.unserved is not None:
            return  # its CRD was deleted: status says so
        state.conflicts.pop(child, None)
        self.metrics.restored.labels(child[0]).inc()
        what = "deleted" if live is None else "changed"
        logger.info("%s/%s: %s %s was %s by hand; restored", *key, *child, what)
        await self.events.post(
            state.body,
            "Normal",
            "Restored",
            f"{child[0]} {child[1]} was {what} outside the operator; put back",
        )
