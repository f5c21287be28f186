"""What the controller knows: the InferenceServices it tracks and their children, from watches.

The watches (``handlers``) fill ``Cache``; the reconcile steps read it instead of asking the API
server. ``ServiceState`` is one InferenceService's part: its latest body, each child as it was
last applied (``AppliedChild``), and the status last written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ketch.operator.spec.model import ServiceSpec

Key = tuple[str, str]  # (namespace, name) of an InferenceService
ChildKey = tuple[str, str]  # (kind, name) of one of its children
Obj = dict[str, Any]


@dataclasses.dataclass
class AppliedChild:
    """One child of the last applied generation."""

    desired: Obj  # as built
    # ``desired`` with each value as the server stored it (``compare.project``): what drift is
    # judged against. None while it is not applied (its kind is not served).
    stored: Obj | None = None
    # The API's whole answer, for kinds that keep it (``ChildKind.keeps_answer``: Deployments)
    # until the watch shows the object; None once the watch has shown it deleted.
    answer: Obj | None = None

    @property
    def wanted(self) -> Obj:
        """What the live object must hold."""
        return self.stored or self.desired


@dataclasses.dataclass
class ServiceState:
    """What the controller knows of one InferenceService."""

    body: Obj
    applied: dict[ChildKey, AppliedChild] = dataclasses.field(default_factory=dict)
    applied_generation: int | None = None
    invalid_generation: int | None = None
    written_status: Obj | None = None
    svc: ServiceSpec | None = None
    # When a status change that is progress only was first held back (``status_patch``).
    held_since: float | None = None
    # Children whose names are taken by objects this InferenceService does not control, with
    # what status says of each (``ownership``); empty once every child is applied.
    conflicts: dict[ChildKey, str] = dataclasses.field(default_factory=dict)
    # Child kinds whose last apply the API server answered 404 for: their CRDs are missing
    # (KEDA's ScaledObject, GAIE's InferencePool, Gateway API's HTTPRoute).
    unserved: set[str] = dataclasses.field(default_factory=set)

    @property
    def last_status(self) -> Obj | None:
        """The status as last written, else as the object came (a restarted operator)."""
        return self.written_status or self.body.get("status")


@dataclasses.dataclass
class Cache:
    """The latest copy of every watched object, by owning InferenceService."""

    tracked: dict[Key, ServiceState] = dataclasses.field(default_factory=dict)
    children: dict[Key, dict[ChildKey, Obj]] = dataclasses.field(default_factory=dict)
    pods: dict[Key, dict[str, Obj]] = dataclasses.field(default_factory=dict)

    def live(self, key: Key) -> dict[ChildKey, Obj]:
        return self.children.get(key, {})

    def observed(self, key: Key, child: ChildKey) -> Obj | None:
        """A child as the watch last showed it, else as the API last answered an apply of it."""
        live = self.live(key).get(child)
        if live is None and key in self.tracked:
            applied = self.tracked[key].applied.get(child)
            return applied.answer if applied else None
        return live

    def live_pods(self, key: Key) -> list[Obj]:
        """The InferenceService's pods that are not being deleted."""
        return [
            p
            for p in self.pods.get(key, {}).values()
            if not (p.get("metadata") or {}).get("deletionTimestamp")
        ]
