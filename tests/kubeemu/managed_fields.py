"""managedFields entries and server-side apply: who owns which fields, how an update moves
ownership, the conflicts an apply meets, and merging an applied configuration into the live
object (field sets and their wire form are in ``fieldsets``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kubeemu.fieldsets import (
    FIELDS_V1,
    Path,
    Resolver,
    canon,
    dcopy,
    flatten,
    item_key,
    keyable,
    path_string,
    tracked_view,
)


@dataclass
class Entry:
    manager: str
    operation: str  # "Apply" | "Update"
    api_version: str
    time: str
    fields: set[Path] = field(default_factory=set)
    subresource: str = ""

    def same_identity(self, manager: str, operation: str, subresource: str) -> bool:
        return (self.manager, self.operation, self.subresource) == (
            manager,
            operation,
            subresource,
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": FIELDS_V1.tree(self.fields),
        }
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def parse_managed(obj: dict[str, Any] | None) -> list[Entry]:
    entries = []
    for raw in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        if not isinstance(raw, dict) or (not raw.get("manager") and not raw.get("fieldsV1")):
            continue
        entries.append(
            Entry(
                manager=raw.get("manager", ""),
                operation=raw.get("operation", "Update"),
                api_version=raw.get("apiVersion", ""),
                time=raw.get("time", ""),
                fields=FIELDS_V1.paths(raw.get("fieldsV1")),
                subresource=raw.get("subresource", ""),
            )
        )
    return entries


def serialize_managed(entries: list[Entry]) -> list[dict[str, Any]]:
    return [e.to_wire() for e in entries if e.fields]


def _diff(old: dict[Path, str], new: dict[Path, str]) -> tuple[set[Path], set[Path], set[Path]]:
    added = {p for p in new if p not in old}
    removed = {p for p in old if p not in new}
    modified = {p for p, v in new.items() if p in old and old[p] != v}
    return added, modified, removed


def record_update(
    entries: list[Entry],
    *,
    manager: str,
    api_version: str,
    subresource: str,
    old_flat: dict[Path, str],
    new_flat: dict[Path, str],
    now: str,
) -> list[Entry]:
    """Ownership after a non-apply write: the writer takes the fields it set or changed."""
    added, modified, removed = _diff(old_flat, new_flat)
    changed = added | modified
    if not changed and not removed:
        return entries
    out: list[Entry] = []
    own: Entry | None = None
    for e in entries:
        e = Entry(e.manager, e.operation, e.api_version, e.time, set(e.fields), e.subresource)
        if e.same_identity(manager, "Update", subresource):
            own = e
        else:
            e.fields -= changed | removed
        out.append(e)
    if own is None:
        own = Entry(manager, "Update", api_version, now, set(), subresource)
        out.append(own)
    own.fields = (own.fields | changed) - removed
    own.api_version = api_version
    own.time = now
    return [e for e in out if e.fields]


class ApplyConflict(Exception):
    """Applied values differ from fields another manager owns (and force was not given)."""

    def __init__(self, conflicts: list[tuple[Entry, Path]]):
        super().__init__("apply conflict")
        self.conflicts = conflicts

    def message(self) -> str:
        def who(e: Entry) -> str:
            text = json.dumps(e.manager)
            if e.subresource:
                text += f" with subresource {json.dumps(e.subresource)}"
            if e.operation == "Update":
                text += f" using {e.api_version}"
            return text

        if len(self.conflicts) == 1:
            e, p = self.conflicts[0]
            return f"Apply failed with 1 conflict: conflict with {who(e)}: {path_string(p)}"
        by_manager: dict[str, list[str]] = {}
        for e, p in self.conflicts:
            by_manager.setdefault(who(e), []).append(path_string(p))
        lines = []
        for name in sorted(by_manager):
            lines.append(f"conflicts with {name}:")
            lines.extend(f"- {p}" for p in sorted(by_manager[name]))
        return f"Apply failed with {len(self.conflicts)} conflicts: " + "\n".join(lines)

    def causes(self) -> list[dict[str, str]]:
        out = []
        for e, p in self.conflicts:
            text = f"conflict with {json.dumps(e.manager)}"
            if e.operation == "Update":
                text += f" using {e.api_version}"
            out.append({"reason": "FieldManagerConflict", "message": text, "field": path_string(p)})
        return out


def merge_applied(live: Any, cfg: Any, names: tuple[str, ...], resolver: Resolver) -> Any:
    """Merge an applied configuration into the live value (maps recurse, keyed lists by key)."""
    if isinstance(cfg, dict):
        base = dict(live) if isinstance(live, dict) else {}
        for k, v in cfg.items():
            if v is None:
                base.pop(k, None)
            else:
                base[k] = merge_applied(base.get(k), v, (*names, k), resolver)
        return base
    if isinstance(cfg, list):
        list_type, keys = resolver(names)
        if (
            list_type == "map"
            and isinstance(live, list)
            and keyable(cfg, keys)
            and keyable(live, keys)
        ):
            out = list(live)
            index = {item_key(it, keys): i for i, it in enumerate(out)}
            for item in cfg:
                k = item_key(item, keys)
                if k in index:
                    out[index[k]] = merge_applied(out[index[k]], item, (*names, "[]"), resolver)
                else:
                    index[k] = len(out)
                    out.append(dcopy(item))
            return out
        if list_type == "set" and isinstance(live, list):
            out = list(live)
            seen = {canon(v) for v in out}
            for item in cfg:
                if canon(item) not in seen:
                    seen.add(canon(item))
                    out.append(item)
            return out
        return dcopy(cfg)
    return cfg


def _prefixes(paths: Iterable[Path]) -> set[Path]:
    out: set[Path] = set()
    for p in paths:
        for i in range(1, len(p) + 1):
            out.add(p[:i])
    return out


def remove_path(obj: dict[str, Any], path: Path, keep: set[Path]) -> None:
    """Delete the field at `path` (in place), then parents it left empty unless owned."""
    stack: list[tuple[Any, Any]] = []  # (container, key or index)
    cur: Any = obj
    for kind, value in path:
        if kind == "f":
            if not isinstance(cur, dict) or value not in cur:
                return
            stack.append((cur, value))
            cur = cur[value]
        else:
            if not isinstance(cur, list):
                return
            idx = None
            for i, item in enumerate(cur):
                if kind == "k" and isinstance(item, dict):
                    keys = tuple(json.loads(value))
                    if item_key(item, keys) == value:
                        idx = i
                        break
                elif kind == "v" and canon(item) == value:
                    idx = i
                    break
            if idx is None:
                return
            stack.append((cur, idx))
            cur = cur[idx]
    depth = len(stack)
    while stack:
        container, key = stack.pop()
        del container[key]
        depth -= 1
        if depth == 0 or path[:depth] in keep or (depth == 1 and path[0] == ("f", "metadata")):
            return
        if container:  # the parent still has content
            return


def apply_config(
    live: dict[str, Any],
    cfg: dict[str, Any],
    *,
    manager: str,
    api_version: str,
    subresource: str,
    scope: str,
    force: bool,
    resolver: Resolver,
    now: str,
) -> tuple[dict[str, Any], list[Entry]]:
    """Server-side apply of `cfg` onto `live` (which may be a bare skeleton for a create).

    Returns the new object (managedFields not yet written into it) and the new entries.
    Raises ApplyConflict.
    """
    entries = parse_managed(live)
    cfg_view = tracked_view(cfg, scope)
    new_set = set(flatten(cfg_view, resolver))
    merged = merge_applied(live, cfg_view, (), resolver)

    own = next((e for e in entries if e.same_identity(manager, "Apply", subresource)), None)
    others = [e for e in entries if e is not own]
    others_prefixes = _prefixes(p for e in others for p in e.fields)
    stale = (own.fields if own else set()) - new_set
    # parents first: removing an item first makes its fields' removal a no-op (not a half item)
    to_remove = sorted((p for p in stale if p not in others_prefixes), key=len)
    if to_remove:
        keep = _prefixes(new_set) | others_prefixes
        merged = dcopy(merged)
        for p in to_remove:
            remove_path(merged, p, keep)

    live_flat = flatten(tracked_view(live, scope), resolver)
    new_flat = flatten(tracked_view(merged, scope), resolver)
    added, modified, removed = _diff(live_flat, new_flat)
    changed = added | modified
    conflicts = [(e, p) for e in others for p in sorted(e.fields & changed)]
    if conflicts and not force:
        raise ApplyConflict(conflicts)

    out: list[Entry] = []
    for e in entries:
        if e is own:
            continue
        fields = e.fields - removed
        if force:
            fields -= changed
        out.append(Entry(e.manager, e.operation, e.api_version, e.time, fields, e.subresource))
    content_changed = bool(changed or removed)
    if own is None:
        own_new = Entry(manager, "Apply", api_version, now, new_set, subresource)
    else:
        same = own.fields == new_set and own.api_version == api_version and not content_changed
        own_new = Entry(
            manager, "Apply", api_version, own.time if same else now, new_set, subresource
        )
    # keep the applier's entry where it was, or first for a new one (as the real server lists it)
    pos = entries.index(own) if own is not None else 0
    out.insert(min(pos, len(out)), own_new)
    return merged, [e for e in out if e.fields]
