"""Fixtures for the cache-manager tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cm_harness import Segment


@pytest.fixture()
def segments() -> Iterator[list[Segment]]:
    """Two KV segments with different seeded data (a sender's and a receiver's)."""
    made = [Segment(seed=1), Segment(seed=2)]
    yield made
    for segment in made:
        segment.remove()
