"""Attention over the paged KV cache on a GPU, through paddle's variable-length flash attention.

WRITTEN BUT NEVER RUN ON A GPU: no paddle GPU build could be installed where Ketch is built and
tested. What has run is everything but the fused op: the index arithmetic, the grouping, the
query folding and padding, with ``varlen_attention`` (plain paddle ops, float32, any device)
standing in for ``flash_attn_unpadded`` on the CPU, checked against the CPU engine's paged
attention (tests/kernels/test_gpu_attention.py).

The GPU cache of one layer is two ``[num_blocks * block_size, kv_heads * head_dim]`` tensors
(keys, values; ``ketch.engine.worker.kv_cache.DeviceKVCache``): row ``block * block_size +
offset`` is one token's keys for every KV head, so one gather by slot yields the
``[tokens, kv_heads, head_dim]`` layout flash attention takes. Per layer and step:

1. the step's new keys and values are written to their slots (index assignment);
2. its sequences are split into calls, decodes apart from prefill chunks, each call gathering at
   most ``window`` context tokens (which bounds the memory a step needs: ``device.
   activation_reserve``);
3. each call is one ``paddle.nn.functional.flash_attention.flash_attn_unpadded`` (documented:
   float16/bfloat16 only, inputs ``[total_tokens, heads, head_dim]``, ``cu_seqlens`` int32):
   - decodes: each sequence's query heads are folded into query rows over its KV heads (rows
     ``g`` of KV head ``h`` are query head ``h * group + g``), non-causal: a decode sees its
     whole context, and queries and keys have the same head count, so nothing depends on
     whether the op supports grouped-query heads itself (its docs do not say);
   - prefill chunks: keys and values repeated to the query heads, causal. A chunk after a
     cached prefix has fewer queries than keys, and the docs do not say where the causal
     diagonal sits then. ``causal_alignment`` finds out once at start-up on a 2x3 case: aligned
     to the bottom right (flash-attn 2.1 and later) the chunk's queries pass as they are; aligned
     to the top left each chunk's queries are padded in front to its context length (the square
     case, where both agree) and the padded rows' outputs dropped.

``block_multihead_attention`` (paddle.incubate) reads a paged cache itself but lays it out
``[blocks, heads, block_size, head_dim]`` and documents no chunk after a cached prefix; it is
not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

BOTTOM_RIGHT, TOP_LEFT = "bottom_right", "top_left"
FlashFn = Callable[..., tuple]


@dataclass(frozen=True)
class AttentionCall:
    """One flash-attention call: its queries' rows in the step, its sequences' context slots."""

    decode: bool
    rows: paddle.Tensor  # [n] int64 rows of the step's flat token order
    context_slots: paddle.Tensor  # [sum of contexts] int64 cache rows, sequence after sequence
    cu_q: paddle.Tensor  # [batch + 1] int32
    cu_k: paddle.Tensor  # [batch + 1] int32
    max_q: int
    max_k: int
    q_dest: paddle.Tensor | None = None  # padded prefill: each query's row in the padded queries
    padded_q: int = 0


@dataclass(frozen=True)
class GpuAttentionMetadata:
    """Per-step tensors shared by every layer."""

    write_slots: paddle.Tensor  # [T] int64 cache row of each new token
    calls: list[AttentionCall]
    output_index: paddle.Tensor  # [T] row of each token in the calls' concatenated outputs


def build_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    *,
    block_size: int,
    group: int,
    window: int,
    pad_queries: bool,
) -> GpuAttentionMetadata:
    """Sequences in flat-token order (new tokens, whole context, blocks); ``group`` query heads
    per KV head; ``pad_queries`` when the op's causal mask is top-left aligned."""
    starts = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)])
    write = np.empty(int(starts[-1]), dtype=np.int64)
    slots = []
    for b, (q, ctx, ids) in enumerate(zip(query_lens, context_lens, block_ids, strict=True)):
        pos = np.arange(ctx, dtype=np.int64)
        table = np.asarray(ids[: -(-ctx // block_size)], dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        write[starts[b] : starts[b] + q] = slots[b][ctx - q :]
    calls, order = [], []
    for decode, members in _batches(query_lens, context_lens, window):
        q = np.asarray([query_lens[b] for b in members], dtype=np.int64)
        ctx = np.asarray([context_lens[b] for b in members], dtype=np.int64)
        rows = np.concatenate([np.arange(starts[b], starts[b] + query_lens[b]) for b in members])
        order.append(rows)
        calls.append(_call(decode, rows, q, ctx, [slots[b] for b in members], group, pad_queries))
    flat = np.concatenate(order) if order else np.empty(0, dtype=np.int64)
    output_index = np.empty_like(flat)
    output_index[flat] = np.arange(len(flat))
    return GpuAttentionMetadata(
        write_slots=paddle.to_tensor(write),
        calls=calls,
        output_index=paddle.to_tensor(output_index),
    )


def _batches(query_lens: Sequence[int], context_lens: Sequence[int], window: int):
    """(decode?, sequence indices) per call: decodes together, prefill chunks together, each
    call's contexts at most ``window`` tokens (a longer single context gets a call of its own)."""
    for decode in (True, False):
        members, total = [], 0
        for b, (q, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
            if (q == 1) != decode:
                continue
            if members and total + ctx > window:
                yield decode, members
                members, total = [], 0
            members.append(b)
            total += ctx
        if members:
            yield decode, members


def _call(
    decode: bool,
    rows: np.ndarray,
    q: np.ndarray,
    ctx: np.ndarray,
    slots: list[np.ndarray],
    group: int,
    pad_queries: bool,
) -> AttentionCall:
    cu_k = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
    q_dest, padded, max_q = None, 0, int(q.max())
    if decode:
        cu_q = (np.arange(len(q) + 1) * group).astype(np.int32)
        max_q = group
    elif pad_queries:
        cu_q, max_q, padded = cu_k, int(ctx.max()), int(ctx.sum())
        q_dest = np.concatenate([cu_k[b] + ctx[b] - q[b] + np.arange(q[b]) for b in range(len(q))])
    else:
        cu_q = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    return AttentionCall(
        decode=decode,
        rows=paddle.to_tensor(rows.astype(np.int64)),
        context_slots=paddle.to_tensor(np.concatenate(slots)),
        cu_q=paddle.to_tensor(cu_q),
        cu_k=paddle.to_tensor(cu_k),
        max_q=max_q,
        max_k=int(ctx.max()),
        q_dest=None if q_dest is None else paddle.to_tensor(q_dest.astype(np.int64)),
        padded_q=padded,
    )


class GpuAttention:
    """Writes a step's keys and values into one layer's cache and attends over it."""

    def __init__(
        self, num_heads: int, kv_heads: int, head_dim: int, flash: FlashFn, alignment: str
    ) -> None:
        if num_heads % kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {kv_heads} KV heads")
        if alignment not in (BOTTOM_RIGHT, TOP_LEFT):
            raise ValueError(f"unknown causal alignment {alignment!r}")
        self.heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.group = num_heads // kv_heads
        self.flash = flash
        self.alignment = alignment

    @classmethod
    def for_dtype(cls, num_heads: int, kv_heads: int, head_dim: int, dtype: str) -> GpuAttention:
        """flash_attn_unpadded for float16/bfloat16 (the only dtypes it takes), with its causal
        alignment measured here; ``varlen_attention`` for float32."""
        if dtype == "float32":
            return cls(num_heads, kv_heads, head_dim, varlen_attention, BOTTOM_RIGHT)
        from paddle.nn.functional.flash_attention import flash_attn_unpadded

        alignment = causal_alignment(flash_attn_unpadded, dtype)
        return cls(num_heads, kv_heads, head_dim, flash_attn_unpadded, alignment)

    def metadata(
        self,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        block_size: int,
        window: int,
    ) -> GpuAttentionMetadata:
        return build_metadata(
            query_lens,
            context_lens,
            block_ids,
            block_size=block_size,
            group=self.group,
            window=window,
            pad_queries=self.alignment == TOP_LEFT,
        )

    def __call__(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        cache: tuple[paddle.Tensor, paddle.Tensor],
        meta: GpuAttentionMetadata,
    ) -> paddle.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D]; ``cache``: the layer's (keys, values). Returns
        [T, H * D]."""
        k_cache, v_cache = cache
        width = self.kv_heads * self.head_dim
        k_cache[meta.write_slots] = k.reshape([-1, width])
        v_cache[meta.write_slots] = v.reshape([-1, width])
        outputs = [self._call(q, k_cache, v_cache, call) for call in meta.calls]
        flat = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)
        return paddle.gather(flat, meta.output_index)

    def _call(self, q, k_cache, v_cache, call: AttentionCall) -> paddle.Tensor:
        kv, d, g, heads = self.kv_heads, self.head_dim, self.group, self.heads
        keys = paddle.gather(k_cache, call.context_slots).reshape([-1, kv, d])
        values = paddle.gather(v_cache, call.context_slots).reshape([-1, kv, d])
        queries = paddle.gather(q, call.rows)
        scale = d**-0.5
        if call.decode:
            b = queries.shape[0]
            folded = queries.reshape([b, kv, g, d]).transpose([0, 2, 1, 3]).reshape([b * g, kv, d])
            out = self._flash(folded, keys, values, call, scale, causal=False)
            return out.reshape([b, g, kv, d]).transpose([0, 2, 1, 3]).reshape([b, heads * d])
        if g > 1:
            keys = paddle.repeat_interleave(keys, g, axis=1)
            values = paddle.repeat_interleave(values, g, axis=1)
        if call.q_dest is not None:
            padded = paddle.zeros([call.padded_q, heads, d], dtype=queries.dtype)
            padded[call.q_dest] = queries
            queries = padded
        out = self._flash(queries, keys, values, call, scale, causal=True)
        if call.q_dest is not None:
            out = paddle.gather(out, call.q_dest)
        return out.reshape([-1, heads * d])

    def _flash(self, q, k, v, call: AttentionCall, scale: float, causal: bool) -> paddle.Tensor:
        return _run(
            self.flash, q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, scale, causal
        )


def _run(flash: FlashFn, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> paddle.Tensor:
    # flash_attn_unpadded(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    # max_seqlen_k, scale, dropout, causal, return_softmax, ..., training) -> (out, softmax)
    out, _ = flash(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout=0.0, causal=causal,
                   training=False)  # fmt: skip
    return out


def causal_alignment(flash: FlashFn, dtype: str) -> str:
    """Where ``flash``'s causal diagonal sits when a sequence has fewer queries than keys: 2
    zero queries over 3 zero keys (uniform weights over what each sees) with values 0, 1, 1.
    Bottom-right: the queries see keys 0-1 and 0-2 (0.5, 0.667); top-left: 0 and 0-1 (0, 0.5)."""
    q = paddle.zeros([2, 1, 64], dtype=dtype)
    k = paddle.zeros([3, 1, 64], dtype=dtype)
    v = paddle.to_tensor(np.repeat(np.float32([0, 1, 1]), 64).reshape(3, 1, 64)).astype(dtype)
    cu_q = paddle.to_tensor(np.int32([0, 2]))
    cu_k = paddle.to_tensor(np.int32([0, 3]))
    out = _run(flash, q, k, v, cu_q, cu_k, 2, 3, 1.0, True).astype("float32").numpy()[:, 0, 0]
    for alignment, expected in ((BOTTOM_RIGHT, (0.5, 2 / 3)), (TOP_LEFT, (0.0, 0.5))):
        if np.allclose(out, expected, atol=1e-2):
            return alignment
    raise RuntimeError(
        f"flash_attn_unpadded(causal=True) gave {out.tolist()} on the alignment check, neither "
        "bottom-right (0.5, 0.667) nor top-left (0, 0.5) masking: refusing to run attention "
        "whose masking is not known"
    )


def varlen_attention(
    query: paddle.Tensor,
    key: paddle.Tensor,
    value: paddle.Tensor,
    cu_seqlens_q: paddle.Tensor,
    cu_seqlens_k: paddle.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    dropout: float = 0.0,
    causal: bool = False,
    training: bool = True,
    top_left: bool = False,
) -> tuple[paddle.Tensor, None]:
    """``flash_attn_unpadded``'s computation in plain paddle ops, one sequence at a time, in any
    dtype and on any device: the float32 GPU path, and the op's stand-in in the CPU tests.
    Causal masks are bottom-right aligned (``top_left`` for the tests of the other case); key
    heads fewer than query heads are repeated."""
    if dropout:
        raise ValueError("varlen_attention does no dropout")
    cq, ck = cu_seqlens_q.numpy(), cu_seqlens_k.numpy()
    heads = query.shape[1]
    outputs = []
    for b in range(len(cq) - 1):
        q, k, v = query[cq[b] : cq[b + 1]], key[ck[b] : ck[b + 1]], value[ck[b] : ck[b + 1]]
        if k.shape[1] != heads:
            k = paddle.repeat_interleave(k, heads // k.shape[1], axis=1)
            v = paddle.repeat_interleave(v, heads // v.shape[1], axis=1)
        scores = paddle.matmul(q.transpose([1, 0, 2]), k.transpose([1, 2, 0])) * scale
        if causal:
            sq, sk = q.shape[0], k.shape[0]
            shift = 0 if top_left else sk - sq
            visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + shift
            bias = np.where(visible, np.float32(0), np.float32(-np.inf))
            scores = scores + paddle.to_tensor(bias).astype(scores.dtype)
        probs = F.softmax(scores.astype("float32"), axis=-1).astype(v.dtype)
        outputs.append(paddle.matmul(probs, v.transpose([1, 0, 2])).transpose([1, 0, 2]))
    return paddle.concat(outputs, axis=0), None
