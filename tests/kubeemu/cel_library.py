"""Kubernetes' CEL libraries as celpy extension functions: lists (``isSorted``, ``sum``, ``min``,
``max``, ``indexOf``), the strings extension, regex ``find``/``findAll`` and quantities.

Each function is registered in :data:`EXT` under its CEL name; celpy's transpiled code reaches it
through :data:`EXT_NS`, which the evaluation globals provide as :data:`EXT_MODULE`.
"""

from __future__ import annotations

import decimal
import functools
import re
import types
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

from celpy import celtypes
from celpy.evaluation import CELEvalError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

EXT_MODULE = "_kubeemu_cel"  # name under which transpiled code finds our extension functions
EXT: dict[str, Callable[..., Any]] = {}  # CEL name -> function
EXT_NS = types.SimpleNamespace()


def _ext(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a CEL extension function under ``names``.

    celpy's transpiler emits ``<fn.__module__>.<fn.__qualname__>(...)`` for a call, so each
    function is renamed into a namespace that the evaluation globals provide.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            for a in args:
                if isinstance(a, CELEvalError):
                    return a
            return fn(*args)

        wrapper.__module__ = EXT_MODULE
        wrapper.__qualname__ = "k8s_" + fn.__name__
        setattr(EXT_NS, wrapper.__qualname__, wrapper)
        for n in names:
            EXT[n] = wrapper
        return wrapper

    return deco


def _cel_list(values: Iterable[Any]) -> celtypes.ListType:
    return celtypes.ListType(list(values))


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise TypeError(what)


@_ext("size")
def size(x: Any) -> Any:
    """``size()``; celpy's builds its int through a per-call decorator, this is hot."""
    if isinstance(x, (str, bytes, list, dict)):
        return int.__new__(celtypes.IntType, len(x))
    raise TypeError("size")


@_ext("isSorted")
def is_sorted(lst: Any) -> celtypes.BoolType:
    _need(isinstance(lst, list), "isSorted")
    return celtypes.BoolType(all(lst[i] <= lst[i + 1] for i in range(len(lst) - 1)))


@_ext("sum")
def sum_(lst: Any) -> Any:
    _need(isinstance(lst, list), "sum")
    if not lst:
        return celtypes.IntType(0)
    total = lst[0]
    for x in lst[1:]:
        total = total + x
    return total


@_ext("_k8s_min")
def min_(lst: Any) -> Any:
    _need(isinstance(lst, list), "min")
    if not lst:
        raise ValueError("min called on empty list")
    return min(lst)


@_ext("max")
def max_(lst: Any) -> Any:
    _need(isinstance(lst, list), "max")
    if not lst:
        raise ValueError("max called on empty list")
    return max(lst)


@_ext("indexOf")
def index_of(target: Any, x: Any, offset: Any = None) -> celtypes.IntType:
    if isinstance(target, str):
        _need(isinstance(x, str), "indexOf")
        start = 0 if offset is None else int(offset)
        if start < 0 or start > len(target):
            raise IndexError(f"index out of range: {start}")
        return celtypes.IntType(target.find(x, start))
    _need(isinstance(target, list) and offset is None, "indexOf")
    for i, v in enumerate(target):
        if v == x:
            return celtypes.IntType(i)
    return celtypes.IntType(-1)


@_ext("lastIndexOf")
def last_index_of(target: Any, x: Any, offset: Any = None) -> celtypes.IntType:
    if isinstance(target, str):
        _need(isinstance(x, str), "lastIndexOf")
        end = len(target) if offset is None else int(offset)
        if end < 0 or end > len(target):
            raise IndexError(f"index out of range: {end}")
        return celtypes.IntType(target.rfind(x, 0, end + len(x)))
    _need(isinstance(target, list) and offset is None, "lastIndexOf")
    for i in range(len(target) - 1, -1, -1):
        if target[i] == x:
            return celtypes.IntType(i)
    return celtypes.IntType(-1)


@_ext("charAt")
def char_at(s: Any, i: Any) -> celtypes.StringType:
    _need(isinstance(s, str), "charAt")
    i = int(i)
    if i < 0 or i > len(s):
        raise IndexError(f"index out of range: {i}")
    return celtypes.StringType(s[i : i + 1])


@_ext("lowerAscii")
def lower_ascii(s: Any) -> celtypes.StringType:
    _need(isinstance(s, str), "lowerAscii")
    return celtypes.StringType("".join(c.lower() if c.isascii() else c for c in s))


@_ext("upperAscii")
def upper_ascii(s: Any) -> celtypes.StringType:
    _need(isinstance(s, str), "upperAscii")
    return celtypes.StringType("".join(c.upper() if c.isascii() else c for c in s))


@_ext("replace")
def replace(s: Any, old: Any, new: Any, n: Any = -1) -> celtypes.StringType:
    _need(isinstance(s, str) and isinstance(old, str) and isinstance(new, str), "replace")
    return celtypes.StringType(s.replace(old, new, int(n)))


@_ext("split")
def split(s: Any, sep: Any, n: Any = -1) -> celtypes.ListType:
    _need(isinstance(s, str) and isinstance(sep, str), "split")
    n = int(n)
    if n == 0:
        return celtypes.ListType()
    if sep == "":
        parts = list(s) if n < 0 else [*list(s[: n - 1]), s[n - 1 :]] if s else []
    else:
        parts = s.split(sep, n - 1) if n > 0 else s.split(sep)
    return _cel_list(celtypes.StringType(p) for p in parts)


@_ext("substring")
def substring(s: Any, start: Any, end: Any = None) -> celtypes.StringType:
    _need(isinstance(s, str), "substring")
    b = int(start)
    e = len(s) if end is None else int(end)
    if b < 0 or e > len(s) or b > e:
        raise IndexError(f"index out of range: {b}, {e}")
    return celtypes.StringType(s[b:e])


@_ext("trim")
def trim(s: Any) -> celtypes.StringType:
    _need(isinstance(s, str), "trim")
    return celtypes.StringType(s.strip())


@_ext("join")
def join(lst: Any, sep: Any = "") -> celtypes.StringType:
    _need(isinstance(lst, list) and isinstance(sep, str), "join")
    _need(all(isinstance(x, str) for x in lst), "join")
    return celtypes.StringType(sep.join(lst))


@_ext("reverse")
def reverse(s: Any) -> Any:
    if isinstance(s, str):
        return celtypes.StringType(s[::-1])
    _need(isinstance(s, list), "reverse")
    return celtypes.ListType(s[::-1])


@functools.lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


@_ext("find")
def find(s: Any, pattern: Any) -> celtypes.StringType:
    _need(isinstance(s, str) and isinstance(pattern, str), "find")
    m = _regex(pattern).search(s)
    return celtypes.StringType(m.group(0) if m else "")


@_ext("findAll")
def find_all(s: Any, pattern: Any, n: Any = -1) -> celtypes.ListType:
    _need(isinstance(s, str) and isinstance(pattern, str), "findAll")
    out = [celtypes.StringType(m.group(0)) for m in _regex(pattern).finditer(s)]
    n = int(n)
    return _cel_list(out if n < 0 else out[:n])


_QUANTITY_RE = re.compile(
    r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
_QUANTITY_SUFFIX = {
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}


class _Quantity:
    """A Kubernetes resource.Quantity for CEL's quantity library (exact rational value)."""

    __slots__ = ("text", "value")

    def __init__(self, text: str, value: Fraction) -> None:
        self.text = text
        self.value = value

    @classmethod
    def parse(cls, text: str) -> _Quantity:
        m = _QUANTITY_RE.match(text)
        if m is None:
            raise ValueError(
                "quantities must match the regular expression "
                "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
            )
        number, suffix = m.group(1), m.group(2) or ""
        scale = (
            Fraction(10) ** int(suffix[1:])
            if suffix[:1] in ("e", "E")
            else _QUANTITY_SUFFIX[suffix]
        )
        return cls(text, Fraction(decimal.Decimal(number)) * scale)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Quantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"quantity({self.text!r})"


def _quantity_operand(x: Any) -> Fraction:
    if isinstance(x, _Quantity):
        return x.value
    if type(x) is celtypes.IntType or type(x) is int:
        return Fraction(int(x))
    raise TypeError("no such overload")


@_ext("quantity")
def quantity(s: Any) -> _Quantity:
    _need(isinstance(s, str), "quantity")
    return _Quantity.parse(s)


@_ext("isQuantity")
def is_quantity(s: Any) -> celtypes.BoolType:
    _need(isinstance(s, str), "isQuantity")
    return celtypes.BoolType(_QUANTITY_RE.match(s) is not None)


@_ext("isInteger")
def q_is_integer(q: Any) -> celtypes.BoolType:
    _need(isinstance(q, _Quantity), "isInteger")
    return celtypes.BoolType(q.value.denominator == 1 and INT64_MIN <= q.value <= INT64_MAX)


@_ext("asInteger")
def q_as_integer(q: Any) -> celtypes.IntType:
    _need(isinstance(q, _Quantity), "asInteger")
    if q.value.denominator != 1 or not INT64_MIN <= q.value <= INT64_MAX:
        raise ValueError("cannot convert value to integer")
    return celtypes.IntType(int(q.value))


@_ext("asApproximateFloat")
def q_as_float(q: Any) -> celtypes.DoubleType:
    _need(isinstance(q, _Quantity), "asApproximateFloat")
    return celtypes.DoubleType(float(q.value))


@_ext("sign")
def q_sign(q: Any) -> celtypes.IntType:
    _need(isinstance(q, _Quantity), "sign")
    return celtypes.IntType((q.value > 0) - (q.value < 0))


@_ext("add")
def q_add(q: Any, other: Any) -> _Quantity:
    _need(isinstance(q, _Quantity), "add")
    v = q.value + _quantity_operand(other)
    return _Quantity(str(v), v)


@_ext("sub")
def q_sub(q: Any, other: Any) -> _Quantity:
    _need(isinstance(q, _Quantity), "sub")
    v = q.value - _quantity_operand(other)
    return _Quantity(str(v), v)


@_ext("isGreaterThan")
def q_gt(q: Any, other: Any) -> celtypes.BoolType:
    _need(isinstance(q, _Quantity) and isinstance(other, _Quantity), "isGreaterThan")
    return celtypes.BoolType(q.value > other.value)


@_ext("isLessThan")
def q_lt(q: Any, other: Any) -> celtypes.BoolType:
    _need(isinstance(q, _Quantity) and isinstance(other, _Quantity), "isLessThan")
    return celtypes.BoolType(q.value < other.value)


@_ext("compareTo")
def q_cmp(q: Any, other: Any) -> celtypes.IntType:
    _need(isinstance(q, _Quantity) and isinstance(other, _Quantity), "compareTo")
    return celtypes.IntType((q.value > other.value) - (q.value < other.value))
