"""How much memory a CPU instance under ``ketch serve`` takes: every rank's weights at their
precision, the KV cache (its /dev/shm segment) and a headroom per process and per step.

``LLMEngine`` logs it at start-up, and the operator checks an InferenceService's pod memory limit
against it where it knows the model (``ketch.operator.runnable``). The settings themselves, and
what they resolve to (dtypes, block counts), are ``ketch.engine.capabilities``'.
"""

from __future__ import annotations

from dataclasses import dataclass

from ketch.engine import device as dev
from ketch.engine.cache_manager.protocol import KVLayout
from ketch.engine.capabilities import (
    cpu_weight_dtype,
    kv_cache_bytes,
    kv_cache_dtype,
    kv_layout,
    num_kv_blocks,
)
from ketch.engine.config import EngineConfig
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.sharding import Shard

# What each process of a CPU instance takes beyond weights, KV cache and activations: paddle,
# Ketch and the Python runtime, its allocator's slack, the tokenizer. Under ``ketch serve`` there
# are 2 + tensor_parallel_size of them (the API server, the engine, one worker per rank). An
# allowance: the tiny model's three measured ~505 MiB in all (each one's anonymous memory, plus
# the shared libraries' pages, which the container is charged for once), and its pods run in
# 1Gi beside a 256MiB KV cache (tests/operator/test_hpa_real.py).
CPU_PROCESS_BYTES = 192 << 20


@dataclass(frozen=True)
class CpuMemory:
    """What a CPU instance under ``ketch serve`` holds in memory (bytes): every rank's weights,
    the KV cache (one segment in /dev/shm, memory-backed: it counts against the container's
    memory) and a headroom: ``CPU_PROCESS_BYTES`` for each process (the API server, the engine,
    one worker per rank) and one step's float32 activations on each rank."""

    weights: int
    kv_cache: int
    headroom: int
    weight_dtype: str
    kv_cache_dtype: str
    quantization: str
    processes: int
    # speculative decoding with a draft model (rank 0's): its weights and its own KV cache (the
    # model's blocks at the draft's shape, private memory: not in --kv-cache-memory)
    draft_weights: int = 0
    draft_kv_cache: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights + self.kv_cache + self.headroom + self.draft_weights + self.draft_kv_cache
        )

    def __str__(self) -> str:
        quantized = ", int8 linear layers" if self.quantization == "int8" else ""
        draft = (
            f" + draft model {self.draft_weights} bytes + draft KV cache "
            f"{self.draft_kv_cache} bytes"
            if self.draft_weights or self.draft_kv_cache
            else ""
        )
        return (
            f"weights {self.weights} bytes ({self.weight_dtype}{quantized}) + KV cache "
            f"{self.kv_cache} bytes ({self.kv_cache_dtype}) + headroom {self.headroom} bytes "
            f"({self.processes} processes at {CPU_PROCESS_BYTES >> 20} MiB and one step's "
            f"activations){draft} = {self.total} bytes"
        )


def cpu_memory(
    config: EngineConfig, model: ModelConfig, draft: ModelConfig | None = None
) -> CpuMemory:
    """The memory a CPU instance of ``config`` takes (``config`` having no refusals for
    ``model``): weights at the chosen precision (``device.cpu_weight_bytes``, every rank's),
    the KV cache at its dtype, and the headroom (``CpuMemory``). ``draft``: the draft model's
    config (``speculative_config`` method draft), whose weights, KV cache (as many blocks as
    the model's) and one step's activations rank 0 holds too."""
    weights_dtype = cpu_weight_dtype(config, model)
    tp = config.tensor_parallel_size
    shards = [Shard.of(model, rank, tp) for rank in range(tp)]
    weights = sum(
        dev.cpu_weight_bytes(model, shard, weights_dtype, config.quantization) for shard in shards
    )
    activations = sum(
        cpu_activation_bytes(model, shard, config.max_num_batched_tokens, config.max_num_seqs)
        for shard in shards
    )
    draft_weights = draft_kv = 0
    if draft is not None:
        whole = Shard.of(draft, 0, 1)
        draft_weights = dev.cpu_weight_bytes(draft, whole, weights_dtype, config.quantization)
        draft_layout = KVLayout(
            num_layers=draft.num_hidden_layers,
            kv_heads=draft.num_key_value_heads,
            num_blocks=0,
            block_size=config.block_size,
            head_dim=draft.head_dim,
            dtype=kv_layout(config, model).dtype,  # the runner gives the draft the model's
        )
        draft_kv = num_kv_blocks(config, model) * draft_layout.block_bytes
        activations += cpu_activation_bytes(
            draft, whole, config.max_num_batched_tokens, config.max_num_seqs
        )
    return CpuMemory(
        weights=weights,
        kv_cache=kv_cache_bytes(config, model),
        headroom=(2 + tp) * CPU_PROCESS_BYTES + activations,
        weight_dtype=weights_dtype,
        kv_cache_dtype=kv_cache_dtype(config, model=model),
        quantization=config.quantization,
        processes=2 + tp,
        draft_weights=draft_weights,
        draft_kv_cache=draft_kv,
    )


def cpu_activation_bytes(
    model: ModelConfig, shard: Shard, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """One step's float32 activations on a CPU rank (an estimate from the shapes): the layer's
    inputs and outputs at the step's token budget, twice (``device.activation_reserve``'s dense
    term, at the widest MLP the rank holds), and on rank 0 a float32 logits row per sequence."""
    hidden, d = model.hidden_size, model.head_dim
    widest = max(
        shard.intermediate[1] - shard.intermediate[0],
        shard.shared[1] - shard.shared[0],
        model.moe_intermediate_size * model.num_experts_per_tok,
    )
    width = 4 * hidden + (shard.num_heads + 2 * shard.num_kv_heads) * d + 3 * widest
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size if shard.first else 0
    return (2 * max_num_batched_tokens * width + logits) * 4
