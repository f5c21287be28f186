"""Attention over the paged KV cache for batches that mix prefills and decodes.

Tokens of one step arrive flattened ([T, heads, head_dim]). New keys/values are written into
the cache at their slots; then each group of requests (decodes together, prefill chunks together,
so short decodes are not padded to a long prompt) gathers its queries and its whole context from
the cache through block tables into padded tensors and runs one masked SDPA call. The mask is
explicit because paddle's ``is_causal`` is top-left aligned, which is wrong after a cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F


@dataclass
class AttentionGroup:
    batch: int
    max_query_len: int
    max_context_len: int
    query_index: paddle.Tensor  # [batch * max_query_len] rows of the flat token order
    context_slots: paddle.Tensor  # [batch * max_context_len] cache slots (padding -> slot 0)
    mask: paddle.Tensor  # [batch, 1, 1, max_query_len, max_context_len] additive: 0 or -inf


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer."""

    slot_mapping: paddle.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]
    output_index: paddle.Tensor  # [T] row of each token in the groups' concatenated outputs


@dataclass
class SequenceSpan:
    """One request's slice of a step, as the runner describes it."""

    start: int  # offset of its first new token in the flat order
    query_len: int
    context_len: int  # computed tokens before this step + query_len
    block_ids: list[int]


def build_metadata(spans: list[SequenceSpan], block_size: int) -> AttentionMetadata:
    num_tokens = sum(s.query_len for s in spans)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    output_index = np.empty(num_tokens, dtype=np.int64)
    decodes = [s for s in spans if s.query_len == 1]
    prefills = [s for s in spans if s.query_len > 1]
    groups: list[AttentionGroup] = []
    offset = 0
    for members in (decodes, prefills):
        if members:
            group = _build_group(members, block_size, slot_mapping, output_index, offset)
            groups.append(group)
            offset += group.batch * group.max_query_len
    return AttentionMetadata(
        slot_mapping=paddle.to_tensor(slot_mapping),
        groups=groups,
        output_index=paddle.to_tensor(output_index),
    )


def _build_group(
    spans: list[SequenceSpan],
    block_size: int,
    slot_mapping: np.ndarray,
    output_index: np.ndarray,
    offset: int,
) -> AttentionGroup:
    """Vectorised over the group: a few numpy calls per step, not per request."""
    batch = len(spans)
    starts = np.fromiter((s.start for s in spans), dtype=np.int64, count=batch)
    q_lens = np.fromiter((s.query_len for s in spans), dtype=np.int64, count=batch)
    ctx_lens = np.fromiter((s.context_len for s in spans), dtype=np.int64, count=batch)
    max_q, max_ctx = int(q_lens.max()), int(ctx_lens.max())
    tables = np.zeros((batch, -(-max_ctx // block_size)), dtype=np.int64)
    for b, span in enumerate(spans):
        tables[b, : len(span.block_ids)] = span.block_ids[: tables.shape[1]]
    rows = np.arange(batch)[:, None]
    key_pos = np.arange(max_ctx)
    context_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size
    j = np.arange(max_q)[None, :]
    valid = j < q_lens[:, None]  # [batch, max_q]
    query_pos = (ctx_lens - q_lens)[:, None] + j
    token_rows = np.where(valid, starts[:, None] + j, 0)
    slot_mapping[token_rows[valid]] = (
        tables[rows, np.minimum(query_pos // block_size, tables.shape[1] - 1)] * block_size
        + query_pos % block_size
    )[valid]
    output_index[token_rows[valid]] = offset + np.arange(batch * max_q).reshape(batch, max_q)[valid]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & valid[:, :, None]
    # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
    mask[:, :, 0] |= ~valid
    bias = np.where(mask, np.float32(0.0), np.float32(-np.inf))
    return AttentionGroup(
        batch=batch,
        max_query_len=max_q,
        max_context_len=max_ctx,
        query_index=paddle.to_tensor(token_rows.reshape(-1)),
        context_slots=paddle.to_tensor(context_slots.reshape(-1)),
        mask=paddle.to_tensor(bias[:, None, None]),
    )


def paged_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    meta: AttentionMetadata,
) -> paddle.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches: [slots, KV, D]. Returns [T, H * D].

    Scores are scaled by 1/sqrt(D), as every supported architecture does. Grouped-query heads
    are handled by folding each KV head's query heads into the query axis, so keys and values
    are never repeated.
    """
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    scale = head_dim**-0.5
    outputs = []
    for g in meta.groups:
        b, sq, sk = g.batch, g.max_query_len, g.max_context_len
        qg = (paddle.gather(q, g.query_index) * scale).reshape([b, sq, kv_heads, group, head_dim])
        qg = qg.transpose([0, 2, 3, 1, 4]).reshape([b, kv_heads, group * sq, head_dim])
        kg = paddle.gather(k_cache, g.context_slots).reshape([b, sk, kv_heads, head_dim])
        vg = paddle.gather(v_cache, g.context_slots).reshape([b, sk, kv_heads, head_dim])
        scores = paddle.matmul(qg, kg.transpose([0, 2, 3, 1]))  # [b, kv, group*sq, sk]
        scores = scores.reshape([b, kv_heads, group, sq, sk]) + g.mask
        probs = F.softmax(scores, axis=-1).reshape([b, kv_heads, group * sq, sk])
        out = paddle.matmul(probs, vg.transpose([0, 2, 1, 3]))  # [b, kv, group*sq, d]
        out = out.reshape([b, kv_heads, group, sq, head_dim]).transpose([0, 3, 1, 2, 4])
        outputs.append(out.reshape([b * sq, num_heads * head_dim]))
    flat = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)
    return paddle.gather(flat, meta.output_index)
