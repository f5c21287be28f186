"""KV cache tensors: on the CPU one host buffer, viewed per layer by paddle without copies; on a
GPU, device memory (``DeviceKVCache``).

The buffer is a numpy array (later: shared memory another process maps), and each layer's key
and value caches are ``from_dlpack`` views of it, so paddle's in-place slot writes land in the
buffer itself. Layout per layer and K/V: ``[kv_heads, num_blocks, block_size, head_dim]``.
"""

from __future__ import annotations

import numpy as np
import paddle

from ketch.engine.models.attention import LayerCache

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVCache:
    """[layers, 2, kv_heads, num_blocks, block_size, head_dim] in one buffer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
        buffer: memoryview | None = None,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """``buffer`` (e.g. a shared-memory segment's) backs the cache instead of private memory.
        ``heads``: the [begin, end) KV heads this tensor-parallel rank attends with (default
        all): its layers view only those, contiguous within each layer's K and V."""
        if dtype != "float32":
            raise ValueError(f"the CPU KV cache holds float32 only, not {dtype}")
        shape = (num_layers, 2, kv_heads, num_blocks, block_size, head_dim)
        begin, end = heads or (0, kv_heads)
        if not 0 <= begin < end <= kv_heads:
            raise ValueError(f"KV heads {begin}..{end} are not within the cache's {kv_heads}")
        if buffer is None:
            self.array = np.zeros(shape, dtype=np.float32)
        else:
            self.array = np.ndarray(shape, dtype=np.float32, buffer=buffer)
            self.array[:, :, begin:end].fill(0.0)  # another rank clears its own heads
        self.num_blocks = num_blocks
        self.layers = [self._layer(self.array[i, :, begin:end]) for i in range(num_layers)]

    @staticmethod
    def _layer(kv: np.ndarray) -> LayerCache:
        head_dim = kv.shape[-1]
        return LayerCache(
            k_blocks=paddle.from_dlpack(kv[0]),
            v_blocks=paddle.from_dlpack(kv[1]),
            k_slots=paddle.from_dlpack(kv[0].reshape(-1, head_dim)),
            v_slots=paddle.from_dlpack(kv[1].reshape(-1, head_dim)),
        )

    @staticmethod
    def nbytes(
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
    ) -> int:
        return num_blocks * KVCache.bytes_per_block(
            num_layers, block_size, kv_heads, head_dim, dtype
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: str
    ) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * _BYTES[dtype]


class DeviceKVCache:
    """The KV cache in device memory (``--device gpu``; never run on a GPU): per layer, keys and
    values as two ``[num_blocks * block_size, kv_heads * head_dim]`` tensors on paddle's
    current device, in the compute dtype. ``kv_heads``: the heads this tensor-parallel rank
    holds (each rank has its own GPU, so nothing is shared between ranks, and nothing lives in
    /dev/shm). The layout is the one ``ketch.kernels.gpu_attention`` gathers from: one row per
    token slot."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> None:
        if dtype not in _BYTES:
            raise ValueError(f"the KV cache holds one of {sorted(_BYTES)}, not {dtype}")
        shape = [num_blocks * block_size, kv_heads * head_dim]
        self.num_blocks = num_blocks
        self.layers = [
            (paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype))
            for _ in range(num_layers)
        ]

    @staticmethod
    def nbytes(
        num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: str
    ) -> int:
        return num_blocks * KVCache.bytes_per_block(
            num_layers, block_size, kv_heads, head_dim, dtype
        )
