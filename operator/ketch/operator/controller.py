"""The reconcile loop: level-triggered, idempotent, one worker per InferenceService.

kopf delivers watch events (InferenceServices and the children the operator labels); the
controller keeps the latest copy of each (``cache``) and queues work per InferenceService
(``workqueue``):

- ``full``: parse the spec, build every child, server-side apply them all, delete children no
  longer wanted (``reconcile.full``, ``reconcile.prune``). Runs when a generation is seen for
  the first time, on start-up, and every ``resync`` seconds. A resync first reads the
  InferenceService afresh: a replica that kopf's peering has paused gets no events, and must
  never re-apply a spec it saw generations ago (both replicas then apply the same current spec:
  a no-op).
- ``drift``: a child was deleted or no longer holds what the operator applied: apply that child
  (``reconcile.drift``).
- ``status``: recompute status from the cached Deployments and Pods; write it only if it changed
  (``status_patch``).

A spec that can't be deployed sets ``Degraded/InvalidSpec`` once and waits for the next
generation: no hot retries. A child whose name an object the InferenceService does not control
already holds sets ``Degraded/ChildConflict`` and is retried with backoff (``ownership``): the
other object may go away (the garbage collector removing what an earlier InferenceService of
the same name left). API errors retry with exponential backoff, per InferenceService.
Coordinated autoscaling runs beside it (``autoscaling.loop``), one loop per InferenceService.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from ketch.operator import api_names, gateway, ownership
from ketch.operator.autoscaling.loop import CoordinatedAutoscaling
from ketch.operator.cache import Cache, Key, Obj, ServiceState
from ketch.operator.children import deployment, inferencepool
from ketch.operator.events import EventRecorder
from ketch.operator.gateway_watch import PoolWatch
from ketch.operator.kube import KubeClient
from ketch.operator.labels import LABEL_INSTANCE
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.reconcile.compare import drifted
from ketch.operator.reconcile.drift import DriftRepair
from ketch.operator.reconcile.full import ChildApplier
from ketch.operator.spec.parse import InvalidSpec, parse
from ketch.operator.status_patch import StatusWriter
from ketch.operator.workqueue import Work, WorkQueue

logger = logging.getLogger("ketch.operator")

# The child kinds status reads: the Deployments, and the InferencePool (``GatewayReady``).
_READ_BY_STATUS = (deployment.KIND.kind, inferencepool.KIND.kind)


class Controller:
    """Watch events in, reconciles out: the parts below, wired to one cache and one client."""

    def __init__(
        self,
        client: KubeClient,
        metrics: OperatorMetrics | None = None,
        *,
        resync_seconds: float = 300.0,
        max_backoff: float = 60.0,
        status_hold: float = 0.0,
    ):
        """``status_hold``: how long a status change that is progress only may wait for the
        next one (``status_patch``); 0 writes every change at once."""
        self.client = client
        self.metrics = metrics or OperatorMetrics()
        self.resync_seconds = resync_seconds
        self.cache = Cache()
        self.queue = WorkQueue(self._reconcile_key, self.metrics, max_backoff)
        self.events = EventRecorder(client)
        self.autoscaling = CoordinatedAutoscaling(client, self.cache, self._status_changed)
        self.applier = ChildApplier(client, self.cache, self.events, self.metrics)
        self.drift = DriftRepair(client, self.cache, self.events, self.metrics)
        # InferencePools (spec.gateway) are watched here, not by kopf: their CRD is optional.
        self.pools = PoolWatch(client, self.on_child_event, self._pools_served)
        self.status = StatusWriter(
            client,
            self.cache,
            self.events,
            self.metrics,
            self.autoscaling,
            hold=status_hold,
            recheck=self._status_changed,
            unserved=lambda namespace: namespace in self.pools.unserved,
        )
        self._resync_task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def last_api_error(self) -> str | None:
        return self.queue.last_error

    # ------------------------------------------------------------------ events in

    def on_service_event(self, event_type: str, body: Obj) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        tracked_all = self.cache.tracked
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            tracked_all.pop(key, None)  # owner references let the GC remove the children
            self.autoscaling.stop(key)
            self._sync_pools()
            self.queue.forget(key)
            self.metrics.services.set(len(tracked_all))
            return
        tracked = tracked_all.get(key)
        if tracked is None or tracked.body["metadata"].get("uid") != meta.get("uid"):
            tracked = tracked_all[key] = ServiceState(body=body)
            self.metrics.services.set(len(tracked_all))
        tracked.body = body
        generation = int(meta.get("generation") or 0)
        seen = generation in (tracked.applied_generation, tracked.invalid_generation)
        self.enqueue(key, Work(full=not seen, status=True))

    def on_child_event(self, event_type: str, body: Obj) -> None:
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(LABEL_INSTANCE)
        if not owner:
            return
        key = (meta.get("namespace") or "", owner)
        kind, name = body.get("kind") or "", meta.get("name") or ""
        if kind == "Pod":
            pods = self.cache.pods.setdefault(key, {})
            if event_type == "DELETED":
                pods.pop(name, None)
            else:
                pods[name] = body
            if key in self.cache.tracked:
                self.enqueue(key, Work(status=True))
            return
        live = self.cache.children.setdefault(key, {})
        if event_type == "DELETED":
            live.pop((kind, name), None)
        else:
            live[(kind, name)] = body
        tracked = self.cache.tracked.get(key)
        if tracked is None:
            return
        applied = tracked.applied.get((kind, name))
        if event_type == "DELETED" and applied is not None:
            applied.answer = None  # gone: no older answer stands in for it
        if drifted(tracked, (kind, name), event_type, body):
            self.enqueue(key, Work(drift={(kind, name)}, status=kind == deployment.KIND.kind))
        elif kind in _READ_BY_STATUS:
            self.enqueue(key, Work(status=True))

    def enqueue(self, key: Key, work: Work) -> None:
        self.queue.put(key, work)

    def _status_changed(self, key: Key) -> None:
        self.enqueue(key, Work(status=True))

    def _sync_pools(self) -> None:
        """Watches InferencePools in the namespaces with an InferenceService with a gateway."""
        self.pools.sync(
            {
                key[0]
                for key, tracked in self.cache.tracked.items()
                if tracked.svc is not None and gateway.enabled(tracked.svc)
            }
        )

    def _pools_served(self, namespace: str, served: bool) -> None:
        """The GAIE CRDs are now installed: apply what could not be applied. Or they are gone:
        status says so (``GatewayReady``)."""
        for key, tracked in self.cache.tracked.items():
            if key[0] != namespace or tracked.svc is None or not gateway.enabled(tracked.svc):
                continue
            if served:
                self.enqueue(key, Work(full=bool(tracked.unserved), status=True))
            else:
                self.enqueue(key, Work(status=True))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self._resync_task is None and self.resync_seconds > 0:
            self._resync_task = self.loop.create_task(self._resync())

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            for key in list(self.cache.tracked):
                try:
                    body = await self.client.get(api_names.KIND, *key)
                except Exception as exc:  # next round; a failing API shows in /healthz
                    logger.warning("%s/%s: resync read failed: %s", *key, exc)
                    continue
                tracked = self.cache.tracked.get(key)
                if tracked is None:
                    continue
                if body is None:
                    self.on_service_event("DELETED", tracked.body)
                    continue
                tracked.body = body
                self.enqueue(key, Work(full=True, status=True))

    async def stop(self) -> None:
        self.autoscaling.stop_all()
        self.status.stop()
        pools = self.pools.stop_all()
        tasks = [t for t in (self._resync_task, *self.queue.tasks(), *pools) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def busy(self) -> bool:
        """True while work is queued or running, or a status change is held back."""
        return self.queue.busy or self.status.holding

    async def idle(self, timeout: float = 30.0) -> None:
        """Waits until no work is queued or running (for tests and the benchmark)."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ reconcile

    async def _reconcile_key(self, key: Key, work: Work) -> bool:
        tracked = self.cache.tracked.get(key)
        if tracked is None:
            return False
        await self.reconcile(key, tracked, work)
        return True

    async def reconcile(self, key: Key, tracked: ServiceState, work: Work) -> None:
        body = tracked.body
        generation = int(body["metadata"].get("generation") or 0)
        kind = "full" if work.full else ("drift" if work.drift else "status")
        started = time.perf_counter()
        if work.full:
            try:
                tracked.svc = parse(body, cel=False)  # the API server ran the CEL rules
            except InvalidSpec as exc:
                await self.status.invalid(key, tracked, generation, exc)
                return
            await self._owning(key, tracked, self.applier.apply_all(key, tracked, generation))
            self.autoscaling.sync(key, tracked)
            self._sync_pools()
        elif work.drift and tracked.svc is not None:
            await self._owning(key, tracked, self.drift.restore(key, tracked, work.drift))
        if tracked.svc is not None and tracked.invalid_generation != generation:
            await self.status.write(key, tracked)
        self.metrics.reconciles.labels(kind).inc()
        self.metrics.duration.labels(kind).observe(time.perf_counter() - started)

    async def _owning(self, key: Key, tracked: ServiceState, applying: Awaitable[None]) -> None:
        """Runs ``applying``; on a ``ChildConflict`` the status says so (``Degraded``, with its
        Warning Event) before the conflict fails the reconcile, which is then retried."""
        try:
            await applying
        except ownership.ChildConflict:
            await self.status.write(key, tracked)
            raise
