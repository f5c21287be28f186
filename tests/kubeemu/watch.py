"""Watch streams: a `Watcher` per client stream, fed by the store's events, and the
registration that hands a new watcher the events it must see first (or a 410 once compacted)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubeemu.errors import ApiError, bad_request
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import FieldRequirement, Requirement, match_fields, match_labels

if TYPE_CHECKING:
    from kubeemu.store import Store


@dataclass
class Event:
    rv: int
    type: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None


class Watcher:
    """One watch stream: a queue fed by the store, filtered by namespace and selectors."""

    def __init__(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: list[Requirement],
        fields: list[FieldRequirement],
    ):
        self.rt = rt
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()

    def matches(self, obj: dict[str, Any]) -> bool:
        if self.namespace is not None and obj["metadata"].get("namespace") != self.namespace:
            return False
        return match_labels(self.labels, obj) and match_fields(self.fields, obj)

    def translate(self, ev: Event) -> tuple[str, dict[str, Any]] | None:
        now_in = self.matches(ev.obj)
        if ev.type != "MODIFIED":
            return (ev.type, ev.obj) if now_in else None
        was_in = ev.prev is not None and self.matches(ev.prev)
        if now_in:
            return ("MODIFIED" if was_in else "ADDED", ev.obj)
        if was_in:
            assert ev.prev is not None
            gone = dict(ev.prev)
            gone["metadata"] = {**ev.prev["metadata"], "resourceVersion": str(ev.rv)}
            return ("DELETED", gone)
        return None

    def offer(self, ev: Event) -> None:
        out = self.translate(ev)
        if out is not None:
            self.queue.put_nowait(out)

    def close(self) -> None:
        self.queue.put_nowait(None)


def watch(
    store: Store,
    rt: ResourceType,
    ns: str | None,
    labels: list[Requirement],
    fields: list[FieldRequirement],
    since: str | None,
) -> tuple[Watcher, list[tuple[str, dict[str, Any]]]]:
    """Register a watcher; returns it with the events to send first.

    Registration and the snapshot happen in one synchronous step, so nothing is lost or
    duplicated between them.
    """
    w = Watcher(rt, ns, labels, fields)
    initial: list[tuple[str, dict[str, Any]]] = []
    if since in (None, "", "0"):
        objs = store.objects.get(rt.key, {})
        for k in sorted(objs):
            if w.matches(objs[k]):
                initial.append(("ADDED", objs[k]))
    else:
        try:
            since_rv = int(since)  # type: ignore[arg-type]
        except ValueError as exc:
            raise bad_request(f"invalid resource version: {since}") from exc
        hist = store.history.get(rt.key, deque())
        oldest = store.compacted.get(rt.key, 0)
        if since_rv < oldest:
            gone = ApiError(
                410,
                "Expired",
                f"too old resource version: {since_rv} ({hist[0].rv if hist else store.rv})",
            ).status()
            return w, [("ERROR", gone)]
        for ev in hist:
            if ev.rv > since_rv:
                out = w.translate(ev)
                if out is not None:
                    initial.append(out)
    store.watchers[rt.key].add(w)
    return w, initial


def unwatch(store: Store, w: Watcher) -> None:
    store.watchers.get(w.rt.key, set()).discard(w)


def close_all_watchers(store: Store) -> None:
    for ws in store.watchers.values():
        for w in list(ws):
            w.close()


def expire(store: Store, keys: list[tuple[str, str]]) -> int:
    """Compacts the history of the given types at the current resourceVersion, as etcd does.

    Open watches of those types get what kube-apiserver sends when its etcd watch is compacted
    (an ERROR event with a 410 Expired Status) and are closed; a new watch from an older
    resourceVersion gets the 410 of ``watch``. A client resumes with a fresh list. Returns the
    number of watches ended."""
    gone = ApiError(410, "Expired", "The resourceVersion for the provided watch is too old.")
    ended = 0
    for key in keys:
        store.history.get(key, deque()).clear()
        store.compacted[key] = store.rv
        for w in list(store.watchers.get(key, ())):
            w.queue.put_nowait(("ERROR", gone.status()))
            w.close()
            ended += 1
    return ended
