"""ERNIE 4.5 (dense): Llama's decoder with RoPE on interleaved pairs (2i, 2i + 1), biases on every
projection with ``use_bias``, tied embeddings by default; against Hugging Face transformers on
random checkpoints the tests make with transformers' own ERNIE 4.5 classes.

Ketch rotates (i, i + D/2); the loader reorders each q/k head's rows (even, then odd:
``loader.deinterleave``), which the first test proves equivalent on transformers' own rotation.
Three shapes: grouped-query heads wider than hidden/heads (untied), one KV head with every bias
(tied), and full multi-head attention with llama3 RoPE scaling (the reorder holds for scaled
frequencies too). Model level: logits at every position of a chunked, paged batch within 1e-4
(relative) of transformers' on the eager, predictor and native backends, tensor parallelism 2 and
the GPU model run on the CPU. Engine level: ``LLM`` greedy outputs token-identical to
``generate`` with chunked prefill, prefix-cache hits and preemption forced, on one rank and two.
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
from ketch.engine.models.loader import deinterleave, load_weights
from ketch.engine.models.sharding import Shard
from ketch.kernels import CpuKernels

SHAPES: dict[str, dict[str, Any]] = {
    # 4 query heads of 32 on a hidden size of 64: q is twice as wide as the hidden state
    "gqa": {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    "mqa-bias": {"num_key_value_heads": 1, "head_dim": 16, "use_bias": True},
    "mha-llama3": {
        "hidden_size": 96,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def make_ernie_checkpoint(out: Path, seed: int = 0, **overrides: Any) -> Path:
    overrides = {"pad_token_id": 0, **overrides}
    return make_small_checkpoint(out, "Ernie4_5Config", seed, **overrides)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """ernie("gqa") -> that shape's checkpoint directory (made once per module)."""
    return shape_cache(
        tmp_path_factory, "ernie", lambda out, shape: make_ernie_checkpoint(out, **SHAPES[shape])
    )


def test_reordered_rows_rotated_by_halves_are_transformers_interleaved_rotation() -> None:
    """transformers' own ``apply_rotary_pos_emb`` on q/k, against Ketch's rotate-half on the
    reordered q/k: the same values, reordered, and every q.k equal."""
    import paddle
    import torch
    from transformers.models.ernie4_5 import modeling_ernie4_5 as hf

    from ketch.engine.models.config import RopeConfig
    from ketch.engine.models.llama import rotate
    from ketch.engine.models.rope import cos_sin_tables

    heads, tokens, d = 3, 7, 16
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((tokens, heads, d)).astype(np.float32) for _ in range(2))
    cos, sin = cos_sin_tables(RopeConfig(theta=500000.0), d, tokens)
    # theirs: [batch, heads, tokens, D], cos/sin [batch, tokens, D]
    tq, tk = (torch.tensor(x).transpose(0, 1)[None] for x in (q, k))
    hq, hk = hf.apply_rotary_pos_emb(tq, tk, torch.tensor(cos)[None], torch.tensor(sin)[None])
    hq, hk = (x[0].transpose(0, 1).numpy() for x in (hq, hk))

    def ours(x: np.ndarray) -> np.ndarray:
        rows = deinterleave(paddle.to_tensor(x.reshape(tokens, heads * d).T), d)
        y = rows.T.reshape([tokens, heads, d])
        c, s = (paddle.to_tensor(t).unsqueeze(1) for t in (cos, sin))
        return rotate(y, c, s).numpy()

    order = [*range(0, d, 2), *range(1, d, 2)]
    oq, ok = ours(q), ours(k)
    np.testing.assert_allclose(oq, hq[..., order], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ok, hk[..., order], rtol=1e-6, atol=1e-6)
    scores = np.einsum("thd,shd->hts", oq, ok)
    np.testing.assert_allclose(scores, np.einsum("thd,shd->hts", hq, hk), rtol=1e-5, atol=1e-5)


def test_the_checkpoints_have_the_shapes_they_claim(ernie) -> None:
    for shape in SHAPES:
        config = ModelConfig.from_dir(ernie(shape))
        assert config.architecture == "Ernie4_5ForCausalLM" and config.rope_interleaved
        biased = shape == "mqa-bias"
        assert config.qkv_bias == config.o_bias == config.mlp_bias == biased
        assert config.tie_word_embeddings == (shape != "gqa")
        assert not config.is_moe and not config.lm_head_bias
    assert ModelConfig.from_dir(ernie("mha-llama3")).rope.rope_type == "llama3"


def test_q_and_k_rows_are_reordered_within_each_head(ernie) -> None:
    """The loaded q/k columns (and biases) are the checkpoint's, each head's even rows then its
    odd ones; v is as stored."""
    from safetensors.numpy import load_file

    path = ernie("mqa-bias")
    config = ModelConfig.from_dir(path)
    d, heads = config.head_dim, config.num_attention_heads
    layer = load_weights(path, config, "float32").layers[0]
    stored = load_file(path / "model.safetensors")
    p = "model.layers.0.self_attn."
    order = np.concatenate([h * d + np.r_[0:d:2, 1:d:2] for h in range(heads)])
    q_size = heads * d
    np.testing.assert_array_equal(
        layer.qkv.numpy()[:, :q_size], stored[p + "q_proj.weight"][order].T
    )
    np.testing.assert_array_equal(layer.qkv_bias.numpy()[:q_size], stored[p + "q_proj.bias"][order])
    k_order = order[:d]  # one KV head
    k = layer.qkv.numpy()[:, q_size : q_size + d]
    np.testing.assert_array_equal(k, stored[p + "k_proj.weight"][k_order].T)
    np.testing.assert_array_equal(layer.qkv.numpy()[:, q_size + d :], stored[p + "v_proj.weight"].T)


def test_config_class_defaults() -> None:
    """Fields left out take Ernie4_5Config's defaults, not Llama's: head_dim 128, RoPE theta
    500000, rms_norm_eps 1e-5, tied embeddings, no biases."""
    raw = {
        "architectures": ["Ernie4_5ForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    config = ModelConfig.from_dict(raw)
    assert (config.head_dim, config.num_key_value_heads) == (128, 2)
    assert config.rope.theta == 500000.0 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings and not config.qkv_bias
    assert config.max_position_embeddings == 131072
    assert ModelConfig.from_dict({**raw, "use_bias": True}).mlp_bias


@pytest.mark.parametrize("backend", ["eager", "predictor", "native"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(ernie, shape: str, backend: str) -> None:
    """Each sequence in two chunks of one paged batch (a decode step after a 99-token prefix
    among them); the predictor runs every step on its programs."""
    assert_close(ernie(shape), 320, CpuKernels.select(log=False), backend=backend)


@pytest.mark.parametrize("matmul", ["packed", "openblas", "paddle"])
def test_native_logits_with_each_matmul(
    ernie, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matmul through each GEMM the native backend may measure fastest, forced here."""
    from ketch.kernels.linear import ENV

    monkeypatch.setenv(ENV, matmul)
    assert_close(ernie("mqa-bias"), 320, CpuKernels.select(log=False), backend="native")


def test_eager_logits_with_the_portable_kernels(ernie) -> None:
    assert_close(ernie("mqa-bias"), 320, CpuKernels.portable())


@pytest.mark.parametrize("shape", ["gqa", "mqa-bias"])
def test_tensor_parallel_logits_match_transformers(ernie, shape: str) -> None:
    """Two ranks: KV heads split (gqa) or replicated (mqa); each rank reorders its own heads."""
    assert_logits_close(ernie(shape), 2)


def test_each_rank_holds_its_heads_reordered(ernie) -> None:
    path = ernie("gqa")
    config = ModelConfig.from_dir(path)
    whole = load_weights(path, config, "float32").layers[1].qkv.numpy()
    d, q_size = config.head_dim, config.num_attention_heads * config.head_dim
    for rank in range(2):
        shard = Shard.of(config, rank, 2)
        part = load_weights(path, config, "float32", shard).layers[1].qkv.numpy()
        h0, h1 = (x * d for x in shard.heads)
        np.testing.assert_array_equal(part[:, : h1 - h0], whole[:, h0:h1])
        k0 = shard.kv_heads[0] * d
        np.testing.assert_array_equal(
            part[:, h1 - h0 : h1 - h0 + d], whole[:, q_size + k0 :][:, :d]
        )


def test_gpu_model_on_the_cpu_matches_transformers(ernie) -> None:
    path = ernie("mqa-bias")
    sequences, splits = sequences_for(320)
    assert_gpu_model_close(gpu_model_logits(path, sequences, splits), path, sequences)


@pytest.mark.parametrize(
    ("shape", "backend"),
    [("gqa", "eager"), ("mqa-bias", "predictor"), ("mqa-bias", "native"), ("mha-llama3", "auto")],
    ids=["gqa-eager", "bias-predictor", "bias-native", "llama3-auto"],
)
def test_greedy_matches_transformers_with_every_mechanism(ernie, shape: str, backend: str) -> None:
    runs_on = "native" if backend == "auto" else backend
    assert_constrained_greedy_matches(ernie(shape), make_prompts(320, count=24), backend, runs_on)


def test_greedy_matches_transformers_on_two_ranks(ernie) -> None:
    assert_two_ranks_greedy_match(ernie("mqa-bias"), make_prompts(320, count=24, seed=1))
