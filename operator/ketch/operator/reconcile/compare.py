"""Drift: whether a live child still holds what the operator applied.

``contains`` decides drift (the live object may carry more than was applied: defaults, other
managers' fields); ``project`` records what was applied as the server stored it, so a value the
server normalised is not taken for a hand edit.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.cache import ChildKey, ServiceState


def project(desired: Any, actual: Any) -> Any:
    """``desired`` with each value as the server stored it (``actual``, the apply's answer).

    The server normalises some values (a CPU of "0.5" comes back as "500m"); drift is judged
    against what it stored, or every watch event would look like a hand edit."""
    if isinstance(desired, dict) and isinstance(actual, dict):
        return {k: project(v, actual[k]) if k in actual else v for k, v in desired.items()}
    if isinstance(desired, list) and isinstance(actual, list) and len(desired) == len(actual):
        return [project(d, a) for d, a in zip(desired, actual, strict=True)]
    if isinstance(desired, dict | list) or isinstance(actual, dict | list):
        return desired
    return actual


def contains(desired: Any, live: Any) -> bool:
    """True when ``live`` holds everything ``desired`` sets (the server may add defaults)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and contains(v, live[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(contains(d, x) for d, x in zip(desired, live, strict=True))
        )
    return desired == live or (isinstance(desired, int | float) and str(desired) == str(live))


def drifted(state: ServiceState, child: ChildKey, event_type: str, live: Any) -> bool:
    """True when a watch event shows that an applied child no longer holds what was applied."""
    applied = state.applied.get(child)
    return applied is not None and (event_type == "DELETED" or not contains(applied.wanted, live))
