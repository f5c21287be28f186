"""``LLM.generate`` greedy outputs equal Hugging Face ``generate``, token for token.

The engine is configured so every mechanism runs at once: 16-token blocks, a token budget that
chunks prefills and mixes them with decodes, prompts sharing prefixes (prefix-cache hits), and a
KV pool small enough to force preemption and recompute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hf_models import hf_greedy
from ketch.engine import LLM, SamplingParams
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import TINY_MODEL_DIR

MAX_TOKENS = 24


def make_prompts(vocab: int, count: int = 36, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, vocab, n).tolist() for n in (40, 70)]
    prompts = []
    for i in range(count):
        suffix = rng.integers(1, vocab, int(rng.integers(1, 90))).tolist()
        prompts.append((prefixes[i % 2] + suffix) if i % 3 else suffix)
    return prompts


def run_constrained(
    path: Path, prompts: list[list[int]], backend: str = "auto"
) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(path),
        backend=backend,
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        num_kv_blocks=26,
        max_model_len=256,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    llm.engine.scheduler.check_integrity()
    return [o.outputs[0].token_ids for o in outputs], llm


def assert_greedy_matches(path: Path, ours: list[list[int]], prompts: list[list[int]]) -> None:
    """``ours`` equals transformers' greedy ``generate`` of ``prompts``, token for token."""
    reference = hf_greedy(path, prompts, MAX_TOKENS)
    mismatches = [i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b]
    assert not mismatches, (
        f"prompts {mismatches} differ, e.g. {ours[mismatches[0]]} vs {reference[mismatches[0]]}"
    )


def assert_constrained_greedy_matches(
    path: Path, prompts: list[list[int]], backend: str, runs_on: str | None = None
) -> None:
    """``run_constrained`` on ``backend`` (which runs the model on ``runs_on``, default the
    same) preempts, hits the prefix cache, returns every block, and is greedy token-identical
    to transformers."""
    ours, llm = run_constrained(path, prompts, backend)
    try:
        model = llm.engine.runner.model
        assert model.backend_name == (runs_on or backend)
        if model.backend_name == "predictor":
            assert model.predictor_steps > 0
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0, "the pool should have been small enough to preempt"
        assert stats.prefix_hit_tokens > 0, "shared prefixes should have hit the prefix cache"
        pool = llm.engine.kv_cache.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
    finally:
        llm.engine.close()
    assert_greedy_matches(path, ours, prompts)


@pytest.mark.parametrize("backend", ["eager", "predictor", "native"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "tiny"])
def test_greedy_matches_transformers_with_every_mechanism(
    checkpoint, name: str, backend: str
) -> None:
    path = TINY_MODEL_DIR if name == "tiny" else checkpoint(name)
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size)
    assert_constrained_greedy_matches(path, prompts, backend)


def test_greedy_matches_transformers_on_an_avx2_only_cpu(checkpoint, monkeypatch) -> None:
    """The same, with the CPU features narrowed to an AVX2 machine's (Zen 3): the path such a
    machine runs is checked on every machine, AVX-512 ones included."""
    from ketch.kernels.cpu_features import ENV_FLAGS

    monkeypatch.setenv(ENV_FLAGS, "sse4_2 avx avx2 fma")
    path = checkpoint("qwen2")
    prompts = make_prompts(ModelConfig.from_dir(path).vocab_size, count=20, seed=3)
    ours, llm = run_constrained(path, prompts, backend="eager")  # the eager kernels' choice
    assert llm.engine.runner.model.kernels.rms_norm_name == "portable"
    assert ours == hf_greedy(path, prompts, MAX_TOKENS)
