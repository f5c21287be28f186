"""Attention over the paged KV cache for batches that mix prefills and decodes.

Tokens of one step arrive flattened ([T, heads, head_dim]). New keys/values are written into
the cache at their slots; then each group of requests (decodes together, prefill chunks together,
so short decodes are not padded to a long prompt) gathers its context *blocks* from the cache
through block tables into padded tensors and runs one masked attention. The cache is head-major
(``[kv_heads, blocks, block_size, head_dim]``), so a block gather yields ``[kv_heads, batch,
context, head_dim]`` directly: no transpose of the (large) context, and grouped-query heads are
folded into the query axis so keys and values are never repeated. The mask is explicit because
the context is padded and a chunk after a cached prefix is not top-left causal. A sliding window
``w`` (Mistral, Qwen2's upper layers) is one more mask per distinct window, built once per step:
a query at position ``p`` sees the keys ``j`` with ``p - w < j <= p`` (transformers' mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F


@dataclass
class LayerCache:
    """Two views of one layer's keys (and of its values) in the shared KV buffer."""

    k_blocks: paddle.Tensor  # [kv_heads, num_blocks, block_size, head_dim], for block gathers
    v_blocks: paddle.Tensor
    k_slots: paddle.Tensor  # [kv_heads * num_blocks * block_size, head_dim], for slot writes
    v_slots: paddle.Tensor


@dataclass
class AttentionGroup:
    batch: int
    max_query_len: int
    context_len: int  # padded to whole blocks
    query_index: paddle.Tensor  # [batch * max_query_len] rows of the flat token order
    block_index: paddle.Tensor  # [batch * blocks per sequence] (padding -> reserved block 0)
    # window (0: full attention) -> [batch, query heads per KV head, max_query_len,
    # context_len], additive (0 or -inf). Full size except the leading KV-head axis: paddle
    # broadcasts over leading axes ~10x faster.
    masks: dict[int, paddle.Tensor]


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer."""

    write_index: paddle.Tensor  # [kv_heads * T] row of each head's new K/V in the slot view
    groups: list[AttentionGroup]
    output_index: paddle.Tensor  # [T] row of each token in the groups' concatenated outputs


@dataclass
class SequenceSpan:
    """One request's slice of a step, as the runner describes it."""

    start: int  # offset of its first new token in the flat order
    query_len: int
    context_len: int  # computed tokens before this step + query_len
    block_ids: list[int]


def build_metadata(
    spans: list[SequenceSpan],
    block_size: int,
    num_blocks: int,
    kv_heads: int,
    group: int,
    windows: Sequence[int] = (0,),
) -> AttentionMetadata:
    """``group`` is the number of query heads per KV head; ``windows``: the sliding windows the
    layers attend with (0: full attention), a mask built for each."""
    num_tokens = sum(s.query_len for s in spans)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    output_index = np.empty(num_tokens, dtype=np.int64)
    groups: list[AttentionGroup] = []
    offset = 0
    for members in _partition(spans):
        built = _build_group(members, block_size, slot_mapping, output_index, offset, group)
        built.masks = {w: _mask(members, built, group, w) for w in windows}
        groups.append(built)
        offset += built.batch * built.max_query_len
    # Head h of token t lives at row h * (num_blocks * block_size) + slot(t) of the slot view.
    heads = np.arange(kv_heads, dtype=np.int64)[:, None] * (num_blocks * block_size)
    return AttentionMetadata(
        write_index=paddle.to_tensor((heads + slot_mapping[None, :]).reshape(-1)),
        groups=groups,
        output_index=paddle.to_tensor(output_index),
    )


def _partition(spans: list[SequenceSpan]) -> list[list[SequenceSpan]]:
    """Groups spans so padding stays small: decodes together, prefill chunks by length.

    A prefill chunk joins the current group while it is at least half as long as the group's
    longest, so padded query rows are at most about half of a group.
    """
    decodes = [s for s in spans if s.query_len == 1]
    groups = [decodes] if decodes else []
    current: list[SequenceSpan] = []
    for span in sorted((s for s in spans if s.query_len > 1), key=lambda s: -s.query_len):
        if current and 2 * span.query_len < current[0].query_len:
            groups.append(current)
            current = []
        current.append(span)
    if current:
        groups.append(current)
    return groups


def _build_group(
    spans: list[SequenceSpan],
    block_size: int,
    slot_mapping: np.ndarray,
    output_index: np.ndarray,
    offset: int,
    group: int,
) -> AttentionGroup:
    """Vectorised over the group: a few numpy calls per step, not per request."""
    batch = len(spans)
    starts = np.fromiter((s.start for s in spans), dtype=np.int64, count=batch)
    q_lens = np.fromiter((s.query_len for s in spans), dtype=np.int64, count=batch)
    ctx_lens = np.fromiter((s.context_len for s in spans), dtype=np.int64, count=batch)
    max_q = int(q_lens.max())
    num_ctx_blocks = -(-int(ctx_lens.max()) // block_size)
    max_ctx = num_ctx_blocks * block_size
    tables = np.zeros((batch, num_ctx_blocks), dtype=np.int64)
    for b, span in enumerate(spans):
        tables[b, : len(span.block_ids)] = span.block_ids[:num_ctx_blocks]
    rows = np.arange(batch)[:, None]
    j = np.arange(max_q)[None, :]
    valid = j < q_lens[:, None]  # [batch, max_q]
    query_pos = (ctx_lens - q_lens)[:, None] + j
    token_rows = np.where(valid, starts[:, None] + j, 0)
    slot_mapping[token_rows[valid]] = (
        tables[rows, np.minimum(query_pos // block_size, tables.shape[1] - 1)] * block_size
        + query_pos % block_size
    )[valid]
    output_index[token_rows[valid]] = offset + np.arange(batch * max_q).reshape(batch, max_q)[valid]
    return AttentionGroup(
        batch=batch,
        max_query_len=max_q,
        context_len=max_ctx,
        query_index=paddle.to_tensor(token_rows.reshape(-1)),
        block_index=paddle.to_tensor(tables.reshape(-1)),
        masks={},
    )


def _mask(
    spans: list[SequenceSpan], built: AttentionGroup, group: int, window: int
) -> paddle.Tensor:
    """The additive mask of one window: causal, and with ``window`` > 0 the keys ``window`` or
    more positions back hidden too."""
    q_lens = np.fromiter((s.query_len for s in spans), dtype=np.int64, count=len(spans))
    ctx_lens = np.fromiter((s.context_len for s in spans), dtype=np.int64, count=len(spans))
    j = np.arange(built.max_query_len)[None, :]
    valid = j < q_lens[:, None]  # [batch, max_q]
    query_pos = ((ctx_lens - q_lens)[:, None] + j)[:, :, None]
    key_pos = np.arange(built.context_len)[None, None, :]
    seen = (key_pos <= query_pos) & valid[:, :, None]
    if window > 0:
        seen &= query_pos - key_pos < window
    # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
    seen[:, :, 0] |= ~valid
    bias = np.where(seen, np.float32(0.0), np.float32(-np.inf))[:, None]
    shape = (built.batch, group, built.max_query_len, built.context_len)
    return paddle.to_tensor(np.ascontiguousarray(np.broadcast_to(bias, shape)))


def paged_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    window: int = 0,
    scale: float | None = None,
) -> paddle.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]. Returns [T, H * D]. Scores are scaled by ``scale``
    (default 1/sqrt(D)); ``window``: the sliding window (0: full attention), one of those
    ``meta`` was built for."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    cache.k_slots[meta.write_index] = k.transpose([1, 0, 2]).reshape([-1, head_dim])
    cache.v_slots[meta.write_index] = v.transpose([1, 0, 2]).reshape([-1, head_dim])
    group = num_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    outputs = []
    for g in meta.groups:
        b, sq, sk = g.batch, g.max_query_len, g.context_len
        qg = (paddle.gather(q, g.query_index) * scale).reshape([b, sq, kv_heads, group, head_dim])
        qg = qg.transpose([2, 0, 3, 1, 4]).reshape([kv_heads, b, group * sq, head_dim])
        kg = paddle.gather(cache.k_blocks, g.block_index, axis=1).reshape(
            [kv_heads, b, sk, head_dim]
        )
        vg = paddle.gather(cache.v_blocks, g.block_index, axis=1).reshape(
            [kv_heads, b, sk, head_dim]
        )
        scores = paddle.matmul(qg, kg, transpose_y=True)  # [kv, b, group * sq, sk]
        scores = scores.reshape([kv_heads, b, group, sq, sk]) + g.masks[window]
        probs = F.softmax(scores, axis=-1).reshape([kv_heads, b, group * sq, sk])
        out = paddle.matmul(probs, vg).reshape([kv_heads, b, group, sq, head_dim])
        outputs.append(out.transpose([1, 3, 0, 2, 4]).reshape([b * sq, num_heads * head_dim]))
    flat = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)
    return paddle.gather(flat, meta.output_index)
