"""Custom-resource admission the way kube-apiserver does it for a structural CRD schema.

The emulator's server calls :class:`CRDValidator` for every create/update of a custom resource.
It mirrors the apiserver's pipeline so that operator tests (and ``kubectl apply`` users of the
emulator) see the same objects and the same error messages as on a real cluster (v1.32):

1. pruning of fields the schema does not know (reported, like the server's
   ``unknown field "spec.foo"`` warnings, so the caller can honour ``fieldValidation``);
2. dropping of non-nullable ``null`` values and defaulting (``default`` applied recursively,
   including inside defaults, array items and ``additionalProperties`` maps);
3. OpenAPI v3 value validation with kube-openapi's messages, converted to ``field.Error``
   causes the way ``kubeOpenAPIResultToFieldErrors`` does;
4. ``x-kubernetes-list-type`` set/map uniqueness;
5. CEL ``x-kubernetes-validations`` rules (with ``oldSelf`` transition rules), skipped like the
   server does when a "blocking" schema error (type/required/enum/too long/too many) exists.

CEL is parsed and transpiled to Python by ``celpy`` once per rule; evaluation runs the
transpiled code with a light activation object because celpy's own ``Activation`` spends most
of an evaluation on name resolution (about 6x slower).

Known differences from the real server: no validation ratcheting on update, no CEL cost
budget, CEL type checking at construction only covers field selections on ``self``/``oldSelf``
(a wrong type in a rule shows up as an evaluation error instead), no ``optionalOldSelf``, and
the CEL libraries for URLs, IPs/CIDRs, semver and string formatting are absent (a rule using
them fails :class:`CRDValidator` construction). Embedded resources keep their
``apiVersion``/``kind``/``metadata`` as given (no ObjectMeta checks).
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import decimal
import functools
import ipaddress
import json
import math
import operator
import re
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import celpy
import celpy.evaluation as _celev
import lark
from celpy import celtypes
from celpy.celparser import CELParser
from celpy.evaluation import CELEvalError

__all__ = ["AdmitResult", "CRDSchemaError", "CRDValidator", "format_causes"]

# Reasons (metav1.CauseType values) used in causes.
INVALID = "FieldValueInvalid"
TYPE_INVALID = "FieldValueTypeInvalid"
NOT_SUPPORTED = "FieldValueNotSupported"
REQUIRED = "FieldValueRequired"
TOO_LONG = "FieldValueTooLong"
TOO_MANY = "FieldValueTooMany"
DUPLICATE = "FieldValueDuplicate"
FORBIDDEN = "FieldValueForbidden"

# Schema errors after which the server does not run CEL rules (hasBlockingErr in the
# customresource strategy): the rules could not have been type-checked against such values.
_BLOCKING = frozenset({NOT_SUPPORTED, REQUIRED, TOO_LONG, TOO_MANY, TYPE_INVALID})
_BLOCKED_MSG = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)
_RULE_REASONS = frozenset({INVALID, FORBIDDEN, REQUIRED, DUPLICATE})
_NIL = "<nil>"  # how a nil *field.Path prints; kube-openapi's composite errors carry no path


class CRDSchemaError(ValueError):
    """The CRD cannot be served: a rule does not compile, uses an unsupported function, ...

    Raised at :class:`CRDValidator` construction so the CRD author finds out at once, the way
    the real server rejects such a CRD instead of failing every later request.
    """


@dataclass
class AdmitResult:
    """What admission produced: the object to store and why it must be rejected, if it must."""

    obj: dict
    causes: list[dict] = field(default_factory=list)
    unknown_fields: list[str] = field(default_factory=list)


def format_causes(causes: list[dict]) -> str:
    """Join causes like the server's Status message (``field.ErrorList.ToAggregate``).

    Duplicates are dropped; one error prints bare, several print as ``[a, b]``.
    """
    msgs: list[str] = []
    seen: set[str] = set()
    for cause in causes:
        fld = cause.get("field") or ""
        msg = f"{fld}: {cause['message']}" if fld else cause["message"]
        if msg not in seen:
            seen.add(msg)
            msgs.append(msg)
    if len(msgs) == 1:
        return msgs[0]
    return "[" + ", ".join(msgs) + "]"


# --------------------------------------------------------------------------------------------
# Go-style rendering of values, so messages read exactly like the Go server's.


def _go_float(f: float) -> str:
    """``fmt.Sprintf("%v", f)`` for a float64 (strconv 'g' with the shortest digits)."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "-0" if math.copysign(1.0, f) < 0 else "0"
    sign, digits, exp = decimal.Decimal(repr(f)).normalize().as_tuple()
    ds = "".join(map(str, digits))
    assert isinstance(exp, int)
    dp = len(ds) + exp  # position of the decimal point relative to the digit string
    x = dp - 1
    neg = "-" if sign else ""
    if x < -4 or x >= 6:
        mant = ds[0] + ("." + ds[1:] if len(ds) > 1 else "")
        return f"{neg}{mant}e{'-' if x < 0 else '+'}{abs(x):02d}"
    if dp <= 0:
        return f"{neg}0.{'0' * -dp}{ds}"
    if dp >= len(ds):
        return f"{neg}{ds}{'0' * (dp - len(ds))}"
    return f"{neg}{ds[:dp]}.{ds[dp:]}"


_GO_ESC = {
    "\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v",
    "\\": "\\\\", '"': '\\"',
}


def _go_quote(s: str) -> str:
    """``strconv.Quote``: printable characters stay, the rest is escaped Go-style."""
    out = ['"']
    for ch in s:
        esc = _GO_ESC.get(ch)
        if esc is not None:
            out.append(esc)
        elif ch.isprintable():
            out.append(ch)
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x80 else f"\\u{o:04x}" if o < 0x10000 else
                       f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


def _jsonable(v: Any) -> Any:
    """Integral floats as ints, like Go's JSON encoder prints them."""
    if type(v) is float and v.is_integer() and abs(v) < 1e21:
        return int(v)
    if type(v) is dict:
        return {k: _jsonable(x) for k, x in v.items()}
    if type(v) is list:
        return [_jsonable(x) for x in v]
    return v


def _go_json(v: Any) -> str:
    """``json.Marshal``: sorted keys, no spaces, HTML-escaped."""
    s = json.dumps(_jsonable(v), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _go_sharp_v(v: Any) -> str:
    """``fmt.Sprintf("%#v", v)`` for a decoded-JSON value held in an ``interface{}``."""
    if v is None:
        return "interface {}(nil)"
    if v is True or v is False:
        return "true" if v else "false"
    if type(v) is int:
        return str(v)
    if type(v) is float:
        return _go_float(v)
    if isinstance(v, str):
        return _go_quote(v)
    if isinstance(v, dict):
        inner = ", ".join(f"{_go_quote(k)}:{_go_sharp_v(v[k])}" for k in sorted(v))
        return "map[string]interface {}{" + inner + "}"
    if isinstance(v, list):
        return "[]interface {}{" + ", ".join(_go_sharp_v(x) for x in v) + "}"
    return repr(v)


def _render(v: Any) -> str:
    """A bad value the way ``field.Error.ErrorBody`` prints it in v1.32.

    Scalars print plainly (strings quoted), nil as ``"null"``, composites in Go syntax
    (``%#v``); JSON rendering of composites only arrived in v1.34.
    """
    if v is None:
        return '"null"'
    if v is True:
        return "true"
    if v is False:
        return "false"
    if type(v) is int:
        return str(v)
    if type(v) is float:
        return _go_float(v)
    if isinstance(v, str):
        return _go_quote(v)
    return _go_sharp_v(v)


def _cause(reason: str, fld: str, message: str) -> dict:
    return {"reason": reason, "field": fld or _NIL, "message": message}


def _invalid(fld: str, value: Any, detail: str, reason: str = INVALID) -> dict:
    msg = f"Invalid value: {_render(value)}"
    return _cause(reason, fld, f"{msg}: {detail}" if detail else msg)


# --------------------------------------------------------------------------------------------
# String formats kube-apiserver knows for CRDs (a useful subset; unknown formats pass, as there).

_UUID = r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
_FORMAT_RES = {
    "uuid": re.compile(rf"^{_UUID}$"),
    "uuid3": re.compile(r"^[0-9a-f]{8}-?[0-9a-f]{4}-?3[0-9a-f]{3}-?[0-9a-f]{4}-?[0-9a-f]{12}$",
                        re.I),
    "uuid4": re.compile(
        r"^[0-9a-f]{8}-?[0-9a-f]{4}-?4[0-9a-f]{3}-?[89ab][0-9a-f]{3}-?[0-9a-f]{12}$", re.I),
    "uuid5": re.compile(
        r"^[0-9a-f]{8}-?[0-9a-f]{4}-?5[0-9a-f]{3}-?[89ab][0-9a-f]{3}-?[0-9a-f]{12}$", re.I),
    "hostname": re.compile(
        r"^([a-zA-Z0-9]([-a-zA-Z0-9]{0,61}[a-zA-Z0-9])?)(\.[a-zA-Z0-9]([-a-zA-Z0-9]{0,61}"
        r"[a-zA-Z0-9])?)*\.?$"),
    "email": re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$"),
    "mac": re.compile(r"^([0-9a-fA-F]{2}[:-]){5}[0-9a-fA-F]{2}$"),
    "hexcolor": re.compile(r"^#?([0-9a-fA-F]{3}|[0-9a-fA-F]{6})$"),
    "rgbcolor": re.compile(r"^rgb\(\s*\d{1,3}\s*,\s*\d{1,3}\s*,\s*\d{1,3}\s*\)$"),
    "date": re.compile(r"^\d{4}-\d{2}-\d{2}$"),
    "datetime": re.compile(
        r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"),
    "duration": re.compile(r"^([-+]?(\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d|w))+$"),
    "bsonobjectid": re.compile(r"^[0-9a-fA-F]{24}$"),
}
_FORMAT_RES["date-time"] = _FORMAT_RES["datetime"]


def _format_ok(fmt: str, s: str) -> bool:
    """Whether ``s`` is a valid ``fmt`` string; formats we do not know are not checked."""
    rx = _FORMAT_RES.get(fmt)
    if rx is not None:
        if not rx.match(s):
            return False
        if fmt in ("date", "datetime", "date-time"):
            try:
                _dt.date.fromisoformat(s[:10])
            except ValueError:
                return False
        return True
    try:
        if fmt == "ipv4":
            ipaddress.IPv4Address(s)
        elif fmt == "ipv6":
            ipaddress.IPv6Address(s)
        elif fmt == "cidr":
            ipaddress.ip_network(s, strict=False)
        elif fmt == "byte":
            base64.b64decode(s, validate=True)
    except (ValueError, binascii.Error):
        return False
    return True


# --------------------------------------------------------------------------------------------
# CEL: parser, Kubernetes extension functions, compiled programs.

_EXT_MODULE = "_kubeemu_cel"  # name under which transpiled code finds our extension functions
_EXT: dict[str, Callable[..., Any]] = {}  # CEL name -> function
_EXT_NS = types.SimpleNamespace()


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

        wrapper.__module__ = _EXT_MODULE
        wrapper.__qualname__ = "k8s_" + fn.__name__
        setattr(_EXT_NS, wrapper.__qualname__, wrapper)
        for n in names:
            _EXT[n] = wrapper
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
    r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_QUANTITY_SUFFIX = {
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60), "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1), "k": Fraction(10**3),
    "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15),
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
            raise ValueError("quantities must match the regular expression "
                             "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
        number, suffix = m.group(1), m.group(2) or ""
        scale = (Fraction(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E")
                 else _QUANTITY_SUFFIX[suffix])
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
    return celtypes.BoolType(q.value.denominator == 1 and _INT64_MIN <= q.value <= _INT64_MAX)


@_ext("asInteger")
def q_as_integer(q: Any) -> celtypes.IntType:
    _need(isinstance(q, _Quantity), "asInteger")
    if q.value.denominator != 1 or not _INT64_MIN <= q.value <= _INT64_MAX:
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


# Macros celpy expands itself (the bind-variable forms) and function-like macros.
_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_FUNC_MACROS = frozenset({"has", "dyn"})
# celpy base functions that are real CEL (operators are not called by name).
_BASE = frozenset(
    name for name in _celev.base_functions
    if name[0].isalpha() and name not in ("list", "map", "null_type")
)
_SUPPORTED = _BASE | frozenset(_EXT)
_FUNCTIONS: dict[str, Any] = dict(_EXT)
_SUPPORTED_TEXT = ", ".join(sorted({*(n for n in _SUPPORTED if not n.startswith("_")), "min"}))


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _fast_int(source: Any, *args: Any) -> Any:
    """``IntType(x)`` without celpy's per-call decorator for the common in-range int case."""
    if type(source) is int and _INT64_MIN <= source <= _INT64_MAX:
        return int.__new__(celtypes.IntType, source)
    return celtypes.IntType(source, *args)


_CEL_TRUE = celtypes.BoolType(True)
_CEL_FALSE = celtypes.BoolType(False)


class _Str(celtypes.StringType):
    """StringType with C-level hashing/equality (celpy's delegate to str in Python code, which
    made every map lookup in a rule a pair of Python calls)."""

    __slots__ = ()
    __eq__ = str.__eq__
    __ne__ = str.__ne__
    __hash__ = str.__hash__


class _Map(celtypes.MapType):
    """MapType whose ``get`` (how transpiled code reads ``self.field``) is a plain lookup."""

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return dict.__getitem__(self, key)
        except KeyError:
            if default is not None:
                return default
            raise KeyError(key) from None


_CANONICAL_TYPES: dict[type, type] = {_Str: celtypes.StringType, _Map: celtypes.MapType}


def _cel_type(x: Any) -> Any:
    """``type(x)``, reporting our fast subclasses as the CEL types they stand for."""
    t = celtypes.TypeType(x)
    return _CANONICAL_TYPES.get(t, t)


_RESULT_TEXT: dict[type, str] = {
    ValueError: "return error for overflow",
    TypeError: "no such overload",
    ZeroDivisionError: "divide by zero",
    OverflowError: "return error for overflow",
    IndexError: "invalid_argument",
}


def _result(activation: Any, expr: Callable[[Any], Any]) -> Any:
    """celpy.evaluation.result without its per-call debug logging (same error mapping)."""
    try:
        return expr(activation)
    except (ValueError, KeyError, TypeError, ZeroDivisionError, OverflowError, IndexError,
            NameError) as ex:
        if isinstance(ex, KeyError):
            text = f"no such member in mapping: {ex.args[0]!r}"
        elif isinstance(ex, NameError):
            text = f"undeclared reference to {ex.args[0]!r}"
        else:
            text = _RESULT_TEXT.get(type(ex)) or next(
                (v for k, v in _RESULT_TEXT.items() if isinstance(ex, k)), "evaluation error")
        err = CELEvalError(text, ex.__class__, ex.args)
        err.__cause__ = ex
        return err


def _has(activation: Any, expr: Callable[[Any], Any]) -> celtypes.BoolType:
    """``has(e.f)`` as a CEL bool (celpy's transpiled form yields a Python bool, which its own
    ``!``, ``&&`` and ``||`` then reject)."""
    found = not isinstance(_result(activation, expr), CELEvalError)
    return _CEL_TRUE if found else _CEL_FALSE


def _as_cel_bool(x: Any) -> Any:
    return (_CEL_TRUE if x else _CEL_FALSE) if type(x) is bool else x


def _logical_not(x: Any) -> Any:
    return celtypes.logical_not(_as_cel_bool(x))


def _logical_and(x: Any, y: Any) -> Any:
    x, y = _as_cel_bool(x), _as_cel_bool(y)
    if isinstance(x, CELEvalError) and not isinstance(y, celtypes.BoolType):
        return x  # both sides failed: report the first error, as cel-go does
    return celtypes.logical_and(x, y)


def _logical_or(x: Any, y: Any) -> Any:
    x, y = _as_cel_bool(x), _as_cel_bool(y)
    if isinstance(x, CELEvalError) and not isinstance(y, celtypes.BoolType):
        return x
    return celtypes.logical_or(x, y)


_HAS_RE = re.compile(
    r"not isinstance\(celpy\.evaluation\.result\(activation, (ex_\d+_h)\), CELEvalError\)")


class _EvalGlobals:
    """Globals for exec'ing transpiled rules: celpy's evaluation module plus our extensions.

    Transpiled code reaches celpy through ``celpy.evaluation.X`` / ``celpy.celtypes.X``; the
    ``celpy`` seen here is a private view where the comparison helpers are wrapped once instead
    of on every call and int literals skip a per-call decorator (2-3x faster rules). The real
    celpy modules are not modified.
    """

    base: dict[str, Any] | None = None

    @classmethod
    def new(cls) -> dict[str, Any]:
        if cls.base is None:
            ev = types.ModuleType("_kubeemu_celpy_evaluation")
            ev.__dict__.update(_celev.__dict__)
            for name, op in (("bool_lt", operator.lt), ("bool_le", operator.le),
                             ("bool_gt", operator.gt), ("bool_ge", operator.ge),
                             ("bool_eq", operator.eq), ("bool_ne", operator.ne)):
                setattr(ev, name, _celev.boolean(op))
            ev.result = _result  # type: ignore[attr-defined]
            ct = types.ModuleType("_kubeemu_celpy_celtypes")
            ct.__dict__.update(celtypes.__dict__)
            ct.IntType = _fast_int  # type: ignore[attr-defined]
            ct.logical_not = _logical_not  # type: ignore[attr-defined]
            ct.logical_and = _logical_and  # type: ignore[attr-defined]
            ct.logical_or = _logical_or  # type: ignore[attr-defined]
            ct.TypeType = _cel_type  # type: ignore[attr-defined]
            g = dict(_celev.__dict__)
            g["celpy"] = types.SimpleNamespace(evaluation=ev, celtypes=ct)
            g[_EXT_MODULE] = _EXT_NS
            g["_kubeemu_has"] = _has
            cls.base = g
        return dict(cls.base)


class _Activation:
    """Variables for one evaluation; celpy's transpiled code only needs these members."""

    __slots__ = ("_parent", "_vars")

    def __init__(self, variables: dict[str, Any], parent: _Activation | None = None) -> None:
        self._vars = variables
        self._parent = parent

    def __getattr__(self, name: str) -> Any:
        act: _Activation | None = self
        while act is not None:
            v = act._vars
            if name in v:
                return v[name]
            act = act._parent
        fn = _celev.base_functions.get(name)  # type names such as ``int`` in ``type(x) == int``
        if fn is not None:
            return fn
        raise NameError(name)

    get = __getattr__

    def resolve_variable(self, name: str) -> Any:
        return self.__getattr__(name)

    def nested_activation(self, annotations: Any = None, vars: Any = None) -> _Activation:
        return _Activation(dict(vars or {}), self)


class _Parser:
    """One LALR parser for celpy's grammar producing the tree class its transpiler needs.

    celpy caches a single parser class-wide with whatever tree class the first Environment
    asked for; building our own keeps the transpiler working whatever else uses celpy.
    """

    _lark: lark.Lark | None = None
    _lock = threading.Lock()
    # What celpy's runners read from an Environment (package, annotations); building a real
    # Environment would build celpy's own parser too, a second 0.3 s for nothing.
    env = types.SimpleNamespace(package=None, annotations=dict(celpy.googleapis))

    @classmethod
    def get(cls) -> lark.Lark:
        with cls._lock:
            if cls._lark is None:
                grammar = (Path(celpy.__file__).parent / "cel.lark").read_text()
                cls._lark = lark.Lark(
                    grammar, parser="lalr", start="expr", g_regex_flags=re.M,
                    lexer_callbacks={"IDENT": CELParser.ambiguous_literals},
                    propagate_positions=True, maybe_placeholders=False, priority="invert",
                    tree_class=_celev.TranspilerTree,
                )
            return cls._lark


class _CelProgram:
    """A CEL expression compiled once: parsed, checked for supported functions, transpiled."""

    def __init__(self, source: str, where: str, node: _Node | None = None) -> None:
        parser = _Parser.get()
        try:
            ast = parser.parse(source)
        except lark.exceptions.UnexpectedInput as ex:
            raise CRDSchemaError(
                f"{where}: compilation failed: {ex.get_context(source).rstrip()}") from ex
        if node is not None:
            _check_fields(ast, node, where)
        self.idents: set[str] = set()
        for node in ast.iter_subtrees():
            if node.data == "member_dot_arg":
                tok = node.children[1]
                name = tok.value
                if name in _MACROS:
                    continue
                if name == "min" and len(node.children) == 2:
                    # celpy treats ``min`` as a two-argument macro; Kubernetes' lists library
                    # means ``list.min()``. Route it to our function.
                    node.children[1] = lark.Token("IDENT", "_k8s_min")
                    continue
                if name not in _SUPPORTED:
                    raise CRDSchemaError(
                        f"{where}: compilation failed: function {name!r} is not supported by "
                        f"the emulator (supported: {_SUPPORTED_TEXT})")
            elif node.data == "ident_arg":
                name = node.children[0].value
                if name not in _FUNC_MACROS and name not in _SUPPORTED:
                    raise CRDSchemaError(
                        f"{where}: compilation failed: function {name!r} is not supported by "
                        f"the emulator (supported: {_SUPPORTED_TEXT})")
            elif node.data == "dot_ident_arg":
                raise CRDSchemaError(f"{where}: compilation failed: qualified function calls "
                                     "are not supported by the emulator")
            elif node.data == "ident":
                self.idents.add(node.children[0].value)
        try:
            runner = celpy.CompiledRunner(_Parser.env, ast, _FUNCTIONS)  # type: ignore[arg-type]
        except Exception as ex:  # celpy reports transpilation problems with various types
            raise CRDSchemaError(f"{where}: compilation failed: {ex}") from ex
        source_text = _HAS_RE.sub(r"_kubeemu_has(activation, \1)",
                                  runner.tp.source_text)  # type: ignore[attr-defined]
        self.code = compile(source_text, f"<cel {where}>", "exec")
        self.source = source
        self._globals = _EvalGlobals.new()

    def run(self, variables: dict[str, Any]) -> Any:
        """Evaluate; returns the CEL value or a CELEvalError (never raises for CEL errors)."""
        g = self._globals
        g["base_activation"] = _Activation(variables)
        try:
            exec(self.code, g)
        except Exception as ex:  # an error outside celpy's checked-exception wrapper
            return CELEvalError(str(ex), type(ex), ex.args)
        return g["CEL"]


_DYNAMIC = object()  # a value whose schema is unknown to the static check
_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def _schema_of(tree: Any, node: _Node) -> Any:
    """The schema node a CEL member expression reads (``self.a[0].b``), or _DYNAMIC."""
    data = getattr(tree, "data", None)
    if data in ("member", "primary"):
        return _schema_of(tree.children[0], node)
    if data == "ident":
        return node if tree.children[0].value in ("self", "oldSelf") else _DYNAMIC
    if data == "member_dot":
        parent = _schema_of(tree.children[0], node)
        if not isinstance(parent, _Node):
            return _DYNAMIC
        name = tree.children[1].value
        if parent.resource_root and name in _ROOT_FIELDS:
            return _DYNAMIC
        if parent.properties is not None:
            for prop, escaped in parent.escaped.items():
                if escaped == name:
                    return parent.properties[prop]
            return _DYNAMIC if parent.preserve_unknown else None
        return parent.additional if parent.additional is not None else _DYNAMIC
    if data == "member_index":
        parent = _schema_of(tree.children[0], node)
        if isinstance(parent, _Node):
            if parent.items is not None:
                return parent.items
            if parent.additional is not None:
                return parent.additional
        return _DYNAMIC
    return _DYNAMIC


def _check_fields(ast: Any, node: _Node, where: str) -> None:
    """Reject ``self.field`` selections the schema does not declare, like the server's CEL type
    check does at CRD creation (so a typo in a rule fails fast instead of at every request)."""
    for sub in ast.iter_subtrees_topdown():
        if sub.data == "member_dot" and _schema_of(sub, node) is None:
            name = sub.children[1].value
            raise CRDSchemaError(f"{where}: compilation failed: undefined field '{name}'")


def _eval_error_text(err: CELEvalError) -> str:
    """A celpy evaluation error in cel-go's words (as seen in apiserver messages)."""
    args = err.args
    msg = str(args[0]) if args else "evaluation error"
    cls = args[1] if len(args) > 1 else None
    exargs = args[2] if len(args) > 2 and isinstance(args[2], tuple) else ()
    if cls is CELEvalError and exargs:  # wrapped by celpy's runner
        return _eval_error_text(CELEvalError(*exargs))
    if cls is KeyError:
        return f"no such key: {exargs[0] if exargs else msg}"
    if cls is ZeroDivisionError:
        return "division by zero"
    if cls is IndexError:
        detail = str(exargs[0]) if exargs else ""
        return "index out of bounds" + (f": {detail}" if detail.startswith("index") else "")
    if cls is TypeError or msg.startswith("no such overload"):
        return "no such overload"
    if cls is NameError:
        return f"undeclared reference to '{exargs[0] if exargs else msg}'"
    if msg == "return error for overflow":
        detail = str(exargs[0]) if exargs else ""
        return "integer overflow" if detail in ("", "overflow") else detail
    return msg


# --------------------------------------------------------------------------------------------
# Compiled schema.

_RESERVED = frozenset((
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
    "function", "if", "import", "let", "loop", "package", "namespace", "return", "var", "void",
    "while",
))
_ESCAPES = {"__": "__underscores__", ".": "__dot__", "-": "__dash__", "/": "__slash__"}
_ESCAPE_RE = re.compile(r"__|[./-]")
_IDENT_CHARS = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")


def _cel_escape(name: str) -> str | None:
    """Property name as CEL sees it (``foo-bar`` -> ``foo__dash__bar``); None if unreachable."""
    if name in _RESERVED:
        return f"__{name}__"
    if not _IDENT_CHARS.match(name):
        return None
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], name)


@dataclass
class _Rule:
    rule: str
    program: _CelProgram
    message: str
    message_program: _CelProgram | None
    field_suffix: str  # normalised fieldPath, "" when none
    reason: str
    uses_old: bool


class _Node:
    """One schema node, with everything admission needs precomputed."""

    def __init__(self, schema: dict, where: str, *, resource_root: bool = False) -> None:
        if not isinstance(schema, dict):
            raise CRDSchemaError(f"{where}: schema must be an object")
        self.where = where
        self.type: str = schema.get("type") or ""
        self.int_or_string = bool(schema.get("x-kubernetes-int-or-string"))
        self.types: tuple[str, ...] = (
            ("integer", "string") if self.int_or_string else (self.type,) if self.type else ())
        self.nullable = bool(schema.get("nullable"))
        self.preserve_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        self.embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        self.resource_root = resource_root or self.embedded
        self.has_default = "default" in schema
        self.default = schema.get("default")
        self.format: str = schema.get("format") or ""
        self.enum: list | None = schema.get("enum")
        self.maximum = schema.get("maximum")
        self.minimum = schema.get("minimum")
        self.exclusive_maximum = bool(schema.get("exclusiveMaximum"))
        self.exclusive_minimum = bool(schema.get("exclusiveMinimum"))
        self.multiple_of = schema.get("multipleOf")
        self.max_length = schema.get("maxLength")
        self.min_length = schema.get("minLength")
        pattern = schema.get("pattern")
        try:
            self.pattern = re.compile(pattern) if pattern is not None else None
        except re.error as ex:
            raise CRDSchemaError(f"{where}.pattern: {pattern!r}: {ex}") from ex
        self.pattern_src = pattern
        self.max_items = schema.get("maxItems")
        self.min_items = schema.get("minItems")
        self.unique_items = bool(schema.get("uniqueItems"))
        self.max_properties = schema.get("maxProperties")
        self.min_properties = schema.get("minProperties")
        self.required: list[str] = list(schema.get("required") or [])
        self.list_type: str = schema.get("x-kubernetes-list-type") or ""
        self.list_map_keys: list[str] = list(schema.get("x-kubernetes-list-map-keys") or [])
        self.map_atomic = schema.get("x-kubernetes-map-type") == "atomic"

        props = schema.get("properties")
        self.properties: dict[str, _Node] | None = (
            {k: _Node(v, f"{where}.properties[{k}]") for k, v in props.items()}
            if props else None)
        self.defaulted = [(k, n) for k, n in (self.properties or {}).items() if n.has_default]
        self.escaped = {k: _cel_escape(k) for k in (self.properties or {})}
        ap = schema.get("additionalProperties")
        self.additional: _Node | None = None
        self.additional_true = ap is True
        if isinstance(ap, dict):
            self.additional = _Node(ap, f"{where}.additionalProperties")
        items = schema.get("items")
        self.items: _Node | None = _Node(items, f"{where}.items") if isinstance(items, dict) \
            else None
        self.all_of = [_Node(s, f"{where}.allOf[{i}]") for i, s in
                       enumerate(schema.get("allOf") or [])]
        self.any_of = [_Node(s, f"{where}.anyOf[{i}]") for i, s in
                       enumerate(schema.get("anyOf") or [])]
        self.one_of = [_Node(s, f"{where}.oneOf[{i}]") for i, s in
                       enumerate(schema.get("oneOf") or [])]
        self.not_: _Node | None = _Node(schema["not"], f"{where}.not") if "not" in schema \
            else None

        if self.list_type == "map":
            if not self.list_map_keys:
                raise CRDSchemaError(f"{where}: x-kubernetes-list-map-keys must be set for "
                                     "x-kubernetes-list-type: map")
        elif self.list_map_keys:
            raise CRDSchemaError(f"{where}: x-kubernetes-list-map-keys requires "
                                 "x-kubernetes-list-type: map")
        if self.list_type and self.list_type not in ("atomic", "set", "map"):
            raise CRDSchemaError(f"{where}: unsupported x-kubernetes-list-type "
                                 f"{self.list_type!r}")

        self.rules = [self._compile_rule(r, i) for i, r in
                      enumerate(schema.get("x-kubernetes-validations") or [])]
        children = [*(self.properties or {}).values()]
        if self.additional is not None:
            children.append(self.additional)
        if self.items is not None:
            children.append(self.items)
        self.rules_below = bool(self.rules) or any(c.rules_below for c in children)
        self.listtype_below = bool(self.list_type in ("set", "map")) or any(
            c.listtype_below for c in children)

    def _compile_rule(self, spec: dict, i: int) -> _Rule:
        where = f"{self.where}.x-kubernetes-validations[{i}]"
        rule = spec.get("rule")
        if not isinstance(rule, str) or not rule.strip():
            raise CRDSchemaError(f"{where}.rule: Required value")
        program = _CelProgram(rule, f"{where}.rule", self)
        msg_expr = spec.get("messageExpression")
        msg_program = (_CelProgram(msg_expr, f"{where}.messageExpression", self) if msg_expr
                       else None)
        reason = spec.get("reason") or INVALID
        if reason not in _RULE_REASONS:
            raise CRDSchemaError(f"{where}.reason: Unsupported value: {_go_quote(reason)}")
        if spec.get("optionalOldSelf"):
            raise CRDSchemaError(f"{where}.optionalOldSelf: not supported by the emulator "
                                 "(needs CEL optional types)")
        message = (spec.get("message") or "").strip()
        suffix = self._field_path(spec["fieldPath"], f"{where}.fieldPath") \
            if spec.get("fieldPath") else ""
        uses_old = "oldSelf" in program.idents or (
            msg_program is not None and "oldSelf" in msg_program.idents)
        return _Rule(rule, program, message, msg_program, suffix, reason, uses_old)

    def _field_path(self, path: str, where: str) -> str:
        """Validate a rule's fieldPath against the schema; return it normalised (``a.b[k]``)."""
        tokens = re.findall(r"\.([^.\[\]]+)|\['((?:[^'\\]|\\.)*)'\]|(.)", path)
        node: _Node | None = self
        out = ""
        for named, quoted, junk in tokens:
            if junk or node is None:
                raise CRDSchemaError(f"{where}: Invalid value: {_go_quote(path)}: fieldPath "
                                     "must be a valid path")
            name = named or quoted.replace("\\'", "'").replace("\\\\", "\\")
            if node.properties is not None:
                if name not in node.properties:
                    raise CRDSchemaError(f"{where}: Invalid value: {_go_quote(path)}: fieldPath "
                                         "must be a valid path: does not refer to a valid field")
                out += ("." if out else "") + name
                node = node.properties[name]
            elif node.additional is not None:
                out += f"[{name}]"
                node = node.additional
            else:
                raise CRDSchemaError(f"{where}: Invalid value: {_go_quote(path)}: fieldPath "
                                     "must be a valid path: does not refer to a valid field")
        return out

    def child(self, key: str) -> _Node | None:
        if self.properties is not None:
            n = self.properties.get(key)
            if n is not None:
                return n
        return self.additional


# --------------------------------------------------------------------------------------------
# Helpers for values.


def _copy(v: Any) -> Any:
    t = type(v)
    if t is dict:
        return {k: _copy(x) for k, x in v.items()}
    if t is list:
        return [_copy(x) for x in v]
    return v


def _kind(v: Any) -> str:
    """The OpenAPI type name of a JSON value (what kube-openapi's type validator reports)."""
    t = type(v)
    if t is str:
        return "string"
    if t is bool:
        return "boolean"
    if t is int:
        return "integer"
    if t is float:
        return "number"
    if t is dict:
        return "object"
    if t is list:
        return "array"
    if v is None:
        return "null"
    return t.__name__


def _canon(v: Any) -> str:
    """A key under which two JSON values are equal iff Go's reflect.DeepEqual says so."""
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _enum_has(enum: list, v: Any) -> bool:
    tv = type(v)
    for e in enum:
        te = type(e)
        if tv is bool or te is bool:
            if tv is te and v == e:
                return True
        elif tv in (int, float) and te in (int, float):
            if v == e:
                return True
        elif tv is te and v == e:
            return True
    return False


def _enum_values(enum: list) -> str:
    return ", ".join(_go_quote(e if isinstance(e, str) else _go_json(e)) for e in enum)


_INT_RANGES = {
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
    "": (-(2**63), 2**63 - 1),
    "int64": (-(2**63), 2**63 - 1),
}


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


# --------------------------------------------------------------------------------------------
# The validator.


class CRDValidator:
    """Admission of one version of one CRD: prune, default, validate (schema, list types, CEL).

    Construction compiles every CEL rule and raises :class:`CRDSchemaError` for anything the
    real server would have refused at CRD creation (syntax errors, invalid ``fieldPath``) and for
    CEL functions this emulator does not implement.
    """

    def __init__(self, crd: dict, version: str) -> None:
        spec = crd.get("spec") or {}
        versions = spec.get("versions") or []
        ver = next((v for v in versions if v.get("name") == version), None)
        if ver is None:
            names = [v.get("name") for v in versions]
            raise CRDSchemaError(f"CRD has no version {version!r} (versions: {names})")
        schema = ((ver.get("schema") or {}).get("openAPIV3Schema")
                  or (spec.get("validation") or {}).get("openAPIV3Schema"))
        if not isinstance(schema, dict):
            raise CRDSchemaError(f"version {version!r} has no openAPIV3Schema")
        self.kind = ((spec.get("names") or {}).get("kind")) or ""
        self.version = version
        subresources = ver.get("subresources") or spec.get("subresources") or {}
        self.has_status = "status" in subresources
        self.root = _Node(schema, "openAPIV3Schema", resource_root=True)
        self._lock = threading.Lock()  # transpiled rules share one globals dict each

    # ---- public -------------------------------------------------------------------------

    def admit(self, obj: dict, old: dict | None, *, field_validation: str = "Strict",
              subresource: str | None = None) -> AdmitResult:
        """Prune + default a copy of ``obj`` and validate it (see the module docstring).

        ``subresource="status"`` admits only ``.status``; otherwise ``.status`` is left as is
        when the CRD has a status subresource. ``old`` (the stored object on update) feeds
        ``oldSelf`` in transition rules. ``field_validation`` is the caller's business:
        unknown fields are always pruned and reported.
        """
        del field_validation  # the caller decides what unknown fields mean
        if subresource not in (None, "status"):
            raise ValueError(f"unsupported subresource {subresource!r}")
        unknown: list[str] = []
        if subresource == "status":
            out = {k: _copy(v) for k, v in obj.items() if k != "status"}
            node = (self.root.properties or {}).get("status")
            if "status" in obj:
                out["status"] = self._normalize(obj["status"], node, "status", unknown)
            roots = [("status", node)]
        else:
            skip = "status" if self.has_status else None
            out = self._normalize(obj, self.root, "", unknown, skip=skip)
            roots = [("", self.root)]

        causes: list[dict] = []
        name = (obj.get("metadata") or {}).get("name")
        if isinstance(name, str) and len(name) > 253:
            causes.append(_invalid("metadata.name", name, "must be no more than 253 characters"))
        list_causes: list[dict] = []
        for key, node in roots:
            if node is None:
                continue
            if key:
                if key in out:
                    self._validate(out[key], node, key, key, causes, list_causes)
            else:
                self._validate(out, node, "", "", causes, list_causes,
                               skip="status" if self.has_status else None)
        causes.extend(list_causes)

        if any(c["reason"] in _BLOCKING for c in causes):
            if self.root.rules_below:
                causes.append(_invalid(_NIL, None, _BLOCKED_MSG))
            return AdmitResult(out, causes, unknown)

        if self.root.rules_below:
            with self._lock:
                for key, node in roots:
                    if node is None or not node.rules_below:
                        continue
                    if key:
                        if key in out:
                            old_v = old.get(key) if isinstance(old, dict) else None
                            self._cel(out[key], node, key, None, old_v, None, causes)
                    else:
                        self._cel(out, node, "", None, old, None, causes,
                                  skip="status" if self.has_status else None)
        return AdmitResult(out, causes, unknown)

    # ---- pruning and defaulting ---------------------------------------------------------

    def _normalize(self, v: Any, node: _Node | None, path: str, unknown: list[str] | None,
                   skip: str | None = None) -> Any:
        """Copy ``v``, dropping unknown fields and non-nullable nulls, applying defaults."""
        if node is None:
            return _copy(v)
        t = type(v)
        if t is dict:
            props = node.properties
            ap = node.additional
            keep = node.preserve_unknown or node.additional_true
            out: dict[str, Any] = {}
            for k, x in v.items():
                if k == skip or (node.resource_root and k in ("apiVersion", "kind", "metadata")):
                    out[k] = _copy(x)
                    continue
                child = props.get(k) if props is not None else None
                if child is None:
                    child = ap
                    if child is None:
                        if keep:
                            out[k] = _copy(x)
                        elif unknown is not None:
                            unknown.append(f"{path}.{k}" if path else k)
                        continue
                if x is None and not child.nullable:
                    if not child.has_default:
                        continue  # PruneNonNullableNullsWithoutDefaults
                    out[k] = self._normalize(_copy(child.default), child,
                                             f"{path}.{k}" if path else k, None)
                    continue
                out[k] = self._normalize(x, child, f"{path}.{k}" if path else k, unknown)
            for k, child in node.defaulted:
                if k not in out and k != skip:
                    out[k] = self._normalize(_copy(child.default), child,
                                             f"{path}.{k}" if path else k, None)
            return out
        if t is list:
            items = node.items
            if items is None:
                return _copy(v)
            res = []
            for i, x in enumerate(v):
                if x is None and not items.nullable and items.has_default:
                    res.append(self._normalize(_copy(items.default), items, f"{path}[{i}]", None))
                else:
                    res.append(self._normalize(x, items, f"{path}[{i}]", unknown))
            return res
        if t is float and node.type == "integer" and v.is_integer():
            return int(v)  # Go's JSON round trip stores 1.0 as 1
        return v

    # ---- OpenAPI value validation -------------------------------------------------------

    def _validate(self, v: Any, node: _Node, name: str, lpath: str, errs: list[dict],
                  lerrs: list[dict] | None, skip: str | None = None) -> None:
        """kube-openapi's SchemaValidator, errors converted as the apiserver converts them.

        ``name`` is kube-openapi's path (map keys joined with "."), ``lpath`` the field.Path
        the list-type check reports (map keys as ``[key]``); ``lerrs`` collects the latter.
        """
        if v is None:
            if node.types and not node.nullable:
                tname = ",".join(node.types)
                errs.append(_invalid(name, "null", f'{name} in body must be of type {tname}: '
                                     '"null"', TYPE_INVALID))
            if node.enum and not _enum_has(node.enum, v):
                errs.append(_cause(NOT_SUPPORTED, name, f"Unsupported value: null: supported "
                                   f"values: {_enum_values(node.enum)}"))
            return
        kind = _kind(v)
        types_ = node.types
        if types_ and kind not in types_ and not (
            (kind == "integer" and "number" in types_)
            or (kind == "number" and "integer" in types_ and v.is_integer())
        ):
            errs.append(_invalid(name, kind, f"{name} in body must be of type "
                                 f"{','.join(types_)}: {_go_quote(kind)}", TYPE_INVALID))
        if node.any_of or node.one_of or node.all_of or node.not_ is not None:
            self._validate_combinators(v, node, name, errs)
        if kind == "string":
            self._validate_string(v, node, name, errs)
        elif kind in ("integer", "number"):
            self._validate_number(v, node, name, errs)
        elif kind == "array":
            if lerrs is not None and node.list_type in ("set", "map"):
                self._validate_list_type(v, node, lpath, lerrs)
            items = node.items
            if items is not None:
                for i, x in enumerate(v):
                    self._validate(x, items, f"{name}[{i}]", f"{lpath}[{i}]", errs, lerrs)
            n = len(v)
            if node.min_items is not None and n < node.min_items:
                errs.append(_invalid(name, n, f"{name} in body should have at least "
                                     f"{node.min_items} items"))
            if node.max_items is not None and n > node.max_items:
                errs.append(_cause(TOO_MANY, name, f"Too many: {n}: must have at most "
                                   f"{node.max_items} {_plural(node.max_items, 'item', 'items')}"))
            if node.unique_items and len({_canon(x) for x in v}) != n:
                errs.append(_invalid(name, "", f"{name} in body shouldn't contain duplicates"))
        if node.enum and not _enum_has(node.enum, v):
            errs.append(_cause(NOT_SUPPORTED, name, f"Unsupported value: {_render(v)}: "
                               f"supported values: {_enum_values(node.enum)}"))
        if kind == "object":
            self._validate_object(v, node, name, lpath, errs, lerrs, skip)

    def _validate_object(self, v: dict, node: _Node, name: str, lpath: str, errs: list[dict],
                         lerrs: list[dict] | None, skip: str | None) -> None:
        n = len(v)
        if node.min_properties is not None and n < node.min_properties:
            errs.append(_invalid(name, n, f"{name} in body should have at least "
                                 f"{node.min_properties} properties"))
            return
        if node.max_properties is not None and n > node.max_properties:
            errs.append(_cause(TOO_MANY, name, f"Too many: {n}: must have at most "
                               f"{node.max_properties} "
                               f"{_plural(node.max_properties, 'item', 'items')}"))
            return
        props = node.properties or {}
        ap = node.additional
        if ap is not None:
            for k, x in v.items():
                if k not in props and k != skip:
                    self._validate(x, ap, f"{name}.{k}" if name else k,
                                   f"{lpath}[{k}]", errs, lerrs)
        for k, child in props.items():
            if k in v and k != skip:
                if node.resource_root and k == "metadata":
                    self._validate(v[k], child, k, k, errs, None)
                    continue
                self._validate(v[k], child, f"{name}.{k}" if name else k,
                               f"{lpath}.{k}" if lpath else k, errs, lerrs)
        for k in node.required:
            if k not in v and k != skip:
                errs.append(_cause(REQUIRED, f"{name}.{k}" if name else k, "Required value"))

    def _validate_string(self, v: str, node: _Node, name: str, errs: list[dict]) -> None:
        if node.max_length is not None and len(v) > node.max_length:
            errs.append(_cause(TOO_LONG, name, f"Too long: may not be more than "
                               f"{node.max_length} "
                               f"{_plural(node.max_length, 'byte', 'bytes')}"))
        elif node.min_length is not None and len(v) < node.min_length:
            errs.append(_invalid(name, v, f"{name} in body should be at least "
                                 f"{node.min_length} chars long"))
        elif node.pattern is not None and not node.pattern.search(v):
            errs.append(_invalid(name, v, f"{name} in body should match '{node.pattern_src}'"))
        if node.format and not _format_ok(node.format, v):
            errs.append(_invalid(name, v, f"{name} in body must be of type {node.format}: "
                                 f"{_go_quote(v)}", TYPE_INVALID))

    def _validate_number(self, v: int | float, node: _Node, name: str,
                         errs: list[dict]) -> None:
        if node.type == "integer":
            lo_hi = _INT_RANGES.get(node.format)
            if lo_hi is not None and (
                (type(v) is float and not v.is_integer()) or not lo_hi[0] <= v <= lo_hi[1]
            ):
                fmt = f" with format {node.format}" if node.format else ""
                errs.append(_invalid(_NIL, "", f"Checked value must be of type integer{fmt} "
                                     f"in {name}"))
        m = node.multiple_of
        if m is not None:
            if type(v) is int and float(m).is_integer() and m != 0:
                if v % int(m):
                    errs.append(_invalid(name, v, f"{name} in body should be a multiple of "
                                         f"{int(m)}"))
            elif m != 0:
                q = v / m
                if not (math.isfinite(q) and float(q).is_integer()):
                    errs.append(_invalid(name, v, f"{name} in body should be a multiple of "
                                         f"{_fmt_bound(v, m)}"))
        if node.maximum is not None:
            mx = node.maximum
            bad = v >= mx if node.exclusive_maximum else v > mx
            if bad:
                rel = "less than" if node.exclusive_maximum else "less than or equal to"
                errs.append(_invalid(name, v, f"{name} in body should be {rel} "
                                     f"{_fmt_bound(v, mx)}"))
        if node.minimum is not None:
            mn = node.minimum
            bad = v <= mn if node.exclusive_minimum else v < mn
            if bad:
                rel = "greater than" if node.exclusive_minimum else "greater than or equal to"
                errs.append(_invalid(name, v, f"{name} in body should be {rel} "
                                     f"{_fmt_bound(v, mn)}"))

    def _validate_combinators(self, v: Any, node: _Node, name: str, errs: list[dict]) -> None:
        if node.any_of:
            best: list[dict] | None = None
            for sub in node.any_of:
                sub_errs: list[dict] = []
                self._validate(v, sub, name, name, sub_errs, None)
                if not sub_errs:
                    best = None
                    break
                if best is None or len(sub_errs) < len(best):
                    best = sub_errs
            else:
                errs.append(_invalid(_NIL, "", f"{_go_quote(name)} must validate at least one "
                                     "schema (anyOf)"))
            if best:
                errs.extend(best)
        if node.one_of:
            valid = 0
            best = None
            for sub in node.one_of:
                sub_errs = []
                self._validate(v, sub, name, name, sub_errs, None)
                if not sub_errs:
                    valid += 1
                elif valid == 0 and (best is None or len(sub_errs) < len(best)):
                    best = sub_errs
            if valid != 1:
                extra = "Found none valid" if valid == 0 else f"Found {valid} valid alternatives"
                errs.append(_invalid(_NIL, "", f"{_go_quote(name)} must validate one and only one "
                                     f"schema (oneOf). {extra}"))
                if valid == 0 and best:
                    errs.extend(best)
        if node.all_of:
            valid = 0
            for sub in node.all_of:
                sub_errs = []
                self._validate(v, sub, name, name, sub_errs, None)
                if not sub_errs:
                    valid += 1
                errs.extend(sub_errs)
            if valid != len(node.all_of):
                extra = ". None validated" if valid == 0 else ""
                errs.append(_invalid(_NIL, "", f"{_go_quote(name)} must validate all the schemas "
                                     f"(allOf){extra}"))
        if node.not_ is not None:
            sub_errs = []
            self._validate(v, node.not_, name, name, sub_errs, None)
            if not sub_errs:
                errs.append(_invalid(_NIL, "", f"{_go_quote(name)} must not validate the "
                                     "schema (not)"))

    def _validate_list_type(self, v: list, node: _Node, lpath: str, lerrs: list[dict]) -> None:
        """``x-kubernetes-list-type`` set/map invariants (structurallisttype in the server)."""
        if node.list_type == "set":
            seen: set[str] = set()
            for i, x in enumerate(v):
                key = _canon(x)
                if key in seen:
                    lerrs.append(_cause(DUPLICATE, f"{lpath}[{i}]",
                                        f"Duplicate value: {_render(x)}"))
                seen.add(key)
            return
        for i, x in enumerate(v):
            if x is not None and type(x) is not dict:
                lerrs.append(_invalid(f"{lpath}[{i}]", x,
                                      "must be an object for an array of list-type map"))
                return
        keys = node.list_map_keys
        seen = set()
        for i, x in enumerate(v):
            kv = {k: x[k] for k in keys if k in x} if x else {}
            key = _canon(kv)
            if key in seen:
                lerrs.append(_cause(DUPLICATE, f"{lpath}[{i}]", f"Duplicate value: {_render(kv)}"))
            seen.add(key)

    # ---- CEL --------------------------------------------------------------------------

    def _cel(self, v: Any, node: _Node, path: str, cv: Any, old: Any, old_cv: Any,
             errs: list[dict], skip: str | None = None) -> None:
        """Evaluate the rules at ``node`` then below it (parents first, like the server)."""
        if v is None:
            return  # rules only see non-null values
        if node.rules:
            if cv is None:
                cv = _to_cel(v, node)
            for rule in node.rules:
                if rule.uses_old:
                    if old is None:
                        continue  # transition rules need an old value at this path
                    if old_cv is None:
                        old_cv = _to_cel(old, node)
                    variables = {"self": cv, "oldSelf": old_cv}
                else:
                    variables = {"self": cv}
                self._run_rule(rule, node, path, variables, errs)
        t = type(v)
        if t is dict:
            props = node.properties
            ap = node.additional
            old_d = old if type(old) is dict and not node.map_atomic else None
            for k, x in v.items():
                if k == skip:
                    continue
                child = props.get(k) if props is not None else None
                if child is not None:
                    if not child.rules_below:
                        continue
                    ck = node.escaped.get(k)
                    sub = f"{path}.{k}" if path else k
                elif ap is not None and ap.rules_below:
                    child, ck, sub = ap, k, f"{path}[{k}]"
                else:
                    continue
                ccv = dict.get(cv, ck) if cv is not None and ck is not None else None
                oldx = old_d.get(k) if old_d is not None else None
                self._cel(x, child, sub, ccv, oldx, None, errs)
        elif t is list:
            items = node.items
            if items is None or not items.rules_below:
                return
            olds: dict[str, Any] = {}
            if node.list_type == "map" and type(old) is list:
                keys = node.list_map_keys
                for o in old:
                    if type(o) is dict:
                        olds[_canon({k: o.get(k) for k in keys})] = o
            for i, x in enumerate(v):
                oldx = None
                if olds and type(x) is dict:
                    oldx = olds.get(_canon({k: x.get(k) for k in node.list_map_keys}))
                ccv = cv[i] if cv is not None else None
                self._cel(x, items, f"{path}[{i}]", ccv, oldx, None, errs)

    def _run_rule(self, rule: _Rule, node: _Node, path: str, variables: dict[str, Any],
                  errs: list[dict]) -> None:
        res = rule.program.run(variables)
        err_field = path or _NIL
        rule_str = rule.message or rule.rule.strip()
        if isinstance(res, CELEvalError):
            text = _eval_error_text(res)
            if text == "no such overload":
                detail = ("'no such overload': call arguments did not match a supported "
                          f"operator, function or macro signature for rule: {rule_str}")
            else:
                detail = f"{text} evaluating rule: {rule_str}"
            errs.append(_invalid(err_field, node.type, detail))
            return
        if type(res) is celtypes.BoolType or type(res) is bool:
            if res:
                return
        else:
            errs.append(_invalid(err_field, node.type, f"rule did not evaluate to a bool: "
                                 f"{rule_str}"))
            return
        fld = path
        if rule.field_suffix:
            fld = f"{path}.{rule.field_suffix}" if path else rule.field_suffix
        detail = ""
        if rule.message_program is not None:
            m = rule.message_program.run(variables)
            if isinstance(m, str) and m.strip() and "\n" not in m.strip():
                detail = m.strip()
        if not detail:
            detail = rule.message or f"failed rule: {rule.rule.strip()}"
        fld = fld or _NIL
        if rule.reason == FORBIDDEN:
            errs.append(_cause(FORBIDDEN, fld, f"Forbidden: {detail}"))
        elif rule.reason == REQUIRED:
            errs.append(_cause(REQUIRED, fld, f"Required value: {detail}"))
        elif rule.reason == DUPLICATE:
            errs.append(_cause(DUPLICATE, fld, f"Duplicate value: {_render(node.type)}"))
        else:
            errs.append(_invalid(fld, node.type, detail))


def _fmt_bound(v: int | float, bound: int | float) -> str:
    """A min/max/multipleOf bound as kube-openapi prints it (int for int data, else %v)."""
    if type(v) is int and float(bound).is_integer():
        return str(int(bound))
    return _go_float(float(bound))


# --------------------------------------------------------------------------------------------
# JSON -> CEL values, following the schema (escaped property names, typed formats).

_StringType = _Str
_IntType = celtypes.IntType
_DoubleType = celtypes.DoubleType
_MapType = _Map
_ListType = celtypes.ListType
_TRUE = celtypes.BoolType(True)
_FALSE = celtypes.BoolType(False)
_META_VISIBLE = ("name", "generateName")
_new_str = str.__new__
_new_int = int.__new__
_new_float = float.__new__


def _to_cel(v: Any, node: _Node | None) -> Any:
    """JSON value -> CEL value (constructors bypassed: celpy's are slow for plain values)."""
    t = type(v)
    if t is str:
        if node is not None and node.format in ("date-time", "date", "duration", "byte"):
            return _typed_string(v, node.format)
        return _new_str(_StringType, v)
    if t is bool:
        return _TRUE if v else _FALSE
    if t is int:
        if (node is not None and node.type == "number") or not _INT64_MIN <= v <= _INT64_MAX:
            return _new_float(_DoubleType, v)
        return _new_int(_IntType, v)
    if t is float:
        return _new_float(_DoubleType, v)
    if t is dict:
        m = _MapType()
        if node is None:
            for k, x in v.items():
                m[_new_str(_StringType, k)] = _to_cel(x, None)
            return m
        props = node.properties
        ap = node.additional
        esc = node.escaped
        root = node.resource_root
        for k, x in v.items():
            if root and k == "metadata" and type(x) is dict:
                m[_new_str(_StringType, k)] = _to_cel(
                    {n: x[n] for n in _META_VISIBLE if n in x}, None)
                continue
            child = props.get(k) if props is not None else None
            if child is not None:
                ck = esc[k]
                if ck is None:
                    continue  # a property CEL cannot name is left out, as in the server
                m[_new_str(_StringType, ck)] = _to_cel(x, child)
            else:
                m[_new_str(_StringType, k)] = _to_cel(x, ap)
        return m
    if t is list:
        items = node.items if node is not None else None
        return _ListType([_to_cel(x, items) for x in v])
    return v  # None


def _typed_string(s: str, fmt: str) -> Any:
    """Kubernetes gives CEL ``format: date-time/date`` as timestamp, ``duration``, ``byte``."""
    try:
        if fmt == "byte":
            return celtypes.BytesType(base64.b64decode(s))
        if fmt == "duration":
            return celtypes.DurationType(s)
        if fmt == "date":
            return celtypes.TimestampType(f"{s}T00:00:00Z")
        return celtypes.TimestampType(s)
    except (ValueError, TypeError, binascii.Error):
        return _StringType(s)
