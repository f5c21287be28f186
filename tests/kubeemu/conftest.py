"""Fixtures for the emulator's own tests: one emulator subprocess per session and a fresh
namespace per test. These tests check the emulator itself, so they never run against a real
cluster (tests/operator does, with KETCH_TEST_KUBECONFIG)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from kubeemu import Emulator, start_emulator


@pytest.fixture(scope="session")
def emu() -> Iterator[Emulator]:
    emulator = start_emulator()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def namespace(emu: Emulator, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace made for this test (named after it) and deleted afterwards."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:6]}"
    emu.post("/api/v1/namespaces", {"metadata": {"name": name}}).ok()
    yield name
    emu.delete(f"/api/v1/namespaces/{name}")
