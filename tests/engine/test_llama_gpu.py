"""The GPU model (``ketch.engine.models.llama_gpu``) run on the CPU, in float32.

It has never run on a GPU (no paddle GPU build can be installed here). Its code is plain paddle
ops except the fused attention op, so on the CPU, with ``varlen_attention`` standing in for
``flash_attn_unpadded`` (under either causal alignment) and the KV cache in ``DeviceKVCache``'s
GPU layout, its logits at every position of a chunked, paged batch must equal Hugging Face's
(rel. err <= 1e-4), for Llama and Qwen2 GQA checkpoints, with biases, and split over 2 ranks
(the shared-memory group standing in for NCCL). What cannot be checked here: the fused op, the
bfloat16/float16 numbers, NCCL, moving weights to a GPU.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest
from test_model_exactness import TOLERANCE, reference_logits
from test_tensor_parallel_exactness import sequences_for
from tp_harness import BLOCK, chunked_logits, num_blocks_for, run_ranks

from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama_gpu import GpuLlamaModel, rms_norm
from ketch.engine.models.loader import load_weights
from ketch.engine.models.sharding import Shard
from ketch.engine.worker.kv_cache import DeviceKVCache
from ketch.engine.worker.model_runner import configure_paddle
from ketch.engine.worker.runner_config import RunnerConfig
from ketch.kernels.gpu_attention import BOTTOM_RIGHT, TOP_LEFT, GpuAttention, varlen_attention

FLASH = {
    BOTTOM_RIGHT: varlen_attention,
    TOP_LEFT: functools.partial(varlen_attention, top_left=True),
}


def gpu_model_logits(path, sequences, splits, alignment=BOTTOM_RIGHT, rank=0, world=1, group=None):
    configure_paddle(1)
    config = ModelConfig.from_dir(path)
    shard = Shard.of(config, rank, world)
    weights = load_weights(path, config, "float32", shard)
    attention = GpuAttention(
        shard.num_heads, shard.num_kv_heads, config.head_dim, FLASH[alignment], alignment
    )
    # a small token budget: the attention window splits the step into several calls
    model = GpuLlamaModel(
        config, weights, 1024, attention, max_num_batched_tokens=8, shard=shard, group=group
    )
    model.attention_window = 120
    cache = DeviceKVCache(
        config.num_hidden_layers,
        num_blocks_for(sequences),
        BLOCK,
        shard.num_kv_heads,
        config.head_dim,
        "float32",
    )
    return chunked_logits(model, cache, sequences, splits)


def assert_close(ours, path, sequences):
    for a, b, seq in zip(ours, reference_logits(path, sequences), sequences, strict=True):
        rel = np.abs(a - b).max() / np.abs(b).max()
        assert rel <= TOLERANCE, f"length {len(seq)}: relative error {rel:.2e}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-linear-bias", "qwen2-mqa"])
@pytest.mark.parametrize("alignment", [BOTTOM_RIGHT, TOP_LEFT])
def test_gpu_model_logits_match_transformers(checkpoint, name, alignment):
    path = checkpoint(name)
    sequences, splits = sequences_for(ModelConfig.from_dir(path).vocab_size)
    assert_close(gpu_model_logits(path, sequences, splits, alignment), path, sequences)


def _rank_job(group, path, sequences, splits):
    return gpu_model_logits(
        path, sequences, splits, rank=group.rank, world=group.world, group=group
    )


@pytest.mark.parametrize("name", ["llama-linear-bias", "qwen2-mqa"], ids=["bias", "1kv"])
def test_gpu_model_split_over_two_ranks(checkpoint, name):
    """Row-parallel all-reduces, biases added once, KV heads replicated, logits on rank 0 only."""
    path = checkpoint(name)
    sequences, splits = sequences_for(ModelConfig.from_dir(path).vocab_size)
    first, second = run_ranks(_rank_job, 2, 1 << 16, path, sequences, splits, 120.0)
    assert not isinstance(first, str), first
    assert second is None
    assert_close(first, path, sequences)


def test_half_precision_loads_on_the_host_as_the_gpu_path_loads_it(checkpoint):
    """The GPU worker loads on the host in the compute dtype, then moves the weights: the host
    half (slicing, casting, transposing bfloat16) runs here."""
    path = checkpoint("qwen2")
    config = ModelConfig.from_dir(path)
    for dtype in ("bfloat16", "float16"):
        weights = load_weights(path, config, dtype, Shard.of(config, 0, 2))
        layer = weights.layers[0]
        assert (
            layer.qkv.dtype == getattr(paddle, dtype) and weights.lm_head.dtype == layer.qkv.dtype
        )
        full = load_weights(path, config, "float32", Shard.of(config, 0, 2))
        np.testing.assert_allclose(
            layer.qkv.astype("float32").numpy(), full.layers[0].qkv.numpy(), rtol=1e-2, atol=1e-2
        )


def test_device_kv_cache_layout_and_dtypes():
    cache = DeviceKVCache(3, 5, 4, 2, 8, "bfloat16")
    assert len(cache.layers) == 3 and cache.num_blocks == 5
    keys, values = cache.layers[0]
    assert keys.shape == [20, 16] and keys.dtype == paddle.bfloat16
    assert keys is not values
    assert DeviceKVCache.nbytes(3, 5, 4, 2, 8, "bfloat16") == 3 * 2 * 20 * 16 * 2
    with pytest.raises(ValueError, match="not int8"):
        DeviceKVCache(1, 2, 4, 1, 8, "int8")


def test_rms_norm_computes_in_float32_and_casts_back():
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 8), np.float32))
    w = paddle.ones([8])
    expected = x.numpy() / np.sqrt((x.numpy() ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6).numpy(), expected, rtol=1e-5)
    half = rms_norm(x.astype("bfloat16"), w.astype("bfloat16"), 1e-6)
    assert half.dtype == paddle.bfloat16


def test_the_runner_defaults_to_the_cpu():
    assert RunnerConfig.__dataclass_fields__["device"].default == "cpu"
