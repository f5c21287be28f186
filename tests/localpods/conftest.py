"""Fixtures for the rendered-pods tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference():
    """The offline engine with the tiny model (``LLM.generate``), the outputs' reference."""
    from ketch.engine import LLM

    return LLM("tiny", kv_cache_memory="64MiB")
