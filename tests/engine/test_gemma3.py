"""Gemma 3 (``Gemma3ForCausalLM``) against Hugging Face transformers on random checkpoints the
tests make with transformers' own Gemma 3 classes.

Gemma 3's decoder: sliding and full layers interleaved, each kind with its own RoPE (the full
ones linearly scaled here), per-head q/k RMSNorm, RMSNorm ``x * (1 + w)``, scaled embeddings,
sandwich norms, a GELU-tanh gated MLP, scores scaled by query_pre_attn_scalar and soft-capped
logits. Three shapes: grouped-query heads wider than hidden/heads (untied), one KV head (MQA,
tied), and full multi-head attention narrower than hidden/heads with attention biases (tied).
Model level: logits at every position of a chunked, paged batch within 1e-4 (relative) of
transformers' on the eager and native backends and tensor parallelism 2. Engine level: ``LLM``
greedy outputs token-identical to ``generate`` with chunked prefill, prefix-cache hits and
preemption forced, on one rank and on two. The predictor backend and the GPU model refuse it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_embeddings import assert_close as assert_embedding_close
from test_embeddings import constrained, prompts_for, reference
from test_engine_exactness import assert_constrained_greedy_matches, make_prompts
from test_model_exactness import assert_close
from test_tensor_parallel_exactness import assert_logits_close, assert_two_ranks_greedy_match

from hf_models import make_small_checkpoint, shape_cache
from ketch.engine.capabilities import refusals
from ketch.engine.config import EngineConfig
from ketch.engine.errors import ModelLoadError
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import load_weights
from ketch.kernels import CpuKernels
from ketch.kernels.paged_attention import PagedAttention

# Sliding windows much shorter than the sequences (up to 250 tokens) and prompts (up to 160):
# one block, not block-aligned, and a block and a half.
WINDOWS = {"gqa": 16, "mqa": 37, "mha-bias": 24}

SHAPES: dict[str, dict[str, Any]] = {
    # 4 query heads of 32 on a hidden size of 64; layers sliding, full, sliding; the full layer's
    # RoPE linearly scaled; scores scaled by 1/sqrt(24), not 1/sqrt(32); logits soft-capped
    "gqa": {
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 3,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
        "rope_theta": 20000.0,
        "rope_local_base_freq": 500.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "tie_word_embeddings": False,
    },
    # transformers 5's per-layer-type rope_parameters and explicit layer_types
    "mqa": {
        "num_key_value_heads": 1,
        "head_dim": 16,
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 30000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        "query_pre_attn_scalar": 16,
        "tie_word_embeddings": True,
    },
    # 4 heads of 16 on a hidden size of 96; q/k/v/o biases (attention_bias)
    "mha-bias": {
        "hidden_size": 96,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "attention_bias": True,
        "num_hidden_layers": 3,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 64,
        "final_logit_softcapping": 8.0,
        "tie_word_embeddings": True,
    },
}


def make_gemma3_checkpoint(out: Path, seed: int = 0, **overrides: Any) -> Path:
    overrides = {"pad_token_id": 0, **overrides}
    return make_small_checkpoint(
        out, "Gemma3TextConfig", seed, architectures=["Gemma3ForCausalLM"], **overrides
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """gemma3("gqa") -> that shape's checkpoint directory (made once per module)."""
    return shape_cache(
        tmp_path_factory,
        "gemma3",
        lambda out, shape: make_gemma3_checkpoint(
            out, sliding_window=WINDOWS[shape], **SHAPES[shape]
        ),
    )


def test_the_checkpoints_have_the_shapes_they_claim(gemma3) -> None:
    for shape in SHAPES:
        config = ModelConfig.from_dir(gemma3(shape))
        assert config.architecture == "Gemma3ForCausalLM" and config.qk_norm
        assert config.gemma is not None and config.gemma.local_layers
        assert len(config.gemma.local_layers) < config.num_hidden_layers
        narrow_or_wide = config.head_dim * config.num_attention_heads != config.hidden_size
        assert narrow_or_wide == (shape != "mqa")
        assert config.qkv_bias == config.o_bias == (shape == "mha-bias")
        assert config.attention_scale != config.head_dim**-0.5 or shape == "mqa"
    gqa = ModelConfig.from_dir(gemma3("gqa"))
    assert gqa.gemma.local_layers == (0, 2) and gqa.sliding_windows == (16, 0, 16)
    assert ModelConfig.from_dir(gemma3("mqa")).sliding_windows == (0, 37)
    assert (gqa.rope.rope_type, gqa.rope.factor, gqa.rope.theta) == ("linear", 4.0, 20000.0)
    assert gqa.gemma.local_rope.theta == 500.0 and gqa.gemma.final_logit_softcapping == 5.0


def test_the_norms_are_folded_and_the_embeddings_scaled(gemma3) -> None:
    """Gemma's ``x * (1 + w)`` norms and sqrt(hidden)-scaled embeddings, folded at load; a tied
    lm_head keeps the unscaled table."""
    from safetensors.numpy import load_file

    path = gemma3("mqa")
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    raw = load_file(str(path / "model.safetensors"))
    layer = weights.layers[1]
    p = "model.layers.1."
    folded = {
        "input_norm": "input_layernorm",
        "attn_out_norm": "post_attention_layernorm",
        "post_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    }
    for field, name in folded.items():
        np.testing.assert_array_equal(getattr(layer, field).numpy(), raw[p + name + ".weight"] + 1)
    np.testing.assert_array_equal(weights.norm.numpy(), raw["model.norm.weight"] + 1)
    embed = raw["model.embed_tokens.weight"]
    np.testing.assert_array_equal(weights.embed.numpy(), embed * np.float32(8.0))
    np.testing.assert_array_equal(weights.lm_head.numpy(), embed.T)


def test_transformers_applies_the_windows_these_tests_check(gemma3, tmp_path: Path) -> None:
    """The reference slides: the same weights with windows longer than the sequence give other
    logits past the window (so a Ketch that ignored the window would fail the tests here)."""
    import shutil

    import torch

    from hf_models import hf_model

    path = gemma3("gqa")
    unslid = tmp_path / "unslid"
    shutil.copytree(path, unslid)
    config = json.loads((path / "config.json").read_text())
    (unslid / "config.json").write_text(json.dumps({**config, "sliding_window": 512}))
    tokens = torch.tensor([np.random.default_rng(0).integers(1, 320, 100).tolist()])
    with torch.no_grad():
        slid, full = (hf_model(p)(tokens).logits[0].numpy() for p in (path, unslid))
    window = WINDOWS["gqa"]
    np.testing.assert_array_equal(slid[:window], full[:window])
    assert np.abs(slid[window:] - full[window:]).max() > 0.1 * np.abs(full).max()


@pytest.mark.parametrize("kernels", ["portable", "selected"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_eager_logits_match_transformers(gemma3, shape: str, kernels: str) -> None:
    path = gemma3(shape)
    chosen = CpuKernels.portable() if kernels == "portable" else CpuKernels.select(log=False)
    assert_close(path, ModelConfig.from_dir(path).vocab_size, chosen)


@pytest.mark.parametrize(
    ("matmul", "attention"),
    [("packed", "selected"), ("paddle", "generic"), ("openblas", "selected")],
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_logits_match_transformers(
    gemma3, shape: str, matmul: str, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matmul forced through each GEMM (the packed one must not apply its SwiGLU epilogue
    to Gemma's GELU MLP); attention in the C++ kernel, generic or this CPU's."""
    from ketch.kernels.linear import ENV

    monkeypatch.setenv(ENV, matmul)
    kernels = CpuKernels.select(log=False)
    if attention == "generic":
        kernels = dataclasses.replace(kernels, paged_attention=PagedAttention("generic"))
    path = gemma3(shape)
    assert_close(path, ModelConfig.from_dir(path).vocab_size, kernels, backend="native")


@pytest.mark.parametrize("shape", ["gqa", "mqa"])
def test_tensor_parallel_logits_match_transformers(gemma3, shape: str) -> None:
    """Two ranks: KV heads split (gqa) or replicated (mqa); the output norms on the summed
    outputs, the soft-cap on rank 0's logits."""
    assert_logits_close(gemma3(shape), 2)


@pytest.mark.parametrize(
    ("shape", "backend"),
    [("gqa", "eager"), ("gqa", "native"), ("mqa", "native"), ("mha-bias", "auto")],
    ids=["gqa-eager", "gqa-native", "mqa-native", "mha-bias-auto"],
)
def test_greedy_matches_transformers_with_every_mechanism(gemma3, shape: str, backend: str) -> None:
    path = gemma3(shape)
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=24)
    runs_on = "native" if backend == "auto" else None  # auto skips the predictor for Gemma 3
    assert_constrained_greedy_matches(path, prompts, backend, runs_on)


def test_greedy_matches_transformers_on_two_ranks(gemma3) -> None:
    path = gemma3("mha-bias")
    assert_two_ranks_greedy_match(
        path, make_prompts(ModelConfig.from_dir(path).vocab_size, count=24, seed=1)
    )


def test_embeddings_equal_transformers(gemma3) -> None:
    """``LLM.embed``: the final-normed hidden states (Gemma's folded final norm) mean-pooled over
    prompts up to several windows long, chunked, equal transformers' ``last_hidden_state``."""
    path = gemma3("mqa")
    prompts = prompts_for(ModelConfig.from_dir(path).vocab_size)
    llm = constrained(path, num_kv_blocks=None, kv_cache_memory="16MiB")
    try:
        outputs = llm.embed(prompts, pooling="mean", normalize=False)
    finally:
        llm.engine.close()
    for i, (output, want) in enumerate(zip(outputs, reference(path, prompts, "mean"), strict=True)):
        assert_embedding_close(output.embedding, want, (i, len(prompts[i])))


def test_the_predictor_and_the_gpu_refuse_it_at_start_up(gemma3) -> None:
    path = gemma3("mqa")
    config = ModelConfig.from_dir(path)
    for backend in ("native", "eager", "auto"):
        assert config.backend_problem(backend) is None
    problem = config.backend_problem("predictor")
    assert "Gemma3ForCausalLM" in problem and "--backend predictor" in problem
    assert "--device gpu" in config.backend_problem("auto", gpu=True)
    found = refusals(EngineConfig(backend="predictor"), model=config)
    assert any(r.setting == "backend" and "Gemma3ForCausalLM" in r.reason for r in found)
    weights = load_weights(path, config, "float32")
    with pytest.raises(ValueError, match="eager/native backend only"):
        build_model("predictor", config, weights, 64, 1)


def _config(**fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "sliding_window": 512,
        **fields,
    }


def test_transformers_4_and_5_configs_read_alike() -> None:
    """Gemma3TextConfig's defaults: thetas 1e6 (full) and 1e4 (sliding), every 6th layer full;
    rope_scaling applies to the full layers only."""
    v4 = ModelConfig.from_dict(
        _config(
            rope_theta=5e5,
            rope_local_base_freq=2e4,
            rope_scaling={"rope_type": "linear", "factor": 8},
        )
    )
    v5 = ModelConfig.from_dict(
        _config(
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
            },
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )
    )
    assert v4 == v5
    assert v4.gemma.local_layers == (0, 1, 2, 3, 4) and v4.rope.factor == 8.0
    plain = ModelConfig.from_dict(_config())
    assert (plain.rope.theta, plain.gemma.local_rope.theta) == (1e6, 1e4)
    assert plain.tie_word_embeddings and plain.attention_scale == 256**-0.5


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"final_logit_softcapping": -1}, "final_logit_softcapping=-1"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters="),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "full_attention layers"),
        # transformers' Gemma 3 keeps rope_type "default" and ignores a legacy "type"
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "type='linear' beside rope_type"),
        ({"layer_types": ["chunked_attention"] * 6}, "'chunked_attention' layers"),
        ({"layer_types": ["full_attention"] * 5}, "5 types for 6 layers"),
        ({"sliding_window": 0}, "sliding_window=0"),
        ({"sliding_window": None}, "sliding_window=None"),
    ],
)
def test_what_it_does_not_implement_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace("(", r"\(")):
        ModelConfig.from_dict(_config(**fields))


def test_a_window_only_in_full_layers_is_not_a_window() -> None:
    config = ModelConfig.from_dict(_config(layer_types=["full_attention"] * 6, sliding_window=8))
    assert config.gemma.local_layers == () and config.sliding_windows == ()
