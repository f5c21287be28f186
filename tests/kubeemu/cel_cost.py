"""Kubernetes' *estimated* CEL cost of a CRD validation rule: what kube-apiserver computes at CRD
create/update and compares with its budgets (cel-go ``checker/cost.go`` driven by the apiserver's
size estimator and library cost estimator, ``apiserver/pkg/cel/library/cost.go``).

:func:`estimate_rule` returns the estimated maximum cost of one evaluation of a rule whose
``self`` has the declaration type ``root`` (:mod:`kubeemu.cel_types`). The walk mirrors cel-go's
coster: every node adds its cost, a comprehension adds ``size(range) * (loop condition + step)``,
and sizes come from literals, from results (concatenation, ``substring``, ...), or from the
schema along the field path of a value (``self.a.b`` -> ``[self, a, b]``; list items
``@items``, map values ``@values``, keys ``@keys``), as the apiserver's ``sizeEstimator`` resolves
it: by walking the path from the rule's own node, ignoring its first element. The quirks that
follow are kept, e.g. a variable iterating a list literal has the path ``[@items]`` and so the
size of ``self``.

The model is cel-go >= 0.23.2 (kube-apiserver 1.33+), where a scalar reached through the schema
has size 0 (older versions give it 1: an ``int == int`` cost 1 more there). The strings extension
is costed by the apiserver's library estimator, not by the per-overload estimators cel-go added
in 2026. Anything outside the modelled subset raises
:class:`~kubeemu.cel_estimate.CostNotModelled`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubeemu import cel_cost_calls
from kubeemu.cel_ast import (
    ACCUMULATOR,
    Call,
    Comprehension,
    Expr,
    Ident,
    ListLit,
    Lit,
    MapLit,
    Select,
)
from kubeemu.cel_check import Checker
from kubeemu.cel_cost_calls import Node
from kubeemu.cel_estimate import (
    LIST_CREATE_BASE_COST,
    MAP_CREATE_BASE_COST,
    ONE,
    SELECT_AND_IDENT_COST,
    UINT64_MAX,
    UNKNOWN,
    ZERO,
    CostNotModelled,
    Est,
    fixed,
)
from kubeemu.cel_types import SCALAR_KINDS, DeclType

# has() costs nothing beyond its operand: kube-apiserver sets PresenceTestHasCost(false).
PRESENCE_TEST_COST = ZERO


@dataclass(frozen=True)
class Entry:
    """Sizes of the keys (list: 1) and values of a container whose entries are known."""

    container: str  # list or map
    key: Est
    val: Est

    def union(self, other: Entry | None) -> Entry | None:
        if other is None:
            return None
        return Entry(self.container, self.key.union(other.key), self.val.union(other.val))


@dataclass
class _Local:
    path: list[str]
    size: Est | None
    entry: Entry | None


def estimate_rule(expr: Expr, root: DeclType) -> Est:
    """Estimated [min, max] cost of ``expr`` (a cel_ast tree) evaluated with ``self: root``."""
    checker = Checker(root)
    checker.check(expr)
    return Coster(root, checker).cost(expr)


class Coster:
    """One rule's cost walk (cel-go's ``coster``), over a type-checked AST."""

    def __init__(self, root: DeclType, checker: Checker) -> None:
        self.root = root
        self.checker = checker
        self.paths: dict[int, list[str]] = {}
        self.sizes: dict[int, Est] = {}
        self.entries: dict[int, Entry] = {}
        self.locals: dict[str, list[_Local]] = {}

    # ---- the walk

    def cost(self, e: Expr) -> Est:
        if isinstance(e, Lit):
            return ZERO
        if isinstance(e, Ident):
            local = self._peek(e.name)
            self.paths[id(e)] = list(local.path) if local is not None else [e.name]
            return fixed(SELECT_AND_IDENT_COST)
        if isinstance(e, Select):
            return self._select(e)
        if isinstance(e, Call):
            return self._call(e)
        if isinstance(e, ListLit):
            return self._list(e)
        if isinstance(e, MapLit):
            return self._map(e)
        if isinstance(e, Comprehension):
            return self._comprehension(e)
        raise CostNotModelled(f"unsupported expression {type(e).__name__}")

    def _select(self, e: Select) -> Est:
        if e.test_only:
            return PRESENCE_TEST_COST + self.cost(e.operand)
        total = self.cost(e.operand)
        if self.type_of(e.operand).kind in ("object", "map"):
            total = total + fixed(SELECT_AND_IDENT_COST)
        self.paths[id(e)] = [*self.path_of(e.operand), e.field]
        return total

    def _list(self, e: ListLit) -> Est:
        total = ZERO
        item = Est(0 if not e.elements else UINT64_MAX, 0)
        for x in e.elements:
            total = total + self.cost(x)
            item = item.union(self.size_or_unknown(x))
        self.entries[id(e)] = Entry("list", ONE, item)
        return total + fixed(LIST_CREATE_BASE_COST)

    def _map(self, e: MapLit) -> Est:
        total = ZERO
        start = Est(0 if not e.entries else UINT64_MAX, 0)
        key, val = start, start
        for k, v in e.entries:
            total = total + self.cost(k) + self.cost(v)
            key = key.union(self.size_or_unknown(k))
            val = val.union(self.size_or_unknown(v))
        self.entries[id(e)] = Entry("map", key, val)
        return total + fixed(MAP_CREATE_BASE_COST)

    def _comprehension(self, e: Comprehension) -> Est:
        total = self.cost(e.iter_range) + self.cost(e.accu_init)
        self._push(
            e.accu_var,
            _Local(self.path_of(e.accu_init), self.size(e.accu_init), self.entry(e.accu_init)),
        )
        self._push_iter(e.iter_var, e.iter_range)
        loop = self.cost(e.loop_condition)
        step = self.cost(e.loop_step)
        self._pop(e.iter_var)
        total = total + self.cost(e.result)
        self._pop(e.accu_var)
        count = self.size_or_unknown(e.iter_range)
        total = total + count * (step + loop)
        if isinstance(e.accu_init, Lit):
            self._set_size(e, self.size(e.accu_init))
        elif isinstance(e.accu_init, ListLit | MapLit):
            self._set_size(e, count)
            step_entry = self.entry(e.loop_step)
            if step_entry is not None:
                self.entries[id(e)] = step_entry
        return total

    def _push_iter(self, var: str, rng: Expr) -> None:
        """pushIterSingle: a list's items (path @items), else a map's keys (@keys)."""
        entry = self.entry(rng)
        container = entry.container if entry is not None else self.type_of(rng).kind
        if container == "list":
            size, sub = (entry.val if entry is not None else None), "@items"
        else:
            size, sub = (entry.key if entry is not None else None), "@keys"
        self._push(var, _Local([*self.path_of(rng), sub], size, None))

    def _call(self, e: Call) -> Est:
        if e.function == "dyn" and e.target is None and len(e.args) == 1:
            arg = e.args[0]
            cost = ONE + self.cost(arg)
            self._set_size(e, self.size(arg))
            entry = self.entry(arg)
            if entry is not None:
                self.entries[id(e)] = entry
            return cost
        arg_costs: list[Est] = []
        args: list[Node] = []
        for a in e.args:
            arg_costs.append(self.cost(a))
            args.append(self.node(a))
        total = ZERO
        target: Node | None = None
        if e.target is not None:
            total = self.cost(e.target)
            target = self.node(e.target)
        fn_cost, result_size = cel_cost_calls.function_cost(self, e, target, args, arg_costs)
        if e.function == "_[_]":
            container = self.type_of(e.args[0]).kind
            entry = self.entry(e.args[0])
            result_size = entry.val if entry is not None else None
            sub = "@items" if container == "list" else "@values"
            self.paths[id(e)] = [*self.path_of(e.args[0]), sub]
        if result_size is None:
            result_size = self.size(e)
        self._set_size(e, result_size)
        return total + fn_cost

    # ---- sizes, paths, scopes

    def type_of(self, e: Expr) -> DeclType:
        return self.checker.type_of(e)

    def path_of(self, e: Expr) -> list[str]:
        if isinstance(e, Ident):
            local = self._peek(e.name)
            if local is not None:
                return list(local.path)
        return list(self.paths.get(id(e), []))

    def node(self, e: Expr) -> Node:
        path: list[str] | None = self.path_of(e)
        if path and path[0] == ACCUMULATOR:
            path = None  # cel-go gives estimators no paths through accumulators
        return Node(e, self.type_of(e), path, self.size(e))

    def size(self, e: Expr) -> Est | None:
        """computeSize: a recorded size, a literal's, the schema's along the path, a scalar's
        (1), or an iteration variable's."""
        known = self.sizes.get(id(e))
        if known is not None:
            return known
        literal = _literal_size(e)
        if literal is not None:
            return literal
        estimated = self.schema_size(self.path_of(e))
        if estimated is not None:
            self.sizes[id(e)] = estimated
            return estimated
        if self.type_of(e).kind in SCALAR_KINDS:
            return ONE
        if isinstance(e, Ident):
            local = self._peek(e.name)
            if local is not None and local.size is not None:
                return local.size
        return None

    def size_or_unknown(self, e: Expr) -> Est:
        found = self.size(e)
        return found if found is not None else UNKNOWN

    def schema_size(self, path: list[str] | None) -> Est | None:
        """The apiserver's sizeEstimator: walk the path (after its first element) from the
        rule's node; the size is 0 to that node's max elements."""
        if not path:
            return None
        node: DeclType | None = self.root
        for name in path[1:]:
            if node is None:
                return None
            if name in ("@items", "@values"):
                node = node.elem
            elif name == "@keys":
                node = node.key
            else:
                node = node.fields.get(name)
        return None if node is None else Est(0, node.max_elements)

    def entry(self, e: Expr) -> Entry | None:
        found = self.entries.get(id(e))
        if found is not None:
            return found
        if isinstance(e, Ident):
            local = self._peek(e.name)
            if local is not None:
                return local.entry
        return None

    def set_entry(self, e: Expr, entry: Entry | None) -> None:
        if entry is not None:
            self.entries[id(e)] = entry

    def _set_size(self, e: Expr, size: Est | None) -> None:
        if size is not None:
            self.sizes[id(e)] = size

    def _peek(self, name: str) -> _Local | None:
        stack = self.locals.get(name)
        return stack[-1] if stack else None

    def _push(self, name: str, local: _Local) -> None:
        self.locals.setdefault(name, []).append(local)

    def _pop(self, name: str) -> None:
        self.locals[name].pop()


def _literal_size(e: Expr) -> Est | None:
    """computeExprSize: strings count runes, bytes bytes, other literals 1; list and map
    literals their entries."""
    if isinstance(e, Lit):
        if e.kind in ("string", "bytes"):
            return fixed(len(e.value))
        return ONE
    if isinstance(e, ListLit):
        return fixed(len(e.elements))
    if isinstance(e, MapLit):
        return fixed(len(e.entries))
    return None
