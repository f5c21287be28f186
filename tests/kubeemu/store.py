"""In-memory object store with the semantics of kube-apiserver that operators depend on.

Everything here is synchronous and runs on the server's event loop, so every operation is atomic.
Stored objects are never mutated in place (every write stores a fresh dict), so they can be
shared with watch queues and history without copying.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import random
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonpatch
import yaml

from kubeemu import builtin_schema, kinds
from kubeemu.fieldsets import (
    ApplyConflict,
    apply_config,
    canon,
    dcopy,
    flatten,
    merge_patch,
    parse_managed,
    record_update,
    serialize_managed,
    strategic_merge,
    tracked_view,
)
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import FieldRequirement, Requirement, match_fields, match_labels

HISTORY_PER_TYPE = 10000
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"
CONTROLLER_MANAGER = "kube-controller-manager"

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def random_suffix(n: int = 5) -> str:
    return "".join(random.choice(_NAME_CHARS) for _ in range(n))


def load_validator_factory() -> Callable[[dict[str, Any], str], Any] | None:
    """CRDValidator from kubeemu.validation when that module exists; else accept everything."""
    if importlib.util.find_spec("kubeemu.validation") is None:
        return None
    from kubeemu.validation import CRDValidator  # written alongside; errors in it surface

    return CRDValidator


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def decode_yaml_or_json(raw: bytes) -> Any:
    """An apply body: JSON (what most clients send) or YAML."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return yaml.load(raw.decode("utf-8"), Loader=_YAML_LOADER)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise bad_request(f"error decoding YAML: {exc}") from exc


class ApiError(Exception):
    """An error the API answers with a `Status` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            out["details"] = self.details
        out["code"] = self.code
        return out


def _details(rt: ResourceType, name: str, kind: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name}
    if rt.group:
        d["group"] = rt.group
    d["kind"] = kind or rt.plural
    return d


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))


def namespace_not_found(ns: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
    )


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', _details(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or (
        "the object has been modified; please apply your changes to the latest version "
        "and try again"
    )
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
        _details(rt, name),
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(rt: ResourceType, name: str, causes: list[dict[str, str]]) -> ApiError:
    texts = [f"{c.get('field', '')}: {c.get('message', '')}" for c in causes]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details = _details(rt, name, rt.kind)
    details["causes"] = [
        {
            "reason": c.get("reason", "FieldValueInvalid"),
            "message": c.get("message", ""),
            "field": c.get("field", ""),
        }
        for c in causes
    ]
    return ApiError(422, "Invalid", f'{rt.qualified_kind} "{name}" is invalid: {joined}', details)


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


@dataclass
class Stats:
    requests: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)
    noop_writes: Counter[str] = field(default_factory=Counter)
    by_agent: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    api_commits: int = 0  # commits (events) caused by API requests, cascades included

    def to_json(self, total_commits: int) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "writes": dict(self.writes),
            "noop_writes": dict(self.noop_writes),
            "requests_by_agent": {k: dict(v) for k, v in self.by_agent.items()},
            "api_commits": self.api_commits,
            "controller_commits": total_commits - self.api_commits,
        }


class Store:
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

    def _build_validators(self, crd: dict[str, Any]) -> None:
        """Fail a CRD write (422) whose schema the validation module cannot compile."""
        if self.validator_factory is None:
            return
        crd_rt = self.rt("apiextensions.k8s.io", "customresourcedefinitions")
        for i, ver in enumerate((crd.get("spec") or {}).get("versions") or []):
            try:
                self.validator_factory(crd, ver.get("name"))
            except Exception as exc:
                raise invalid(
                    crd_rt,
                    crd["metadata"].get("name", ""),
                    [
                        {
                            "reason": "FieldValueInvalid",
                            "field": f"spec.versions[{i}].schema.openAPIV3Schema",
                            "message": f"Invalid value: {exc}",
                        }
                    ],
                ) from exc

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

    def _ns_check(self, rt: ResourceType, ns: str | None, name: str) -> None:
        if not rt.namespaced:
            return
        ns_obj = self.peek(("", "namespaces"), None, ns or "")
        if ns_obj is None:
            raise namespace_not_found(ns or "")
        if ns_obj["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f'{rt.qualified} "{name}" is forbidden: unable to create new content in '
                f"namespace {ns} because it is being terminated",
                {
                    **_details(rt, name),
                    "causes": [
                        {
                            "reason": "NamespaceTerminating",
                            "message": f"namespace {ns} is being terminated",
                            "field": "metadata.namespace",
                        }
                    ],
                },
            )

    def _check_type(self, rt: ResourceType, body: dict[str, Any]) -> None:
        av, kind = body.get("apiVersion"), body.get("kind")
        if av and av != rt.api_version:
            raise bad_request(
                f"the API version in the data ({av}) does not match the expected API version "
                f"({rt.api_version})"
            )
        if kind and kind != rt.kind:
            raise bad_request(
                f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})"
            )

    def _admit(
        self,
        rt: ResourceType,
        new: dict[str, Any],
        old: dict[str, Any] | None,
        *,
        subresource: str | None,
        field_validation: str,
    ) -> tuple[dict[str, Any], list[str]]:
        """Defaulting, pruning and validation; returns the admitted object and warnings."""
        warnings: list[str] = []
        name = new["metadata"].get("name", "")
        causes: list[dict[str, str]] = []
        if rt.is_crd:
            if rt.validator is not None:
                meta = new["metadata"]
                result = rt.validator.admit(
                    new, old, field_validation=field_validation, subresource=subresource
                )
                if result.unknown_fields:
                    if field_validation == "Strict":
                        raise bad_request(
                            "strict decoding error: "
                            + ", ".join(f'unknown field "{f}"' for f in result.unknown_fields)
                        )
                    if field_validation == "Warn":
                        warnings += [f'unknown field "{f}"' for f in result.unknown_fields]
                causes += list(result.causes)
                new = dict(result.obj)
                new["metadata"] = meta
        else:
            unknown = builtin_schema.prune_unknown(rt.group, rt.version, rt.kind, new)
            if unknown and field_validation == "Strict":
                raise bad_request(
                    f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                    "strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in unknown)
                )
            if unknown and field_validation == "Warn":
                warnings += [f'unknown field "{f}"' for f in unknown]
            if rt.key == ("", "services") and old is not None:
                kinds.keep_allocated_service_fields(old, new)
            kinds.apply_defaults(rt, new, self._alloc_ip)
            causes += kinds.validate_builtin(rt, new, old)
            if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
                kinds.default_crd(new)
        if subresource != "status":
            causes += kinds.validate_labels(new["metadata"].get("labels"), "metadata.labels")
        if causes:
            raise invalid(rt, name, causes)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._build_validators(new)
            new["status"] = kinds.crd_status(new, now_rfc3339(), (old or {}).get("status"))
        return new, warnings

    def _alloc_ip(self) -> str:
        n = self._ip_next
        self._ip_next += 1
        return f"10.96.{(n // 250) % 250}.{n % 250 + 1}"

    def create(
        self,
        rt: ResourceType,
        ns: str | None,
        body: Any,
        *,
        manager: str,
        dry_run: bool = False,
        field_validation: str = "Warn",
        entries: list[Any] | None = None,
    ) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        self._check_type(rt, body)
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if rt.namespaced:
            body_ns = meta.get("namespace")
            if body_ns and ns and body_ns != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            ns = ns or body_ns
            if not ns:
                raise bad_request("the namespace of the object must be set")
        else:
            ns = None
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            for _ in range(10):
                name = meta["generateName"] + random_suffix()
                if self.peek(rt.key, ns, name) is None:
                    break
        if not name:
            raise invalid(
                rt,
                "",
                [
                    {
                        "reason": "FieldValueRequired",
                        "field": "metadata.name",
                        "message": "Required value: name or generateName is required",
                    }
                ],
            )
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        self._ns_check(rt, ns, name)
        name_errs = kinds.validate_name(rt, name)
        if name_errs:
            raise invalid(rt, name, name_errs)
        if self.peek(rt.key, ns, name) is not None:
            raise already_exists(rt, name)

        new = dcopy(body)
        new["apiVersion"] = rt.api_version
        new["kind"] = rt.kind
        new_meta = new.setdefault("metadata", {})
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            new_meta.pop(k, None)
        new_meta["name"] = name
        if ns:
            new_meta["namespace"] = ns
        else:
            new_meta.pop("namespace", None)
        new_meta["uid"] = str(uuid.uuid4())
        new_meta["creationTimestamp"] = now_rfc3339()
        new_meta["generation"] = 1
        if rt.status:
            new.pop("status", None)
        request_managed = new_meta.pop("managedFields", None)
        new, warnings = self._admit(
            rt, new, None, subresource=None, field_validation=field_validation
        )
        new_meta = new["metadata"]
        if entries is None:
            if _explicit_managed(request_managed):
                entries = (
                    []
                    if request_managed == [{}]
                    else parse_managed({"metadata": {"managedFields": request_managed}})
                )
            else:
                entries = record_update(
                    [],
                    manager=manager,
                    api_version=rt.api_version,
                    subresource="",
                    old_flat={},
                    new_flat=flatten(tracked_view(new, rt.scope), rt.resolver),
                    now=now_rfc3339(),
                )
        managed = serialize_managed(entries)
        if managed:
            new_meta["managedFields"] = managed
        if dry_run:
            return self.view(rt, new), warnings
        stored = self._commit(rt, None, new)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._sync_crd_types(stored)
        if stored["metadata"].get("ownerReferences"):
            self._later(self._collect_if_orphaned, rt.key, ns, name)
        return self.view(rt, stored), warnings

    def _compose(
        self,
        rt: ResourceType,
        old: dict[str, Any],
        body: dict[str, Any],
        subresource: str | None,
    ) -> dict[str, Any]:
        """The object a write would store, before admission: subresource rules applied."""
        if subresource == "status":
            new = dict(old)
            new["metadata"] = dict(old["metadata"])
            if body.get("status") is None:
                new.pop("status", None)
            else:
                new["status"] = dcopy(body["status"])
            return new
        new = dcopy(body)
        new["apiVersion"] = rt.api_version
        new["kind"] = rt.kind
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        old_meta = old["metadata"]
        for k in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if k in old_meta:
                meta[k] = old_meta[k]
            else:
                meta.pop(k, None)
        if rt.status:
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        return new

    def _write(
        self,
        rt: ResourceType,
        old: dict[str, Any],
        new: dict[str, Any],
        *,
        verb: str,
        manager: str,
        subresource: str | None,
        dry_run: bool,
        field_validation: str,
        request_managed: Any = None,
        entries: list[Any] | None = None,
    ) -> tuple[dict[str, Any], list[str]]:
        new, warnings = self._admit(
            rt, new, old, subresource=subresource, field_validation=field_validation
        )
        meta = new["metadata"]
        old_meta = old["metadata"]
        if old_meta.get("deletionTimestamp"):
            added = [
                f
                for f in meta.get("finalizers") or []
                if f not in (old_meta.get("finalizers") or [])
            ]
            if added:
                raise invalid(
                    rt,
                    meta["name"],
                    [
                        {
                            "reason": "FieldValueForbidden",
                            "field": "metadata.finalizers",
                            "message": "Forbidden: no new finalizers can be added if the object "
                            "is being deleted, found new finalizers "
                            f"[]string{{{', '.join(json.dumps(f) for f in added)}}}",
                        }
                    ],
                )
        scope = "status" if subresource == "status" else rt.scope
        if entries is None:
            # like the real field manager: managedFields sent with a main-resource write are the
            # base the update is recorded on (that is how clients rewrite them, e.g. kubectl's
            # client-side -> server-side apply migration; [{}] clears them); else the live ones
            old_managed = old_meta.get("managedFields")
            if (
                not subresource
                and _explicit_managed(request_managed)
                and canon(request_managed) != canon(old_managed)
            ):
                base = (
                    []
                    if request_managed == [{}]
                    else parse_managed({"metadata": {"managedFields": request_managed}})
                )
            else:
                base = parse_managed(old)
            entries = record_update(
                base,
                manager=manager,
                api_version=rt.api_version,
                subresource=subresource or "",
                old_flat=flatten(tracked_view(old, scope), rt.resolver),
                new_flat=flatten(tracked_view(new, scope), rt.resolver),
                now=now_rfc3339(),
            )
        managed = serialize_managed(entries)
        if managed:
            meta["managedFields"] = managed
        else:
            meta.pop("managedFields", None)
        meta["generation"] = old_meta.get("generation", 1)
        if _spec_changed(rt, old, new):
            meta["generation"] += 1
        meta["resourceVersion"] = old_meta.get("resourceVersion")
        new["apiVersion"] = old["apiVersion"]
        if canon(new) == canon(old):
            return self.view(rt, old), warnings
        if old_meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # the last finalizer went: the object is deleted, not updated (one DELETED event,
            # carrying the last stored state, as etcd reports it)
            if dry_run:
                return self.view(rt, new), warnings
            final = self._remove(rt, old, "Background")
            new["metadata"]["resourceVersion"] = final["metadata"]["resourceVersion"]
            return self.view(rt, new), warnings
        if dry_run:
            return self.view(rt, new), warnings
        stored = self._commit(rt, old, new)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._sync_crd_types(stored)
        if canon(meta.get("ownerReferences")) != canon(old_meta.get("ownerReferences")):
            self._later(self._collect_if_orphaned, rt.key, meta.get("namespace"), meta["name"])
        return self.view(rt, stored), warnings

    def update(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        body: Any,
        *,
        manager: str,
        subresource: str | None = None,
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str]]:
        old = self.peek(rt.key, ns, name)
        if old is None:
            raise not_found(rt, name)
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        self._check_type(rt, body)
        meta = body.get("metadata") or {}
        _check_identity(rt, ns, name, meta)
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        if subresource == "scale":
            return self._write_scale(rt, old, body, manager=manager, dry_run=dry_run, verb="update")
        new = self._compose(rt, old, body, subresource)
        return self._write(
            rt,
            old,
            new,
            verb="update",
            manager=manager,
            subresource=subresource,
            dry_run=dry_run,
            field_validation=field_validation,
            request_managed=meta.get("managedFields"),
        )

    def patch(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        raw: bytes,
        content_type: str,
        *,
        manager: str | None,
        subresource: str | None = None,
        force: bool = False,
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str], bool]:
        """Returns (object, warnings, created)."""
        ctype = content_type.split(";")[0].strip().lower()
        if ctype == APPLY_PATCH:
            return self.apply(
                rt,
                ns,
                name,
                raw,
                manager=manager,
                subresource=subresource,
                force=force,
                dry_run=dry_run,
                field_validation=field_validation,
            )
        if ctype not in (MERGE_PATCH, JSON_PATCH, STRATEGIC_PATCH):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types "
                f"include: {JSON_PATCH}, {MERGE_PATCH}, {APPLY_PATCH}"
                + ("" if rt.is_crd else f", {STRATEGIC_PATCH}"),
            )
        if force:
            raise bad_request("force may not be set for non-apply patch requests")
        old = self.peek(rt.key, ns, name)
        if old is None:
            raise not_found(rt, name)
        try:
            patch = json.loads(raw or b"null")
        except ValueError as exc:
            raise bad_request(f"error decoding patch: {exc}") from exc
        current: dict[str, Any] = self.view(rt, old)
        if subresource == "scale":
            current = self._scale_of(rt, old)
        if ctype == MERGE_PATCH:
            if not isinstance(patch, dict):
                raise bad_request("a merge patch must be a JSON object")
            patched = merge_patch(current, patch)
        elif ctype == JSON_PATCH:
            if not isinstance(patch, list):
                raise bad_request("a JSON patch must be a list of operations")
            try:
                patched = jsonpatch.apply_patch(current, patch)
            except jsonpatch.InvalidJsonPatch as exc:
                raise bad_request(str(exc)) from exc
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, "Invalid", str(exc)) from exc
        else:
            if rt.is_crd:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"strategic merge patch is not supported for {rt.api_version}, Kind={rt.kind}",
                )
            if not isinstance(patch, dict):
                raise bad_request("a strategic merge patch must be a JSON object")
            patched = strategic_merge(current, patch, (), rt.resolver)
        if not isinstance(patched, dict):
            raise bad_request("the patched object must be a JSON object")
        pmeta = patched.get("metadata") or {}
        if (
            pmeta.get("resourceVersion")
            and pmeta["resourceVersion"] != old["metadata"]["resourceVersion"]
        ):
            raise conflict(rt, name)
        if subresource == "scale":
            obj, warnings = self._write_scale(
                rt, old, patched, manager=manager or "unknown", dry_run=dry_run, verb="patch"
            )
            return obj, warnings, False
        new = self._compose(rt, old, patched, subresource)
        obj, warnings = self._write(
            rt,
            old,
            new,
            verb="patch",
            manager=manager or "unknown",
            subresource=subresource,
            dry_run=dry_run,
            field_validation=field_validation,
            request_managed=pmeta.get("managedFields"),
        )
        return obj, warnings, False

    def apply(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        raw: bytes,
        *,
        manager: str | None,
        subresource: str | None = None,
        force: bool = False,
        dry_run: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[dict[str, Any], list[str], bool]:
        cfg = decode_yaml_or_json(raw)
        self.apply_log.append(
            {
                "seq": len(self.apply_log) + 1,
                "time": now_rfc3339(),
                "manager": manager,
                "apiVersion": cfg.get("apiVersion") if isinstance(cfg, dict) else None,
                "kind": cfg.get("kind") if isinstance(cfg, dict) else None,
                "namespace": ns,
                "name": name,
                "subresource": subresource,
                "force": force,
                "dryRun": dry_run,
                "body": cfg,
            }
        )
        if not manager:
            raise bad_request(
                "PATCH, application/apply-patch+yaml requests must have a fieldManager"
            )
        if not isinstance(cfg, dict):
            raise bad_request("the apply configuration must be an object")
        if subresource == "scale":
            raise ApiError(
                405, "MethodNotAllowed", "apply is not supported on the scale subresource"
            )
        if not cfg.get("apiVersion") or not cfg.get("kind"):
            raise bad_request("apiVersion and kind must be set in an apply configuration")
        self._check_type(rt, cfg)
        meta = cfg.get("metadata") or {}
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        _check_identity(rt, ns, name, meta)
        old = self.peek(rt.key, ns, name)
        if old is None and subresource:
            raise not_found(rt, name)
        scope = "status" if subresource == "status" else rt.scope
        base: dict[str, Any]
        if old is not None:
            rv = meta.get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise conflict(rt, name)
            base = self.view(rt, old)
        else:
            base_meta: dict[str, Any] = {"name": name}
            if ns:
                base_meta["namespace"] = ns
            base = {"apiVersion": rt.api_version, "kind": rt.kind, "metadata": base_meta}
        try:
            merged, entries = apply_config(
                base,
                cfg,
                manager=manager,
                api_version=rt.api_version,
                subresource=subresource or "",
                scope=scope,
                force=force,
                resolver=rt.resolver,
                now=now_rfc3339(),
            )
        except ApplyConflict as exc:
            details = _details(rt, name)
            details["causes"] = exc.causes()
            raise ApiError(409, "Conflict", exc.message(), details) from exc
        if old is None:
            merged.setdefault("metadata", {})
            obj, warnings = self.create(
                rt,
                ns,
                merged,
                manager=manager,
                dry_run=dry_run,
                field_validation=field_validation,
                entries=entries,
            )
            return obj, warnings, True
        new = self._compose(rt, old, merged, subresource)
        obj, warnings = self._write(
            rt,
            old,
            new,
            verb="apply",
            manager=manager,
            subresource=subresource,
            dry_run=dry_run,
            field_validation=field_validation,
            entries=entries,
        )
        return obj, warnings, False

    # ------------------------------------------------------------------------------------------
    # scale subresource

    def _scale_of(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        if rt.scale is None:
            raise not_found(rt, obj["metadata"]["name"])
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": _get_path(obj, rt.scale.status_replicas) or 0}
        if rt.is_crd:
            if rt.scale.label_selector:
                sel = _get_path(obj, rt.scale.label_selector)
                if sel:
                    status["selector"] = sel
        else:
            from kubeemu.labelsel import selector_to_string

            sel = selector_to_string((obj.get("spec") or {}).get("selector"))
            if sel:
                status["selector"] = sel
        out_meta = {
            k: meta[k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in meta
        }
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": out_meta,
            "spec": {"replicas": _get_path(obj, rt.scale.spec_replicas) or 0},
            "status": status,
        }

    def get_scale(self, rt: ResourceType, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.peek(rt.key, ns, name)
        if obj is None or rt.scale is None:
            raise not_found(rt, name)
        return self._scale_of(rt, obj)

    def _write_scale(
        self,
        rt: ResourceType,
        old: dict[str, Any],
        scale: dict[str, Any],
        *,
        manager: str,
        dry_run: bool,
        verb: str,
    ) -> tuple[dict[str, Any], list[str]]:
        assert rt.scale is not None
        replicas = (scale.get("spec") or {}).get("replicas")
        name = old["metadata"]["name"]
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError(
                422,
                "Invalid",
                f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid value: '
                f"{replicas}: must be greater than or equal to 0",
                {
                    "name": name,
                    "group": "autoscaling",
                    "kind": "Scale",
                    "causes": [
                        {
                            "reason": "FieldValueInvalid",
                            "field": "spec.replicas",
                            "message": f"Invalid value: {replicas}: must be greater than or "
                            "equal to 0",
                        }
                    ],
                },
            )
        new = dcopy(self.view(rt, old))
        _set_path(new, rt.scale.spec_replicas, replicas)
        new = self._compose(rt, old, new, None)
        obj, warnings = self._write(
            rt,
            old,
            new,
            verb=verb,
            manager=manager,
            subresource="scale",
            dry_run=dry_run,
            field_validation="Ignore",
        )
        return self._scale_of(rt, obj), warnings

    # ------------------------------------------------------------------------------------------
    # deletion and garbage collection

    def delete(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        *,
        propagation: str | None = None,
        preconditions: dict[str, Any] | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        old = self.peek(rt.key, ns, name)
        if old is None:
            raise not_found(rt, name)
        meta = old["metadata"]
        pre = preconditions or {}
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {pre['uid']}, "
                f"UID in object meta: {meta['uid']}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise conflict(
                rt,
                name,
                "Precondition failed: ResourceVersion in precondition: "
                f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                f"{meta['resourceVersion']}",
            )
        policy = propagation or "Background"
        if rt.key == ("", "namespaces") or rt.key == (
            "apiextensions.k8s.io",
            "customresourcedefinitions",
        ):
            return self._delete_container(rt, old, dry_run)
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return self.view(rt, old)
            new = dict(old)
            new["metadata"] = {
                **meta,
                "deletionTimestamp": now_rfc3339(),
                "deletionGracePeriodSeconds": 0,
                "generation": meta.get("generation", 1) + 1,
            }
            if dry_run:
                return self.view(rt, new)
            return self.view(rt, self._commit(rt, old, new))
        if dry_run:
            return self.view(rt, old)
        return self.view(rt, self._remove(rt, old, policy))

    def _delete_container(
        self, rt: ResourceType, old: dict[str, Any], dry_run: bool
    ) -> dict[str, Any]:
        """Namespaces and CRDs: terminate (delete contents), then go away once empty."""
        meta = old["metadata"]
        if meta.get("deletionTimestamp"):
            return self.view(rt, old)
        new = dict(old)
        new["metadata"] = {
            **meta,
            "deletionTimestamp": now_rfc3339(),
            "deletionGracePeriodSeconds": 0,
        }
        if rt.key == ("", "namespaces"):
            new["status"] = {**(old.get("status") or {}), "phase": "Terminating"}
        else:
            new["metadata"]["finalizers"] = ["customresourcecleanup.apiextensions.k8s.io"]
            conds = [
                c
                for c in (old.get("status") or {}).get("conditions") or []
                if c.get("type") != "Terminating"
            ]
            conds.append(
                {
                    "type": "Terminating",
                    "status": "True",
                    "lastTransitionTime": now_rfc3339(),
                    "reason": "InstanceDeletionInProgress",
                    "message": "CustomResource deletion is in progress",
                }
            )
            new["status"] = {**(old.get("status") or {}), "conditions": conds}
        if dry_run:
            return self.view(rt, new)
        stored = self._commit(rt, old, new)
        for key, ns, name in self._contents(rt, old):
            obj = self.peek(key, ns, name)
            if obj is not None and not obj["metadata"].get("deletionTimestamp"):
                self.delete(self.storage_rt(key), ns or None, name)
        return self.view(rt, self._finalize_container(rt, stored) or stored)

    def _crd_keys(self, crd_name: str) -> list[tuple[str, str]]:
        return [k for k, v in self.types.items() if any(r.crd_name == crd_name for r in v.values())]

    def _contents(self, rt: ResourceType, container: dict[str, Any]) -> list[tuple[Any, str, str]]:
        name = container["metadata"]["name"]
        out = []
        if rt.key == ("", "namespaces"):
            if not self.ns_counts.get(name):
                return []
            for key, objs in self.objects.items():
                out.extend((key, ns, oname) for (ns, oname) in objs if ns == name)
        else:
            for key in self._crd_keys(name):
                out.extend((key, ns, oname) for (ns, oname) in self.objects.get(key, {}))
        return out

    def _is_empty(self, rt: ResourceType, container: dict[str, Any]) -> bool:
        name = container["metadata"]["name"]
        if rt.key == ("", "namespaces"):
            return not self.ns_counts.get(name)
        return not any(self.objects.get(key) for key in self._crd_keys(name))

    def _finalize_container(
        self, rt: ResourceType, container: dict[str, Any]
    ) -> dict[str, Any] | None:
        if not self._is_empty(rt, container):
            return None
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            for key in self._crd_keys(container["metadata"]["name"]):
                self._unregister(key)
        return self._remove(rt, container, "Background")

    def _remove(self, rt: ResourceType, obj: dict[str, Any], policy: str) -> dict[str, Any]:
        """Delete for real: DELETED event, then garbage-collect dependents."""
        meta = obj["metadata"]
        key = rt.key
        ns, name = meta.get("namespace", ""), meta["name"]
        if self.objects.get(key, {}).get((ns, name)) is not obj:
            return obj
        self.rv += 1
        final = dict(obj)
        final["metadata"] = {**meta, "resourceVersion": str(self.rv)}
        del self.objects[key][(ns, name)]
        self._index(key, obj, None)
        self._emit(key, "DELETED", final, None)
        uid = meta["uid"]
        for dkey, dns, dname in sorted(self.dependents.get(uid, ())):
            dep = self.peek(dkey, dns, dname)
            if dep is None or dkey not in self.types:
                continue
            drt = self.storage_rt(dkey)
            if policy == "Orphan":
                refs = [
                    r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid
                ]
                new = dcopy(dep)
                if refs:
                    new["metadata"]["ownerReferences"] = refs
                else:
                    new["metadata"].pop("ownerReferences", None)
                self._write(
                    drt,
                    dep,
                    new,
                    verb="gc",
                    manager="kube-controller-manager",
                    subresource=None,
                    dry_run=False,
                    field_validation="Ignore",
                )
            elif not self._has_live_owner(dep):
                self.delete(drt, dns or None, dname, propagation="Background")
        if ns and key != ("", "namespaces"):
            ns_obj = self.peek(("", "namespaces"), None, ns)
            if ns_obj is not None and ns_obj["metadata"].get("deletionTimestamp"):
                self._finalize_container(self.rt("", "namespaces"), ns_obj)
        if rt.crd_name:
            crd = self.peek(
                ("apiextensions.k8s.io", "customresourcedefinitions"), None, rt.crd_name
            )
            if crd is not None and crd["metadata"].get("deletionTimestamp"):
                self._finalize_container(
                    self.rt("apiextensions.k8s.io", "customresourcedefinitions"), crd
                )
        return final

    def _has_live_owner(self, obj: dict[str, Any]) -> bool:
        refs = obj["metadata"].get("ownerReferences") or []
        return any(r.get("uid") in self.uids for r in refs)

    def _collect_if_orphaned(self, key: tuple[str, str], ns: str | None, name: str) -> None:
        """The garbage collector's view of a child whose owners do not exist (any more)."""
        obj = self.peek(key, ns, name)
        if obj is None or key not in self.types:
            return
        meta = obj["metadata"]
        if (
            meta.get("ownerReferences")
            and not self._has_live_owner(obj)
            and not meta.get("deletionTimestamp")
        ):
            self.delete(self.storage_rt(key), ns or None, name)

    def _later(self, fn: Callable[..., None], *args: Any) -> None:
        if self.loop is not None:
            self.loop.call_later(0.05, fn, *args)
        else:
            fn(*args)

    def delete_collection(
        self,
        rt: ResourceType,
        ns: str | None,
        labels: list[Requirement],
        fields: list[FieldRequirement],
        *,
        propagation: str | None = None,
        dry_run: bool = False,
    ) -> list[dict[str, Any]]:
        items, _, _, _ = self.list(rt, ns, labels, fields)
        out = []
        for obj in items:
            meta = obj["metadata"]
            if self.peek(rt.key, meta.get("namespace"), meta["name"]) is None:
                continue
            out.append(
                self.delete(
                    rt,
                    meta.get("namespace"),
                    meta["name"],
                    propagation=propagation,
                    dry_run=dry_run,
                )
            )
        return out

    # ------------------------------------------------------------------------------------------
    # watch

    def watch(
        self,
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
            objs = self.objects.get(rt.key, {})
            for k in sorted(objs):
                if w.matches(objs[k]):
                    initial.append(("ADDED", objs[k]))
        else:
            try:
                since_rv = int(since)  # type: ignore[arg-type]
            except ValueError as exc:
                raise bad_request(f"invalid resource version: {since}") from exc
            hist = self.history.get(rt.key, deque())
            oldest = self.compacted.get(rt.key, 0)
            if since_rv < oldest:
                gone = ApiError(
                    410,
                    "Expired",
                    f"too old resource version: {since_rv} ({hist[0].rv if hist else self.rv})",
                ).status()
                return w, [("ERROR", gone)]
            for ev in hist:
                if ev.rv > since_rv:
                    out = w.translate(ev)
                    if out is not None:
                        initial.append(out)
        self.watchers[rt.key].add(w)
        return w, initial

    def unwatch(self, w: Watcher) -> None:
        self.watchers.get(w.rt.key, set()).discard(w)

    def close_all_watchers(self) -> None:
        for ws in self.watchers.values():
            for w in list(ws):
                w.close()

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


def _check_identity(rt: ResourceType, ns: str | None, name: str, meta: dict[str, Any]) -> None:
    if meta.get("name") and meta["name"] != name:
        raise bad_request(
            f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
        )
    if rt.namespaced and meta.get("namespace") and meta["namespace"] != ns:
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )


def _explicit_managed(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0


def _spec_changed(rt: ResourceType, old: dict[str, Any], new: dict[str, Any]) -> bool:
    skip = {"metadata", "apiVersion", "kind"} | ({"status"} if rt.status else set())
    a = {k: v for k, v in old.items() if k not in skip}
    b = {k: v for k, v in new.items() if k not in skip}
    return canon(a) != canon(b)


def _get_path(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.strip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


def monotonic() -> float:
    return time.monotonic()
