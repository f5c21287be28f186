"""Applying a generation: build every child, server-side apply it, prune what is no longer wanted.

One field manager (``kube.FIELD_MANAGER``), forced: the operator owns exactly the fields its
builders set, and an identical apply changes nothing on the server. What each apply answered is
kept (``Tracked.expected``) to judge drift against. One Event per generation lists what changed.

Children go in three stages (``stages``): config, NetworkPolicy, Services and budgets; then the
Deployments; then their autoscalers. A stage's children are applied concurrently, so a new
InferenceService costs three round trips of latency, not one per child, and no pod ever starts
before its policy and config exist.
"""

from __future__ import annotations

import asyncio
import logging

from ketch.operator import builders, handoff, prune
from ketch.operator.cache import Cache, Key, Obj, Tracked
from ketch.operator.drift import project
from ketch.operator.events import EventRecorder
from ketch.operator.kube import ApiError, KubeClient
from ketch.operator.metrics import OperatorMetrics

logger = logging.getLogger("ketch.operator")


class ChildApplier:
    """Applies the children of a parsed InferenceService and prunes the ones it dropped."""

    def __init__(
        self, client: KubeClient, cache: Cache, events: EventRecorder, metrics: OperatorMetrics
    ):
        self.client = client
        self.cache = cache
        self.events = events
        self.metrics = metrics

    async def apply_all(self, key: Key, tracked: Tracked, generation: int) -> None:
        svc = tracked.svc
        assert svc is not None
        first = tracked.applied_generation is None
        children = builders.build(svc)
        desired = {(c["kind"], c["metadata"]["name"]): c for c in children}
        changed = []
        expected = {}
        answers = {}
        for stage in stages(children):
            results = await asyncio.gather(
                *(self._apply_one(key, tracked, child) for child in stage), return_exceptions=True
            )
            for outcome in results:
                if isinstance(outcome, BaseException):
                    raise outcome
            for child, (before, result) in zip(stage, results, strict=True):
                if result is None:
                    continue
                child_key = (child["kind"], child["metadata"]["name"])
                expected[child_key] = project(child, result)
                if child["kind"] == "Deployment":
                    answers[child_key] = result
                self.metrics.applies.labels(child["kind"]).inc()
                if before is None or _rv(before) != _rv(result):
                    changed.append(f"{child['kind']} {child['metadata']['name']}")
        pruned = await prune.prune_watched(self.client, svc, self.cache.live(key), desired)
        pruned += await prune.prune_unwatched(self.client, tracked, svc, desired)
        tracked.desired = desired
        tracked.expected = expected
        tracked.answers = answers
        tracked.applied_generation = generation
        tracked.invalid_generation = None
        if changed or pruned:
            all_new = first and not pruned and len(changed) == len(children)
            await self._announce(
                tracked, generation, "created" if all_new else "applied", changed, pruned
            )
        logger.info(
            "%s/%s: generation %d applied (%d children, %d changed, %d deleted)",
            *key,
            generation,
            len(children),
            len(changed),
            len(pruned),
        )

    async def _apply_one(
        self, key: Key, tracked: Tracked, child: Obj
    ) -> tuple[Obj | None, Obj | None]:
        """(the child as cached before, the server's answer) for one child."""
        before = self.cache.live(key).get((child["kind"], child["metadata"]["name"]))
        child = await self._hand_over_replicas(tracked, child, before)
        return before, await self._apply(key, tracked, child)

    async def _hand_over_replicas(self, tracked: Tracked, child: Obj, cached: Obj | None) -> Obj:
        """Before a Deployment is applied without ``replicas`` (its role is autoscaled), the
        count it has is handed over, so that it does not fall to 1 (see ``handoff``). A new
        one is created with its autoscaler's ``minReplicas``, handed over the same way on the
        next apply (or taken by the autoscaler's first scale). Returns the child to apply."""
        if child["kind"] != "Deployment" or "replicas" in child["spec"]:
            return child
        meta = child["metadata"]
        live = cached or await self.client.get("Deployment", meta["namespace"], meta["name"])
        if live is None:
            initial = _initial_replicas(tracked, meta["name"])
            if initial is None:
                return child
            return {**child, "spec": {**child["spec"], "replicas": initial}}
        if handoff.needs_handoff(child, live):
            assert live is not None
            if await handoff.hand_over(self.client, child, live):
                logger.info(
                    "%s/%s: %d replicas handed over to the autoscaler",
                    meta["namespace"],
                    meta["name"],
                    live["spec"].get("replicas", 1),
                )
        return child

    async def _apply(self, key: Key, tracked: Tracked, child: Obj) -> Obj | None:
        """The server's answer, or None when the child's kind is not served (KEDA missing)."""
        try:
            return await self.client.apply(child)
        except ApiError as exc:
            if not (exc.status == 404 and child["kind"] in prune.UNWATCHED_KINDS):
                raise
            # The kind's CRD is not installed: everything else is applied; the next full
            # reconcile (resync, new generation) tries again.
            name = child["metadata"]["name"]
            logger.warning("%s/%s: cannot apply %s %s: %s", *key, child["kind"], name, exc)
            await self.events.post(
                tracked.body,
                "Warning",
                "AutoscalerUnavailable",
                f"{child['kind']} {name} could not be created: "
                f"{child['apiVersion']} is not served (is KEDA installed?)",
            )
            return None

    async def _announce(
        self, tracked: Tracked, generation: int, verb: str, changed: list[str], pruned: list[str]
    ) -> None:
        message = f"generation {generation}: {verb} " + ", ".join(changed) if changed else ""
        if pruned:
            message += ("; " if message else "") + "deleted " + ", ".join(pruned)
        await self.events.post(tracked.body, "Normal", "Reconciled", message)


# What must be in place before a kind is applied: config, policy, Services and budgets before
# the pods that use them; Deployments before the autoscalers that target them.
_STAGE = {"Deployment": 1, "HorizontalPodAutoscaler": 2, "ScaledObject": 2}


def stages(children: list[Obj]) -> list[list[Obj]]:
    """``children`` (in ``builders.build`` order) cut into groups applied one after another;
    the children of one group are applied concurrently (one round trip, not one per child)."""
    groups: dict[int, list[Obj]] = {}
    for child in children:
        groups.setdefault(_STAGE.get(child["kind"], 0), []).append(child)
    return [groups[rank] for rank in sorted(groups)]


def _rv(obj: Obj | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


def _initial_replicas(tracked: Tracked, name: str) -> int | None:
    """``minReplicas`` of the autoscaled role whose Deployment is ``name``; None otherwise."""
    svc = tracked.svc
    assert svc is not None
    for role in svc.roles:
        autoscaling = svc.role(role).get("autoscaling")
        if autoscaling and name == f"{svc.name}-{role}":
            return int(autoscaling.get("minReplicas", 1))
    return None
