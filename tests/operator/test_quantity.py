"""The operator's Quantity canonicaliser (ketch.operator.quantity) against apimachinery's own
test table (tests/quantity_cases.py), which the emulator's independent implementation is
checked against too."""

from __future__ import annotations

from fractions import Fraction

import pytest
from quantity_cases import EMIT, INVALID, PARSE, STRING

from ketch.operator.quantity import QuantityError, canonical, format_quantity, parse, plus_gi


def _value(mantissa: int, exponent: int) -> Fraction:
    return mantissa * Fraction(10) ** exponent


@pytest.mark.parametrize(("text", "mantissa", "exponent", "fmt"), PARSE)
def test_parse(text: str, mantissa: int, exponent: int, fmt: str) -> None:
    """Parsing keeps the exact value; the table's values are rounded up to nano units."""
    want = _value(mantissa, exponent)
    exact, _ = parse(text)
    if exact > 2**63 - 1 or 0 < exact < Fraction(1, 10**9):
        pytest.skip(
            "apimachinery clamps at int64 and re-formats sub-nano values while parsing; "
            "no quantity the operator renders comes near either"
        )
    for sign, expect in (("", want), ("+", want), ("-", -want)):
        value, got_fmt = parse(sign + text)
        # (apimachinery turns a binary value with a fraction into decimal while parsing; here
        # formatting does that, so the stored text is the same)
        assert format_quantity(value, got_fmt) == format_quantity(expect, fmt), sign + text


@pytest.mark.parametrize("text", [*INVALID, ""])
def test_invalid(text: str) -> None:
    if text.strip() != text and text.strip():
        pytest.skip("surrounding spaces: the JSON decoder trims them before parsing")
    with pytest.raises(QuantityError):
        parse(text)


@pytest.mark.parametrize(("mantissa", "exponent", "fmt", "expect", "alternate"), STRING)
def test_string(mantissa: int, exponent: int, fmt: str, expect: str, alternate: str) -> None:
    value = _value(mantissa, exponent)
    assert format_quantity(value, fmt) == expect
    if value:
        assert format_quantity(-value, fmt) == "-" + expect
    assert canonical(expect) == expect
    if alternate:
        assert canonical(alternate) == expect


@pytest.mark.parametrize(("text", "expect"), EMIT)
def test_emit(text: str, expect: str) -> None:
    assert canonical(text) == expect
    assert canonical("-" + text) == "-" + expect


def test_everyday_values_and_headroom() -> None:
    got = {q: canonical(q) for q in ("0.5", "2000m", "1.5Gi", "1024Mi", "8Gi", "2", 4, 0.25)}
    assert got == {
        "0.5": "500m", "2000m": "2", "1.5Gi": "1536Mi", "1024Mi": "1Gi", "8Gi": "8Gi",
        "2": "2", 4: "4", 0.25: "250m",
    }  # fmt: skip
    assert plus_gi("4Gi", 1) == "5Gi"
    assert plus_gi("512Mi", 1) == "1536Mi"
    assert plus_gi("0", 1) == "1Gi"
    assert plus_gi("16G", 1) == "16673576Ki"  # decimal swap space: still 1 GiB more
