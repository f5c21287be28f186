"""CEL expressions in the shape cel-go's parser gives them, for the cost estimator.

The emulator parses CEL with celpy's grammar; :func:`parse` turns that parse tree into cel-go's
AST: literals, identifiers, selections (``has()`` is a test-only selection), calls named like
cel-go's operators (``_&&_``, ``_[_]``, ``@in``, ...), list and map literals, and comprehensions.
The macros ``all``, ``exists``, ``exists_one``, ``map`` and ``filter`` are expanded the way
cel-go's ``parser/macro.go`` expands them, because the estimated cost is a function of that
expansion (its accumulator, loop condition and step). ``!!x`` is ``x``, as in cel-go.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import lark

ACCUMULATOR = "@result"


class CelSyntaxError(ValueError):
    """A rule the cost estimator cannot read (it does not parse, or uses unsupported syntax)."""


@dataclass(eq=False)
class Expr:
    """Base of the AST nodes; identity (not value) is what side tables key on."""


@dataclass(eq=False)
class Lit(Expr):
    kind: str  # int uint double string bytes bool null
    value: Any


@dataclass(eq=False)
class Ident(Expr):
    name: str


@dataclass(eq=False)
class Select(Expr):
    operand: Expr
    field: str
    test_only: bool = False


@dataclass(eq=False)
class Call(Expr):
    function: str
    args: list[Expr]
    target: Expr | None = None  # the receiver of a member call


@dataclass(eq=False)
class ListLit(Expr):
    elements: list[Expr]


@dataclass(eq=False)
class MapLit(Expr):
    entries: list[tuple[Expr, Expr]]


@dataclass(eq=False)
class Comprehension(Expr):
    macro: str  # all exists exists_one map filter: the checker types the accumulator by it
    iter_range: Expr
    iter_var: str
    accu_var: str
    accu_init: Expr
    loop_condition: Expr
    loop_step: Expr
    result: Expr
    mapped: Expr | None = field(default=None)  # map: the transform (types the result list)


_BINARY = {
    "conditionalor": "_||_",
    "conditionaland": "_&&_",
    "relation_lt": "_<_",
    "relation_le": "_<=_",
    "relation_gt": "_>_",
    "relation_ge": "_>=_",
    "relation_eq": "_==_",
    "relation_ne": "_!=_",
    "relation_in": "@in",
    "addition_add": "_+_",
    "addition_sub": "_-_",
    "multiplication_mul": "_*_",
    "multiplication_div": "_/_",
    "multiplication_mod": "_%_",
}


def parse(tree: lark.Tree) -> Expr:
    """cel-go's AST of a celpy parse tree (from the emulator's CEL parser)."""
    return _Converter().expr(tree)


class _Converter:
    def expr(self, t: lark.Tree) -> Expr:
        kind = t.data
        kids = t.children
        if kind == "expr":
            if len(kids) == 1:
                return self.expr(kids[0])
            cond, yes, no = (self.expr(k) for k in kids)
            return Call("_?_:_", [cond, yes, no])
        if kind in ("conditionalor", "conditionaland", "relation", "addition", "multiplication"):
            if len(kids) == 1:
                return self.expr(kids[0])
            left, right = kids
            if kind in ("conditionalor", "conditionaland"):
                return Call(_BINARY[kind], [self.expr(left), self.expr(right)])
            # relation_lt(relation) addition, etc.: the operator node wraps the left operand
            op = left.data
            return Call(_BINARY[op], [self.expr(left.children[0]), self.expr(right)])
        if kind == "unary":
            return self.unary(t)
        if kind in ("member", "primary", "paren_expr"):
            return self.expr(kids[0])
        handler = getattr(self, kind, None)
        if handler is None:
            raise CelSyntaxError(f"unsupported CEL syntax: {kind}")
        return handler(t)

    def unary(self, t: lark.Tree) -> Expr:
        ops: list[str] = []
        node = t
        while len(node.children) == 2:
            ops.append(node.children[0].data)
            node = node.children[1]
        operand = self.expr(node.children[0])
        if not ops:
            return operand
        if len(set(ops)) != 1:
            raise CelSyntaxError("mixed '!' and '-' prefixes are not CEL")
        if len(ops) % 2 == 0:
            return operand
        return Call("!_" if ops[0] == "unary_not" else "-_", [operand])

    def member_dot(self, t: lark.Tree) -> Expr:
        return Select(self.expr(t.children[0]), t.children[1].value)

    def member_index(self, t: lark.Tree) -> Expr:
        return Call("_[_]", [self.expr(t.children[0]), self.expr(t.children[1])])

    def member_dot_arg(self, t: lark.Tree) -> Expr:
        target_tree, name_tok, *rest = t.children
        args = self.exprlist(rest[0]) if rest else []
        name = name_tok.value
        if name in ("all", "exists", "exists_one", "filter") and len(args) == 2:
            return self.quantifier(name, target_tree, args)
        if name == "map" and len(args) in (2, 3):
            return self.map(target_tree, args)
        return Call(name, args, target=self.expr(target_tree))

    def ident_arg(self, t: lark.Tree) -> Expr:
        name_tok, *rest = t.children
        args = self.exprlist(rest[0]) if rest else []
        if name_tok.value == "has":
            if len(args) != 1 or not isinstance(args[0], Select):
                raise CelSyntaxError("invalid argument to has() macro")
            return Select(args[0].operand, args[0].field, test_only=True)
        return Call(name_tok.value, args)

    def ident(self, t: lark.Tree) -> Expr:
        return Ident(t.children[0].value)

    def list_lit(self, t: lark.Tree) -> Expr:
        return ListLit(self.exprlist(t.children[0]) if t.children else [])

    def map_lit(self, t: lark.Tree) -> Expr:
        if not t.children:
            return MapLit([])
        items = [self.expr(k) for k in t.children[0].children]
        return MapLit(list(zip(items[0::2], items[1::2], strict=True)))

    def literal(self, t: lark.Tree) -> Expr:
        return literal(t.children[0])

    def exprlist(self, t: lark.Tree) -> list[Expr]:
        return [self.expr(k) for k in t.children]

    # ---- macros (cel-go parser/macro.go)

    def _iter_var(self, arg: Expr) -> str:
        if not isinstance(arg, Ident):
            raise CelSyntaxError("argument is not an identifier")
        return arg.name

    def quantifier(self, name: str, target_tree: lark.Tree, args: list[Expr]) -> Expr:
        var = self._iter_var(args[0])
        target = self.expr(target_tree)
        accu = Ident(ACCUMULATOR)
        if name == "all":
            init: Expr = Lit("bool", True)
            cond: Expr = Call("@not_strictly_false", [Ident(ACCUMULATOR)])
            step: Expr = Call("_&&_", [accu, args[1]])
            result: Expr = Ident(ACCUMULATOR)
        elif name == "exists":
            init = Lit("bool", False)
            cond = Call("@not_strictly_false", [Call("!_", [Ident(ACCUMULATOR)])])
            step = Call("_||_", [accu, args[1]])
            result = Ident(ACCUMULATOR)
        elif name == "exists_one":
            init = Lit("int", 0)
            cond = Lit("bool", True)
            plus_one = Call("_+_", [accu, Lit("int", 1)])
            step = Call("_?_:_", [args[1], plus_one, Ident(ACCUMULATOR)])
            result = Call("_==_", [Ident(ACCUMULATOR), Lit("int", 1)])
        else:  # filter
            init = ListLit([])
            cond = Lit("bool", True)
            append = Call("_+_", [accu, ListLit([Ident(var)])])
            step = Call("_?_:_", [args[1], append, Ident(ACCUMULATOR)])
            result = Ident(ACCUMULATOR)
        return Comprehension(name, target, var, ACCUMULATOR, init, cond, step, result)

    def map(self, target_tree: lark.Tree, args: list[Expr]) -> Expr:
        var = self._iter_var(args[0])
        fn = args[-1]
        step: Expr = Call("_+_", [Ident(ACCUMULATOR), ListLit([fn])])
        if len(args) == 3:
            step = Call("_?_:_", [args[1], step, Ident(ACCUMULATOR)])
        return Comprehension(
            "map",
            self.expr(target_tree),
            var,
            ACCUMULATOR,
            ListLit([]),
            Lit("bool", True),
            step,
            Ident(ACCUMULATOR),
            mapped=fn,
        )


# --------------------------------------------------------------------------- literals

_ESCAPE = re.compile(
    r"\\(?:([abfnrtv\\'\"`?])|([0-3][0-7]{2})|[xX]([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})"
    r"|U([0-9a-fA-F]{8}))"
)
_SIMPLE = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}


def _unescape(body: str, as_bytes: bool) -> str | bytes:
    """CEL string/bytes escapes; \\x and octal are one byte in bytes, one code point in text."""
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(body):
        out += body[pos : m.start()].encode()
        simple_, octal, hex2, u4, u8 = m.groups()
        if simple_:
            out += bytes([_SIMPLE[simple_]]) if simple_ in _SIMPLE else simple_.encode()
        elif octal or hex2:
            code = int(octal, 8) if octal else int(hex2, 16)
            out += bytes([code]) if as_bytes else chr(code).encode()
        else:
            out += chr(int(u4 or u8, 16)).encode()
        pos = m.end()
    out += body[pos:].encode()
    return bytes(out) if as_bytes else out.decode("utf-8", errors="surrogatepass")


def literal(tok: lark.Token) -> Lit:
    text = tok.value
    kind = tok.type
    if kind == "BOOL_LIT":
        return Lit("bool", text == "true")
    if kind == "NULL_LIT":
        return Lit("null", None)
    if kind in ("UINT_LIT", "INT_LIT"):
        digits = text[:-1] if kind == "UINT_LIT" else text
        value = int(digits, 16 if "x" in digits.lower() else 10)
        return Lit("uint" if kind == "UINT_LIT" else "int", value)
    if kind == "FLOAT_LIT":
        return Lit("double", float(text))
    as_bytes = kind == "BYTES_LIT"
    if as_bytes:
        text = text[1:]
    raw = text[:1] in ("r", "R")
    if raw:
        text = text[1:]
    quote = 3 if text[:3] in ('"""', "'''") else 1
    body = text[quote:-quote]
    if raw:
        return Lit("bytes" if as_bytes else "string", body.encode() if as_bytes else body)
    return Lit("bytes" if as_bytes else "string", _unescape(body, as_bytes))
