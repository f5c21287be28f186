"""Megatron-style sharding of the Llama/Qwen2 decoder across tensor-parallel ranks.

Rank ``r`` of ``world`` holds query heads ``[r H/w, (r+1) H/w)``, the KV heads they attend to,
and intermediate columns ``[r I/w, (r+1) I/w)``. q/k/v and gate/up are column-parallel (each
rank computes its heads' and columns' outputs from the whole hidden state), o and down are
row-parallel (each rank multiplies its part of the input and one all-reduce sums the parts); the
o and down biases are added once, after the sum. Embeddings are replicated; the lm_head lives on
rank 0 only, which computes whole logits and samples.

KV heads: with ``kv_heads >= world`` each rank holds ``kv_heads / world`` of them; with fewer KV
heads than ranks (GQA, e.g. 2 KV heads on 4 ranks) each KV head is replicated on the
``world / kv_heads`` ranks whose query heads use it. Every rank views its KV heads in the one
KV-cache segment (``[layers, 2, kv_heads, blocks, block_size, head_dim]``: a rank's heads are
contiguous per layer), so the scheduler keeps one block table and the cache manager sees the
same layout at any tensor-parallel size; ranks that replicate a head write the same bits to it.

Routed experts (Qwen3-MoE): rank ``r`` holds experts ``[r E/w, (r+1) E/w)`` whole and the
router entire; it adds up its own experts' contributions, and the same all-reduce as the dense
MLP's down projection sums the ranks' parts. Dense layers of a MoE model split as above.
ERNIE 4.5's shared experts (one dense MLP beside the routed ones) split as a dense MLP does, by
their own intermediate columns (``Shard.shared``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ketch.engine.models.config import ModelConfig


def shard_problems(config: ModelConfig, world: int) -> list[str]:
    """Why ``config`` cannot be split across ``world`` ranks ([] when it can)."""
    if world == 1:
        return []
    out = []
    heads, kv, inter = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    )
    if heads % world:
        out.append(f"num_attention_heads {heads} is not divisible by tensor_parallel_size {world}")
    if kv % world and world % kv:
        out.append(
            f"num_key_value_heads {kv} and tensor_parallel_size {world}: one must divide the "
            "other (KV heads are split across ranks, or replicated when there are fewer)"
        )
    if inter % world and len(config.moe_layers) < config.num_hidden_layers:
        out.append(f"intermediate_size {inter} is not divisible by tensor_parallel_size {world}")
    if config.shared_intermediate_size % world:
        out.append(
            f"the shared experts' intermediate size {config.shared_intermediate_size} is not "
            f"divisible by tensor_parallel_size {world}"
        )
    if config.num_experts % world:
        out.append(
            f"num_experts {config.num_experts} is not divisible by tensor_parallel_size {world} "
            "(each rank holds an equal share of the experts, whole)"
        )
    return out


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``world`` holds: [begin, end) ranges of query heads, KV heads,
    intermediate columns (of the dense MLP), routed experts ((0, 0) for a dense model) and the
    shared experts' intermediate columns ((0, 0) without them)."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    experts: tuple[int, int] = (0, 0)
    shared: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world: int) -> Shard:
        problems = shard_problems(config, world)
        if problems:
            raise ValueError("; ".join(problems))
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        h, kv, inter = (
            config.num_attention_heads // world,
            config.num_key_value_heads,
            config.intermediate_size // world,
        )
        if kv >= world:
            kv_range = (rank * kv // world, (rank + 1) * kv // world)
        else:
            head = rank // (world // kv)
            kv_range = (head, head + 1)
        e, shared = config.num_experts // world, config.shared_intermediate_size // world
        return cls(
            rank,
            world,
            (rank * h, (rank + 1) * h),
            kv_range,
            (rank * inter, (rank + 1) * inter),
            (rank * e, (rank + 1) * e),
            (rank * shared, (rank + 1) * shared),
        )

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def first(self) -> bool:
        """Rank 0: holds the lm_head, samples and answers the engine."""
        return self.rank == 0


def whole(config: ModelConfig) -> Shard:
    """The one shard of an unsplit model."""
    return Shard.of(config, 0, 1)
