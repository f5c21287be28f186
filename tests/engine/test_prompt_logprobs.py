"""``prompt_logprobs``: the log-probability of every prompt token after the first, from the
logits the prefill computes, equal to the Hugging Face model's log-softmax on the prompt.

Run under every mechanism that could lose or repeat a position: prefills chunked by a small
token budget, prompts sharing prefixes (no prefix-cache hit may skip a position's logits), and a
KV pool small enough to preempt and recompute (a recomputed prompt is not scored twice).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import hf_model
from ketch.engine import LLM, SamplingParams
from ketch.engine.models.config import ModelConfig

TOP = 3
TOLERANCE = 1e-4


def reference(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    """HF log-softmax at each prompt position, [len(prompt), vocab] in float64."""
    model = hf_model(path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits[0].double()
            out.append(torch.log_softmax(logits, dim=-1).numpy())
    return out


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, vocab, 40).tolist()
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(2, 90, 10)]
    return [prefix + p if i % 2 else p for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def path(checkpoint) -> Path:
    return checkpoint("llama")


def constrained(path: Path) -> LLM:
    return LLM(
        str(path),
        block_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        num_kv_blocks=24,
        max_model_len=256,
    )


def test_prompt_logprobs_equal_transformers_under_chunking_sharing_and_preemption(path) -> None:
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = prompts_for(vocab)
    llm = constrained(path)
    # The shared prefix is cached by the plain requests; the scored ones must not use it.
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
        if i % 3
        else SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, params)
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the pool should preempt"
    assert llm.engine.scheduler.stats.prefix_hit_tokens > 0, "some prefix should be cached"
    for i, (prompt, output, want) in enumerate(
        zip(prompts, outputs, reference(path, prompts), strict=True)
    ):
        if not i % 3:
            assert output.prompt_logprobs is None
            continue
        got = output.prompt_logprobs
        assert got is not None and len(got) == len(prompt) - 1, i
        assert [e.token_id for e in got] == prompt[1:]
        expected = want[np.arange(len(prompt) - 1), prompt[1:]]
        actual = np.array([e.logprob for e in got])
        rel = np.abs(actual - expected).max() / np.abs(expected).max()
        assert rel <= TOLERANCE, f"prompt {i}: relative error {rel:.2e}"
        for position, entry in enumerate(got):
            top_ids = np.argsort(-want[position], kind="stable")[:TOP].tolist()
            assert [t for t, _ in entry.top] == top_ids, (i, position)
            np.testing.assert_allclose(
                [lp for _, lp in entry.top], want[position][top_ids], rtol=TOLERANCE, atol=1e-6
            )


def test_a_repeated_prompt_is_scored_whole_again(path) -> None:
    prompt = prompts_for(ModelConfig.from_dir(path).vocab_size, seed=1)[1]
    llm = LLM(str(path), block_size=16, kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    assert len(second.prompt_logprobs) == len(prompt) - 1
    assert [e.logprob for e in first.prompt_logprobs] == pytest.approx(
        [e.logprob for e in second.prompt_logprobs], abs=1e-6
    )
    assert all(e.top == [] for e in second.prompt_logprobs)
