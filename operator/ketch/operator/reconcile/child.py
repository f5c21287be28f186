"""``reconcile_child``: one child, the same way in a full reconcile and in drift repair.

One field manager (``managers.FIELD_MANAGER``), forced: the operator owns exactly the fields its
builds set, and an identical apply changes nothing on the server. Forced only on its own
children (``ownership``): the caller first finds the object as it is now (``find``: absent, or
this InferenceService's); one that does not exist is created by an apply that is not forced
(``ownership.create``). Before the apply, the kind's ``prepare`` hook may change the child or ask
for an apply of its own first (a Deployment's replica hand-over, ``children.handoff``). After
it, the child is recorded as applied (``AppliedChild``: what was built, as the server stored it,
and the answer where the kind keeps it), counted (``ketch_operator_applies_total``), and its kind
noted as served. A kind whose CRD may be missing (``ChildKind.optional``) answered 404 is noted
as not served instead; the caller says so.
"""

from __future__ import annotations

import dataclasses
import logging

from ketch.operator import children, ownership
from ketch.operator.cache import AppliedChild, Cache, ChildKey, Key, Obj, ServiceState
from ketch.operator.children.kind import Prepared
from ketch.operator.kube import ApiError, KubeClient
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.reconcile.compare import project

logger = logging.getLogger("ketch.operator")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What applying one child did."""

    key: ChildKey
    before: Obj | None  # the child as the watch showed it before
    answer: Obj | None  # the server's answer; None: its kind is not served (``unserved``)
    unserved: ApiError | None = None


def child_key(child: Obj) -> ChildKey:
    return child["kind"], child["metadata"]["name"]


class ChildReconciler:
    """Finds, applies and records single children."""

    def __init__(self, client: KubeClient, cache: Cache, metrics: OperatorMetrics):
        self.client = client
        self.cache = cache
        self.metrics = metrics

    async def find(self, key: Key, uid: str, child: ChildKey) -> Obj | None:
        """The child as it is now: from the watch cache where that shows it as this
        InferenceService's (``uid``), else read (None: absent)."""
        cached = self.cache.observed(key, child)
        if ownership.controlled_by(cached, uid):
            return cached
        return await self.client.get(child[0], key[0], child[1])

    async def reconcile_child(
        self,
        key: Key,
        state: ServiceState,
        child: Obj,
        live: Obj | None,
        record: dict[ChildKey, AppliedChild],
    ) -> Outcome:
        """Applies ``child`` onto ``live`` (this InferenceService's, or None: created) and
        records it in ``record``. ``ChildConflict`` when a create finds the name taken."""
        svc = state.svc
        assert svc is not None
        kind = children.BY_KIND[child["kind"]]
        name = child_key(child)
        before = self.cache.live(key).get(name)
        prepared = kind.prepare(svc, child, live) if kind.prepare else Prepared(child)
        if prepared.first is not None and await self.apply_first(prepared):
            logger.info("%s/%s: %s", key[0], child["metadata"]["name"], prepared.note)
        try:
            if live is None:
                answer = await ownership.create(self.client, svc.uid, prepared.child)
            else:
                answer = await self.client.apply(prepared.child)
        except ApiError as exc:
            if not (exc.status == 404 and kind.optional):
                raise
            state.unserved.add(kind.kind)
            record.setdefault(name, AppliedChild(child))
            return Outcome(name, before, None, exc)
        state.unserved.discard(kind.kind)
        kept = answer if kind.keeps_answer else None
        record[name] = AppliedChild(child, project(child, answer), kept)
        self.metrics.applies.labels(kind.kind).inc()
        return Outcome(name, before, answer)

    async def apply_first(self, prepared: Prepared) -> bool:
        """Applies ``prepared.first`` under its own manager, not forced. False when another
        manager owns a field it sets with another value (409: nothing to do)."""
        assert prepared.first is not None
        try:
            await self.client.apply(prepared.first, force=False, manager=prepared.manager)
        except ApiError as exc:
            if exc.status != 409:
                raise
            return False
        return True
