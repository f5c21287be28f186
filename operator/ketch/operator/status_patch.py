"""Writing an InferenceService's status: computed by ``status`` (pure), patched only on change.

The status comes from the cached children (Deployments, Pods) and the coordinated autoscaler's
part; it is sent as a merge patch of the ``status`` subresource, and only when it differs from
what was last written, so a burst of pod events costs no write when nothing visible changed.
A condition that turns Ready, or Degraded (other than InvalidSpec, which has its own), is also
posted as an Event.

Progress is not news: a change that only moves a rollout along (a new object's first status
while its pods start, a message or a count while it stays Progressing) waits up to ``hold``
seconds for the next, and only the latest is written — so a new InferenceService whose pods
start quickly gets one status write, straight to Ready. Every other change is written at once:
Ready or Degraded turning True, a condition's status or reason changing, a new
observedGeneration, the autoscaler's part.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable

from ketch.operator import api_names, gateway, ownership
from ketch.operator import status as status_mod
from ketch.operator.autoscaling.loop import CoordinatedAutoscaling
from ketch.operator.cache import Cache, Key, Obj, ServiceState
from ketch.operator.children.roles import pod_roles
from ketch.operator.children.service import service_url
from ketch.operator.events import EventRecorder
from ketch.operator.kube import KubeClient
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.spec.parse import InvalidSpec

logger = logging.getLogger("ketch.operator")


class StatusWriter:
    """The status subresource of every tracked InferenceService."""

    def __init__(
        self,
        client: KubeClient,
        cache: Cache,
        events: EventRecorder,
        metrics: OperatorMetrics,
        autoscaling: CoordinatedAutoscaling,
        *,
        hold: float = 0.0,
        recheck: Callable[[Key], None] | None = None,
        unserved: Callable[[str], bool] | None = None,
    ):
        """``recheck(key)`` queues a status reconcile; it is called ``hold`` seconds after a
        change was held back (0: nothing is held)."""
        self.client = client
        self.cache = cache
        self.events = events
        self.metrics = metrics
        self.autoscaling = autoscaling
        self.hold = hold
        self.recheck = recheck
        # Whether InferencePools are not served in a namespace (the pool watch's 404s).
        self.unserved = unserved or (lambda namespace: False)
        self._timers: dict[Key, asyncio.TimerHandle] = {}

    async def write(self, key: Key, tracked: ServiceState) -> None:
        """Status from the observed children, written if it changed."""
        svc = tracked.svc
        assert svc is not None
        roles = pod_roles(svc)
        deployments = {
            role: self.cache.observed(key, ("Deployment", f"{svc.name}-{role}")) for role in roles
        }
        # Only its own Deployments count (another object of the name is a conflict).
        deployments = {
            role: dep if ownership.controlled_by(dep, svc.uid) else None
            for role, dep in deployments.items()
        }
        generation = tracked.applied_generation or 0
        conflict = None
        now = status_mod.now()
        if tracked.conflicts:  # this generation was seen, and refused
            generation = int(tracked.body["metadata"].get("generation") or generation)
            conflict = ownership.summary(tracked.conflicts)
        new = status_mod.compute(
            generation=generation,
            mode=svc.mode,
            url=service_url(svc),
            deployments=deployments,
            pods=self.cache.live_pods(key),
            old=tracked.last_status,
            now=now,
            conflict=conflict,
        )
        state = self.autoscaling.states.get(key)
        if state is not None:
            # a copy: the loop appends to its lists, and written_status must keep what was written
            new["autoscaling"] = copy.deepcopy(state.status)
            if state.condition is not None:
                new["conditions"] = [*new["conditions"], state.condition]
        pool = self.cache.observed(key, ("InferencePool", svc.name))
        pool = pool if ownership.controlled_by(pool, svc.uid) else None
        unserved = set(tracked.unserved)
        if self.unserved(key[0]):
            unserved.add("InferencePool")
        ready = gateway.condition(svc, pool, unserved, generation)
        if ready is not None:
            old = tracked.last_status
            new["conditions"] = [*new["conditions"], *status_mod.with_times([ready], old, now)]
        await self.patch(key, tracked, new)

    async def invalid(
        self, key: Key, tracked: ServiceState, generation: int, exc: InvalidSpec
    ) -> None:
        """``Degraded/InvalidSpec`` once per generation (and its Event); the children stay."""
        self.metrics.errors.labels("InvalidSpec").inc()
        if tracked.invalid_generation == generation:
            return
        tracked.invalid_generation = generation
        message = "; ".join(exc.problems)
        logger.warning("%s/%s: generation %d is invalid: %s", *key, generation, message)
        new = status_mod.invalid(
            generation=generation, message=message, old=tracked.last_status, now=status_mod.now()
        )
        await self.patch(key, tracked, new)
        await self.events.post(tracked.body, "Warning", "InvalidSpec", message)

    async def patch(self, key: Key, tracked: ServiceState, new: Obj) -> None:
        old = tracked.last_status or {}
        if _comparable(old) == _comparable(new):
            tracked.written_status = new
            tracked.held_since = None
            return
        if self._held(key, tracked, old, new):
            return
        await self.client.patch_status(api_names.KIND, key[0], key[1], merge_patch(old, new))
        tracked.written_status = new
        tracked.held_since = None
        await self._announce(tracked, old, new)

    def _held(self, key: Key, tracked: ServiceState, old: Obj, new: Obj) -> bool:
        """True when ``new`` is progress only and waits (see the module docstring)."""
        if self.hold <= 0 or self.recheck is None or not progress_only(old, new):
            return False
        now = time.monotonic()
        if tracked.held_since is None:
            tracked.held_since = now
        due = tracked.held_since + self.hold
        if now >= due:
            return False
        if key not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_at(loop.time() + due - now, self._wake, key)
        return True

    def _wake(self, key: Key) -> None:
        self._timers.pop(key, None)
        if self.recheck is not None:
            self.recheck(key)

    @property
    def holding(self) -> bool:
        """True while a status change waits to be written."""
        return bool(self._timers)

    def stop(self) -> None:
        """Drops the pending rechecks (the controller stops)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def _announce(self, tracked: ServiceState, old: Obj, new: Obj) -> None:
        before = {c["type"]: c for c in old.get("conditions") or []}
        for cond in new.get("conditions") or []:
            prev = before.get(cond["type"], {})
            flipped = prev.get("status") != cond["status"] or prev.get("reason") != cond["reason"]
            if cond["type"] == "Ready" and cond["status"] == "True" and flipped:
                await self.events.post(tracked.body, "Normal", "Ready", cond["message"])
            # InvalidSpec has its own event.
            degraded = cond["type"] == "Degraded" and cond["reason"] != "InvalidSpec"
            if degraded and cond["status"] == "True" and flipped:
                await self.events.post(tracked.body, "Warning", cond["reason"], cond["message"])


def merge_patch(old: Obj, new: Obj) -> Obj:
    """The merge patch that turns status ``old`` into ``new`` (null removes a member)."""
    patch = dict(new)
    for name in set(old) - set(new):
        patch[name] = None
    gone = set(old.get("roles") or {}) - set(new.get("roles") or {})
    if gone:  # copies: ``new`` is kept as the written status
        patch["roles"] = {**(new.get("roles") or {}), **dict.fromkeys(gone)}
    old_scaling = (old.get("autoscaling") or {}).get("roles") or {}
    new_scaling = (new.get("autoscaling") or {}).get("roles") or {}
    gone = set(old_scaling) - set(new_scaling)
    if new.get("autoscaling") is not None and gone:
        roles = {**new_scaling, **dict.fromkeys(gone)}
        patch["autoscaling"] = {**new["autoscaling"], "roles": roles}
    return patch


def progress_only(old: Obj, new: Obj) -> bool:
    """True when ``new`` only moves a rollout along from ``old``: nothing turned Ready or
    Degraded, no condition changed its status or reason, the generation and the autoscaler's
    part are the same (a first status counts when it is still Progressing)."""
    conditions = {c["type"]: c for c in new.get("conditions") or []}
    if any(conditions.get(t, {}).get("status") == "True" for t in ("Ready", "Degraded")):
        return False
    if conditions.get("Progressing", {}).get("status") != "True":
        return False
    if not old:
        return True
    before = {c.get("type"): c for c in old.get("conditions") or []}
    for kind, cond in conditions.items():
        prev = before.get(kind) or {}
        if (prev.get("status"), prev.get("reason")) != (cond["status"], cond["reason"]):
            return False
    same = ("observedGeneration", "autoscaling")
    return all(old.get(name) == new.get(name) for name in same)


def _comparable(status: Obj) -> Obj:
    return {k: v for k, v in status.items() if v is not None}
