"""``ketch.kernels.gpu_attention`` on the CPU: everything but the fused op.

No paddle GPU build can be installed here, so ``flash_attn_unpadded`` never runs. What runs is
the rest of the GPU attention (slot writes, the calls a step is split into, decodes folded over
their KV heads, prefill chunks with keys repeated to the query heads, queries padded when the
causal mask is top-left aligned) with ``varlen_attention`` standing in for the op under either
alignment, against the CPU kernels' specification (``paged_attention_reference``) on mixed
batches: decodes, fresh prefills, chunks after a cached prefix, grouped-query heads.
"""

from __future__ import annotations

import functools
import py_compile
from pathlib import Path

import numpy as np
import paddle
import pytest

from ketch.kernels import gpu_attention
from ketch.kernels.gpu_attention import (
    BOTTOM_RIGHT,
    TOP_LEFT,
    GpuAttention,
    build_metadata,
    causal_alignment,
    varlen_attention,
)
from ketch.kernels.paged_attention import PagedAttentionMetadata, paged_attention_reference

BLOCK = 4
TOP_LEFT_FLASH = functools.partial(varlen_attention, top_left=True)
# (query tokens, context tokens): decode, fresh prefill, chunk after a prefix, 1-token decode,
# chunk across block boundaries, fresh 1-block prefill
SEQUENCES = [(1, 37), (20, 20), (13, 50), (1, 1), (6, 11), (4, 4)]


def step(heads: int, kv_heads: int, head_dim: int = 8, seed: int = 0):
    """Every sequence's keys/values (cached prefix + new), its blocks (scattered), the step's
    queries and new keys/values in flat order."""
    rng = np.random.default_rng(seed)
    blocks = [-(-ctx // BLOCK) for _, ctx in SEQUENCES]
    order = rng.permutation(np.arange(1, sum(blocks) + 1)).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    keys = [rng.standard_normal((ctx, kv_heads, head_dim), np.float32) for _, ctx in SEQUENCES]
    values = [rng.standard_normal((ctx, kv_heads, head_dim), np.float32) for _, ctx in SEQUENCES]
    total = sum(q for q, _ in SEQUENCES)
    queries = rng.standard_normal((total, heads, head_dim), np.float32)
    new_k = np.concatenate([k[ctx - q :] for (q, ctx), k in zip(SEQUENCES, keys, strict=True)])
    new_v = np.concatenate([v[ctx - q :] for (q, ctx), v in zip(SEQUENCES, values, strict=True)])
    return tables, keys, values, queries, new_k, new_v, sum(blocks) + 1


def reference(heads, kv_heads, tables, keys, values, queries, num_blocks, head_dim=8):
    """The CPU kernels' specification over a head-major cache holding every token."""
    k_cache = np.zeros((kv_heads, num_blocks, BLOCK, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    for table, k, v in zip(tables, keys, values, strict=True):
        for pos in range(len(k)):
            k_cache[:, table[pos // BLOCK], pos % BLOCK] = k[pos]
            v_cache[:, table[pos // BLOCK], pos % BLOCK] = v[pos]
    meta = PagedAttentionMetadata.build(
        [q for q, _ in SEQUENCES], [c for _, c in SEQUENCES], tables, BLOCK
    )
    out = paged_attention_reference(
        paddle.to_tensor(queries),
        paddle.to_tensor(k_cache),
        paddle.to_tensor(v_cache),
        meta,
        head_dim**-0.5,
    )
    return out.numpy().reshape(len(queries), heads * head_dim)


def slot_cache(kv_heads, tables, keys, values, num_blocks, head_dim=8):
    """The GPU layout holding only each sequence's cached prefix (the step writes the rest)."""
    k_cache = np.zeros((num_blocks * BLOCK, kv_heads * head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    for (q, ctx), table, k, v in zip(SEQUENCES, tables, keys, values, strict=True):
        for pos in range(ctx - q):
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            k_cache[slot], v_cache[slot] = k[pos].reshape(-1), v[pos].reshape(-1)
    return paddle.to_tensor(k_cache), paddle.to_tensor(v_cache)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    ("flash", "alignment"),
    [(varlen_attention, BOTTOM_RIGHT), (TOP_LEFT_FLASH, TOP_LEFT)],
    ids=["bottom-right", "top-left-padded"],
)
@pytest.mark.parametrize("window", [10_000, 40], ids=["one-call", "split-calls"])
def test_gpu_attention_equals_the_cpu_specification(heads, kv_heads, flash, alignment, window):
    tables, keys, values, queries, new_k, new_v, num_blocks = step(heads, kv_heads)
    attention = GpuAttention(heads, kv_heads, 8, flash, alignment)
    meta = attention.metadata(
        [q for q, _ in SEQUENCES], [c for _, c in SEQUENCES], tables, BLOCK, window
    )
    if window == 40:
        assert len(meta.calls) > 2  # decodes and prefills each split
    cache = slot_cache(kv_heads, tables, keys, values, num_blocks)
    out = attention(
        paddle.to_tensor(queries),
        paddle.to_tensor(new_k),
        paddle.to_tensor(new_v),
        cache,
        meta,
    )
    expected = reference(heads, kv_heads, tables, keys, values, queries, num_blocks)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    # the step's keys and values landed in their slots
    for (_, ctx), table, k in zip(SEQUENCES, tables, keys, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
        np.testing.assert_array_equal(cache[0].numpy()[slots], k.reshape(ctx, -1))


def test_the_wrong_alignment_gives_wrong_chunks():
    """The padding matters: a top-left op fed unpadded chunks attends to the wrong keys (which
    is why the alignment is measured at start-up, not assumed)."""
    tables, keys, values, queries, new_k, new_v, num_blocks = step(4, 2)
    attention = GpuAttention(4, 2, 8, TOP_LEFT_FLASH, BOTTOM_RIGHT)  # the lie
    meta = attention.metadata(
        [q for q, _ in SEQUENCES], [c for _, c in SEQUENCES], tables, BLOCK, 10_000
    )
    out = attention(
        paddle.to_tensor(queries),
        paddle.to_tensor(new_k),
        paddle.to_tensor(new_v),
        slot_cache(2, tables, keys, values, num_blocks),
        meta,
    ).numpy()
    expected = reference(4, 2, tables, keys, values, queries, num_blocks)
    chunk = slice(21, 34)  # the 13-token chunk after a 37-token prefix
    assert not np.allclose(out[chunk], expected[chunk], atol=1e-3)
    np.testing.assert_allclose(out[:21], expected[:21], rtol=1e-5, atol=1e-5)  # decode, fresh


def test_causal_alignment_tells_the_two_conventions_apart():
    assert causal_alignment(varlen_attention, "float32") == BOTTOM_RIGHT
    assert causal_alignment(TOP_LEFT_FLASH, "float32") == TOP_LEFT

    def uniform(q, k, v, *args, **kwargs):  # no mask at all
        return varlen_attention(q, k, v, *args, **{**kwargs, "causal": False})

    with pytest.raises(RuntimeError, match="neither bottom-right"):
        causal_alignment(uniform, "float32")


def test_metadata_arithmetic():
    """Slots, cumulative lengths and the order outputs come back in, on a small case."""
    meta = build_metadata(
        [3, 1, 2],  # a chunk of 3 after 2 cached tokens, a decode, a fresh prefill
        [5, 6, 2],
        [[7, 2], [4, 9], [3]],
        block_size=4,
        group=2,
        window=100,
        pad_queries=True,
    )
    # positions 2..4 of blocks [7, 2]: 30, 31, 8; the decode's position 5: block 9 offset 1
    assert meta.write_slots.numpy().tolist() == [30, 31, 8, 37, 12, 13]
    decode, prefill = meta.calls
    assert decode.decode and decode.rows.numpy().tolist() == [3]
    assert decode.cu_q.numpy().tolist() == [0, 2]  # 2 query heads per KV head, folded
    assert decode.cu_k.numpy().tolist() == [0, 6] and decode.max_k == 6
    assert decode.context_slots.numpy().tolist() == [16, 17, 18, 19, 36, 37]
    assert prefill.rows.numpy().tolist() == [0, 1, 2, 4, 5]
    assert prefill.cu_k.numpy().tolist() == [0, 5, 7]
    assert prefill.cu_q.numpy().tolist() == [0, 5, 7]  # padded: as long as the contexts
    assert prefill.q_dest.numpy().tolist() == [2, 3, 4, 5, 6] and prefill.padded_q == 7
    assert prefill.cu_q.dtype == paddle.int32 and prefill.context_slots.dtype == paddle.int64
    # the decode's output comes first: token 3 is row 0, the prefill's rows follow
    assert meta.output_index.numpy().tolist() == [1, 2, 3, 0, 4, 5]
    unpadded = build_metadata(
        [3, 1, 2], [5, 6, 2], [[7, 2], [4, 9], [3]], block_size=4, group=2, window=100,
        pad_queries=False,
    )  # fmt: skip
    assert unpadded.calls[1].cu_q.numpy().tolist() == [0, 3, 5]
    assert unpadded.calls[1].q_dest is None and unpadded.calls[1].max_q == 3


def test_a_window_splits_calls_but_never_a_sequence():
    meta = build_metadata(
        [1, 1, 1], [30, 30, 70], [[1, 2], [3, 4], [5, 6, 7, 8, 9]],
        block_size=16, group=1, window=64, pad_queries=False,
    )  # fmt: skip
    assert [c.rows.numpy().tolist() for c in meta.calls] == [[0, 1], [2]]


def test_bad_head_counts_and_alignments_are_refused():
    with pytest.raises(ValueError, match="do not group"):
        GpuAttention(6, 4, 8, varlen_attention, BOTTOM_RIGHT)
    with pytest.raises(ValueError, match="alignment"):
        GpuAttention(4, 2, 8, varlen_attention, "diagonal")


def test_float32_uses_the_plain_ops_without_touching_the_fused_op():
    attention = GpuAttention.for_dtype(4, 2, 8, "float32")
    assert attention.flash is varlen_attention and attention.alignment == BOTTOM_RIGHT


def test_the_gpu_modules_compile_and_import_without_cuda(tmp_path: Path):
    """What can be checked of the GPU-only modules here: they compile, and importing them needs
    no CUDA (they are imported only with --device gpu)."""
    import ketch.engine.models.llama_gpu as llama_gpu
    import ketch.engine.worker.gpu_setup as gpu_setup

    assert not paddle.device.is_compiled_with_cuda()
    for module in (gpu_attention, llama_gpu, gpu_setup):
        py_compile.compile(module.__file__, cfile=str(tmp_path / "x.pyc"), doraise=True)
