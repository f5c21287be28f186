"""Cost and size ranges with cel-go's saturating arithmetic (``checker/cost.go``), and its
cost constants (``common/cost.go``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

UINT64_MAX = 2**64 - 1
_TWO_TO_64 = float(2**64)

SELECT_AND_IDENT_COST = 1
CONST_COST = 0
LIST_CREATE_BASE_COST = 10
MAP_CREATE_BASE_COST = 30
STRUCT_CREATE_BASE_COST = 40
STRING_TRAVERSAL_COST_FACTOR = 0.1
REGEX_STRING_LENGTH_COST_FACTOR = 0.25


class CostNotModelled(ValueError):
    """The rule uses a construct this estimator does not model; no estimate is better than a
    low one."""


def _add(x: int, y: int) -> int:
    return min(x + y, UINT64_MAX)


def _mul(x: int, y: int) -> int:
    return min(x * y, UINT64_MAX)


def _by_factor(x: int, factor: float) -> int:
    """multiplyByCostFactor: float64 product rounded up, saturating (as Go computes it)."""
    fx = float(x)
    if fx > 0 and factor > 0 and fx > float(UINT64_MAX) / factor:
        return UINT64_MAX
    ceil = math.ceil(fx * factor)
    return UINT64_MAX if ceil >= _TWO_TO_64 else int(ceil)


@dataclass(frozen=True)
class Est:
    """A [lo, hi] range: a size estimate (CEL ``size()``) or a cost estimate."""

    lo: int
    hi: int

    def __add__(self, other: Est) -> Est:
        return Est(_add(self.lo, other.lo), _add(self.hi, other.hi))

    def __mul__(self, other: Est) -> Est:
        return Est(_mul(self.lo, other.lo), _mul(self.hi, other.hi))

    def factor(self, f: float) -> Est:
        return Est(_by_factor(self.lo, f), _by_factor(self.hi, f))

    def union(self, other: Est) -> Est:
        return Est(min(self.lo, other.lo), max(self.hi, other.hi))


def fixed(n: int) -> Est:
    return Est(n, n)


ZERO = fixed(0)
ONE = fixed(1)
UNKNOWN = Est(0, UINT64_MAX)
