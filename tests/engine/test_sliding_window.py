"""Sliding-window attention against Hugging Face transformers, on random checkpoints the tests
make with transformers' own config classes.

Three checkpoints, windows of 16-24 tokens, sequences of up to 250 (several windows):
Mistral (every layer slides), Qwen2 with ``use_sliding_window`` and ``max_window_layers``
splitting the layers (0 full, 1-2 sliding), Qwen3 with ``layer_types`` mixed (sliding, full,
sliding), and Qwen3-MoE (every layer). First that transformers really applies the window in the
attention it runs here (its logits differ from the same weights without one, so these tests can
fail); then logits at every position of a chunked, paged batch within 1e-4 (relative) on the
eager, predictor and native backends and at tensor parallelism 2; then ``LLM`` greedy outputs
token-identical to ``generate`` with prefill chunks shorter and longer than the window, prefix-cache
hits and preemption forced, on one rank and on two.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_engine_exactness import (
    MAX_TOKENS,
    assert_constrained_greedy_matches,
    assert_greedy_matches,
    make_prompts,
)
from test_model_exactness import assert_close, reference_logits
from test_tensor_parallel_exactness import assert_logits_close, assert_two_ranks_greedy_match

from hf_models import make_small_checkpoint, shape_cache
from ketch.engine import LLM, SamplingParams
from ketch.engine.models.config import ModelConfig
from ketch.kernels import CpuKernels
from ketch.kernels.paged_attention import PagedAttention

WINDOWED_SIZES: dict[str, Any] = dict(num_hidden_layers=3, num_key_value_heads=2)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    # name: (config class, its settings, the windows Ketch must read from them)
    "mistral": ("MistralConfig", {"sliding_window": 16}, (16, 16, 16)),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
        (0, 20, 20),
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "use_sliding_window": True,
            "sliding_window": 24,
            "head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        (24, 0, 24),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "use_sliding_window": True,
            "sliding_window": 16,
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
        (16, 16),
    ),
}


def make_windowed_checkpoint(out: Path, name: str) -> Path:
    cls, settings, _ = CHECKPOINTS[name]
    return make_small_checkpoint(out, cls, **{**WINDOWED_SIZES, **settings})


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """windowed("mistral") -> that checkpoint's directory (made once per module)."""
    return shape_cache(tmp_path_factory, "windowed", make_windowed_checkpoint)


def without_window(path: Path, out: Path) -> Path:
    """A copy of the checkpoint at ``path`` whose config has no sliding window."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["sliding_window"] = None
    config.pop("layer_types", None)  # recomputed: every layer full
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_config_gives_each_layer_its_window(windowed, name: str) -> None:
    config = ModelConfig.from_dir(windowed(name))
    assert config.sliding_windows == CHECKPOINTS[name][2]
    assert [config.window(i) for i in range(config.num_hidden_layers)] == list(
        config.sliding_windows
    )
    assert config.attention_windows == tuple(sorted(set(config.sliding_windows)))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_transformers_applies_the_window(windowed, name: str, tmp_path: Path) -> None:
    """The oracle itself slides: its logits past the first window differ from the same weights'
    without one (so the exactness tests below can fail), and agree before it."""
    from hf_models import hf_model

    path = windowed(name)
    assert hf_model(path).config._attn_implementation in ("sdpa", "eager")
    sequence = np.random.default_rng(0).integers(1, 320, 100).tolist()
    slid = reference_logits(path, [sequence])[0]
    full = reference_logits(without_window(path, tmp_path / "full"), [sequence])[0]
    assert ModelConfig.from_dir(tmp_path / "full").sliding_windows == ()
    first = min(w for w in CHECKPOINTS[name][2] if w)
    np.testing.assert_allclose(slid[:first], full[:first], rtol=1e-5, atol=1e-5)
    assert np.abs(slid[first + 1 :] - full[first + 1 :]).max() > 1e-2 * np.abs(full).max()


@pytest.mark.parametrize(
    ("backend", "kernels"),
    [
        ("eager", "portable"),
        ("eager", "selected"),
        ("predictor", "portable"),
        ("predictor", "selected"),
        ("native", "generic"),
        ("native", "selected"),
    ],
)
@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3"])
def test_logits_match_transformers(windowed, name: str, backend: str, kernels: str) -> None:
    """Sequences of 1 to 250 tokens, each in two chunks of one paged batch (a decode step after
    a 99-token prefix among them); the predictor runs every step on its programs, with
    attention in dygraph (portable) or in the C++ kernel."""
    path = windowed(name)
    chosen = CpuKernels.portable() if kernels == "portable" else CpuKernels.select(log=False)
    if kernels == "generic":
        chosen = dataclasses.replace(chosen, paged_attention=PagedAttention("generic"))
    assert_close(path, 320, chosen, backend=backend)


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_moe_logits_match_transformers(windowed, backend: str) -> None:
    assert_close(windowed("qwen3-moe"), 320, CpuKernels.select(log=False), backend=backend)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_tensor_parallel_logits_match_transformers(windowed, name: str) -> None:
    assert_logits_close(windowed(name), 2)


def windowed_prompts(seed: int = 0) -> list[list[int]]:
    """``make_prompts``' shared prefixes (40 and 70 tokens) with longer suffixes: 60-160 tokens,
    several windows each."""
    rng = np.random.default_rng(seed)
    return [p + rng.integers(1, 320, 20).tolist() for p in make_prompts(320, count=20, seed=seed)]


@pytest.mark.parametrize(
    ("name", "backend"),
    [("mistral", "eager"), ("mistral", "native"), ("qwen2", "predictor"), ("qwen3", "native")],
)
def test_greedy_matches_transformers_with_every_mechanism(
    windowed, name: str, backend: str
) -> None:
    """Chunks of up to 48 tokens (longer than the window), prefix-cache hits, preemption."""
    assert_constrained_greedy_matches(windowed(name), windowed_prompts(), backend)


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_greedy_matches_with_chunks_shorter_than_the_window(windowed, name: str) -> None:
    """A token budget of 8: every prompt prefilled in chunks shorter than the window, each
    attending across the chunks before it in the cache."""
    path = windowed(name)
    prompts = windowed_prompts(seed=1)[:8]
    llm = LLM(
        str(path), backend="native", block_size=16, max_num_batched_tokens=8, max_num_seqs=4,
        num_kv_blocks=40, max_model_len=256,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.scheduler.check_integrity()
    finally:
        llm.engine.close()
    assert_greedy_matches(path, ours, prompts)


def test_greedy_matches_transformers_on_two_ranks(windowed) -> None:
    assert_two_ranks_greedy_match(windowed("qwen2"), windowed_prompts(seed=2))


def test_the_gpu_model_refuses_a_window_naming_the_field_and_backend(windowed) -> None:
    config = ModelConfig.from_dir(windowed("qwen2"))
    problem = config.backend_problem("auto", gpu=True)
    assert "sliding_window=20" in problem and "--device gpu" in problem
    for backend in ("auto", "native", "predictor", "eager"):
        assert config.backend_problem(backend) is None
