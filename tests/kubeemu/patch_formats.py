"""The patch formats: RFC 7386 JSON merge patch and strategic merge patch."""

from __future__ import annotations

from typing import Any

from kubeemu.fieldsets import Resolver, builtin_resolver, canon, dcopy


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
