"""Estimated cost of one function call: the apiserver's library estimator first
(``apiserver/pkg/cel/library/cost.go``: lists, strings extension, regex, quantity), then cel-go's
own per-overload costs (``checker/cost.go``: string traversals cost ``ceil(len * 0.1)``,
``matches`` ``ceil((1 + len) * 0.1) * ceil(len(regex) * 0.25)``, ``in`` on a list its size,
``&&``/``||`` their operands, the conditional its condition and costlier branch), and 1 for
everything else. Each returns (cost, result size or None); the arguments' own costs are added
here, the receiver's by the caller, as in cel-go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubeemu.cel_ast import Call, Expr, Lit
from kubeemu.cel_estimate import (
    ONE,
    REGEX_STRING_LENGTH_COST_FACTOR,
    STRING_TRAVERSAL_COST_FACTOR,
    UINT64_MAX,
    UNKNOWN,
    CostNotModelled,
    Est,
    fixed,
)
from kubeemu.cel_types import DeclType

if TYPE_CHECKING:
    from kubeemu.cel_cost import Coster

_TEXT = STRING_TRAVERSAL_COST_FACTOR
_REGEX = REGEX_STRING_LENGTH_COST_FACTOR
_LIST_SCANS = frozenset({"isSorted", "sum", "max", "min", "indexOf", "lastIndexOf", "includes"})
_O1_LIBRARY = frozenset(
    {
        "sign",
        "asInteger",
        "isInteger",
        "asApproximateFloat",
        "isGreaterThan",
        "isLessThan",
        "compareTo",
        "add",
        "sub",
    }
)
_RELATIONS = frozenset({"_<_", "_<=_", "_>_", "_>=_"})
_TEXTS = frozenset({"string", "bytes"})

Result = tuple[Est, Est | None]


@dataclass(frozen=True)
class Node:
    """What a function's cost sees of an argument (cel-go's ``AstNode``)."""

    expr: Expr | None
    type: DeclType
    path: list[str] | None
    size: Est | None  # the computed size, if any


def _sum(costs: list[Est]) -> Est:
    total = fixed(0)
    for c in costs:
        total = total + c
    return total


def size_of(node: Node) -> Est:
    """sizeOrUnknown / the library's sizeEstimate: the computed size, the schema's along the
    node's path, else unknown (0 to 2^64-1)."""
    return node.size if node.size is not None else UNKNOWN


def function_cost(
    coster: Coster, e: Call, target: Node | None, args: list[Node], arg_costs: list[Est]
) -> Result:
    fn = e.function
    library = _library(coster, fn, target, args)
    if library is not None:
        cost, size = library
        return cost + _sum(arg_costs), size
    return _standard(coster, e, target, args, arg_costs)


# --------------------------------------------------------------------------- k8s library


def _element(coster: Coster, target: Node) -> Node | None:
    """listElementNode: the items of a list (path + @items), None for non-list types."""
    t = target.type
    if t.kind not in ("list", "map") or t.elem is None:
        return None
    elem = t.elem if t.kind == "list" else t.key
    if elem is None:
        return None
    path = [*target.path, "@items"] if target.path is not None else None
    # an items node has no computed size: the library asks the schema (sizeEstimate)
    return Node(None, elem, path, coster.schema_size(path))


def _library(coster: Coster, fn: str, target: Node | None, args: list[Node]) -> Result | None:
    if fn in _LIST_SCANS and target is not None:
        elem = _element(coster, target)
        if elem is not None:
            per = ONE
            if elem.type.kind in _TEXTS:
                per = per + size_of(elem).factor(_TEXT)
            return size_of(target) * per, None
        if fn == "includes":
            return size_of(target) * ONE, None
        return size_of(target).factor(_TEXT), None
    if fn in ("lowerAscii", "upperAscii", "substring", "trim") and target is not None:
        size = size_of(target)
        return size.factor(_TEXT), size
    if fn == "replace" and target is not None and len(args) >= 2:
        return _replace(size_of(target), size_of(args[0]), size_of(args[1]))
    if fn == "split" and target is not None:
        size = size_of(target)
        most = size.hi
        if len(args) > 1 and isinstance(args[1].expr, Lit) and args[1].expr.kind == "int":
            most = args[1].expr.value % 2**64  # Go's uint64(int64)
        return size.factor(2 * _TEXT), Est(0, most)
    if fn == "join" and target is not None:
        return _join(coster, target, args)
    if fn in ("find", "findAll") and target is not None and args:
        size = size_of(target)
        text = (size + ONE).factor(_TEXT)
        regex = size_of(args[0]).factor(_REGEX)
        return text * regex, Est(0, size.hi)
    if fn in ("quantity", "isQuantity") and target is None and args:
        return size_of(args[0]).factor(_TEXT), None
    if fn in _O1_LIBRARY and target is not None:
        return ONE, None
    if fn == "_==_" and args[0].type.kind == args[1].type.kind == "quantity":
        return ONE, None
    return None


def _replace(size: Est, old: Est, new: Est) -> Result:
    if old.lo == 0:
        count_hi = size.hi + 1 if size.hi < UINT64_MAX else size.hi
        kept_hi = size.hi
    elif new.hi <= old.lo:
        count_hi, kept_hi = 0, size.hi
    else:
        count_hi, kept_hi = math.ceil(size.hi / old.lo), 0
    if old.hi == 0:
        count_lo = size.lo + 1 if size.lo < UINT64_MAX else size.lo
        kept_lo = size.lo
    elif old.hi <= new.lo:
        count_lo, kept_lo = 0, size.lo
    else:
        count_lo, kept_lo = math.ceil(size.lo / old.hi), 0
    result = Est(count_lo, count_hi) * new + Est(kept_lo, kept_hi)
    return size.factor(2 * _TEXT), result


def _join(coster: Coster, target: Node, args: list[Node]) -> Result:
    items = size_of(target)
    elem = _element(coster, target)
    size = items * size_of(elem) if elem is not None else fixed(0)
    if args:
        separators = Est(max(items.lo - 1, 0), max(items.hi - 1, 0))
        size = size + size_of(args[0]) * separators
    return size.factor(_TEXT), size


# --------------------------------------------------------------------------- cel-go


def _kinds(args: list[Node]) -> tuple[str, ...]:
    return tuple(a.type.kind for a in args)


def _standard(
    coster: Coster, e: Call, target: Node | None, args: list[Node], arg_costs: list[Est]
) -> Result:
    fn = e.function
    total = _sum(arg_costs)
    if fn in ("startsWith", "endsWith") and target is not None and len(args) == 1:
        return size_of(args[0]).factor(_TEXT) + total, None
    if fn == "matches" and target is not None and len(args) == 1:
        # Only the receiver form (matches_string) is costed by size; cel-go prices the global
        # matches(s, re) like any O(1) call.
        text = (size_of(target) + ONE).factor(_TEXT)
        regex = size_of(args[0]).factor(_REGEX)
        return text * regex + total, None
    if fn == "contains" and target is not None and len(args) == 1:
        text = size_of(target).factor(_TEXT)
        sub = size_of(args[0]).factor(_TEXT)
        return text * sub + total, None
    if fn in ("_&&_", "_||_"):
        left, right = arg_costs
        return Est(left.lo, (left + right).hi), None
    if fn == "_?_:_":
        size = size_of(args[1]).union(size_of(args[2]))
        yes, no = coster.entry(e.args[1]), coster.entry(e.args[2])
        coster.set_entry(e, yes.union(no) if yes is not None else None)
        return arg_costs[0] + arg_costs[1].union(arg_costs[2]), size
    if fn == "@in":
        kind = args[1].type.kind
        if kind == "dyn":
            raise CostNotModelled("'in' on a dyn value")
        if kind == "list":
            return size_of(args[1]) + total, None
        return ONE + total, None
    if fn == "_+_":
        return _plus(coster, e, args, total)
    if fn in ("_==_", "_!=_") or (fn in _RELATIONS and _text_compare(args)):
        smallest = min(size_of(args[0]).hi, size_of(args[1]).hi)
        return Est(1 if smallest > 0 else 0, smallest).factor(_TEXT) + total, None
    if fn == "bytes" and target is None and _kinds(args) == ("string",):
        size = size_of(args[0])
        return size.factor(_TEXT) + total, Est(size.lo, size.hi * 4)
    if fn == "string" and target is None and _kinds(args) == ("bytes",):
        size = size_of(args[0])
        return size.factor(_TEXT) + total, Est(size.lo // 4, size.hi)
    if fn == "_[_]" and args[0].type.kind not in ("list", "map"):
        raise CostNotModelled(f"indexing a {args[0].type!r}")
    return ONE + total, None


def _text_compare(args: list[Node]) -> bool:
    """Whether a relation picks the string/bytes overload (a dyn operand takes the other's)."""
    kinds = set(_kinds(args))
    if kinds == {"dyn"}:
        raise CostNotModelled("a relation between two dyn values")
    return bool(kinds & _TEXTS)


def _plus(coster: Coster, e: Call, args: list[Node], total: Est) -> Result:
    kinds = set(_kinds(args))
    if kinds == {"dyn"}:
        raise CostNotModelled("'+' of two dyn values")
    if not kinds & {"string", "bytes", "list"}:
        return ONE + total, None
    size = size_of(args[0]) + size_of(args[1])
    left, right = coster.entry(e.args[0]), coster.entry(e.args[1])
    coster.set_entry(e, left.union(right) if left is not None else None)
    if "list" in kinds:
        return ONE + total, size  # concatenation is O(1); the size is tracked
    return size.factor(_TEXT) + total, size
