"""In-memory object store with the semantics of kube-apiserver that operators depend on.

Everything here is synchronous and runs on the server's event loop, so every operation is atomic.
Stored objects are never mutated in place (every write stores a fresh dict), so they can be
shared with watch queues and history without copying.

This module holds the state (types served, objects, indexes, history) and the commit every
change goes through; the verbs live by responsibility next to it and are bound here as methods:
admission.py (checks and defaulting), writes.py (create, update), patches.py (patch, apply),
scale.py (/scale), deletion.py (finalizers, namespaces, garbage collection), watch.py.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubeemu import admission, deletion, kinds, patches, scale, writes
from kubeemu import watch as watching
from kubeemu.errors import (
    ApiError,
    already_exists,
    bad_request,
    conflict,
    invalid,
    namespace_not_found,
    not_found,
)
from kubeemu.fieldsets import canon
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import FieldRequirement, Requirement, match_fields, match_labels
from kubeemu.patches import (
    APPLY_PATCH,
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_PATCH,
    decode_yaml_or_json,
)
from kubeemu.timefmt import now_rfc3339
from kubeemu.watch import Event, Watcher

HISTORY_PER_TYPE = 10000
CONTROLLER_MANAGER = "kube-controller-manager"

__all__ = [
    "APPLY_PATCH",
    "CONTROLLER_MANAGER",
    "HISTORY_PER_TYPE",
    "JSON_PATCH",
    "MERGE_PATCH",
    "STRATEGIC_PATCH",
    "ApiError",
    "Event",
    "Stats",
    "Store",
    "Watcher",
    "already_exists",
    "bad_request",
    "conflict",
    "decode_yaml_or_json",
    "invalid",
    "load_validator_factory",
    "namespace_not_found",
    "not_found",
    "now_rfc3339",
]


def load_validator_factory() -> Callable[[dict[str, Any], str], Any] | None:
    """CRDValidator from kubeemu.validation when that module exists; else accept everything."""
    if importlib.util.find_spec("kubeemu.validation") is None:
        return None
    from kubeemu.validation import CRDValidator  # written alongside; errors in it surface

    return CRDValidator


@dataclass
class Stats:
    requests: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)
    noop_writes: Counter[str] = field(default_factory=Counter)
    by_agent: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    by_resource: Counter[str] = field(default_factory=Counter)  # "agent verb plural[/sub]"
    api_commits: int = 0  # commits (events) caused by API requests, cascades included

    def to_json(self, total_commits: int) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "writes": dict(self.writes),
            "noop_writes": dict(self.noop_writes),
            "requests_by_agent": {k: dict(v) for k, v in self.by_agent.items()},
            "requests_by_resource": dict(self.by_resource),
            "api_commits": self.api_commits,
            "controller_commits": total_commits - self.api_commits,
        }


class Store:
    """The API server's storage: every resource type served, every object, and its history."""

    def __init__(
        self,
        validator_factory: Callable[..., Any] | None = None,
        history: int = HISTORY_PER_TYPE,
    ) -> None:
        self.rv = 0
        self.history_size = history
        self.validator_factory = validator_factory
        self.types: dict[tuple[str, str], dict[str, ResourceType]] = {}
        self.objects: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.uids: dict[str, tuple[tuple[str, str], str, str]] = {}
        self.dependents: dict[str, set[tuple[tuple[str, str], str, str]]] = defaultdict(set)
        self.history: dict[tuple[str, str], deque[Event]] = {}
        self.compacted: dict[tuple[str, str], int] = {}
        self.watchers: dict[tuple[str, str], set[Watcher]] = defaultdict(set)
        self.listeners: list[Callable[[tuple[str, str], str, dict[str, Any], Any], None]] = []
        self.apply_log: list[dict[str, Any]] = []
        self.stats = Stats()
        self.commits = 0  # every stored change (ADDED/MODIFIED/DELETED event)
        self.ns_counts: Counter[str] = Counter()  # objects per namespace
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ip_next = 1
        for rt in kinds.BUILTIN_TYPES:
            self._register(rt)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(
                self.rt("", "namespaces"),
                None,
                {"metadata": {"name": ns}},
                manager="kube-apiserver",
            )

    # ------------------------------------------------------------------------------------------
    # types

    def _register(self, rt: ResourceType) -> None:
        self.types.setdefault(rt.key, {})[rt.version] = rt
        self.objects.setdefault(rt.key, {})
        self.history.setdefault(rt.key, deque(maxlen=self.history_size))

    def rt(self, group: str, plural: str, version: str | None = None) -> ResourceType:
        versions = self.types[(group, plural)]
        if version is not None:
            return versions[version]
        return next(iter(versions.values()))

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, plural), {}).get(version)

    def served(self) -> list[ResourceType]:
        return [rt for versions in self.types.values() for rt in versions.values()]

    def storage_rt(self, key: tuple[str, str]) -> ResourceType:
        versions = self.types[key]
        for rt in versions.values():
            if rt.version == rt.storage_version:
                return rt
        return next(iter(versions.values()))

    def _sync_crd_types(self, crd: dict[str, Any]) -> None:
        """Serve (or stop serving) what a CRD declares, right when it is written."""
        new_types = kinds.crd_types(crd, self.validator_factory)
        name = crd["metadata"]["name"]
        keys = {rt.key for rt in new_types}
        for key in [
            k for k, v in self.types.items() if any(r.crd_name == name for r in v.values())
        ]:
            if key not in keys:
                self._unregister(key)
        for key in keys:
            self.types[key] = {}
        for rt in new_types:
            self._register(rt)

    def _unregister(self, key: tuple[str, str]) -> None:
        self.types.pop(key, None)
        for w in list(self.watchers.pop(key, ())):
            w.close()
        self.objects.pop(key, None)
        self.history.pop(key, None)
        self.compacted[key] = self.rv

    # ------------------------------------------------------------------------------------------
    # reading

    def peek(self, key: tuple[str, str], ns: str | None, name: str) -> dict[str, Any] | None:
        return self.objects.get(key, {}).get((ns or "", name))

    def get(self, rt: ResourceType, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.peek(rt.key, ns, name)
        if obj is None:
            raise not_found(rt, name)
        return self.view(rt, obj)

    @staticmethod
    def view(rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """The object as the requested API version shows it (shared, must not be mutated)."""
        if obj.get("apiVersion") == rt.api_version:
            return obj
        return {**obj, "apiVersion": rt.api_version}

    def list(
        self,
        rt: ResourceType,
        ns: str | None,
        labels: list[Requirement],
        fields: list[FieldRequirement],
        limit: int = 0,
        cont: str | None = None,
    ) -> tuple[list[dict[str, Any]], str, str | None, int | None]:
        objs = self.objects.get(rt.key, {})
        keys = sorted(k for k in objs if ns is None or k[0] == ns)
        list_rv = str(self.rv)
        if cont:
            try:
                token = json.loads(base64.urlsafe_b64decode(cont.encode()).decode())
                start = tuple(token["start"])
                list_rv = token["rv"]
            except (ValueError, KeyError, TypeError) as exc:
                raise bad_request(f"continue key is not valid: {exc}") from exc
            keys = [k for k in keys if k > start]
        items = []
        items_last: tuple[str, str] = ("", "")
        next_token = None
        remaining = None
        for i, k in enumerate(keys):
            obj = objs[k]
            if not (match_labels(labels, obj) and match_fields(fields, obj)):
                continue
            if limit and len(items) >= limit:
                rest = keys[i:]
                remaining = sum(
                    1
                    for kk in rest
                    if match_labels(labels, objs[kk]) and match_fields(fields, objs[kk])
                )
                token = {"rv": list_rv, "start": list(items_last)}
                next_token = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
                break
            items.append(self.view(rt, obj))
            items_last = k
        return items, list_rv, next_token, remaining

    # ------------------------------------------------------------------------------------------
    # the write path

    def _emit(self, key: tuple[str, str], etype: str, obj: dict[str, Any], prev: Any) -> None:
        self.commits += 1
        ev = Event(self.rv, etype, obj, prev)
        hist = self.history.setdefault(key, deque(maxlen=self.history_size))
        if len(hist) == hist.maxlen:
            self.compacted[key] = hist[0].rv
        hist.append(ev)
        for w in self.watchers.get(key, ()):
            w.offer(ev)
        for cb in self.listeners:
            cb(key, etype, obj, prev)

    def _index(self, key: tuple[str, str], old: dict[str, Any] | None, new: dict[str, Any] | None):
        ref = None
        for o in (old, new):
            if o is not None:
                ref = (key, o["metadata"].get("namespace", ""), o["metadata"]["name"])
        assert ref is not None
        old_owners = {
            r.get("uid") for r in (old or {}).get("metadata", {}).get("ownerReferences") or []
        }
        new_owners = {
            r.get("uid") for r in (new or {}).get("metadata", {}).get("ownerReferences") or []
        }
        for uid in old_owners - new_owners:
            deps = self.dependents.get(uid)
            if deps is not None:
                deps.discard(ref)
                if not deps:
                    del self.dependents[uid]
        for uid in new_owners - old_owners:
            if uid:
                self.dependents[uid].add(ref)
        if old is None and new is not None:
            self.uids[new["metadata"]["uid"]] = ref
            if ref[1]:
                self.ns_counts[ref[1]] += 1
        elif new is None and old is not None:
            self.uids.pop(old["metadata"]["uid"], None)
            if ref[1]:
                self.ns_counts[ref[1]] -= 1

    def _commit(
        self, rt: ResourceType, old: dict[str, Any] | None, new: dict[str, Any]
    ) -> dict[str, Any]:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        new["apiVersion"] = rt.storage_api_version
        meta = new["metadata"]
        self.objects[rt.key][(meta.get("namespace", ""), meta["name"])] = new
        self._index(rt.key, old, new)
        self._emit(rt.key, "MODIFIED" if old is not None else "ADDED", new, old)
        return new

    # ------------------------------------------------------------------------------------------
    # the verbs, by responsibility

    _check_namespace = admission.check_namespace
    _check_type = admission.check_type
    _admit = admission.admit
    _alloc_ip = admission.alloc_ip
    _build_validators = admission.build_validators

    create = writes.create
    update = writes.update
    _compose = writes.compose
    _write = writes.write

    patch = patches.patch
    apply = patches.apply

    get_scale = scale.get_scale
    _scale_of = scale.scale_of
    _write_scale = scale.write_scale

    delete = deletion.delete
    delete_collection = deletion.delete_collection
    _delete_container = deletion.delete_container
    _crd_keys = deletion.crd_keys
    _contents = deletion.contents
    _is_empty = deletion.is_empty
    _finalize_container = deletion.finalize_container
    _remove = deletion.remove
    _has_live_owner = deletion.has_live_owner
    _collect_if_orphaned = deletion.collect_if_orphaned
    _later = deletion.later

    watch = watching.watch
    unwatch = watching.unwatch
    close_all_watchers = watching.close_all_watchers

    # ------------------------------------------------------------------------------------------
    # helpers for the in-process controllers

    def internal_status(
        self, key: tuple[str, str], ns: str | None, name: str, status: dict[str, Any]
    ) -> None:
        """Write `.status` as kube-controller-manager would (no-op when unchanged)."""
        old = self.peek(key, ns, name)
        if old is None or canon(old.get("status")) == canon(status):
            return
        rt = self.storage_rt(key)
        new = self._compose(rt, old, {"status": status}, "status")
        self._write(
            rt,
            old,
            new,
            verb="controller",
            manager=CONTROLLER_MANAGER,
            subresource="status",
            dry_run=False,
            field_validation="Ignore",
        )
