"""Field sets, the ground of field ownership (managedFields) and server-side apply.

A *path* is a tuple of elements naming one field of an object, as structured-merge-diff does:
("f", name) a map field, ("k", key_json) an item of an associative list (keyed by some fields),
("v", value_json) an item of a set list. A manager's field set is a set of such paths; the wire
form is FieldsV1 (`{"f:spec": {"f:replicas": {}}}`, with "." marking a member that has children).

List semantics come from a *resolver*: given the field names leading to a list (list items shown
as "[]"), it answers ("atomic" | "set" | "map", key field names).

Here: those paths, the resolvers of built-in kinds and CRD schemas, flattening an object into
its paths and the FieldsV1 form. The managedFields entries and server-side apply built on them
are in ``managed_fields``; the merge and strategic merge patch formats in ``patch_formats``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
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


def keyable(items: list[Any], keys: tuple[str, ...]) -> bool:
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
        if list_type == "map" and keyable(value, keys):
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
