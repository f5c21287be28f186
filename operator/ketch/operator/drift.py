"""Drift: a child that was deleted, or no longer holds what the operator applied, is put back.

``contains`` decides drift (the live object may carry more than was applied: defaults, other
managers' fields); ``project`` records what was applied as the server stored it, so a value the
server normalised is not taken for a hand edit. ``DriftRepair`` re-applies the drifted children
and says so with an Event — only onto objects this InferenceService controls: one that was
deleted and then made again by someone else under that name is a conflict (``ownership``).
"""

from __future__ import annotations

import logging
from typing import Any

from ketch.operator import ownership
from ketch.operator.cache import Cache, ChildKey, Key, Tracked
from ketch.operator.events import EventRecorder
from ketch.operator.kube import ApiError, KubeClient
from ketch.operator.metrics import OperatorMetrics
from ketch.operator.prune import UNWATCHED_KINDS

logger = logging.getLogger("ketch.operator")


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


def drifted(tracked: Tracked, child: ChildKey, event_type: str, live: Any) -> bool:
    """True when a watch event shows that an applied child no longer holds what was applied."""
    wanted = tracked.expected.get(child) or tracked.desired.get(child)
    return wanted is not None and (event_type == "DELETED" or not contains(wanted, live))


class DriftRepair:
    """Puts drifted children back by applying them again."""

    def __init__(
        self, client: KubeClient, cache: Cache, events: EventRecorder, metrics: OperatorMetrics
    ):
        self.client = client
        self.cache = cache
        self.events = events
        self.metrics = metrics

    async def restore(self, key: Key, tracked: Tracked, drift: set[ChildKey]) -> None:
        """Puts the drifted children back; ``ChildConflict`` (noted in ``tracked.conflicts``)
        for those whose name an object this InferenceService does not control now holds."""
        svc = tracked.svc
        assert svc is not None
        conflicts = {}
        for child_key in sorted(drift):
            child = tracked.desired.get(child_key)
            live = self.cache.live(key).get(child_key)
            wanted = tracked.expected.get(child_key) or child
            if child is None or (live is not None and contains(wanted, live)):
                continue  # already put back, or no longer wanted
            if not ownership.controlled_by(live, svc.uid):
                live = await self.client.get(child_key[0], svc.namespace, child_key[1])
            try:
                if live is None:
                    result = await ownership.create(self.client, svc.uid, child)
                elif ownership.controlled_by(live, svc.uid):
                    result = await self.client.apply(child)
                else:
                    description = ownership.describe(
                        child_key[0], svc.namespace, child_key[1], live
                    )
                    raise ownership.ChildConflict({child_key: description})
            except ownership.ChildConflict as exc:
                conflicts.update(exc.conflicts)
                continue
            except ApiError as exc:
                if exc.status != 404 or child_key[0] not in UNWATCHED_KINDS:
                    raise
                tracked.unserved.add(child_key[0])  # its CRD was deleted: status says so
                continue
            tracked.conflicts.pop(child_key, None)
            tracked.expected[child_key] = project(child, result)
            if child_key[0] == "Deployment":
                tracked.answers[child_key] = result
            self.metrics.applies.labels(child_key[0]).inc()
            self.metrics.restored.labels(child_key[0]).inc()
            what = "deleted" if live is None else "changed"
            logger.info("%s/%s: %s %s was %s by hand; restored", *key, *child_key, what)
            await self.events.post(
                tracked.body,
                "Normal",
                "Restored",
                f"{child_key[0]} {child_key[1]} was {what} outside the operator; put back",
            )
        if conflicts:
            tracked.conflicts.update(conflicts)
            raise ownership.ChildConflict(tracked.conflicts)
