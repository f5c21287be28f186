"""Qwen3 (per-head q/k RMSNorm before the rotation, an explicit ``head_dim``) against Hugging Face
transformers on random checkpoints the tests make with transformers' own Qwen3 classes.

Three shapes: grouped-query heads wider than hidden/heads (untied embeddings), one KV head (MQA,
tied), and full multi-head attention narrower than hidden/heads with attention biases (tied).
Model level: logits at every position of a chunked, paged batch within 1e-4 (relative) of
transformers' on the eager, predictor and native backends, tensor parallelism 2 and the GPU
model run on the CPU. Engine level: ``LLM`` greedy outputs token-identical to ``generate`` with
chunked prefill, prefix-cache hits and preemption forced, on one rank and on two.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_engine_exactness import assert_constrained_greedy_matches, make_prompts
from test_llama_gpu import assert_close as assert_gpu_model_close
from test_llama_gpu import gpu_model_logits
from test_model_exactness import assert_close
from test_tensor_parallel_exactness import (
    assert_logits_close,
    assert_two_ranks_greedy_match,
    sequences_for,
)

from hf_models import make_small_checkpoint, shape_cache
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import load_weights
from ketch.engine.models.sharding import Shard
from ketch.kernels import CpuKernels

SHAPES: dict[str, dict[str, Any]] = {
    # 4 query heads of 32 on a hidden size of 64: q is twice as wide as the hidden state
    "gqa": {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    "mqa": {"num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True},
    # 4 heads of 16 on a hidden size of 96; q/k/v/o biases (Qwen3's attention_bias)
    "mha-bias": {
        "hidden_size": 96,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "attention_bias": True,
        "num_hidden_layers": 3,
        "tie_word_embeddings": True,
    },
}


def make_qwen3_checkpoint(out: Path, seed: int = 0, **overrides: Any) -> Path:
    return make_small_checkpoint(out, "Qwen3Config", seed, **overrides)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """qwen3("gqa") -> that shape's checkpoint directory (made once per module)."""
    return shape_cache(
        tmp_path_factory, "qwen3", lambda out, shape: make_qwen3_checkpoint(out, **SHAPES[shape])
    )


def test_the_checkpoints_have_the_shapes_they_claim(qwen3) -> None:
    for shape in SHAPES:
        config = ModelConfig.from_dir(qwen3(shape))
        assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm
        narrow_or_wide = config.head_dim * config.num_attention_heads != config.hidden_size
        assert narrow_or_wide == (shape != "mqa")
        assert config.qkv_bias == config.o_bias == (shape == "mha-bias")
        assert not config.mlp_bias


@pytest.mark.parametrize(
    ("backend", "kernels"),
    [
        ("eager", "portable"),
        ("eager", "selected"),
        ("predictor", "selected"),
        ("native", "selected"),
    ],
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(qwen3, shape: str, backend: str, kernels: str) -> None:
    """Each sequence in two chunks of one paged batch (a decode step after a 99-token prefix
    among them); the predictor runs every step on its programs."""
    path = qwen3(shape)
    chosen = CpuKernels.portable() if kernels == "portable" else CpuKernels.select(log=False)
    assert_close(path, ModelConfig.from_dir(path).vocab_size, chosen, backend=backend)


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_tensor_parallel_logits_match_transformers(qwen3, shape: str) -> None:
    """Two ranks: KV heads split (gqa) or replicated (mqa); q_norm/k_norm on both ranks."""
    assert_logits_close(qwen3(shape), 2)


def test_each_rank_holds_the_whole_head_norms(qwen3) -> None:
    path = qwen3("gqa")
    config = ModelConfig.from_dir(path)
    whole = load_weights(path, config, "float32").layers[1]
    for rank in range(2):
        part = load_weights(path, config, "float32", Shard.of(config, rank, 2)).layers[1]
        for name in ("q_norm", "k_norm"):
            np.testing.assert_array_equal(getattr(part, name).numpy(), getattr(whole, name).numpy())
            assert getattr(part, name).shape == [config.head_dim]


def test_gpu_model_on_the_cpu_matches_transformers(qwen3) -> None:
    path = qwen3("gqa")
    sequences, splits = sequences_for(ModelConfig.from_dir(path).vocab_size)
    assert_gpu_model_close(gpu_model_logits(path, sequences, splits), path, sequences)


@pytest.mark.parametrize(
    ("shape", "backend"),
    [("gqa", "eager"), ("gqa", "predictor"), ("gqa", "native"), ("mqa", "native")],
    ids=["gqa-eager", "gqa-predictor", "gqa-native", "mqa-native"],
)
def test_greedy_matches_transformers_with_every_mechanism(qwen3, shape: str, backend: str) -> None:
    path = qwen3(shape)
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=24)
    assert_constrained_greedy_matches(path, prompts, backend)


def test_greedy_matches_transformers_on_two_ranks(qwen3) -> None:
    path = qwen3("mha-bias")
    assert_two_ranks_greedy_match(
        path, make_prompts(ModelConfig.from_dir(path).vocab_size, count=24, seed=1)
    )
