"""Fixtures for the router tests: shared ``ketch serve --runner null`` instances, a router runner.

The ``ketch serve`` harness lives with the serving tests; its directory is put on ``sys.path``
so it is imported by name, as the serving tests do.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serving"))

from router_harness import start_instances
from serve_harness import Server


@pytest.fixture(scope="session")
def instances() -> Iterator[list[Server]]:
    """Three mixed ``ketch serve --runner null`` instances shared by every router test."""
    with start_instances(3, "--runner", "null", "--max-num-seqs", "32") as servers:
        yield servers
