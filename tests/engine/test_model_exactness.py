"""The paddle model against Hugging Face transformers (torch, CPU) on the same checkpoints.

Sequences run together in one paged batch, each split into two chunks at different points
(the second chunk attends to the first through the KV cache; a split at the last token is a
decode step), so the attention paths of a real mixed batch are what is compared.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from tp_harness import BLOCK, chunked_logits, num_blocks_for

from hf_models import hf_model
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import TINY_MODEL_DIR, load_weights
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.model_runner import configure_paddle
from ketch.kernels import CpuKernels
from ketch.kernels.paged_attention import PagedAttention

TOLERANCE = 1e-4


def engine_logits(
    path: Path,
    sequences: list[list[int]],
    splits: list[int],
    kernels: CpuKernels,
    backend: str = "eager",
) -> list[np.ndarray]:
    """Logits at every position of every sequence, computed in two batched chunked steps."""
    threads = configure_paddle(None)
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    model = build_model(backend, config, weights, 1024, threads, kernels)
    if backend == "predictor":
        model.eager_below_tokens = 0  # every step on the predictor
    cache = KVCache(
        config.num_hidden_layers,
        num_blocks_for(sequences),
        BLOCK,
        config.num_key_value_heads,
        config.head_dim,
    )
    return chunked_logits(model, cache, sequences, splits)


def reference_logits(path: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    model = hf_model(path)
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].numpy() for s in sequences]


def assert_close(
    path: Path, vocab: int, kernels: CpuKernels, seed: int = 0, backend: str = "eager"
) -> None:
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 17, 40, 100, 250]
    sequences = [rng.integers(1, vocab, n).tolist() for n in lengths]
    splits = [0 if n == 1 else int(rng.integers(1, n)) for n in lengths]
    splits[-2] = lengths[-2] - 1  # a decode step after a 99-token prefix
    ours = engine_logits(path, sequences, splits, kernels, backend)
    theirs = reference_logits(path, sequences)
    for a, b, n in zip(ours, theirs, lengths, strict=True):
        rel = np.abs(a - b).max() / np.abs(b).max()
        assert rel <= TOLERANCE, f"length {n}: relative error {rel:.2e}"


@pytest.fixture(params=["portable", "selected"])
def kernels(request) -> CpuKernels:
    """The portable kernels (what an AVX2-only CPU runs), forced on every machine, and the ones
    this machine's CPU selects (the fused AVX-512 ones where it has AVX-512)."""
    return CpuKernels.portable() if request.param == "portable" else CpuKernels.select()


CHECKPOINT_NAMES = ["llama", "llama-tied-llama3rope", "llama-linear-bias", "qwen2", "qwen2-untied"]


@pytest.mark.parametrize("name", CHECKPOINT_NAMES)
def test_random_checkpoints_match_transformers(checkpoint, name: str, kernels) -> None:
    path = checkpoint(name)
    assert_close(path, ModelConfig.from_dir(path).vocab_size, kernels)


@pytest.mark.parametrize("name", CHECKPOINT_NAMES)
def test_predictor_backend_matches_transformers(checkpoint, name: str, kernels) -> None:
    """Dense layers on the predictor, attention in dygraph (portable kernels) or in the C++
    paged-attention kernel this CPU selects."""
    path = checkpoint(name)
    assert_close(path, ModelConfig.from_dir(path).vocab_size, kernels, backend="predictor")


def test_sharded_checkpoint_matches_transformers(checkpoint, kernels) -> None:
    path = checkpoint("qwen2", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    assert_close(path, ModelConfig.from_dir(path).vocab_size, kernels, seed=1)


def test_tiny_model_matches_transformers(kernels) -> None:
    config = ModelConfig.from_dir(TINY_MODEL_DIR)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert_close(TINY_MODEL_DIR, config.vocab_size, kernels, seed=2)


def test_tiny_model_on_the_predictor_matches_transformers(kernels) -> None:
    config = ModelConfig.from_dir(TINY_MODEL_DIR)
    assert_close(TINY_MODEL_DIR, config.vocab_size, kernels, seed=2, backend="predictor")


@pytest.fixture(params=["generic", "selected"])
def native_kernels(request) -> CpuKernels:
    """The native backend runs attention in C++: the generic kernel (any x86-64) and the one this
    CPU selects (AVX-512 or AVX2)."""
    kernels = CpuKernels.select(log=False)
    if request.param == "generic":
        kernels = dataclasses.replace(kernels, paged_attention=PagedAttention("generic"))
    return kernels


@pytest.mark.parametrize("matmul", ["packed", "openblas", "paddle"])
@pytest.mark.parametrize("name", [*CHECKPOINT_NAMES, "tiny"])
def test_native_backend_matches_transformers(
    checkpoint, name: str, native_kernels, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every matmul through the packed GEMM, OpenBLAS's or paddle.matmul, whichever the backend
    would measure faster on some machine, forced here; attention in the C++ kernel."""
    from ketch.kernels.linear import ENV

    monkeypatch.setenv(ENV, matmul)
    path = TINY_MODEL_DIR if name == "tiny" else checkpoint(name)
    assert_close(path, ModelConfig.from_dir(path).vocab_size, native_kernels, backend="native")
