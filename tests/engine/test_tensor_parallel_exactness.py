"""Tensor parallelism on the CPU: a checkpoint split across worker processes, one per rank,
against Hugging Face transformers.

Model level (``tp_harness``): rank 0's logits at every position of a chunked, paged batch equal
the HF model's (rel. err <= 1e-4), for Llama and Qwen2 GQA checkpoints, with biases (o and down
biases are added once, after the all-reduce), with fewer KV heads than ranks (replicated), with
both collectives (the shared-memory group and paddle.distributed's gloo).
Engine level: ``LLM(tensor_parallel_size=2)`` greedy outputs are token-identical to HF
``generate`` on 36 prompts with chunked prefill, prefix-cache hits and preemption all forced.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engine_exactness import MAX_TOKENS, assert_greedy_matches, make_prompts
from test_model_exactness import TOLERANCE, reference_logits
from tp_harness import parallel_logits

from ketch.engine import LLM, SamplingParams
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.loader import load_weights
from ketch.engine.models.sharding import Shard, shard_problems


def sequences_for(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 17, 40, 100, 250]
    sequences = [rng.integers(1, vocab, n).tolist() for n in lengths]
    splits = [0 if n == 1 else int(rng.integers(1, n)) for n in lengths]
    splits[-2] = lengths[-2] - 1  # a decode step after a 99-token prefix
    return sequences, splits


def assert_logits_close(path: Path, world: int, group: str = "shm") -> None:
    sequences, splits = sequences_for(ModelConfig.from_dir(path).vocab_size)
    ours = parallel_logits(path, world, sequences, splits, group)
    for a, b, seq in zip(ours, reference_logits(path, sequences), sequences, strict=True):
        rel = np.abs(a - b).max() / np.abs(b).max()
        assert rel <= TOLERANCE, f"length {len(seq)}: relative error {rel:.2e}"


@pytest.mark.parametrize(
    ("name", "world"),
    [("llama", 2), ("qwen2", 2), ("llama-linear-bias", 2), ("qwen2-mqa", 2), ("llama", 4)],
    ids=["llama-tp2", "qwen2-tp2", "llama-bias-tp2", "qwen2-1kv-tp2", "llama-2kv-tp4"],
)
def test_sharded_logits_match_transformers(checkpoint, name: str, world: int) -> None:
    assert_logits_close(checkpoint(name), world)


def test_paddle_distributed_group_gives_the_same_logits(checkpoint) -> None:
    """gloo's all-reduce, initialised from the environment the engine would give each rank."""
    assert_logits_close(checkpoint("qwen2"), 2, group="paddle")


def test_each_rank_loads_only_its_slices(checkpoint) -> None:
    path = checkpoint("llama-linear-bias")
    config = ModelConfig.from_dir(path)
    full = load_weights(path, config, "float32")
    d, inter = config.head_dim, config.intermediate_size
    for rank in range(2):
        shard = Shard.of(config, rank, 2)
        part = load_weights(path, config, "float32", shard)
        whole_layer, layer = full.layers[1], part.layers[1]
        h0, h1 = (x * d for x in shard.heads)
        k0, k1 = (x * d for x in shard.kv_heads)
        q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
        columns = [
            *range(h0, h1),
            *range(q_size + k0, q_size + k1),
            *range(q_size + kv_size + k0, q_size + kv_size + k1),
        ]
        np.testing.assert_array_equal(layer.qkv.numpy(), whole_layer.qkv.numpy()[:, columns])
        np.testing.assert_array_equal(layer.qkv_bias.numpy(), whole_layer.qkv_bias.numpy()[columns])
        np.testing.assert_array_equal(layer.o.numpy(), whole_layer.o.numpy()[h0:h1])
        np.testing.assert_array_equal(layer.o_bias.numpy(), whole_layer.o_bias.numpy())  # once
        i0, i1 = shard.intermediate
        gate_up = whole_layer.gate_up.numpy()
        np.testing.assert_array_equal(
            layer.gate_up.numpy(),
            np.concatenate([gate_up[:, i0:i1], gate_up[:, inter + i0 : inter + i1]], 1),
        )
        np.testing.assert_array_equal(layer.down.numpy(), whole_layer.down.numpy()[i0:i1])
        assert (part.lm_head is not None) == (rank == 0)


def test_shards_cover_the_model_once() -> None:
    config = ModelConfig.from_dir(Path(__file__).parents[2] / "engine/ketch/engine/models/tiny")
    for world in (1, 2, 4):
        shards = [Shard.of(config, r, world) for r in range(world)]
        heads = [h for s in shards for h in range(*s.heads)]
        assert heads == list(range(config.num_attention_heads))
        columns = [c for s in shards for c in range(*s.intermediate)]
        assert columns == list(range(config.intermediate_size))
        group = config.num_attention_heads // config.num_key_value_heads
        for s in shards:  # each rank's query heads attend to the KV heads it holds
            assert {h // group for h in range(*s.heads)} == set(range(*s.kv_heads))
    assert shard_problems(config, 3) and shard_problems(config, 8)
    with pytest.raises(ValueError, match="not divisible"):
        Shard.of(config, 0, 3)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        Shard.of(config, 2, 2)


def assert_two_ranks_greedy_match(path: Path, prompts: list[list[int]]) -> None:
    """``LLM`` on two ranks, with a pool small enough to preempt and shared prefixes hitting the
    prefix cache, is greedy token-identical to transformers."""
    llm = LLM(
        str(path),
        tensor_parallel_size=2,
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        num_kv_blocks=26,
        max_model_len=256,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0, "the pool should have been small enough to preempt"
        assert stats.prefix_hit_tokens > 0, "shared prefixes should have hit the prefix cache"
        assert len(llm.engine.runner.processes) == 2
    finally:
        llm.engine.close()
    assert_greedy_matches(path, ours, prompts)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2-mqa"])
def test_greedy_matches_transformers_with_every_mechanism(checkpoint, name: str) -> None:
    path = checkpoint(name)
    assert_two_ranks_greedy_match(path, make_prompts(ModelConfig.from_dir(path).vocab_size))


def test_an_unknown_collective_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("KETCH_TP_COLLECTIVE", "carrier-pigeon")
    with pytest.raises(ValueError, match="KETCH_TP_COLLECTIVE='carrier-pigeon': choose one of"):
        LLM("tiny", tensor_parallel_size=2)
