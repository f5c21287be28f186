"""Fixtures: one shared ``ketch serve`` for the session, and the offline reference engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_harness import KV_MEMORY, Server, running_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The shared default server: tiny model, 64 sequences per step, model's max_model_len."""
    with running_server("--max-num-seqs", "64") as srv:
        yield srv


@pytest.fixture(scope="session")
def reference_llm():
    """The offline engine with the server's settings, for greedy output comparisons."""
    from ketch.engine import LLM

    return LLM("tiny", block_size=16, kv_cache_memory=KV_MEMORY)
