"""The memory a CPU instance takes: ``device.cpu_weight_bytes`` (weights at the chosen precision)
and ``cpu_sizing.cpu_memory`` (weights + KV cache + headroom), which the operator checks a
pod's memory limit against. The numbers are checked against hand computations."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from ketch.engine import device as dev
from ketch.engine.capabilities import (
    below_float32,
    cpu_dtypes,
    kv_cache_bytes,
    num_kv_blocks,
    precision_backend_refusal,
    refusals,
)
from ketch.engine.config import EngineConfig
from ketch.engine.cpu_sizing import CPU_PROCESS_BYTES, cpu_activation_bytes, cpu_memory
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import TINY_MODEL_DIR
from ketch.engine.models.sharding import Shard, whole

TINY = ModelConfig.from_dir(TINY_MODEL_DIR)

# The tiny model by hand: vocab 1024, hidden 128, 4 layers, 4 heads and 2 KV heads of 32, MLP
# 384, tied embeddings, no biases. Per layer: q/k/v [128 -> (4 + 2 * 2) * 32 = 256],
# o [128 -> 128], gate/up [128 -> 768], down [384 -> 128].
TINY_LINEAR = 4 * (128 * 256 + 128 * 128 + 128 * 768 + 384 * 128)  # 786432 weights
TINY_CHANNELS = 4 * (256 + 128 + 768 + 128)  # 5120 output channels
TINY_NORMS = 4 * 2 * 128 + 128  # two per layer, and the final one
TINY_TABLES = 2 * 1024 * 128  # the embedding, and the lm_head's own transposed copy


def test_tiny_model_by_hand():
    assert TINY_LINEAR == 786432 and TINY_CHANNELS == 5120
    shard = whole(TINY)
    fp32 = (TINY_LINEAR + TINY_NORMS + TINY_TABLES) * 4
    assert dev.cpu_weight_bytes(TINY, shard, "float32") == fp32 == 4198912
    # bfloat16: the matrices; the norms stay float32 (the CPU loader reads them so). What a
    # bfloat16 `ketch serve` of the tiny model reports in /metrics, to the byte.
    bf16 = (TINY_LINEAR + TINY_TABLES) * 2 + TINY_NORMS * 4
    assert dev.cpu_weight_bytes(TINY, shard, "bfloat16") == bf16 == 2101760
    int8 = TINY_LINEAR + 4 * TINY_CHANNELS  # a byte per weight, a float32 scale per channel
    assert dev.cpu_weight_bytes(TINY, shard, "float32", "int8") == int8 + 4 * (
        TINY_NORMS + TINY_TABLES
    )
    assert (
        dev.cpu_weight_bytes(TINY, shard, "bfloat16", "int8")
        == 1335808
        == int8 + 2 * TINY_TABLES + 4 * TINY_NORMS
    )


def test_tiny_float32_is_its_checkpoint_plus_the_lm_head_copy():
    """Against the checkpoint itself: every tensor it stores, at 4 bytes, plus the transposed
    lm_head the loader makes of the tied embedding."""
    stored = 0
    with safe_open(str(TINY_MODEL_DIR / "model.safetensors"), framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            shape = f.get_slice(name).get_shape()
            count = 1
            for n in shape:
                count *= n
            stored += count
    lm_head = TINY.vocab_size * TINY.hidden_size
    assert dev.cpu_weight_bytes(TINY, whole(TINY), "float32") == (stored + lm_head) * 4


def test_tensor_parallel_ranks_replicate_the_embedding_and_norms_and_rank_0_has_the_lm_head():
    ranks = [dev.cpu_weight_bytes(TINY, Shard.of(TINY, r, 2), "float32") for r in range(2)]
    replicated = (1024 * 128 + TINY_NORMS) * 4
    assert sum(ranks) == dev.cpu_weight_bytes(TINY, whole(TINY), "float32") + replicated
    assert ranks[0] - ranks[1] == 1024 * 128 * 4  # the lm_head


def _moe(tmp_path) -> ModelConfig:
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dir(tmp_path)


def test_a_moe_model_by_hand(tmp_path):
    """Layer 0 holds 4 routed experts and a router; layer 1 (mlp_only_layers) a dense MLP.
    Qwen3's per-head q/k norms count; the norms and the router are float32 at any dtype."""
    moe = _moe(tmp_path)
    assert moe.moe_layers == (0,) and moe.qk_norm
    attention = 64 * 128 + 64 * 64  # q/k/v [64 -> (4 + 4) * 16], o [64 -> 64]
    experts = 4 * (64 * 64 + 32 * 64)  # gate/up [64 -> 2 * 32], down [32 -> 64], each
    dense = 64 * 256 + 128 * 64
    linear = 2 * attention + experts + dense
    channels = 2 * (128 + 64) + 4 * (64 + 64) + (256 + 64)
    norms = 2 * (2 * 64 + 2 * 16) + 64
    router = 64 * 4
    tables = 2 * 320 * 64
    shard = whole(moe)
    assert (
        dev.cpu_weight_bytes(moe, shard, "float32")
        == ((linear + norms + router + tables) * 4)
        == 461312
    )
    assert (
        dev.cpu_weight_bytes(moe, shard, "bfloat16", "int8")
        == (linear + 4 * channels + 4 * (norms + router) + 2 * tables)
        == 163072
    )
    # two ranks: two experts each; the attention, dense MLP split; the router replicated
    ranks = [dev.cpu_weight_bytes(moe, Shard.of(moe, r, 2), "float32") for r in range(2)]
    assert sum(ranks) == (linear + 2 * norms + 2 * router + tables + 320 * 64) * 4


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of none, int8"):
        dev.cpu_weight_bytes(TINY, whole(TINY), "float32", "int4")


def test_cpu_memory_adds_weights_kv_cache_and_headroom():
    config = EngineConfig(dtype="bfloat16", quantization="int8", kv_cache_memory="64MiB")
    plan = cpu_memory(config, TINY)
    assert plan.weights == 1335808
    assert plan.kv_cache == kv_cache_bytes(config, TINY) and plan.kv_cache_dtype == "bfloat16"
    activations = cpu_activation_bytes(TINY, whole(TINY), 2048, 64)
    assert activations == (2 * 2048 * (4 * 128 + 256 + 3 * 384) + 64 * 1024) * 4
    # the API server, the engine and one worker
    assert plan.headroom == 3 * CPU_PROCESS_BYTES + activations and plan.processes == 3
    assert plan.total == plan.weights + plan.kv_cache + plan.headroom
    text = str(plan)
    assert "weights 1335808 bytes (bfloat16, int8 linear layers)" in text
    assert f"KV cache {plan.kv_cache} bytes (bfloat16)" in text
    assert text.endswith(f"= {plan.total} bytes")
    tp2 = cpu_memory(EngineConfig(tensor_parallel_size=2), TINY)
    assert tp2.processes == 4 and tp2.weight_dtype == "float32"
    assert tp2.weights == sum(
        dev.cpu_weight_bytes(TINY, Shard.of(TINY, r, 2), "float32") for r in range(2)
    )


def test_a_bfloat16_kv_cache_holds_twice_the_blocks_in_the_same_bytes():
    fp32, bf16 = (
        EngineConfig(kv_cache_memory="64MiB"),
        EngineConfig(kv_cache_memory="64MiB", kv_cache_dtype="bfloat16"),
    )
    assert num_kv_blocks(bf16, TINY) == 2 * num_kv_blocks(fp32, TINY)
    assert kv_cache_bytes(bf16, TINY) == kv_cache_bytes(fp32, TINY) == 64 << 20
    blocks = EngineConfig(num_kv_blocks=100)
    assert kv_cache_bytes(blocks, TINY) == 2 * kv_cache_bytes(
        EngineConfig(num_kv_blocks=100, kv_cache_dtype="bfloat16"), TINY
    )


def test_cpu_dtypes_follow_the_checkpoint_and_the_backend():
    assert cpu_dtypes(EngineConfig()) == ("float32", "float32")
    assert cpu_dtypes(EngineConfig(), "bfloat16") == ("bfloat16", "bfloat16")
    assert cpu_dtypes(EngineConfig(backend="eager"), "bfloat16") == ("float32", "float32")
    assert cpu_dtypes(EngineConfig(kv_cache_dtype="bfloat16")) == ("float32", "bfloat16")
    assert cpu_dtypes(EngineConfig(dtype="bfloat16", kv_cache_dtype="float32")) == (
        "bfloat16",
        "float32",
    )
    with pytest.raises(ValueError, match="float16 is not a CPU weight dtype"):
        cpu_dtypes(EngineConfig(dtype="float16"))


def test_the_backend_refusal_is_the_one_refusals_reports():
    config = EngineConfig(backend="eager", quantization="int8", kv_cache_dtype="bfloat16")
    assert below_float32(config) == [("kv_cache_dtype", "bfloat16"), ("quantization", "int8")]
    refusal = precision_backend_refusal(config)
    assert refusal is not None and refusal in refusals(config, model=TINY)
    assert refusal.reason.startswith("kv_cache_dtype=bfloat16, quantization=int8 runs on the")
    assert precision_backend_refusal(EngineConfig(backend="eager")) is None
    assert precision_backend_refusal(EngineConfig(quantization="int8")) is None
