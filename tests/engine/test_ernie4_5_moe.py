"""ERNIE 4.5 MoE (routed experts chosen on probabilities plus a per-expert correction bias,
shared experts beside them, expert layers chosen by ``moe_layer_start_index``/``end_index``/
``interval``) against Hugging Face transformers on random checkpoints the tests make with
transformers' own ERNIE 4.5 MoE classes (which give the correction bias random values too).

Shapes: 8 experts, top-2, one shared expert, the experts in layers 0-1 of 3 (end index 1),
untied, no biases; the experts in every other layer from 1 (interval 2), two shared experts,
``use_bias`` (q/k/v/o, the dense and shared MLPs and the lm_head biased), tied, one KV head; and a
router whose experts share rows and correction biases in threes, so most tokens' top-2 breaks an
exact tie (it must break as torch's ``topk`` breaks it), with no shared experts. Model level:
logits at every position of a chunked, paged batch within 1e-4 (relative) of transformers' on
the eager and native backends and with the experts split across two ranks. Engine level: ``LLM``
greedy output token-identical to ``generate`` with chunked prefill, prefix-cache hits and
preemption forced, on one rank and two. The predictor and the GPU model have no expert layers:
they refuse, naming the backend.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_engine_exactness import assert_constrained_greedy_matches, make_prompts
from test_model_exactness import assert_close
from test_tensor_parallel_exactness import assert_logits_close, assert_two_ranks_greedy_match

from hf_models import make_small_checkpoint, shape_cache
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
    "early": {
        "num_hidden_layers": 3,
        "moe_layer_start_index": 0,
        "moe_layer_end_index": 1,  # layer 2 dense
        "moe_num_shared_experts": 1,
        "tie_word_embeddings": False,
    },
    "alternate-bias": {
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 2,  # layers 1 and 3
        "moe_num_shared_experts": 2,
        "use_bias": True,
    },
    "ties": {"num_hidden_layers": 2, "moe_layer_start_index": 0, "moe_num_shared_experts": 0},
}
MOE_LAYERS = {"early": (0, 1), "alternate-bias": (1, 3), "ties": (0, 1)}
SHARED = {"early": 32, "alternate-bias": 64, "ties": 0}
BIAS = "mlp.moe_statics.e_score_correction_bias"


def make_ernie_moe_checkpoint(out: Path, seed: int = 0, **overrides: Any) -> Path:
    settings: dict[str, Any] = dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_num_experts=8,
        moe_k=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return make_small_checkpoint(out, "Ernie4_5_MoeConfig", seed, **{**settings, **overrides})


def _tie_router_rows(path: Path) -> None:
    """Experts {0, 1, 2}, {3, 4, 5} and {6, 7} share router rows and correction biases (equal
    biased scores): a token whose best group is one of three picks two of them by the tie."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            t[1], t[2], t[4], t[5], t[7] = t[0], t[0], t[3], t[3], t[6]
        if name.endswith(BIAS):
            t[0, 1], t[0, 2], t[0, 4], t[0, 5], t[0, 7] = (
                t[0, 0],
                t[0, 0],
                t[0, 3],
                t[0, 3],
                t[0, 6],
            )
    save_file(tensors, file, metadata={"format": "pt"})


def _ernie_moe_shape(out: Path, shape: str) -> Path:
    path = make_ernie_moe_checkpoint(out, **SHAPES[shape])
    if shape == "ties":
        _tie_router_rows(path)
    return path


@pytest.fixture(scope="module")
def ernie_moe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """ernie_moe("early") -> that shape's checkpoint directory (made once per module)."""
    return shape_cache(tmp_path_factory, "ernie_moe", _ernie_moe_shape)


def test_the_checkpoints_have_the_layers_they_claim(ernie_moe) -> None:
    for shape in SHAPES:
        config = ModelConfig.from_dir(ernie_moe(shape))
        assert config.architecture == "Ernie4_5_MoeForCausalLM" and config.rope_interleaved
        assert config.moe_layers == MOE_LAYERS[shape]
        assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
        assert config.moe_score_bias and config.moe_norm_min == 1e-12
        assert config.shared_intermediate_size == SHARED[shape]
        biased = shape == "alternate-bias"
        assert config.lm_head_bias == config.mlp_bias == config.qkv_bias == biased
        weights = load_weights(ernie_moe(shape), config, "float32")
        assert (weights.lm_head_bias is not None) == biased
        for i, layer in enumerate(weights.layers):
            routed = i in MOE_LAYERS[shape]
            assert (layer.moe is not None) == routed
            assert (layer.gate_up is None) == (routed and not SHARED[shape])
            if routed:
                assert layer.moe.score_bias.shape == [8]
                assert layer.moe.router.dtype == layer.moe.score_bias.dtype  # float32
            if routed and SHARED[shape]:
                assert layer.gate_up.shape == [64, 2 * SHARED[shape]]


@pytest.mark.parametrize("tied", [False, True])
def test_the_router_is_transformers_router(tied: bool) -> None:
    """``route_with_bias`` against ``Ernie4_5_MoeTopKRouter`` itself: the same experts, in the
    same order (ties included), and the same weights; the bias changes some tokens' choice."""
    import paddle
    import torch
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    from ketch.engine.models.moe import route_with_bias

    config = Ernie4_5_MoeConfig(hidden_size=32, moe_num_experts=8, moe_k=3)
    router = Ernie4_5_MoeTopKRouter(config)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        router.moe_statics.e_score_correction_bias.normal_(0.0, 0.1)
        if tied:
            w, b = router.weight, router.moe_statics.e_score_correction_bias[0]
            w[1], w[2], w[5], b[1], b[2], b[5] = w[0], w[0], w[4], b[0], b[0], b[4]
    x = torch.randn(200, 32)
    _, their_weights, their_experts = router(x)
    weights, experts = route_with_bias(
        paddle.to_tensor(x.numpy()),
        paddle.to_tensor(router.weight.detach().numpy().T),
        paddle.to_tensor(router.moe_statics.e_score_correction_bias.detach().numpy()[0]),
        3,
        config.moe_norm_min,
    )
    np.testing.assert_array_equal(experts.numpy(), their_experts.numpy())
    np.testing.assert_allclose(
        weights.numpy(), their_weights.detach().numpy(), rtol=1e-5, atol=1e-7
    )
    unbiased = torch.topk(torch.softmax(x @ router.weight.T, -1), 3).indices
    assert (unbiased.sort(-1).values != their_experts.sort(-1).values).any()


def test_hub_style_config_fields() -> None:
    """The Hub's ERNIE-4.5-21B-A3B config.json (sizes shrunk): ``rope_theta`` at the top, the
    MTP layer count and the original code's routing fields (ignored, as transformers ignores
    them), ``moe_layer_end_index`` left out (-1: the last layer)."""
    raw = {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000,
        "moe_num_experts": 16,
        "moe_k": 4,
        "moe_intermediate_size": 32,
        "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
        "moe_use_aux_free": True,
        "moe_gate": "topk",
        "moe_capacity": [16, 16, 16],
        "num_nextn_predict_layers": 1,
        "multi_token_pred_lambda": 0.3,
        "use_bias": False,
        "tie_word_embeddings": True,
    }
    config = ModelConfig.from_dict(raw)
    assert config.moe_layers == (1, 2, 3, 4) and config.num_experts == 16
    assert config.num_experts_per_tok == 4 and config.shared_intermediate_size == 64
    assert config.head_dim == 16  # hidden / heads: Ernie4_5_MoeConfig has no head_dim default
    assert config.rope.theta == 500000.0 and config.rms_norm_eps == 1e-5
    # transformers' attribute_map: num_experts / num_experts_per_tok name the same fields
    aliased = {**raw, "num_experts": 8, "num_experts_per_tok": 2}
    del aliased["moe_num_experts"], aliased["moe_k"]
    config = ModelConfig.from_dict(aliased)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    # an end index before the start: transformers builds no expert layer, and neither does Ketch
    dense = ModelConfig.from_dict({**raw, "moe_layer_end_index": 0})
    assert not dense.is_moe and dense.shared_intermediate_size == 0


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("moe_k", 9, "moe_k=9"),
        ("moe_num_experts", 0, "moe_num_experts=0"),
        ("moe_layer_interval", 0, "moe_layer_interval=0"),
        ("moe_layer_start_index", None, "moe_layer_start_index=None"),
        ("moe_intermediate_size", 0, "moe_intermediate_size=0"),
        ("moe_num_shared_experts", -1, "moe_num_shared_experts=-1"),
        ("moe_norm_min", "tiny", "moe_norm_min='tiny'"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_type='yarn'"),
    ],
)
def test_bad_expert_fields_are_refused_naming_the_field(field: str, value: Any, shown: str) -> None:
    raw = {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "moe_num_experts": 8,
        field: value,
    }
    with pytest.raises(ModelLoadError, match=shown):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("backend", ["eager", "native"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(ernie_moe, shape: str, backend: str) -> None:
    """Each sequence in two chunks of one paged batch (a decode step after a 99-token prefix
    among them); for "ties", most top-2 choices break a tie among three experts."""
    assert_close(ernie_moe(shape), 320, CpuKernels.select(log=False), backend=backend)


@pytest.mark.parametrize("matmul", ["packed", "openblas", "paddle"])
@pytest.mark.parametrize("shape", ["early", "alternate-bias"])
def test_native_logits_with_each_matmul(
    ernie_moe, shape: str, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routed and shared experts and the lm_head through each GEMM the native backend may
    measure fastest (with no bias the packed one computes SwiGLU in its epilogue; with biases it
    adds them, the lm_head's too), forced here."""
    from ketch.kernels.linear import ENV

    monkeypatch.setenv(ENV, matmul)
    assert_close(ernie_moe(shape), 320, CpuKernels.select(log=False), backend="native")


def _other_layout(src: Path, out: Path) -> None:
    """``src`` with the experts stacked (transformers' in-memory ``mlp.experts.gate_up_proj``
    [E, 2I, H], ``down_proj`` [E, H, I]), the correction bias at transformers' module path
    (``mlp.gate.moe_statics.``) and an MTP layer's weights (``mtp_*``) beside the model's."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        if p + "experts.0.gate_proj.weight" not in tensors:
            continue
        pop = [
            {n: tensors.pop(f"{p}experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")}
            for e in range(config["moe_num_experts"])
        ]
        tensors[p + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate"], w["up"]]) for w in pop]
        )
        tensors[p + "experts.down_proj"] = torch.stack([w["down"] for w in pop])
        tensors[p + "gate.moe_statics.e_score_correction_bias"] = tensors.pop(
            f"model.layers.{i}.{BIAS}"
        )
    tensors["mtp_emb_norm.0.weight"] = torch.ones(64)
    tensors["mtp_linear_proj.0.weight"] = torch.zeros(64, 128)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def test_other_weight_layouts_load_the_same(
    ernie_moe, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = ernie_moe("alternate-bias")
    _other_layout(path, tmp_path / "other")
    config = ModelConfig.from_dir(path)
    ours = load_weights(path, config, "float32").layers[3].moe
    with caplog.at_level(logging.WARNING, logger="ketch.engine.models.loader"):
        other = load_weights(tmp_path / "other", config, "float32").layers[3].moe
    assert "unused" not in caplog.text  # the MTP layer is not ours to read
    for a, b in zip(
        [*ours.gate_up, *ours.down, ours.score_bias],
        [*other.gate_up, *other.down, other.score_bias],
        strict=True,
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_tensor_parallel_splits_the_routed_and_the_shared_experts(ernie_moe) -> None:
    path = ernie_moe("alternate-bias")
    config = ModelConfig.from_dir(path)
    whole = load_weights(path, config, "float32").layers[1]
    shared = config.shared_intermediate_size
    for rank in range(2):
        shard = Shard.of(config, rank, 2)
        assert shard.experts == (4 * rank, 4 * rank + 4)
        assert shard.shared == (rank * shared // 2, (rank + 1) * shared // 2)
        part = load_weights(path, config, "float32", shard).layers[1]
        assert part.moe.first == 4 * rank and len(part.moe.gate_up) == 4
        np.testing.assert_array_equal(part.moe.router.numpy(), whole.moe.router.numpy())
        np.testing.assert_array_equal(part.moe.score_bias.numpy(), whole.moe.score_bias.numpy())
        s0, s1 = shard.shared
        gate_up = whole.gate_up.numpy()
        np.testing.assert_array_equal(
            part.gate_up.numpy(),
            np.concatenate([gate_up[:, s0:s1], gate_up[:, shared + s0 : shared + s1]], 1),
        )
        np.testing.assert_array_equal(part.down.numpy(), whole.down.numpy()[s0:s1])
        np.testing.assert_array_equal(part.down_bias.numpy(), whole.down_bias.numpy())  # once
    problems = "; ".join(shard_problems(config, 3))
    assert "num_experts 8 is not divisible by tensor_parallel_size 3" in problems
    assert "shared experts' intermediate size 64 is not divisible" in problems


@pytest.mark.parametrize("shape", ["early", "alternate-bias"])
def test_tensor_parallel_logits_match_transformers(ernie_moe, shape: str) -> None:
    assert_logits_close(ernie_moe(shape), 2)


def test_backends_without_experts_refuse_naming_the_backend(ernie_moe) -> None:
    path = ernie_moe("early")
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    assert "--backend predictor" in config.backend_problem("predictor")
    assert "--device gpu" in config.backend_problem("auto", gpu=True)
    assert config.backend_problem("native") is None and config.backend_problem("auto") is None
    with pytest.raises(ValueError, match="Ernie4_5_MoeForCausalLM runs on the eager/native"):
        build_model("predictor", config, weights, 512, 1)
    with pytest.raises(ValueError, match="eager/native backend only; --device gpu"):
        to_device(weights)
    [refusal] = refusals(EngineConfig(backend="predictor"), model=config)
    assert (refusal.setting, refusal.value) == ("backend", "predictor")
    assert refusals(EngineConfig(backend="native"), model=config) == []


@pytest.mark.parametrize(
    ("shape", "backend"),
    [("alternate-bias", "eager"), ("early", "native"), ("ties", "auto")],
    ids=["bias-eager", "early-native", "ties-auto"],
)
def test_greedy_matches_transformers_with_every_mechanism(
    ernie_moe, shape: str, backend: str
) -> None:
    runs_on = "native" if backend == "auto" else backend
    assert_constrained_greedy_matches(
        ernie_moe(shape), make_prompts(320, count=24), backend, runs_on
    )


def test_greedy_matches_transformers_on_two_ranks(ernie_moe) -> None:
    assert_two_ranks_greedy_match(ernie_moe("alternate-bias"), make_prompts(320, count=24, seed=1))
