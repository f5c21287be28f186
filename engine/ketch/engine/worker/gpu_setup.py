"""A model runner's GPU setup, its model and KV cache in device memory: WRITTEN BUT NEVER RUN
ON A GPU (docs/gpu.md).

Imported only when the runner's device is a GPU. Puts paddle on the rank's GPU, loads this rank's
weights in the compute dtype and moves them there, measures the attention op's causal alignment,
and allocates the KV cache in device memory (the number of blocks was decided by the engine from
every rank's free memory: ``capabilities.num_kv_blocks``).
"""

from __future__ import annotations

import logging

import paddle

from ketch.engine.device import Device
from ketch.engine.models.llama_gpu import GpuLlamaModel, to_device
from ketch.engine.models.loader import load_weights
from ketch.engine.models.sharding import Shard
from ketch.engine.worker.kv_cache import DeviceKVCache
from ketch.engine.worker.runner_config import RunnerConfig
from ketch.kernels.collective import Group
from ketch.kernels.gpu_attention import GpuAttention

logger = logging.getLogger(__name__)


def gpu_model_and_cache(
    config: RunnerConfig, device: Device, shard: Shard, group: Group | None
) -> tuple[GpuLlamaModel, DeviceKVCache]:
    mc = config.model_config
    paddle.set_device(str(device))
    weights = to_device(load_weights(config.model_path, mc, config.dtype, shard))
    attention = GpuAttention.for_dtype(
        shard.num_heads, shard.num_kv_heads, mc.head_dim, config.dtype
    )
    logger.info("%s: %s, attention causal mask %s", device, config.dtype, attention.alignment)
    model = GpuLlamaModel(
        mc,
        weights,
        config.max_model_len,
        attention,
        max_num_batched_tokens=config.max_num_batched_tokens,
        shard=shard,
        group=group,
    )
    cache = DeviceKVCache(
        mc.num_hidden_layers,
        config.num_blocks,
        config.block_size,
        shard.num_kv_heads,
        mc.head_dim,
        config.dtype,
    )
    return model, cache
