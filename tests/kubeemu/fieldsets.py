"""Field ownership (managedFields), server-side apply and the patch formats.

A *path* is a tuple of elements naming one field of an object, as structured-merge-diff does:
("f", name) a map field, ("k", key_json) an item of an associative list (keyed by some fields),
("v", value_json) an item of a set list. A manager's field set is a set of such paths; the wire
form is FieldsV1 (`{"f:spec": {"f:replicas": {}}}`, with "." marking a member that has children).

List semantics come from a *resolver*: given the field names leading to a list (list items shown
as "[]"), it answers ("atomic" | "set" | "map", key field names).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Path = tuple[tuple[str, str], ...]
Resolver = Callable[[tuple[str, ...]], tuple[str, tuple[str, ...]]]

ITEM = "\x00item"  # flattened value of an associative-list item node: present, never "modified"

# metadata fields the server owns; never part of anyone's field set
SYSTEM_META = frozenset(
    {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "managedFields",
        "selfLink",
        "generateName",
    }
)


def canon(value: Any) -> str:
    """Canonical JSON text: equal text <=> equal JSON value (unlike ==, where True == 1)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _leaf(value: Any) -> str:
    """Cheap canonical text of a flattened value (typed, so "1", 1, 1.0 and True differ)."""
    t = type(value)
    if t is str:
        return "s" + value
    if t is bool:
        return "b1" if value else "b0"
    if t is int:
        return "i" + str(value)
    if value is None:
        return "n"
    return "j" + canon(value)


def dcopy(value: Any) -> Any:
    """Fast deep copy of a JSON value."""
    if isinstance(value, dict):
        return {k: dcopy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [dcopy(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------
# list semantics of built-in kinds


_BUILTIN_MAP_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "volumes": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
    "hostAliases": ("ip",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
    "resourceClaims": ("name",),
}
_CONTAINER_LISTS = frozenset({"containers", "initContainers", "ephemeralContainers"})


def builtin_resolver(names: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """List types of the built-in kinds (the `patchMergeKey`/`listType=map` fields we know)."""
    if not names:
        return "atomic", ()
    last = names[-1]
    if last == "finalizers":
        return "set", ()
    if last == "ports":
        if any(n in _CONTAINER_LISTS for n in names[:-1]):
            return "map", ("containerPort",)
        return "map", ("port",)
    keys = _BUILTIN_MAP_KEYS.get(last)
    if keys:
        return "map", keys
    return "atomic", ()


def _schema_at(schema: dict[str, Any] | None, names: Iterable[str]) -> dict[str, Any] | None:
    cur = schema
    for name in names:
        if not isinstance(cur, dict):
            return None
        if name == "[]":
            cur = cur.get("items")
            continue
        props = cur.get("properties") or {}
        if name in props:
            cur = props[name]
        elif isinstance(cur.get("additionalProperties"), dict):
            cur = cur["additionalProperties"]
        else:
            return None
    return cur


def schema_resolver(schema: dict[str, Any] | None) -> Resolver:
    """List types of a custom resource: `x-kubernetes-list-type` in its schema, atomic otherwise.

    `metadata` follows the built-in rules (finalizers are a set, ownerReferences keyed by uid).
    """

    def resolve(names: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        if names and names[0] == "metadata":
            return builtin_resolver(names)
        sub = _schema_at(schema, names)
        if not sub:
            return "atomic", ()
        list_type = sub.get("x-kubernetes-list-type", "atomic")
        if list_type == "map":
            return "map", tuple(sub.get("x-kubernetes-list-map-keys") or ())
        if list_type == "set":
            return "set", ()
        return "atomic", ()

    return resolve


# ----------------------------------------------------------------------------------------------
# flattening objects into owned paths


def item_key(item: Any, keys: tuple[str, ...]) -> str | None:
    """JSON of an associative-list item's key fields, or None if it cannot be keyed."""
    if not keys or not isinstance(item, dict) or any(k not in item for k in keys):
        return None
    return canon({k: item[k] for k in keys})


def _keyable(items: list[Any], keys: tuple[str, ...]) -> bool:
    seen = set()
    for item in items:
        k = item_key(item, keys)
        if k is None or k in seen:
            return False
        seen.add(k)
    return True


def tracked_view(obj: dict[str, Any] | None, scope: str) -> dict[str, Any]:
    """The part of an object whose fields have owners.

    scope: "main" (status excluded: it has its own subresource), "status" (only status) or
    "all" (a resource without a status subresource).
    """
    out: dict[str, Any] = {}
    for k, v in (obj or {}).items():
        if k in ("apiVersion", "kind"):
            continue
        if scope == "status":
            if k == "status":
                out[k] = v
            continue
        if k == "status" and scope == "main":
            continue
        if k == "metadata":
            meta = {mk: mv for mk, mv in (v or {}).items() if mk not in SYSTEM_META}
            if meta:
                out[k] = meta
            continue
        out[k] = v
    return out


def flatten(view: dict[str, Any], resolver: Resolver) -> dict[Path, str]:
    """Every owned path of `view` -> canonical JSON of its value (ITEM for list-map items)."""
    out: dict[Path, str] = {}
    _flatten(view, (), (), resolver, out)
    return out


def _flatten(
    value: Any, path: Path, names: tuple[str, ...], resolver: Resolver, out: dict[Path, str]
) -> None:
    if isinstance(value, dict):
        if not value:
            if path:
                out[path] = "j{}"
            return
        for k, v in value.items():
            _flatten(v, (*path, ("f", k)), (*names, k), resolver, out)
        return
    if isinstance(value, list) and value:
        list_type, keys = resolver(names)
        if list_type == "map" and _keyable(value, keys):
            for item in value:
                ipath = (*path, ("k", item_key(item, keys) or ""))
                out[ipath] = ITEM
                for k, v in item.items():
                    _flatten(v, (*ipath, ("f", k)), (*names, "[]", k), resolver, out)
            return
        if list_type == "set" and all(not isinstance(v, dict | list) for v in value):
            for item in value:
                out[(*path, ("v", canon(item)))] = _leaf(item)
            return
    if path:
        out[path] = _leaf(value)


# ----------------------------------------------------------------------------------------------
# FieldsV1 wire form


def _el_str(el: tuple[str, str]) -> str:
    return f"{el[0]}:{el[1]}"


def to_fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    members = list(paths)
    for p in members:
        node = root
        for el in p:
            node = node.setdefault(_el_str(el), {})
    for p in members:
        node = root
        for el in p:
            node = node[_el_str(el)]
        if any(k != "." for k in node):
            node["."] = {}
    return _sorted_tree(root)


def _sorted_tree(node: dict[str, Any]) -> dict[str, Any]:
    keys = sorted(node, key=lambda k: (k != ".", k))
    return {k: _sorted_tree(node[k]) for k in keys}


def from_fields_v1(tree: dict[str, Any] | None) -> set[Path]:
    out: set[Path] = set()

    def walk(node: dict[str, Any], prefix: Path) -> None:
        for key, child in node.items():
            if key == ".":
                continue
            kind, _, rest = key.partition(":")
            p = (*prefix, (kind, rest))
            child = child or {}
            if not child or "." in child:
                out.add(p)
            walk(child, p)

    walk(tree or {}, ())
    return out


def path_string(path: Path) -> str:
    """A path as structured-merge-diff prints it in conflict messages."""
    parts = []
    for kind, value in path:
        if kind == "f":
            parts.append(f".{value}")
        elif kind == "k":
            fields = json.loads(value)
            parts.append("[" + ",".join(f"{k}={json.dumps(v)}" for k, v in fields.items()) + "]")
        elif kind == "v":
            parts.append(f"[={value}]")
        else:
            parts.append(f"[{value}]")
    return "".join(parts)


class FieldsV1Memo:
    """The FieldsV1 trees of recent field sets, and the sets of the trees it made.

    Every write parses the live object's managedFields and serialises the new ones, and most
    entries come out unchanged: building and sorting the tree again was a quarter of the
    emulator's time in a burst. A tree it made is shared by the stored objects that carry it
    (stored objects are never mutated), so parsing the same tree is a lookup by identity; the
    memo holds each tree it hands out, so an identity is never reused while it is remembered.
    Trees from clients are parsed as before. Bounded: it forgets everything past `limit`.
    """

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._trees: dict[frozenset[Path], dict[str, Any]] = {}
        self._sets: dict[int, tuple[dict[str, Any], frozenset[Path]]] = {}

    def tree(self, paths: set[Path]) -> dict[str, Any]:
        key = frozenset(paths)
        tree = self._trees.get(key)
        if tree is None:
            if len(self._trees) >= self.limit:
                self._trees.clear()
                self._sets.clear()
            tree = self._trees[key] = to_fields_v1(key)
            self._sets[id(tree)] = (tree, key)
        return tree

    def paths(self, tree: dict[str, Any] | None) -> set[Path]:
        known = self._sets.get(id(tree)) if tree is not None else None
        if known is not None and known[0] is tree:
            return set(known[1])
        return from_fields_v1(tree)


# One per emulator process: a pure cache of a pure function, shared by every store.
FIELDS_V1 = FieldsV1Memo()


# ----------------------------------------------------------------------------------------------
# managedFields entries


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
            and _keyable(cfg, keys)
            and _keyable(live, keys)
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


# ----------------------------------------------------------------------------------------------
# patch formats


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return dcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _strip_directives(v)
            for k, v in value.items()
            if not k.startswith("$") and v is not None
        }
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def strategic_merge(
    live: Any, patch: Any, names: tuple[str, ...], resolver: Resolver = builtin_resolver
) -> Any:
    """Strategic merge patch for built-in kinds: keyed lists merge by their patch merge key.

    Supports `$patch: replace|delete` in maps and list items, `$deleteFromPrimitiveList/<f>`;
    `$setElementOrder/<f>` and `$retainKeys` are accepted and ignored.
    """
    if not isinstance(patch, dict):
        return _strip_directives(dcopy(patch))
    directive = patch.get("$patch")
    if directive == "replace":
        return _strip_directives(dcopy(patch))
    if directive == "delete":
        return None
    out = dict(live) if isinstance(live, dict) else {}
    for k, v in patch.items():
        if k.startswith("$deleteFromPrimitiveList/"):
            fname = k.split("/", 1)[1]
            drop = {canon(x) for x in v or []}
            if isinstance(out.get(fname), list):
                out[fname] = [x for x in out[fname] if canon(x) not in drop]
            continue
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
            continue
        fnames = (*names, k)
        if isinstance(v, dict):
            merged = strategic_merge(out.get(k), v, fnames, resolver)
            if merged is None:
                out.pop(k, None)
            else:
                out[k] = merged
        elif isinstance(v, list):
            out[k] = _strategic_list(out.get(k), v, fnames, resolver)
        else:
            out[k] = v
    return out


def _strategic_list(
    live: Any, patch: list[Any], names: tuple[str, ...], resolver: Resolver
) -> list[Any]:
    list_type, keys = resolver(names)
    if any(isinstance(x, dict) and x.get("$patch") == "replace" for x in patch):
        return [_strip_directives(x) for x in patch if not isinstance(x, dict) or "$patch" not in x]
    base = list(live) if isinstance(live, list) else []
    if list_type == "set":
        seen = {canon(x) for x in base}
        for x in patch:
            if canon(x) not in seen:
                seen.add(canon(x))
                base.append(x)
        return base
    if list_type != "map" or len(keys) == 0:
        return _strip_directives(dcopy(patch))
    merge_key = keys[0]  # strategic merge patch uses a single patchMergeKey
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            base.append(_strip_directives(item))
            continue
        idx = next(
            (
                i
                for i, x in enumerate(base)
                if isinstance(x, dict) and canon(x.get(merge_key)) == canon(item[merge_key])
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if idx is not None:
                del base[idx]
            continue
        if idx is None:
            base.append(_strip_directives(item))
        else:
            base[idx] = strategic_merge(base[idx], item, (*names, "[]"), resolver)
    return base
