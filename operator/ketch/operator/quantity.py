"""Kubernetes ``resource.Quantity`` values, written the way the API server stores them.

kube-apiserver keeps a Quantity field of a built-in object (a container's cpu and memory, an
``emptyDir.sizeLimit``, an HPA target) in canonical form: ``0.5`` is stored as ``500m``, ``1.5Gi``
as ``1536Mi``, ``2000m`` as ``2``. A controller that applies a spec spelled otherwise has the
server rewrite the object on every full reconcile (server-side apply counts the other spelling
as a change: new managedFields, a new resourceVersion, a watch event for everyone). So the
operator renders every quantity it writes in canonical form, through ``canonical``.

The rules (apimachinery's ``resource.Quantity``): the value is rounded up to nano units; the
format comes from the suffix the user wrote (``Ki``..``Ei``: binary SI; ``n``..``E`` or none:
decimal SI; ``e<n>``: decimal exponent); a binary quantity below 1024 or with a fraction is
written as decimal SI; a decimal one with the largest exponent that is a multiple of 3 and
keeps the mantissa whole; a binary one with the largest power of 1024 that divides it.
"""

from __future__ import annotations

import re
from fractions import Fraction

BINARY, DECIMAL, EXPONENT = "BinarySI", "DecimalSI", "DecimalExponent"
_PATTERN = re.compile(r"^([+-]?)([0-9]*\.?[0-9]*)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_BINARY_SUFFIXES = {"": 0, "Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15}
_DECIMAL_SUFFIXES["E"] = 18
_DECIMAL_BY_EXPONENT = {e: s for s, e in _DECIMAL_SUFFIXES.items()}
_BINARY_BY_POWER = {p: s for s, p in _BINARY_SUFFIXES.items()}
_NANO = Fraction(1, 10**9)


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


def parse(text: str) -> tuple[Fraction, str]:
    """(exact value, format) of a quantity string; QuantityError if it is none."""
    match = _PATTERN.match(text.strip())
    if match is None or not any(c.isdigit() for c in match.group(2)):
        raise QuantityError(f"{text!r} is not a quantity (e.g. 500m, 2, 1.5Gi, 1e3)")
    sign, number, suffix = match.groups()
    value = Fraction(number if not number.startswith(".") else "0" + number)
    if suffix in ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"):
        value *= 1024 ** _BINARY_SUFFIXES[suffix]
        fmt = BINARY
    elif suffix in _DECIMAL_SUFFIXES:
        value *= Fraction(10) ** _DECIMAL_SUFFIXES[suffix]
        fmt = DECIMAL
    elif suffix[:1] in ("e", "E") and re.fullmatch(r"[-+]?[0-9]+", suffix[1:]):
        value *= Fraction(10) ** int(suffix[1:])
        fmt = EXPONENT
    else:
        raise QuantityError(f"{text!r}: unknown quantity suffix {suffix!r}")
    return (-value if sign == "-" else value), fmt


def format_quantity(value: Fraction, fmt: str) -> str:
    """The canonical text of ``value`` in format ``fmt`` (rounded up to nano units)."""
    magnitude = abs(value)
    if magnitude % _NANO:
        magnitude = (magnitude // _NANO + 1) * _NANO
    sign = "-" if value < 0 and magnitude else ""
    if magnitude == 0:
        return "0"
    if fmt == BINARY and magnitude >= 1024 and magnitude.denominator == 1:
        number, power = int(magnitude), 0
        while power < 6 and number % 1024 == 0:
            number, power = number // 1024, power + 1
        return f"{sign}{number}{_BINARY_BY_POWER[power]}"
    mantissa, exponent = magnitude, 0
    while mantissa.denominator != 1:  # whole mantissa: at most 9 steps (nano units)
        mantissa, exponent = mantissa * 10, exponent - 1
    number = int(mantissa)
    while number % 10 == 0:
        number, exponent = number // 10, exponent + 1
    number *= 10 ** (exponent % 3)
    exponent -= exponent % 3
    if fmt == EXPONENT:
        return f"{sign}{number}" + (f"e{exponent}" if exponent else "")
    if exponent > 18:
        number, exponent = number * 10 ** (exponent - 18), 18
    return f"{sign}{number}{_DECIMAL_BY_EXPONENT[exponent]}"


def canonical(text: str | int | float) -> str:
    """``text`` as the API server stores it: ``'0.5'`` -> ``'500m'``, ``'1024Mi'`` -> ``'1Gi'``."""
    value, fmt = parse(str(text))
    return format_quantity(value, fmt)


def plus_gi(text: str, extra_gi: int) -> str:
    """``text`` plus ``extra_gi`` GiB, canonical and binary: ``'4Gi'`` + 1 -> ``'5Gi'``,
    ``'16G'`` + 1 -> ``'16673576Ki'``."""
    value, _ = parse(text)
    return format_quantity(value + extra_gi * 1024**3, BINARY)
