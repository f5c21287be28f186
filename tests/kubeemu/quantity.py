"""``resource.Quantity`` as kube-apiserver stores it: every quantity field of a built-in object
is parsed and written back in canonical form ("0.5" -> "500m", "1.5Gi" -> "1536Mi", "2000m" ->
"2"), or the write is refused with the decoder's message. Custom resources are left alone
(they store what was sent).

Read from apimachinery ``pkg/api/resource`` (quantity.go, suffix.go, amount.go), written anew:
values are exact (a ``Fraction``), rounded up to nano precision; a string already in canonical
form is kept as sent, with the server's quirks ("+1", "1E3" and "100.035k" stay as they are).
A JSON number arrives here already decoded, so ``1e3`` is read as "1000.0" (the server reads
the literal text).
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from kubeemu.errors import bad_request
from kubeemu.kinds import ResourceType

SPLIT_RE = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
ERR_FORMAT = f"quantities must match the regular expression '{SPLIT_RE}'"
ERR_NUMERIC = "unable to parse numeric part of quantity"
ERR_SUFFIX = "unable to parse quantity's suffix"

BINARY, DECIMAL, EXPONENT = "BinarySI", "DecimalSI", "DecimalExponent"
_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15}
_DECIMAL_SUFFIX["E"] = 18
_BINARY_SUFFIX = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX_CHARS = set("eEinumkKMGTP")
_MAX_INT64 = 2**63 - 1
_MAX_DIGITS = 18  # digits an int64 always holds (maxInt64Factors)
NANO = Fraction(1, 10**9)


class QuantityError(ValueError):
    """A string that is not a quantity; the message is apimachinery's."""


def _digits(s: str, pos: int) -> int:
    while pos < len(s) and s[pos].isdigit() and s[pos].isascii():
        pos += 1
    return pos


def split(s: str) -> tuple[bool, str, str, str, str]:
    """(positive, value, numerator, denominator, suffix), as ``parseQuantityString``."""
    positive, pos = True, 0
    if s[:1] in ("-", "+"):
        positive, pos = s[0] == "+", 1
    while pos < len(s) and s[pos] == "0":
        pos += 1
    if pos == len(s):
        return positive, "0", "0", "", ""
    end = _digits(s, pos)
    num = s[pos:end] or "0"
    denom = ""
    if end < len(s) and s[end] == ".":
        stop = _digits(s, end + 1)
        denom, end = s[end + 1 : stop], stop
    value = s[:end]
    rest = end
    while rest < len(s) and s[rest] in _SUFFIX_CHARS:
        rest += 1
    if rest < len(s) and s[rest] in "+-":
        rest += 1
    if _digits(s, rest) != len(s):
        raise QuantityError(ERR_FORMAT)
    return positive, value, num, denom, s[end:]


def _interpret(suffix: str) -> tuple[int, int, str]:
    """(base, exponent, format) of a suffix."""
    if suffix in _DECIMAL_SUFFIX:
        return 10, _DECIMAL_SUFFIX[suffix], DECIMAL
    if suffix in _BINARY_SUFFIX:
        return 2, _BINARY_SUFFIX[suffix], BINARY
    exp = suffix[1:]
    if len(suffix) > 1 and suffix[0] in "eE" and _is_go_int(exp):
        return 10, int(exp), EXPONENT
    raise QuantityError(ERR_SUFFIX)


def _is_go_int(s: str) -> bool:
    body = s[1:] if s[:1] in "+-" else s
    return body.isdigit() and body.isascii() and abs(int(s)) < 2**63


def parse(s: str) -> tuple[Fraction, str, str | None]:
    """(value, format, the string kept as sent when it is already canonical)."""
    if not s:
        raise QuantityError(ERR_FORMAT)
    if s == "0":
        return Fraction(0), DECIMAL, s
    positive, value, num, denom, suffix = split(s)
    base, exponent, fmt = _interpret(suffix)
    fast = _parse_int64(s, positive, num, denom, base, exponent, fmt)
    if fast is not None:
        return fast
    amount = _decimal(value) * (Fraction(10) ** exponent if base == 10 else 2**exponent)
    magnitude = abs(amount)
    if magnitude:  # round up, so that asking for a little always gets something
        magnitude = Fraction(-((-magnitude * 10**9) // 1), 10**9)
    if fmt == BINARY and magnitude > _MAX_INT64:
        magnitude = Fraction(_MAX_INT64)
    if fmt == BINARY and 0 < magnitude < 1:
        fmt = DECIMAL
    return (-magnitude if amount < 0 else magnitude), fmt, None


def _parse_int64(
    s: str, positive: bool, num: str, denom: str, base: int, exponent: int, fmt: str
) -> tuple[Fraction, str, str | None] | None:
    """The int64 fast path of ``ParseQuantity``, the one that keeps canonical strings."""
    if fmt == BINARY:
        if denom:
            return None
        scale, mantissa = 0, 2**exponent
        precision = 15 - len(num) - int(exponent * 3 / 10) - 1
    else:
        scale, mantissa = exponent, 1
        precision = _MAX_DIGITS - len(num) - len(denom)
    scale -= len(denom)
    if precision < 0 or scale < -9:
        return None
    shifted = num + denom
    result = int(shifted) * mantissa
    if result > _MAX_INT64:
        return None
    signed = Fraction(result if positive else -result) * Fraction(10) ** scale
    if fmt == BINARY:
        keep = exponent % 10 == 0 and int(shifted) & 7 != 0
    else:
        keep = scale % 3 == 0 and not shifted.endswith("000") and shifted[0] != "0"
    return signed, fmt, (s if keep else None)


def _decimal(value: str) -> Fraction:
    body = value.lstrip("+-")
    whole, _, frac = body.partition(".")
    if not (whole + frac).isdigit() and (whole or frac):
        raise QuantityError(ERR_NUMERIC)
    magnitude = Fraction(int(whole or "0")) + Fraction(int(frac or "0"), 10 ** len(frac))
    return -magnitude if value.startswith("-") else magnitude


def format_quantity(value: Fraction, fmt: str) -> str:
    """The canonical string of a value (``CanonicalizeBytes``)."""
    if value == 0:
        return "0"
    if fmt == BINARY and (-1024 < value < 1024 or value.denominator != 1):
        fmt = DECIMAL  # rounding to whole bytes would lose precision
    if fmt == BINARY:
        mantissa, power = value.numerator, 0
        while mantissa % 1024 == 0 and abs(mantissa) >= 1024:
            mantissa, power = mantissa // 1024, power + 1
        return f"{mantissa}{next((k for k, p in _BINARY_SUFFIX.items() if p == power * 10), '')}"
    mantissa, exp10 = _base10(value)
    while exp10 % 3:
        mantissa, exp10 = mantissa * 10, exp10 - 1
    if fmt == EXPONENT:
        return f"{mantissa}e{exp10}" if exp10 else str(mantissa)
    # An exponent with no suffix (past "E") is dropped, as the server's suffixer does.
    return f"{mantissa}{next((k for k, p in _DECIMAL_SUFFIX.items() if p == exp10), '')}"


def _base10(value: Fraction) -> tuple[int, int]:
    """(mantissa, exponent) with every factor of ten moved into the exponent."""
    exp10 = 0
    while value.denominator != 1:
        value, exp10 = value * 10, exp10 - 1
    mantissa = value.numerator
    while mantissa % 10 == 0:
        mantissa, exp10 = mantissa // 10, exp10 + 1
    return mantissa, exp10


def canonical(raw: Any) -> str:
    """What the server stores for a quantity sent as ``raw`` (a JSON string or number)."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise QuantityError(ERR_FORMAT)
    text = raw.strip() if isinstance(raw, str) else str(raw)
    value, fmt, kept = parse(text)
    return kept if kept is not None else format_quantity(value, fmt)


# ----------------------------------------------------------------------------- built-in objects

_POD_TEMPLATE_KINDS = {
    ("apps", "deployments"): ("spec", "template", "spec"),
    ("apps", "replicasets"): ("spec", "template", "spec"),
    ("apps", "statefulsets"): ("spec", "template", "spec"),
    ("apps", "daemonsets"): ("spec", "template", "spec"),
    ("batch", "jobs"): ("spec", "template", "spec"),
    ("batch", "cronjobs"): ("spec", "jobTemplate", "spec", "template", "spec"),
    ("", "podtemplates"): ("template", "spec"),
    ("", "pods"): ("spec",),
}
_HPA_SOURCES = ("resource", "containerResource", "pods", "object", "external")


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _maps(obj: Any, *paths: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    for path in paths:
        found = _dig(obj, path)
        if isinstance(found, dict):
            yield found


def _resources(holder: Any) -> Iterator[dict[str, Any]]:
    yield from _maps(holder, ("resources", "limits"), ("resources", "requests"))


def _pod_spec_maps(spec: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str | None]]:
    """(dict, key) pairs holding quantities; key None means every value of the dict."""
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(key) or []:
            for m in _resources(c):
                yield m, None
    for m in _resources(spec):
        yield m, None
    for m in _maps(spec, ("overhead",)):
        yield m, None
    for v in spec.get("volumes") or []:
        for m in _maps(v, ("emptyDir",)):
            yield m, "sizeLimit"
        claim = _dig(v, ("ephemeral", "volumeClaimTemplate", "spec"))
        for m in _resources(claim):
            yield m, None


def _hpa_maps(obj: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str | None]]:
    for metric in _dig(obj, ("spec", "metrics")) or []:
        for source in _HPA_SOURCES:
            for m in _maps(metric, (source, "target")):
                yield m, "value"
                yield m, "averageValue"
    for metric in _dig(obj, ("status", "currentMetrics")) or []:
        for source in _HPA_SOURCES:
            for m in _maps(metric, (source, "current")):
                yield m, "value"
                yield m, "averageValue"


def quantity_fields(rt: ResourceType, obj: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Every (dict, key) of ``obj`` that holds a ``resource.Quantity``."""
    if rt.is_crd:
        return
    places: Iterator[tuple[dict[str, Any], str | None]] = iter(())
    if rt.key in _POD_TEMPLATE_KINDS:
        spec = _dig(obj, _POD_TEMPLATE_KINDS[rt.key])
        if isinstance(spec, dict):
            places = _pod_spec_maps(spec)
    elif rt.key == ("autoscaling", "horizontalpodautoscalers"):
        places = _hpa_maps(obj)
    elif rt.key == ("", "persistentvolumeclaims"):
        places = ((m, None) for m in _resources(obj.get("spec")))
    for holder, key in places:
        for k in list(holder) if key is None else [key]:
            if k in holder:
                yield holder, k


def canonicalize(rt: ResourceType, obj: dict[str, Any]) -> None:
    """Rewrite the quantities of a built-in object in place as the server stores them; a value
    that is not a quantity fails the write (400), as decoding it does on the server."""
    for holder, key in list(quantity_fields(rt, obj)):
        if holder[key] is None:  # a null map value decodes as zero, a null pointer as absent
            if key in ("sizeLimit", "value", "averageValue"):
                del holder[key]
            else:
                holder[key] = "0"
            continue
        try:
            holder[key] = canonical(holder[key])
        except QuantityError as exc:
            raise bad_request(
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: {exc}'
            ) from exc
