"""Field errors (``metav1.StatusCause``) in kube-apiserver's words, and the Go-style rendering of
values that its messages use (``%q``, ``%v``, ``%#v``, JSON), so emulator messages read exactly
like the server's."""

from __future__ import annotations

import decimal
import json
import math
from typing import Any

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
BLOCKING = frozenset({NOT_SUPPORTED, REQUIRED, TOO_LONG, TOO_MANY, TYPE_INVALID})
BLOCKED_MSG = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)
RULE_REASONS = frozenset({INVALID, FORBIDDEN, REQUIRED, DUPLICATE})
NIL = "<nil>"  # how a nil *field.Path prints; kube-openapi's composite errors carry no path


class CRDSchemaError(ValueError):
    """The CRD cannot be served: a rule does not compile, uses an unsupported function, ...

    Raised at :class:`CRDValidator` construction so the CRD author finds out at once, the way
    the real server rejects such a CRD instead of failing every later request.
    """


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


def go_float(f: float) -> str:
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
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def go_quote(s: str) -> str:
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
            out.append(
                f"\\x{o:02x}" if o < 0x80 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
            )
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


def go_json(v: Any) -> str:
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
        return go_float(v)
    if isinstance(v, str):
        return go_quote(v)
    if isinstance(v, dict):
        inner = ", ".join(f"{go_quote(k)}:{_go_sharp_v(v[k])}" for k in sorted(v))
        return "map[string]interface {}{" + inner + "}"
    if isinstance(v, list):
        return "[]interface {}{" + ", ".join(_go_sharp_v(x) for x in v) + "}"
    return repr(v)


def render(v: Any) -> str:
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
        return go_float(v)
    if isinstance(v, str):
        return go_quote(v)
    return _go_sharp_v(v)


def cause(reason: str, fld: str, message: str) -> dict:
    return {"reason": reason, "field": fld or NIL, "message": message}


def invalid(fld: str, value: Any, detail: str, reason: str = INVALID) -> dict:
    msg = f"Invalid value: {render(value)}"
    return cause(reason, fld, f"{msg}: {detail}" if detail else msg)
