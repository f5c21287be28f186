"""Paged attention over block tables, and the KV write: the C++ kernels and their reference.

The KV cache of one layer is ``[kv_heads, num_blocks, block_size, head_dim]`` for keys and the
same for values (the worker's layout, ``ketch.engine.worker.kv_cache``). A step's query tokens are
flattened to ``[T, heads, head_dim]``; sequence ``b`` owns rows ``query_start[b] ..
query_start[b + 1]`` and has ``context_lens[b]`` tokens in all, its cached prefix followed by
these. New token ``i`` of a sequence with ``n`` new tokens sits at position
``context_lens[b] - n + i`` and attends to every key up to and including its own position: fully
over the cached prefix, causally within the chunk. With a sliding window ``w > 0`` it sees only
the keys ``j`` with ``position - j < w`` (its own and the ``w - 1`` before it: transformers'
sliding-window mask); the kernel does not read the blocks wholly before a tile's first window.
Decodes (``n = 1``) and prefill chunks mix freely in one call; grouped-query heads share KV head
``h // (heads // kv_heads)``.

The caches hold float32 or bfloat16 (``--kv-cache-dtype bfloat16``: half the bytes per token).
q, k and v are float32 either way, and so is the output: the KV write rounds k and v to bfloat16
(nearest, ties to even, as the packed GEMM rounds bfloat16 weights), and the kernels widen each
cached row back to float32 as they load it, so scores, softmax and sums are float32 arithmetic
on the rounded keys and values.

``paged_attention_reference`` is the specification, in plain paddle ops, one sequence at a time.
``PagedAttention`` runs the C++ op (``csrc/paged_attention.cc``) with the kernel for one
instruction set; ``CpuKernels.select`` picks the instruction set from the CPU's features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from ketch.kernels import cpp_ops
from ketch.kernels.cpu_features import CpuFeatures

# Keys of ``cpu_features.ISA_SPECIFIC_OPS``: the kernels below that need an instruction set.
AVX512_OP = "ketch.kernels.paged_attention.paged_attention_avx512"
AVX2_OP = "ketch.kernels.paged_attention.paged_attention_avx2"
# Vector width of each kernel: head_dim must be a multiple of it.
WIDTHS = {"avx512": 16, "avx2": 8, "generic": 1}


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where each sequence's queries, context and new K/V rows are, for every layer of a step."""

    block_tables: paddle.Tensor  # [num_seqs, max_blocks] int32; entries past a context: 0
    query_start: paddle.Tensor  # [num_seqs + 1] int32, offsets into the flat token order
    context_lens: paddle.Tensor  # [num_seqs] int32: cached prefix + new tokens
    slot_mapping: paddle.Tensor  # [T] int64: block * block_size + offset of each new token

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
    ) -> PagedAttentionMetadata:
        """Sequences in flat-token order, each with its new-token count, total context length
        and block ids (at least enough blocks to hold its context)."""
        num_seqs = len(query_lens)
        max_blocks = max((len(ids) for ids in block_ids), default=0) or 1
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for b, ids in enumerate(block_ids):
            tables[b, : len(ids)] = ids
        starts = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(np.asarray(query_lens, dtype=np.int32), out=starts[1:])
        lens = np.asarray(context_lens, dtype=np.int32)
        # Position of every new token, and the slot its K/V go to.
        seq = np.repeat(np.arange(num_seqs), query_lens)
        pos = (lens - np.asarray(query_lens, dtype=np.int32))[seq]
        pos = pos + np.arange(len(seq)) - starts[seq]
        slots = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
        return cls(
            block_tables=paddle.to_tensor(tables),
            query_start=paddle.to_tensor(starts),
            context_lens=paddle.to_tensor(lens),
            slot_mapping=paddle.to_tensor(slots.astype(np.int64)),
        )


@dataclass(frozen=True)
class PagedAttention:
    """The C++ kernels for one instruction set (``avx512``, ``avx2`` or ``generic``).

    ``num_threads`` > 1 splits the (sequence, KV head, query tile) work items over OpenMP
    threads; the library is built on first use (``cpp_ops``)."""

    isa: str
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.isa not in WIDTHS:
            raise ValueError(f"unknown isa {self.isa!r}; expected one of {sorted(WIDTHS)}")

    def supports(self, head_dim: int) -> bool:
        return head_dim % WIDTHS[self.isa] == 0

    def __call__(
        self,
        q: paddle.Tensor,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        meta: PagedAttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> paddle.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]; scores are scaled by ``scale``;
        ``window``: the sliding window (keys a query sees, its own included), 0 for none."""
        return cpp_ops.ops().ketch_paged_attention(
            q.contiguous(), k_cache, v_cache, meta.block_tables, meta.query_start,
            meta.context_lens, float(scale), int(self.num_threads), self.isa, int(window),
        )  # fmt: skip

    @staticmethod
    def write_kv(
        k: paddle.Tensor,
        v: paddle.Tensor,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        meta: PagedAttentionMetadata,
    ) -> None:
        """Writes k, v ([T, kv_heads, head_dim], float32) into their slots of the caches
        (float32 or bfloat16), in place. A slot of -1 is skipped. Plain copies, or roundings
        to bfloat16: the same code on every CPU."""
        cpp_ops.ops().ketch_reshape_and_cache(
            k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping
        )


paged_attention_avx512 = PagedAttention("avx512")
paged_attention_avx2 = PagedAttention("avx2")
paged_attention_generic = PagedAttention("generic")


def select_paged_attention(features: CpuFeatures, num_threads: int = 1) -> PagedAttention:
    """The fastest kernel ``features`` allow: AVX-512, else AVX2 + FMA, else the generic one."""
    for isa, op in (("avx512", AVX512_OP), ("avx2", AVX2_OP)):
        if features.can_run(op):
            return PagedAttention(isa, num_threads)
    return PagedAttention("generic", num_threads)


def paged_attention_reference(
    q: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    window: int = 0,
) -> paddle.Tensor:
    """The specification: per sequence, gather its context, mask the keys after each query's
    position (and, with a ``window`` > 0, those ``window`` or more before it),
    softmax(q·kᵀ·scale)·v. q: [T, heads, head_dim] -> [T, heads, head_dim]. A bfloat16 cache
    is read as float32 (exactly its values), and everything after is float32."""
    k_cache, v_cache = (c.astype("float32") if c.dtype != paddle.float32 else c
                        for c in (k_cache, v_cache))  # fmt: skip
    kv_heads, _, block_size, head_dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    starts = meta.query_start.tolist()
    outputs = []
    for b, context in enumerate(meta.context_lens.tolist()):
        n = starts[b + 1] - starts[b]
        if n == 0:
            continue
        blocks = meta.block_tables[b, : -(-context // block_size)]
        keys, values = (
            paddle.gather(cache, blocks, axis=1).reshape([kv_heads, -1, head_dim])[:, :context]
            for cache in (k_cache, v_cache)
        )
        queries = q[starts[b] : starts[b + 1]].reshape([n, kv_heads, group, head_dim])
        queries = queries.transpose([1, 2, 0, 3])  # [kv_heads, group, n, head_dim]
        scores = paddle.matmul(queries * scale, keys.unsqueeze(1), transpose_y=True)
        position = paddle.arange(context - n, context).unsqueeze(1)
        key = paddle.arange(context).unsqueeze(0)
        visible = key <= position  # [n, context]
        if window > 0:
            visible = visible & (position - key < window)
        scores = paddle.where(visible, scores, paddle.full_like(scores, -np.inf))
        out = paddle.matmul(F.softmax(scores, axis=-1), values.unsqueeze(1))
        outputs.append(out.transpose([2, 0, 1, 3]).reshape([n, heads, head_dim]))
    return paddle.concat(outputs, axis=0)


def write_kv_reference(
    k: paddle.Tensor,
    v: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    meta: PagedAttentionMetadata,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The specification of ``PagedAttention.write_kv``, without writing in place: the caches
    with row ``h * num_blocks * block_size + slot`` of head h of each kept token replaced, in
    the caches' dtype (a bfloat16 cache gets k and v rounded to nearest, ties to even)."""
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    kept = paddle.nonzero(meta.slot_mapping >= 0).reshape([-1])
    slots = paddle.gather(meta.slot_mapping, kept)
    rows = (paddle.arange(kv_heads, dtype="int64") * num_blocks * block_size).unsqueeze(1)
    index = (rows + slots.unsqueeze(0)).reshape([-1])
    written = []
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = paddle.gather(new, kept).transpose([1, 0, 2]).reshape([-1, head_dim])
        if cache.dtype == paddle.bfloat16:
            # paddle's cast rounds to nearest even (a NaN to 0x7fff: the kernel's is torch's
            # quiet 0x7fc0); its scatter has no bfloat16 kernel, so the bits travel as int32
            # (int16 -> int32 -> int16 is exact).
            bits = reinterpret(cache, paddle.int16).astype("int32").reshape([-1, head_dim])
            rounded = reinterpret(new.astype("bfloat16"), paddle.int16).astype("int32")
            new = paddle.where(paddle.isnan(new), paddle.full_like(rounded, 0x7FC0), rounded)
            flat = paddle.scatter(bits, index, new, overwrite=True)
            flat = reinterpret(flat.astype("int16"), paddle.bfloat16)
        else:
            flat = paddle.scatter(cache.reshape([-1, head_dim]), index, new, overwrite=True)
        written.append(flat.reshape(cache.shape))
    return written[0], written[1]


def reinterpret(t: paddle.Tensor, dtype) -> paddle.Tensor:
    """``t``'s memory as ``dtype`` of the same width (bfloat16 <-> int16), no copy. paddle's
    ``view_dtype`` is a stride kernel, registered only while its stride kernels are on, which
    inference turns off (``configure_paddle``): on for this one call."""
    previous = paddle.get_flags(["FLAGS_use_stride_kernel"])
    paddle.set_flags({"FLAGS_use_stride_kernel": True})
    try:
        return t.view(dtype)
    finally:
        paddle.set_flags(previous)
