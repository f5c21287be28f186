"""Applying a generation: build every child, server-side apply it, prune what is no longer wanted.

One field manager (``kube.FIELD_MANAGER``), forced: the operator owns exactly the fields its
builders set, and an identical apply changes nothing on the server. What each apply answered is
kept (``Tracked.expected``) to judge drift against. One Event per generation lists what changed.

Forced only on its own children: first every child's name is checked (``verify``, see
``ownership``); an object of that name that this InferenceService does not control is a
conflict, and then nothing of the generation is applied and nothing is pruned
(``ChildConflict``: ``Degraded``, retried with backoff). A child that does not exist yet is
created by an apply that is not forced (``ownership.create``).

Children go in three stages (``stages``): config, NetworkPolicy, Services and budgets; then the
Deployments; then their autoscalers. A stage's children are applied concurrently, so a new
InferenceService costs three round trips of latency, not one per child, and no pod ever starts
before its policy and config exist.
"""

from __future__ import annotations

import asyncio
import logging

from ketch.operator import builders, handoff, ownership, prune
from ketch.operator.cache import Cache, ChildKey, Key, Obj, Tracked
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
        known = await self.verify(key, tracked, children)
        changed = []
        expected = {}
        answers = {}
        for stage in stages(children):
            results = await asyncio.gather(
                *(self._apply_one(key, tracked, child, known) for child in stage),
                return_exceptions=True,
            )
            raced = {}
            for outcome in results:
                if isinstance(outcome, ownership.ChildConflict):
                    raced.update(outcome.conflicts)
                elif isinstance(outcome, BaseException):
                    raise outcome
            if raced:  # created by someone else since ``verify``: no later stage is applied
                tracked.conflicts = raced
                raise ownership.ChildConflict(raced)
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
        tracked.unserved &= {kind for kind, _ in desired}  # only what is still wanted counts
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

    async def verify(
        self, key: Key, tracked: Tracked, children: list[Obj]
    ) -> dict[ChildKey, Obj | None]:
        """Each child as it exists now (None: absent), read concurrently where the watch cache
        does not already show it as this InferenceService's. Raises ``ChildConflict``, after
        noting it in ``tracked.conflicts``, when any name is taken by an object the
        InferenceService does not control: then nothing is applied (a Deployment needs its
        ConfigMap, pods must not start without their NetworkPolicy, and a half-applied
        generation is harder to reason about than the previous one left running)."""
        svc = tracked.svc
        assert svc is not None

        async def one(child: Obj) -> tuple[ChildKey, Obj | None]:
            child_key = (child["kind"], child["metadata"]["name"])
            cached = self.cache.observed(key, child_key)
            if ownership.controlled_by(cached, svc.uid):
                return child_key, cached
            return child_key, await self.client.get(child_key[0], svc.namespace, child_key[1])

        found = dict(await asyncio.gather(*(one(child) for child in children)))
        tracked.conflicts = {
            (kind, name): ownership.describe(kind, svc.namespace, name, obj)
            for (kind, name), obj in found.items()
            if obj is not None and not ownership.controlled_by(obj, svc.uid)
        }
        if tracked.conflicts:
            raise ownership.ChildConflict(tracked.conflicts)
        return found

    async def _apply_one(
        self, key: Key, tracked: Tracked, child: Obj, known: dict[ChildKey, Obj | None]
    ) -> tuple[Obj | None, Obj | None]:
        """(the child as cached before, the server's answer) for one child."""
        child_key = (child["kind"], child["metadata"]["name"])
        before = self.cache.live(key).get(child_key)
        live = known.get(child_key)
        child = await self._hand_over_replicas(tracked, child, live)
        return before, await self._apply(key, tracked, child, live)

    async def _hand_over_replicas(self, tracked: Tracked, child: Obj, live: Obj | None) -> Obj:
        """Before a Deployment is applied without ``replicas`` (its role is autoscaled), the
        count it has is handed over, so that it does not fall to 1 (see ``handoff``). A new
        one is created with its autoscaler's ``minReplicas``, handed over the same way on the
        next apply (or taken by the autoscaler's first scale). ``live``: the Deployment as
        ``verify`` found it (this InferenceService's, or None). Returns the child to apply."""
        if child["kind"] != "Deployment" or "replicas" in child["spec"]:
            return child
        meta = child["metadata"]
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

    async def _apply(self, key: Key, tracked: Tracked, child: Obj, live: Obj | None) -> Obj | None:
        """The server's answer, or None when the child's kind is not served (KEDA missing).
        ``live`` is this InferenceService's (a forced apply) or None (created, not forced)."""
        assert tracked.svc is not None
        kind = child["kind"]
        try:
            if live is None:
                result = await ownership.create(self.client, tracked.svc.uid, child)
            else:
                result = await self.client.apply(child)
            tracked.unserved.discard(kind)
            return result
        except ApiError as exc:
            if not (exc.status == 404 and kind in prune.UNWATCHED_KINDS):
                raise
            tracked.unserved.add(kind)
            # The kind's CRD is not installed: everything else is applied; the next full
            # reconcile (resync, new generation) tries again.
            name = child["metadata"]["name"]
            logger.warning("%s/%s: cannot apply %s %s: %s", *key, child["kind"], name, exc)
            reason = "AutoscalerUnavailable" if kind == "ScaledObject" else "GatewayAPIUnavailable"
            await self.events.post(
                tracked.body,
                "Warning",
                reason,
                f"{kind} {name} could not be created: "
                f"{child['apiVersion']} is not served ({_PROVIDER[kind]})",
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
# The InferencePool names the router Service (stage 0); the HTTPRoute names the pool.
_STAGE = {
    "Deployment": 1,
    "HorizontalPodAutoscaler": 2,
    "ScaledObject": 2,
    "InferencePool": 2,
    "HTTPRoute": 3,
}
# Why a kind may not be served, for the Warning Event.
_PROVIDER = {
    "ScaledObject": "is KEDA installed?",
    "InferencePool": "are the Gateway API Inference Extension CRDs installed?",
    "HTTPRoute": "are the Gateway API CRDs installed?",
}


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
