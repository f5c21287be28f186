"""Label and field selectors with the grammar kube-apiserver accepts.

Label selectors: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`; a comma is AND.
Field selectors: `path=value`, `path==value`, `path!=value`; a comma is AND.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_SET_RE = re.compile(rf"^\s*({_KEY})\s+(in|notin)\s*\(([^)]*)\)\s*$")
_CMP_RE = re.compile(rf"^\s*({_KEY})\s*(==|!=|=)\s*([-A-Za-z0-9_.]*)\s*$")
_EXISTS_RE = re.compile(rf"^\s*(!?)\s*({_KEY})\s*$")


class SelectorError(ValueError):
    """A selector string that the real API server would reject with 400."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op == "in":
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values  # notin / !=


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside a parenthesised value set."""
    terms, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(ch)
    terms.append("".join(current))
    return [t for t in (t.strip() for t in terms) if t]


def parse_labels(text: str | None) -> list[Requirement]:
    """Parse a label selector string into requirements (all must hold)."""
    if not text:
        return []
    reqs = []
    for term in _split_terms(text):
        if m := _SET_RE.match(term):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif m := _CMP_RE.match(term):
            op = "notin" if m.group(2) == "!=" else "in"
            reqs.append(Requirement(m.group(1), op, frozenset([m.group(3)])))
        elif m := _EXISTS_RE.match(term):
            reqs.append(Requirement(m.group(2), "!" if m.group(1) else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return reqs


def match_labels(reqs: list[Requirement], obj: dict[str, Any]) -> bool:
    if not reqs:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


@dataclass(frozen=True)
class FieldRequirement:
    path: tuple[str, ...]
    value: str
    negate: bool

    def matches(self, obj: dict[str, Any]) -> bool:
        cur: Any = obj
        for part in self.path:
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is None:
            actual = ""
        elif isinstance(cur, bool):
            actual = "true" if cur else "false"
        else:
            actual = str(cur)
        return (actual == self.value) != self.negate


_FIELD_RE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(==|!=|=)\s*(.*?)\s*$")


def parse_fields(text: str | None) -> list[FieldRequirement]:
    if not text:
        return []
    reqs = []
    for term in _split_terms(text):
        m = _FIELD_RE.match(term)
        if not m:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        reqs.append(FieldRequirement(tuple(m.group(1).split(".")), m.group(3), m.group(2) == "!="))
    return reqs


def match_fields(reqs: list[FieldRequirement], obj: dict[str, Any]) -> bool:
    return all(r.matches(obj) for r in reqs)


def match_selector_object(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Match a metav1.LabelSelector (matchLabels + matchExpressions); empty matches everything."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        op = expr.get("operator", "")
        key = expr.get("key", "")
        values = frozenset(expr.get("values") or [])
        mapped = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}.get(op)
        if mapped is None or not Requirement(key, mapped, values).matches(labels):
            return False
    return True


def selector_to_string(selector: dict[str, Any] | None) -> str:
    """Render a metav1.LabelSelector the way the /scale subresource reports it."""
    if not selector:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, key = expr.get("operator"), expr.get("key")
        values = ",".join(sorted(expr.get("values") or []))
        if op == "In":
            parts.append(f"{key} in ({values})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)
