"""A full reconcile: build every child, apply each (``reconcile_child``), prune what is no longer
wanted. Each child is applied, not only those that look changed: an identical server-side apply
changes nothing, and a resync so puts back what the watch did not show. One Event per
generation lists what changed.

Forced only on its own children: first every child's name is checked (``verify``, see
``ownership``); an object of that name that this InferenceService does not control is a
conflict, and then nothing of the generation is applied and nothing is pruned
(``ChildConflict``: ``Degraded``, retried with backoff).

Children go in stages (``children.stages``): config, NetworkPolicy, Services and budgets; then
the Deployments; then what targets them. A stage's children are applied concurrently, so a new
InferenceService costs a round trip of latency per stage, not one per child, and no pod ever
starts before its policy and config exist.
"""

from __future__ import annotations

import asyncio
import logging

from ketch.operator import children, ownership
from ketch.operator.cache import AppliedChild, Cache, ChildKey, Key, Obj, ServiceState
from ketch.operator.events import EventRecorder
from ketch.operator.kube import KubeClient
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.reconcile import prune
from ketch.operator.reconcile.child import ChildReconciler, Outcome, child_key

logger = logging.getLogger("ketch.operator")


class ChildApplier:
    """Applies the children of a parsed InferenceService and prunes the ones it dropped."""

    def __init__(
        self, client: KubeClient, cache: Cache, events: EventRecorder, metrics: OperatorMetrics
    ):
        self.client = client
        self.cache = cache
        self.events = events
        self.children = ChildReconciler(client, cache, metrics)

    async def apply_all(self, key: Key, state: ServiceState, generation: int) -> None:
        svc = state.svc
        assert svc is not None
        first = state.applied_generation is None
        built = children.build(svc)
        known = await self.verify(key, state, built)
        applied: dict[ChildKey, AppliedChild] = {}
        changed = []
        for stage in children.stages(built):
            outcomes = await self._apply_stage(key, state, stage, known, applied)
            for outcome in outcomes:
                if outcome.unserved is not None:
                    await self._unserved(key, state, outcome)
                elif outcome.before is None or _rv(outcome.before) != _rv(outcome.answer):
                    changed.append(f"{outcome.key[0]} {outcome.key[1]}")
        desired = {child_key(c): c for c in built}
        pruned = await prune.prune_watched(self.client, svc, self.cache.live(key), desired)
        pruned += await prune.prune_unwatched(self.client, state, svc, desired)
        state.unserved &= {kind for kind, _ in desired}  # only what is still wanted counts
        state.applied = applied
        state.applied_generation = generation
        state.invalid_generation = None
        if changed or pruned:
            all_new = first and not pruned and len(changed) == len(built)
            verb = "created" if all_new else "applied"
            await self._announce(state, generation, verb, changed, pruned)
        logger.info(
            "%s/%s: generation %d applied (%d children, %d changed, %d deleted)",
            *key,
            generation,
            len(built),
            len(changed),
            len(pruned),
        )

    async def _apply_stage(
        self,
        key: Key,
        state: ServiceState,
        stage: list[Obj],
        known: dict[ChildKey, Obj | None],
        applied: dict[ChildKey, AppliedChild],
    ) -> list[Outcome]:
        """The stage's children, applied concurrently. A conflict (a name taken by someone
        else since ``verify``) raises ``ChildConflict``: no later stage is applied."""
        results = await asyncio.gather(
            *(
                self.children.reconcile_child(key, state, c, known.get(child_key(c)), applied)
                for c in stage
            ),
            return_exceptions=True,
        )
        raced = {}
        outcomes = []
        for result in results:
            if isinstance(result, ownership.ChildConflict):
                raced.update(result.conflicts)
            elif isinstance(result, BaseException):
                raise result
            else:
                outcomes.append(result)
        if raced:
            state.conflicts = raced
            raise ownership.ChildConflict(raced)
        return outcomes

    async def verify(
        self, key: Key, state: ServiceState, built: list[Obj]
    ) -> dict[ChildKey, Obj | None]:
        """Each child as it exists now (None: absent), read concurrently where the watch cache
        does not already show it as this InferenceService's. Raises ``ChildConflict``, after
        noting it in ``state.conflicts``, when any name is taken by an object the
        InferenceService does not control: then nothing is applied (a Deployment needs its
        ConfigMap, pods must not start without their NetworkPolicy, and a half-applied
        generation is harder to reason about than the previous one left running)."""
        svc = state.svc
        assert svc is not None

        async def one(child: Obj) -> tuple[ChildKey, Obj | None]:
            name = child_key(child)
            return name, await self.children.find(key, svc.uid, name)

        found = dict(await asyncio.gather(*(one(child) for child in built)))
        state.conflicts = {
            (kind, name): ownership.describe(kind, svc.namespace, name, obj)
            for (kind, name), obj in found.items()
            if obj is not None and not ownership.controlled_by(obj, svc.uid)
        }
        if state.conflicts:
            raise ownership.ChildConflict(state.conflicts)
        return found

    async def _unserved(self, key: Key, state: ServiceState, outcome: Outcome) -> None:
        """The kind's CRD is not installed: everything else is applied; the next full
        reconcile (resync, new generation) tries again."""
        kind, name = outcome.key
        optional = children.BY_KIND[kind].optional
        assert optional is not None
        logger.warning("%s/%s: cannot apply %s %s: %s", *key, kind, name, outcome.unserved)
        api_version = children.BY_KIND[kind].api_version
        await self.events.post(
            state.body,
            "Warning",
            optional.reason,
            f"{kind} {name} could not be created: "
            f"{api_version} is not served ({optional.provider})",
        )

    async def _announce(
        self, state: ServiceState, generation: int, verb: str, changed: list[str], pruned: list[str]
    ) -> None:
        message = f"generation {generation}: {verb} " + ", ".join(changed) if changed else ""
        if pruned:
            message += ("; " if message else "") + "deleted " + ", ".join(pruned)
        await self.events.post(state.body, "Normal", "Reconciled", message)


def _rv(obj: Obj | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")
