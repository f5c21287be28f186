"""A small CEL type checker: the types the cost estimator needs, per AST node.

cel-go's cost pass reads the checked types: a selection costs 1 only on an object or a map (not
on ``dyn``), string and list operators have their own costs, scalars have a size of 1, and a
comprehension iterates items or keys depending on its range. This checker covers the CEL that
CRD rules use (the standard operators and macros, strings, lists, regex and quantity libraries,
conversions, timestamp and duration accessors); anything else raises
:class:`~kubeemu.cel_estimate.CostNotModelled`, as does a selection of a field the schema does not
declare (which the API server's checker refuses too).
"""

from __future__ import annotations

from kubeemu.cel_ast import Call, Comprehension, Expr, Ident, ListLit, Lit, MapLit, Select
from kubeemu.cel_estimate import CostNotModelled
from kubeemu.cel_types import DYN, INT, STRING, DeclType, list_of, map_of, simple

BOOL = simple("bool")
DOUBLE = simple("double")
UINT = simple("uint")
BYTES = simple("bytes")
QUANTITY = simple("quantity")
TYPE = simple("type")
TIMESTAMP = simple("timestamp")
DURATION = simple("duration")
NULL = simple("null")

_LITERAL = {
    "int": INT,
    "uint": UINT,
    "double": DOUBLE,
    "string": STRING,
    "bytes": BYTES,
    "bool": BOOL,
    "null": NULL,
}
_TYPE_NAMES = frozenset(
    {
        "bool",
        "bytes",
        "double",
        "duration",
        "dyn",
        "int",
        "list",
        "map",
        "null_type",
        "string",
        "timestamp",
        "type",
        "uint",
    }
)
_BOOL_RESULT = frozenset(
    {
        "_&&_",
        "_||_",
        "!_",
        "@not_strictly_false",
        "_==_",
        "_!=_",
        "_<_",
        "_<=_",
        "_>_",
        "_>=_",
        "@in",
        "matches",
        "contains",
        "startsWith",
        "endsWith",
        "isSorted",
        "isQuantity",
        "isInteger",
        "isGreaterThan",
        "isLessThan",
    }
)
_INT_RESULT = frozenset(
    {
        "size",
        "indexOf",
        "lastIndexOf",
        "asInteger",
        "sign",
        "compareTo",
        "getFullYear",
        "getMonth",
        "getDayOfYear",
        "getDayOfMonth",
        "getDate",
        "getDayOfWeek",
        "getHours",
        "getMinutes",
        "getSeconds",
        "getMilliseconds",
    }
)
_STRING_RESULT = frozenset(
    {"lowerAscii", "upperAscii", "trim", "substring", "replace", "charAt", "join", "find"}
)
_CONVERSIONS = {
    "int": INT,
    "uint": UINT,
    "double": DOUBLE,
    "string": STRING,
    "bytes": BYTES,
    "bool": BOOL,
    "type": TYPE,
    "timestamp": TIMESTAMP,
    "duration": DURATION,
    "quantity": QUANTITY,
}


class Checker:
    """Types of every node of one rule, for ``self`` (and ``oldSelf``) of type ``root``."""

    def __init__(self, root: DeclType) -> None:
        self.root = root
        self.types: dict[int, DeclType] = {}
        self._scopes: list[dict[str, DeclType]] = []

    def type_of(self, e: Expr) -> DeclType:
        return self.types[id(e)]

    def check(self, e: Expr) -> DeclType:
        t = self._check(e)
        self.types[id(e)] = t
        return t

    def _lookup(self, name: str) -> DeclType | None:
        for scope in reversed(self._scopes):
            if name in scope:
                return scope[name]
        return None

    def _check(self, e: Expr) -> DeclType:
        if isinstance(e, Lit):
            return _LITERAL[e.kind]
        if isinstance(e, Ident):
            return self._ident(e)
        if isinstance(e, Select):
            return self._select(e)
        if isinstance(e, ListLit):
            return list_of(_common([self.check(x) for x in e.elements]))
        if isinstance(e, MapLit):
            keys = [self.check(k) for k, _ in e.entries]
            values = [self.check(v) for _, v in e.entries]
            return map_of(_common(keys), _common(values))
        if isinstance(e, Comprehension):
            return self._comprehension(e)
        if isinstance(e, Call):
            return self._call(e)
        raise CostNotModelled(f"unsupported expression {type(e).__name__}")

    def _ident(self, e: Ident) -> DeclType:
        local = self._lookup(e.name)
        if local is not None:
            return local
        if e.name in ("self", "oldSelf"):
            return self.root
        if e.name in _TYPE_NAMES:
            return TYPE
        raise CostNotModelled(f"undeclared reference to '{e.name}'")

    def _select(self, e: Select) -> DeclType:
        operand = self.check(e.operand)
        if e.test_only and operand.kind not in ("object", "map", "dyn"):
            raise CostNotModelled(f"has() of a field of a {operand!r}")
        found: DeclType | None
        if operand.kind == "object":
            found = operand.fields.get(e.field)
            if found is None:
                raise CostNotModelled(f"undefined field '{e.field}'")
        elif operand.kind == "map":
            found = operand.elem
        elif operand.kind == "dyn":
            found = DYN
        else:
            raise CostNotModelled(f"selection of '{e.field}' on a {operand!r}")
        return BOOL if e.test_only else (found or DYN)

    def _comprehension(self, e: Comprehension) -> DeclType:
        rng = self.check(e.iter_range)
        if rng.kind == "list":
            var = rng.elem or DYN
        elif rng.kind == "map":
            var = rng.key or STRING
        elif rng.kind == "dyn":
            var = DYN
        else:
            raise CostNotModelled(f"{e.macro}() over a {rng!r}")
        init = self.check(e.accu_init)
        accu = {"all": BOOL, "exists": BOOL, "exists_one": INT, "filter": list_of(var)}.get(
            e.macro, init
        )
        self._scopes.append({e.iter_var: var})
        if e.macro == "map" and e.mapped is not None:
            accu = list_of(self.check(e.mapped))
        self._scopes[-1][e.accu_var] = accu
        self.check(e.loop_condition)
        self.check(e.loop_step)
        self._scopes[-1] = {e.accu_var: accu}  # the result sees the accumulator only
        result = self.check(e.result)
        self._scopes.pop()
        return result

    def _call(self, e: Call) -> DeclType:
        target = self.check(e.target) if e.target is not None else None
        args = [self.check(a) for a in e.args]
        fn = e.function
        if fn in _BOOL_RESULT:
            return BOOL
        if fn in _INT_RESULT:
            return INT
        if fn in _STRING_RESULT:
            return STRING
        if fn == "dyn":
            return DYN
        if fn in _CONVERSIONS and target is None and len(args) == 1:
            return _CONVERSIONS[fn]
        if fn == "_?_:_":
            yes, no = args[1], args[2]
            return no if yes.kind == "dyn" or _empty_list(yes) else yes
        if fn in ("-_", "_-_", "_*_", "_/_", "_%_"):
            return _arithmetic(fn, args)
        if fn == "_+_":
            return _plus(args)
        if fn == "_[_]":
            return _index(args[0])
        if fn in ("split", "findAll"):
            return list_of(STRING)
        if fn in ("sum", "min", "max") and target is not None and target.kind == "list":
            return target.elem or DYN
        if fn in ("add", "sub") and target is not None and target.kind == "quantity":
            return QUANTITY
        if fn == "asApproximateFloat":
            return DOUBLE
        raise CostNotModelled(f"function '{fn}' is not modelled by the cost estimator")


def _common(types: list[DeclType]) -> DeclType:
    if not types:
        return DYN
    first = types[0]
    return first if all(t.kind == first.kind for t in types) else DYN


def _empty_list(t: DeclType) -> bool:
    return t.kind == "list" and (t.elem is None or t.elem.kind == "dyn")


def _arithmetic(fn: str, args: list[DeclType]) -> DeclType:
    if fn == "_-_" and args[0].kind == args[1].kind == "timestamp":
        return DURATION
    return args[0]


def _plus(args: list[DeclType]) -> DeclType:
    left, right = args
    if left.kind == "list" or right.kind == "list":
        return right if _empty_list(left) else left
    if left.kind == "dyn":
        return right
    return TIMESTAMP if "timestamp" in (left.kind, right.kind) else left


def _index(container: DeclType) -> DeclType:
    if container.kind in ("list", "map"):
        return container.elem or DYN
    if container.kind == "dyn":
        return DYN
    raise CostNotModelled(f"indexing a {container!r}")
