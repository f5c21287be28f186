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
    mask: paddle.Tensor  # [batch, 1, max_query_len, max_context_len] bool, True = attend


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
    for span in spans:
        positions = np.arange(span.context_len - span.query_len, span.context_len)
        table = np.asarray(span.block_ids, dtype=np.int64)
        slot_mapping[span.start : span.start + span.query_len] = (
            table[positions // block_size] * block_size + positions % block_size
        )
    decodes = [i for i, s in enumerate(spans) if s.query_len == 1]
    prefills = [i for i, s in enumerate(spans) if s.query_len > 1]
    groups: list[AttentionGroup] = []
    output_index = np.empty(num_tokens, dtype=np.int64)
    offset = 0
    for members in (decodes, prefills):
        if members:
            group = _build_group([spans[i] for i in members], block_size, output_index, offset)
            groups.append(group)
            offset += group.batch * group.max_query_len
    return AttentionMetadata(
        slot_mapping=paddle.to_tensor(slot_mapping),
        groups=groups,
        output_index=paddle.to_tensor(output_index),
    )


def _build_group(
    spans: list[SequenceSpan], block_size: int, output_index: np.ndarray, offset: int
) -> AttentionGroup:
    batch = len(spans)
    max_q = max(s.query_len for s in spans)
    max_ctx = max(s.context_len for s in spans)
    query_index = np.zeros((batch, max_q), dtype=np.int64)
    context_slots = np.zeros((batch, max_ctx), dtype=np.int64)
    mask = np.zeros((batch, 1, max_q, max_ctx), dtype=bool)
    key_pos = np.arange(max_ctx)
    for b, span in enumerate(spans):
        q_len, ctx = span.query_len, span.context_len
        query_index[b, :q_len] = np.arange(span.start, span.start + q_len)
        output_index[span.start : span.start + q_len] = offset + b * max_q + np.arange(q_len)
        table = np.asarray(span.block_ids, dtype=np.int64)
        positions = np.arange(ctx)
        context_slots[b, :ctx] = (
            table[positions // block_size] * block_size + positions % block_size
        )
        query_pos = np.arange(ctx - q_len, ctx)
        mask[b, 0, :q_len, :] = key_pos[None, :] <= query_pos[:, None]
        # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
        mask[b, 0, q_len:, 0] = True
    return AttentionGroup(
        batch=batch,
        max_query_len=max_q,
        max_context_len=max_ctx,
        query_index=paddle.to_tensor(query_index.reshape(-1)),
        context_slots=paddle.to_tensor(context_slots.reshape(-1)),
        mask=paddle.to_tensor(mask),
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

    Scores are scaled by 1/sqrt(D), as every supported architecture does.
    """
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    outputs = []
    for g in meta.groups:
        qg = paddle.gather(q, g.query_index).reshape(
            [g.batch, g.max_query_len, num_heads, head_dim]
        )
        kg = paddle.gather(k_cache, g.context_slots).reshape(
            [g.batch, g.max_context_len, kv_heads, head_dim]
        )
        vg = paddle.gather(v_cache, g.context_slots).reshape(
            [g.batch, g.max_context_len, kv_heads, head_dim]
        )
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask)
        outputs.append(out.reshape([g.batch * g.max_query_len, num_heads * head_dim]))
    flat = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)
    return paddle.gather(flat, meta.output_index)
