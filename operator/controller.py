"""The reconcile loop: level-triggered, idempotent, one worker per InferenceService.

kopf delivers watch events (InferenceServices and the children the operator labels); the
controller keeps the latest copy of each and queues work per InferenceService:

- ``full``: parse the spec, build every child, server-side apply them all (one field manager,
  forced), delete children no longer wanted. Runs when a generation is seen for the first time,
  on start-up, and every ``resync`` seconds. A resync first reads the InferenceService afresh:
  a replica that kopf's peering has paused gets no events, and must never re-apply a spec it
  saw generations ago (both replicas then apply the same current spec: a no-op).
- ``drift``: a child was deleted or no longer holds what the operator applied: apply that child.
- ``status``: recompute status from the cached Deployments and Pods; write it only if it changed.

Work for one InferenceService is serialised and coalesced (events that arrive while a reconcile
runs fold into the next one), and InferenceServices never wait on each other. A spec that can't be
deployed sets ``Degraded/InvalidSpec`` once and waits for the next generation: no hot retries.
API errors retry with exponential backoff, per InferenceService.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import socket
import time
from typing import Any

from ketch.operator import builders, crd, objects
from ketch.operator import status as status_mod
from ketch.operator.coordinated import Autoscale, CoordinatedScaling
from ketch.operator.kube import ApiError, KubeClient
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.spec import InvalidSpec, ServiceSpec, parse

logger = logging.getLogger("ketch.operator")

Key = tuple[str, str]  # (namespace, name)
ChildKey = tuple[str, str]  # (kind, name)
Obj = dict[str, Any]

CHILD_KINDS = (
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "HorizontalPodAutoscaler",
    "ScaledObject",
)
# Child kinds kopf does not watch (handlers.CHILD_RESOURCES): KEDA's ScaledObject is a custom
# kind that may not be installed, and a watch on a missing resource fails forever. Without
# events, a ScaledObject edited by hand is put back by the next full reconcile (resync) rather
# than at once, and pruning looks such children up by name (see _prune_unwatched).
UNWATCHED_KINDS = ("ScaledObject",)


def project(desired: Any, actual: Any) -> Any:
    """``desired`` with each value as the server stored it (``actual``, the apply's answer).

    The server normalises some values (a CPU of "0.5" comes back as "500m"); drift is judged
    against what it stored, or every watch event would look like a hand edit."""
    if isinstance(desired, dict) and isinstance(actual, dict):
        return {k: project(v, actual[k]) if k in actual else v for k, v in desired.items()}
    if isinstance(desired, list) and isinstance(actual, list) and len(desired) == len(actual):
        return [project(d, a) for d, a in zip(desired, actual, strict=True)]
    if isinstance(desired, dict | list) or isinstance(actual, dict | list):
        return desired
    return actual


def contains(desired: Any, live: Any) -> bool:
    """True when ``live`` holds everything ``desired`` sets (the server may add defaults)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and contains(v, live[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(contains(d, x) for d, x in zip(desired, live, strict=True))
        )
    return desired == live or (isinstance(desired, int | float) and str(desired) == str(live))


@dataclasses.dataclass
class Work:
    full: bool = False
    drift: set[ChildKey] = dataclasses.field(default_factory=set)
    status: bool = False

    def merge(self, other: Work) -> None:
        self.full |= other.full
        self.drift |= other.drift
        self.status |= other.status


@dataclasses.dataclass
class Tracked:
    """What the controller knows of one InferenceService."""

    body: Obj
    desired: dict[ChildKey, Obj] = dataclasses.field(default_factory=dict)  # what is applied
    expected: dict[ChildKey, Obj] = dataclasses.field(default_factory=dict)  # as the server has it
    applied_generation: int | None = None
    invalid_generation: int | None = None
    written_status: Obj | None = None
    failures: int = 0
    svc: ServiceSpec | None = None


class Controller(CoordinatedScaling):
    def __init__(
        self,
        client: KubeClient,
        metrics: OperatorMetrics | None = None,
        *,
        resync_seconds: float = 300.0,
        max_backoff: float = 60.0,
    ):
        self.client = client
        self.metrics = metrics or OperatorMetrics()
        self.resync_seconds = resync_seconds
        self.max_backoff = max_backoff
        self.tracked: dict[Key, Tracked] = {}
        self.children: dict[Key, dict[ChildKey, Obj]] = {}  # live children by owner, from watches
        self.pods: dict[Key, dict[str, Obj]] = {}
        self._pending: dict[Key, Work] = {}
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._resync_task: asyncio.Task[None] | None = None
        self.autoscale: dict[Key, Autoscale] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_api_error: str | None = None
        self.reporter = f"{socket.gethostname()}-{os.getpid()}"

    # ------------------------------------------------------------------ events in

    def on_service_event(self, event_type: str, body: Obj) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self.tracked.pop(key, None)  # owner references let the GC remove the children
            self._stop_autoscaler(key)
            self._pending.pop(key, None)
            self.metrics.services.set(len(self.tracked))
            return
        tracked = self.tracked.get(key)
        if tracked is None or tracked.body["metadata"].get("uid") != meta.get("uid"):
            tracked = self.tracked[key] = Tracked(body=body)
            self.metrics.services.set(len(self.tracked))
        tracked.body = body
        generation = int(meta.get("generation") or 0)
        seen = generation in (tracked.applied_generation, tracked.invalid_generation)
        self.enqueue(key, Work(full=not seen, status=True))

    def on_child_event(self, event_type: str, body: Obj) -> None:
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(objects.LABEL_INSTANCE)
        if not owner:
            return
        key = (meta.get("namespace") or "", owner)
        kind, name = body.get("kind") or "", meta.get("name") or ""
        if kind == "Pod":
            pods = self.pods.setdefault(key, {})
            if event_type == "DELETED":
                pods.pop(name, None)
            else:
                pods[name] = body
            if key in self.tracked:
                self.enqueue(key, Work(status=True))
            return
        live = self.children.setdefault(key, {})
        if event_type == "DELETED":
            live.pop((kind, name), None)
        else:
            live[(kind, name)] = body
        tracked = self.tracked.get(key)
        if tracked is None:
            return
        desired = tracked.expected.get((kind, name)) or tracked.desired.get((kind, name))
        if desired is not None and (event_type == "DELETED" or not contains(desired, body)):
            self.enqueue(key, Work(drift={(kind, name)}, status=kind == "Deployment"))
        elif kind == "Deployment":
            self.enqueue(key, Work(status=True))

    # ------------------------------------------------------------------ scheduling

    def enqueue(self, key: Key, work: Work) -> None:
        pending = self._pending.get(key)
        if pending is None:
            self._pending[key] = work
        else:
            pending.merge(work)
        if key not in self._tasks:
            self._tasks[key] = asyncio.get_running_loop().create_task(self._worker(key))

    async def _worker(self, key: Key) -> None:
        try:
            while key in self._pending:
                work = self._pending.pop(key)
                tracked = self.tracked.get(key)
                if tracked is None:
                    continue
                try:
                    await self.reconcile(key, tracked, work)
                    tracked.failures = 0
                    self.last_api_error = None
                except Exception as exc:  # one InferenceService's failure stays its own
                    tracked.failures += 1
                    reason = _error_reason(exc)
                    self.metrics.errors.labels(reason).inc()
                    self.last_api_error = str(exc)
                    delay = min(self.max_backoff, 0.5 * 2 ** min(tracked.failures, 10))
                    logger.warning(
                        "%s/%s: reconcile failed (%s), retrying in %.1f s: %s",
                        *key,
                        reason,
                        delay,
                        exc,
                    )
                    work.merge(self._pending.pop(key, Work()))
                    await asyncio.sleep(delay)
                    self._pending[key] = work
        finally:
            self._tasks.pop(key, None)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self._resync_task is None and self.resync_seconds > 0:
            self._resync_task = asyncio.get_running_loop().create_task(self._resync())

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            for key in list(self.tracked):
                try:
                    body = await self.client.get(crd.KIND, *key)
                except Exception as exc:  # next round; a failing API shows in /healthz
                    logger.warning("%s/%s: resync read failed: %s", *key, exc)
                    continue
                tracked = self.tracked.get(key)
                if tracked is None:
                    continue
                if body is None:
                    self.on_service_event("DELETED", tracked.body)
                    continue
                tracked.body = body
                self.enqueue(key, Work(full=True, status=True))

    async def stop(self) -> None:
        for key in list(self.autoscale):
            self._stop_autoscaler(key)
        tasks = [t for t in (self._resync_task, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def idle(self, timeout: float = 30.0) -> None:
        """Waits until no work is queued or running (for tests and the benchmark)."""
        deadline = time.monotonic() + timeout
        while (self._tasks or self._pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ reconcile

    async def reconcile(self, key: Key, tracked: Tracked, work: Work) -> None:
        body = tracked.body
        generation = int(body["metadata"].get("generation") or 0)
        kind = "full" if work.full else ("drift" if work.drift else "status")
        started = time.perf_counter()
        if work.full:
            try:
                tracked.svc = parse(body, cel=False)  # the API server ran the CEL rules
            except InvalidSpec as exc:
                await self._invalid(key, tracked, generation, exc)
                return
            await self._apply_all(key, tracked, generation)
            self._sync_autoscaler(key, tracked)
        elif work.drift and tracked.svc is not None:
            await self._restore(key, tracked, work.drift)
        if tracked.svc is not None and tracked.invalid_generation != generation:
            await self._write_status(key, tracked)
        self.metrics.reconciles.labels(kind).inc()
        self.metrics.duration.labels(kind).observe(time.perf_counter() - started)

    async def _apply_all(self, key: Key, tracked: Tracked, generation: int) -> None:
        svc = tracked.svc
        assert svc is not None
        first = tracked.applied_generation is None
        children = builders.build(svc)
        desired = {(c["kind"], c["metadata"]["name"]): c for c in children}
        changed = []
        expected = {}
        for child in children:
            child_key = (child["kind"], child["metadata"]["name"])
            before = self.children.get(key, {}).get(child_key)
            try:
                result = await self.client.apply(child)
            except ApiError as exc:
                if not (exc.status == 404 and child["kind"] in UNWATCHED_KINDS):
                    raise
                # The kind's CRD is not installed (KEDA missing): everything else is applied;
                # the next full reconcile (resync, new generation) tries again.
                logger.warning("%s/%s: cannot apply %s %s: %s", *key, *child_key, exc)
                await self.event(
                    tracked.body,
                    "Warning",
                    "AutoscalerUnavailable",
                    f"{child['kind']} {child['metadata']['name']} could not be created: "
                    f"{child['apiVersion']} is not served (is KEDA installed?)",
                )
                continue
            expected[child_key] = project(child, result)
            self.metrics.applies.labels(child["kind"]).inc()
            if before is None or _rv(before) != _rv(result):
                changed.append(f"{child['kind']} {child['metadata']['name']}")
        pruned = await self._prune(key, svc, desired)
        pruned += await self._prune_unwatched(key, tracked, svc, desired)
        tracked.desired = desired
        tracked.expected = expected
        tracked.applied_generation = generation
        tracked.invalid_generation = None
        if changed or pruned:
            verb = (
                "created" if first and not pruned and len(changed) == len(children) else "applied"
            )
            message = f"generation {generation}: {verb} " + ", ".join(changed) if changed else ""
            if pruned:
                message += ("; " if message else "") + "deleted " + ", ".join(pruned)
            await self.event(tracked.body, "Normal", "Reconciled", message)
        logger.info(
            "%s/%s: generation %d applied (%d children, %d changed, %d deleted)",
            *key,
            generation,
            len(children),
            len(changed),
            len(pruned),
        )

    async def _prune(self, key: Key, svc: ServiceSpec, desired: dict[ChildKey, Obj]) -> list[str]:
        """Deletes children this InferenceService owns that its spec no longer wants."""
        deleted = []
        for (kind, name), live in list(self.children.get(key, {}).items()):
            if (kind, name) in desired or kind not in CHILD_KINDS:
                continue
            owners = (live.get("metadata") or {}).get("ownerReferences") or []
            if not any(o.get("uid") == svc.uid for o in owners):
                continue
            await self.client.delete(kind, svc.namespace, name)
            deleted.append(f"{kind} {name}")
        return deleted

    async def _prune_unwatched(
        self, key: Key, tracked: Tracked, svc: ServiceSpec, desired: dict[ChildKey, Obj]
    ) -> list[str]:
        """Deletes unwatched children (ScaledObjects) no longer wanted. They are looked up by
        their names (``<name>-<role>``), and only where one may exist."""
        deleted = []
        first = tracked.applied_generation is None
        for kind in UNWATCHED_KINDS:
            # After a start-up nothing is known: look at the spec's roles; else at what the
            # last applied generation had.
            names = (
                {f"{svc.name}-{role}" for role in svc.roles}
                if first
                else {n for k, n in tracked.desired if k == kind}
            )
            for name in sorted(names):
                if (kind, name) in desired:
                    continue
                live = await self.client.get(kind, svc.namespace, name)  # None: 404
                owners = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
                if not any(o.get("uid") == svc.uid for o in owners):
                    continue
                await self.client.delete(kind, svc.namespace, name)
                deleted.append(f"{kind} {name}")
        return deleted

    async def _restore(self, key: Key, tracked: Tracked, drift: set[ChildKey]) -> None:
        for child_key in sorted(drift):
            child = tracked.desired.get(child_key)
            live = self.children.get(key, {}).get(child_key)
            wanted = tracked.expected.get(child_key) or child
            if child is None or (live is not None and contains(wanted, live)):
                continue  # already put back, or no longer wanted
            result = await self.client.apply(child)
            tracked.expected[child_key] = project(child, result)
            self.metrics.applies.labels(child_key[0]).inc()
            self.metrics.restored.labels(child_key[0]).inc()
            what = "deleted" if live is None else "changed"
            logger.info("%s/%s: %s %s was %s by hand; restored", *key, *child_key, what)
            await self.event(
                tracked.body,
                "Normal",
                "Restored",
                f"{child_key[0]} {child_key[1]} was {what} outside the operator; put back",
            )

    async def _invalid(self, key: Key, tracked: Tracked, generation: int, exc: InvalidSpec) -> None:
        self.metrics.errors.labels("InvalidSpec").inc()
        if tracked.invalid_generation == generation:
            return
        tracked.invalid_generation = generation
        message = "; ".join(exc.problems)
        logger.warning("%s/%s: generation %d is invalid: %s", *key, generation, message)
        old = tracked.written_status or tracked.body.get("status")
        new = status_mod.invalid(
            generation=generation, message=message, old=old, now=status_mod.now()
        )
        await self._patch_status(key, tracked, new)
        await self.event(tracked.body, "Warning", "InvalidSpec", message)

    async def _write_status(self, key: Key, tracked: Tracked) -> None:
        svc = tracked.svc
        assert svc is not None
        live = self.children.get(key, {})
        roles = [*svc.roles, "router"] if svc.disaggregated else svc.roles
        deployments = {role: live.get(("Deployment", f"{svc.name}-{role}")) for role in roles}
        pods = [
            p
            for p in self.pods.get(key, {}).values()
            if not (p.get("metadata") or {}).get("deletionTimestamp")
        ]
        old = tracked.written_status or tracked.body.get("status")
        new = status_mod.compute(
            generation=tracked.applied_generation or 0,
            mode=svc.mode,
            url=builders.service_url(svc),
            deployments=deployments,
            pods=pods,
            old=old,
            now=status_mod.now(),
        )
        state = self.autoscale.get(key)
        if state is not None:
            # a copy: the loop appends to its lists, and written_status must keep what was written
            new["autoscaling"] = copy.deepcopy(state.status)
            if state.condition is not None:
                new["conditions"] = [*new["conditions"], state.condition]
        await self._patch_status(key, tracked, new)

    async def _patch_status(self, key: Key, tracked: Tracked, new: Obj) -> None:
        old = tracked.written_status or tracked.body.get("status") or {}
        if _comparable(old) == _comparable(new):
            tracked.written_status = new
            return
        patch = dict(new)
        for name in set(old) - set(new):
            patch[name] = None  # merge patch: null removes
        for role in set(old.get("roles") or {}) - set(new.get("roles") or {}):
            patch.setdefault("roles", {})[role] = None
        old_scaling = (old.get("autoscaling") or {}).get("roles") or {}
        new_scaling = (new.get("autoscaling") or {}).get("roles") or {}
        if new.get("autoscaling") is not None:
            for role in set(old_scaling) - set(new_scaling):
                patch["autoscaling"] = {**patch["autoscaling"], "roles": {**new_scaling}}
                patch["autoscaling"]["roles"][role] = None
        await self.client.patch_status(crd.KIND, key[0], key[1], patch)
        before = {c["type"]: c for c in old.get("conditions") or []}
        tracked.written_status = new
        for cond in new.get("conditions") or []:
            prev = before.get(cond["type"], {})
            flipped = prev.get("status") != cond["status"] or prev.get("reason") != cond["reason"]
            if cond["type"] == "Ready" and cond["status"] == "True" and flipped:
                await self.event(tracked.body, "Normal", "Ready", cond["message"])
            # InvalidSpec has its own event.
            degraded = cond["type"] == "Degraded" and cond["reason"] != "InvalidSpec"
            if degraded and cond["status"] == "True" and flipped:
                await self.event(tracked.body, "Warning", cond["reason"], cond["message"])

    def _status_changed(self, key: Key) -> None:
        self.enqueue(key, Work(status=True))

    # ------------------------------------------------------------------ events out

    async def event(self, body: Obj, kind: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        stamp = status_mod.now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": crd.API_VERSION,
                "kind": crd.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "ketch-operator"},
            "reportingComponent": "ketch-operator",
            "reportingInstance": self.reporter,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.client.post("Event", meta["namespace"], event)
        except (TimeoutError, ApiError, OSError) as exc:  # events are best effort
            logger.debug("could not post event %s: %s", reason, exc)


def _rv(obj: Obj | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


def _comparable(status: Obj) -> Obj:
    return {k: v for k, v in status.items() if v is not None}


def _error_reason(exc: Exception) -> str:
    if isinstance(exc, ApiError):
        return {409: "Conflict", 422: "Invalid", 403: "Forbidden", 404: "NotFound"}.get(
            exc.status, "ApiError"
        )
    if isinstance(exc, OSError | asyncio.TimeoutError):
        return "Unreachable"
    return "Internal"
