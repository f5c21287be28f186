"""KV cache tensors: on the CPU one host buffer, viewed per layer by paddle without copies; on a
GPU, device memory (``DeviceKVCache``).

The buffer is a numpy array (later: shared memory another process maps), and each layer's key
and value caches are ``from_dlpack`` views of it, so paddle's in-place slot writes land in the
buffer itself. Layout per layer and K/V: ``[kv_heads, num_blocks, block_size, head_dim]``.

A bfloat16 cache (``--kv-cache-dtype bfloat16``) is a numpy ``uint16`` buffer of the raw bits
(numpy has no bfloat16; the cache manager copies the same words). Its layer views are paddle
bfloat16 tensors on the same memory: numpy hands a uint16 array to DLPack as an unsigned
integer, which paddle 3.3 imports as its legacy ``uint16`` dtype, and paddle registers neither
kernels nor a dtype view for that one; an ``int16`` view of the same words imports as int16,
which ``Tensor.view(paddle.bfloat16)`` reinterprets in place (same pointer, no copy). So the
kernels take real bfloat16 tensors (``k_cache.dtype == paddle.bfloat16``, ``.astype`` works).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import paddle

from ketch.engine.models.attention import LayerCache
from ketch.kernels.paged_attention import reinterpret

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The CPU cache's numpy storage per KV dtype: bfloat16 as its raw bits.
_HOST_DTYPES = {"float32": np.float32, "bfloat16": np.uint16}


class ModelShape(Protocol):
    """What of a ``ModelConfig`` sizes its KV cache."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


class BlockShape(Protocol):
    """What of a ``RunnerConfig`` sizes the KV cache: its blocks and their element type."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str


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
        if dtype not in _HOST_DTYPES:
            raise ValueError(f"the CPU KV cache holds float32 or bfloat16, not {dtype}")
        shape = (num_layers, 2, kv_heads, num_blocks, block_size, head_dim)
        begin, end = heads or (0, kv_heads)
        if not 0 <= begin < end <= kv_heads:
            raise ValueError(f"KV heads {begin}..{end} are not within the cache's {kv_heads}")
        storage = _HOST_DTYPES[dtype]
        if buffer is None:
            self.array = np.zeros(shape, dtype=storage)
        else:
            # Not cleared: a block is always written before attention reads it (reads stop at
            # each sequence's context), and clearing would make every page of the segment
            # resident at start-up, where an untouched page of a fresh segment costs nothing
            # until a request first writes it.
            self.array = np.ndarray(shape, dtype=storage, buffer=buffer)
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.layers = [self._layer(self.array[i, :, begin:end]) for i in range(num_layers)]

    @staticmethod
    def _layer(kv: np.ndarray) -> LayerCache:
        head_dim = kv.shape[-1]
        return LayerCache(
            k_blocks=_view(kv[0]),
            v_blocks=_view(kv[1]),
            k_slots=_view(kv[0].reshape(-1, head_dim)),
            v_slots=_view(kv[1].reshape(-1, head_dim)),
        )

    @classmethod
    def for_model(
        cls,
        model: ModelShape,
        blocks: BlockShape,
        num_layers: int | None = None,
        buffer: memoryview | None = None,
        heads: tuple[int, int] | None = None,
    ) -> KVCache:
        """The cache of ``model``'s layers (``num_layers`` of them if given: a proposer's own)
        in ``blocks``' blocks and KV dtype (a ``RunnerConfig``)."""
        return cls(
            model.num_hidden_layers if num_layers is None else num_layers,
            blocks.num_blocks,
            blocks.block_size,
            model.num_key_value_heads,
            model.head_dim,
            blocks.kv_cache_dtype,
            buffer=buffer,
            heads=heads,
        )

    @staticmethod
    def model_nbytes(model: ModelShape, blocks: BlockShape) -> int:
        """Bytes of ``for_model(model, blocks)``."""
        return KVCache.nbytes(
            model.num_hidden_layers,
            blocks.num_blocks,
            blocks.block_size,
            model.num_key_value_heads,
            model.head_dim,
            blocks.kv_cache_dtype,
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


def _view(array: np.ndarray) -> paddle.Tensor:
    """A paddle tensor on ``array``'s memory (C-contiguous): float32 as it is, uint16 words as
    bfloat16 (see the module's docstring for why through int16)."""
    if array.dtype == np.uint16:
        return reinterpret(paddle.from_dlpack(array.view(np.int16)), paddle.bfloat16)
    return paddle.from_dlpack(array)


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
