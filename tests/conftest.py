"""Shared fixtures: small random Hugging Face checkpoints made on demand, once per session."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import make_checkpoint

# name -> (architecture, overrides). Every variant uses GQA (4 query heads, 2 KV heads).
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied-llama3rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-linear-bias": (
        "llama",
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "attention_bias": True,
            "mlp_bias": True,
            "head_dim": 32,
        },
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen2-untied": ("qwen2", {"num_hidden_layers": 3}),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint("qwen2") -> directory of that random checkpoint (made once per session)."""
    made: dict[tuple[str, str | None], Path] = {}

    def get(name: str, max_shard_size: str | None = None) -> Path:
        key = (name, max_shard_size)
        if key not in made:
            arch, overrides = CHECKPOINTS[name]
            out = tmp_path_factory.mktemp(name.replace("-", "_"))
            made[key] = make_checkpoint(out, arch, max_shard_size=max_shard_size, **overrides)
        return made[key]

    return get


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """CLI entry points run in-process call logging.basicConfig(force=True) with whatever
    sys.stderr is then (pytest's capture, closed after the test); later tests would log into a
    closed file. Put the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
