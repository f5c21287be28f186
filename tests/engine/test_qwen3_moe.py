"""Qwen3-MoE (routed experts in place of the dense MLP, in the layers ``decoder_sparse_step`` and
``mlp_only_layers`` choose) against Hugging Face transformers on random checkpoints the tests make
with transformers' own Qwen3-MoE classes.

Shapes: 8 experts, top-2, every layer sparse, ``norm_topk_prob`` (GQA, untied); 8 experts, top-2,
``norm_topk_prob`` false, ``decoder_sparse_step`` 2 and ``mlp_only_layers`` [3] so one layer of
four is sparse (MQA, tied); and a router whose experts share rows in threes, so most tokens'
top-2 breaks an exact tie (it must break as torch's ``topk`` breaks it). Model level: logits at
every position of a chunked, paged batch within 1e-4 (relative) of transformers' on the eager and
native backends and with the experts split across two ranks. Engine level: ``LLM`` greedy output
token-identical to ``generate`` with chunked prefill, prefix-cache hits and preemption forced.
The predictor and the GPU model have no expert layers: they refuse, naming the backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_engine_exactness import assert_constrained_greedy_matches, make_prompts
from test_model_exactness import assert_close
from test_tensor_parallel_exactness import (
    assert_logits_close,
    assert_two_ranks_greedy_match,
)

from hf_models import make_small_checkpoint, shape_cache
from ketch.engine import LLM
from ketch.engine.capabilities import refusals
from ketch.engine.config import EngineConfig
from ketch.engine.errors import ModelLoadError
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama_gpu import to_device
from ketch.engine.models.loader import load_weights
from ketch.engine.models.sharding import Shard, shard_problems
from ketch.kernels import CpuKernels

SHAPES: dict[str, dict[str, Any]] = {
    "sparse": {"num_hidden_layers": 3, "norm_topk_prob": True, "tie_word_embeddings": False},
    "mixed": {
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,  # layers 1 and 3 ...
        "mlp_only_layers": [3],  # ... but 3 is dense
        "tie_word_embeddings": True,
    },
    "ties": {"num_hidden_layers": 2, "norm_topk_prob": True, "tie_word_embeddings": False},
}
MOE_LAYERS = {"sparse": (0, 1, 2), "mixed": (1,), "ties": (0, 1)}


def make_qwen3_moe_checkpoint(out: Path, seed: int = 0, **overrides: Any) -> Path:
    settings: dict[str, Any] = dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    return make_small_checkpoint(out, "Qwen3MoeConfig", seed, **{**settings, **overrides})


def _tie_router_rows(path: Path) -> None:
    """Experts {0, 1, 2}, {3, 4, 5} and {6, 7} share router rows (equal logits, equal
    probabilities): a token whose best group is one of three picks two of them by the tie."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            t[1], t[2], t[4], t[5], t[7] = t[0], t[0], t[3], t[3], t[6]
    save_file(tensors, file, metadata={"format": "pt"})


def _stack_experts(src: Path, out: Path) -> None:
    """``src`` with each layer's experts in transformers' in-memory layout: stacked
    ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    experts = config["num_local_experts"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue
        pop = [
            {n: tensors.pop(f"{p}{e}.{n}_proj.weight") for n in ("gate", "up", "down")}
            for e in range(experts)
        ]
        tensors[p + "gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in pop])
        tensors[p + "down_proj"] = torch.stack([w["down"] for w in pop])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _qwen3_moe_shape(out: Path, shape: str) -> Path:
    path = make_qwen3_moe_checkpoint(out, **SHAPES[shape])
    if shape == "ties":
        _tie_router_rows(path)
    return path


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """qwen3_moe("sparse") -> that shape's checkpoint directory (made once per module)."""
    return shape_cache(tmp_path_factory, "qwen3_moe", _qwen3_moe_shape)


def test_the_checkpoints_have_the_layers_they_claim(qwen3_moe) -> None:
    for shape in SHAPES:
        config = ModelConfig.from_dir(qwen3_moe(shape))
        assert config.architecture == "Qwen3MoeForCausalLM" and config.qk_norm
        assert config.moe_layers == MOE_LAYERS[shape]
        assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
        assert config.moe_intermediate_size == 32 and config.intermediate_size == 96
        assert config.norm_topk_prob == (shape != "mixed")
        weights = load_weights(qwen3_moe(shape), config, "float32")
        for i, layer in enumerate(weights.layers):
            assert (layer.moe is not None) == (i in MOE_LAYERS[shape])
            assert (layer.gate_up is None) == (i in MOE_LAYERS[shape])


def test_hub_style_config_fields() -> None:
    """The Hub's Qwen3-MoE configs write ``num_experts`` (transformers 5 writes
    ``num_local_experts``); the training-only router fields are accepted; no experts, no MoE."""
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "mlp_only_layers": None,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.001,
        "max_window_layers": 2,
    }
    config = ModelConfig.from_dict(raw)
    assert config.num_experts == 16 and config.moe_layers == (0, 1, 2, 3)
    assert config.head_dim == 16  # hidden / heads: Qwen3MoeConfig has no head_dim default
    assert config.intermediate_size == 6144 and not config.norm_topk_prob  # the defaults
    dense = ModelConfig.from_dict({**raw, "num_experts": 0})
    assert not dense.is_moe and dense.moe_layers == ()


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("num_experts_per_tok", 9, "num_experts_per_tok=9"),
        ("decoder_sparse_step", 0, "decoder_sparse_step=0"),
        ("mlp_only_layers", "1", "mlp_only_layers='1'"),
        ("moe_intermediate_size", 0, "moe_intermediate_size=0"),
    ],
)
def test_bad_expert_fields_are_refused_naming_the_field(field: str, value: Any, shown: str) -> None:
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_local_experts": 8,
        field: value,
    }
    with pytest.raises(ModelLoadError, match=shown):
        ModelConfig.from_dict(raw)


def test_a_window_slides_in_every_layer() -> None:
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "use_sliding_window": True,
        "sliding_window": 64,
    }
    assert ModelConfig.from_dict(raw).sliding_windows == (64, 64)
    assert ModelConfig.from_dict({**raw, "use_sliding_window": False}).sliding_windows == ()
    every_layer = r"sliding_window=0 \(use_sliding_window=true: every layer\): expected"
    with pytest.raises(ModelLoadError, match=every_layer):
        ModelConfig.from_dict({**raw, "sliding_window": 0})


@pytest.mark.parametrize("backend", ["eager", "native"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(qwen3_moe, shape: str, backend: str) -> None:
    """Each sequence in two chunks of one paged batch (a decode step after a 99-token prefix
    among them); for "ties", most top-2 choices break a tie among three experts."""
    path = qwen3_moe(shape)
    assert_close(path, 320, CpuKernels.select(log=False), backend=backend)


@pytest.mark.parametrize("matmul", ["packed", "openblas", "paddle"])
def test_native_logits_with_each_matmul(
    qwen3_moe, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts through each GEMM the native backend may measure fastest (the packed one
    computes SwiGLU in its epilogue), forced here."""
    from ketch.kernels.linear import ENV

    monkeypatch.setenv(ENV, matmul)
    assert_close(qwen3_moe("mixed"), 320, CpuKernels.select(log=False), backend="native")


@pytest.mark.parametrize("matmul,fused", [("auto", True), ("packed", True), ("openblas", False)])
def test_native_experts_run_fused_unless_another_matmul_is_forced(
    qwen3_moe, matmul: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused experts op (``ketch.kernels.fused_moe``) on the packed GEMM whatever the dense
    layers measured fastest; a forced other matmul runs them one matmul pair per expert."""
    from ketch.kernels.linear import ENV

    monkeypatch.setenv(ENV, matmul)
    path = qwen3_moe("mixed")
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    model = build_model("native", config, weights, 64, 1, CpuKernels.select(log=False))
    assert (model.experts_op is not None) is fused


def test_stacked_expert_tensors_load_the_same(qwen3_moe, tmp_path: Path) -> None:
    path = qwen3_moe("mixed")
    _stack_experts(path, tmp_path / "stacked")
    config = ModelConfig.from_dir(path)
    ours = load_weights(path, config, "float32").layers[1].moe
    stacked = load_weights(tmp_path / "stacked", config, "float32").layers[1].moe
    for a, b in zip(ours.gate_up + ours.down, stacked.gate_up + stacked.down, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_tensor_parallel_splits_the_experts(qwen3_moe) -> None:
    path = qwen3_moe("mixed")
    config = ModelConfig.from_dir(path)
    whole = load_weights(path, config, "float32").layers[1].moe
    for rank in range(2):
        shard = Shard.of(config, rank, 2)
        assert shard.experts == (4 * rank, 4 * rank + 4)
        part = load_weights(path, config, "float32", shard).layers[1].moe
        assert part.first == 4 * rank and len(part.gate_up) == len(part.down) == 4
        np.testing.assert_array_equal(part.router.numpy(), whole.router.numpy())
        for j in range(4):
            np.testing.assert_array_equal(
                part.gate_up[j].numpy(), whole.gate_up[4 * rank + j].numpy()
            )
    assert "num_experts 8 is not divisible by tensor_parallel_size 3" in "; ".join(
        shard_problems(config, 3)
    )


@pytest.mark.parametrize("shape", ["sparse", "mixed"])
def test_tensor_parallel_logits_match_transformers(qwen3_moe, shape: str) -> None:
    assert_logits_close(qwen3_moe(shape), 2)


def test_backends_without_experts_refuse_naming_the_backend(qwen3_moe) -> None:
    path = qwen3_moe("mixed")
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    assert "--backend predictor" in config.backend_problem("predictor")
    assert "--device gpu" in config.backend_problem("auto", gpu=True)
    assert config.backend_problem("native") is None and config.backend_problem("auto") is None
    with pytest.raises(ValueError, match="eager/native backend only; --backend predictor"):
        build_model("predictor", config, weights, 512, 1)
    with pytest.raises(ValueError, match="eager/native backend only; --device gpu"):
        to_device(weights)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM runs on the eager/native"):
        LLM(str(path), backend="predictor", num_kv_blocks=8, max_model_len=64)
    # and at start-up, before any weight is read (what `ketch serve` and the operator check)
    [refusal] = refusals(EngineConfig(backend="predictor"), model=config)
    assert (refusal.setting, refusal.value) == ("backend", "predictor")
    assert "eager/native backend only" in refusal.reason
    assert refusals(EngineConfig(backend="native"), model=config) == []


@pytest.mark.parametrize(
    ("shape", "backend"),
    [("mixed", "eager"), ("sparse", "native"), ("mixed", "auto")],
    ids=["mixed-eager", "sparse-native", "mixed-auto"],
)
def test_greedy_matches_transformers_with_every_mechanism(
    qwen3_moe, shape: str, backend: str
) -> None:
    runs_on = "native" if backend == "auto" else backend
    assert_constrained_greedy_matches(
        qwen3_moe(shape), make_prompts(320, count=24), backend, runs_on
    )


def test_greedy_matches_transformers_on_two_ranks(qwen3_moe) -> None:
    path = qwen3_moe("sparse")
    assert_two_ranks_greedy_match(path, make_prompts(320, count=24, seed=1))
