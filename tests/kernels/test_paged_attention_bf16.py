"""The bfloat16 KV cache in the C++ kernels: the KV write's rounding and attention over it.

The write must store exactly the round-to-nearest-even bfloat16 of each float32 key and value
(checked bit for bit, ties and specials included); the attention kernels must compute, in
float32, what the reference computes on the cache widened to float32 (1e-5 of the output's
largest value, as for float32 caches), on the batches of test_paged_attention: decodes and
prefill chunks mixed, contexts on block boundaries, GQA, head dims 32/64/128, sliding windows.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from test_paged_attention import ISAS, TOLERANCE, Batch, _boundary_batch, _rel_err

from ketch.engine.worker.kv_cache import KVCache
from ketch.kernels.paged_attention import (
    PagedAttention,
    PagedAttentionMetadata,
    paged_attention_reference,
    reinterpret,
    write_kv_reference,
)


def rne_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), nearest with ties to even; NaN -> 0x7fc0."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    kept, dropped = bits >> 16, bits & 0xFFFF
    up = (dropped > 0x8000) | ((dropped == 0x8000) & (kept & 1 == 1))
    out = ((kept + up) & 0xFFFF).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def bits_of(t: paddle.Tensor) -> np.ndarray:
    return reinterpret(t, paddle.int16).numpy().view(np.uint16)


def to_bf16(batch: Batch) -> Batch:
    """``batch`` with its caches rounded to bfloat16 (same keys and values, fewer bits)."""
    batch.k_cache = batch.k_cache.astype("bfloat16")
    batch.v_cache = batch.v_cache.astype("bfloat16")
    return batch


def test_rne_bits_by_hand() -> None:
    one = 1.0
    values = np.array(
        [one + 2**-8, one + 3 * 2**-8, one + 2**-8 + 2**-20, -(one + 2**-8 + 2**-20), 1e-45,
         np.inf, -np.inf, np.nan, 3.4028235e38],
        np.float32,
    )  # fmt: skip
    # tie -> even 1.0; tie -> even 1 + 2^-6; above the tie -> 1 + 2^-7 (both signs); a
    # subnormal rounds to 0; infinities stay; NaN is quiet; the largest finite rounds to inf.
    want = [0x3F80, 0x3F82, 0x3F81, 0xBF81, 0x0000, 0x7F80, 0xFF80, 0x7FC0, 0x7F80]
    assert rne_bits(values).tolist() == want
    # paddle's own cast agrees (the reference relies on it), but for its NaN (0x7fff)
    cast = bits_of(paddle.to_tensor(values).astype("bfloat16")).tolist()
    assert cast[:7] + cast[8:] == want[:7] + want[8:]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_mixed_batch_on_block_boundaries(isa: str, group: int, head_dim: int) -> None:
    batch = Batch(_boundary_batch(16), kv_heads=2, group=group, head_dim=head_dim, block_size=16)
    exact = batch.reference()  # float32 keys and values, before rounding
    to_bf16(batch)
    out = batch.run(PagedAttention(isa))
    assert out.dtype == np.float32
    assert _rel_err(out, batch.reference()) <= TOLERANCE
    # The cache really holds rounded values: close to the float32 result, not equal to it.
    assert 1e-5 < _rel_err(out, exact) < 3e-2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [1, 16, 17, 40])
def test_sliding_windows(isa: str, window: int) -> None:
    batch = to_bf16(Batch(_boundary_batch(16), kv_heads=2, group=4, head_dim=64, block_size=16))
    want = batch.reference(window)
    assert _rel_err(batch.run(PagedAttention(isa), window), want) <= TOLERANCE
    assert _rel_err(batch.reference(), want) > 1e-2  # the window changes the result


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(isa: str, seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    block_size = int(rng.choice([1, 5, 16, 64]))
    seqs = []
    for _ in range(int(rng.integers(1, 9))):
        ctx = int(rng.integers(1, 300))
        seqs.append((1 if rng.random() < 0.5 else int(rng.integers(1, ctx + 1)), ctx))
    batch = to_bf16(
        Batch(
            seqs, kv_heads=int(rng.integers(1, 4)), group=int(rng.choice([1, 2, 4, 8])),
            head_dim=int(rng.choice([32, 64, 128])), block_size=block_size, seed=seed,
        )
    )  # fmt: skip
    window = int(rng.integers(0, 80))
    out = batch.run(PagedAttention(isa, 2), window)
    assert _rel_err(out, batch.reference(window)) <= TOLERANCE
    assert np.array_equal(batch.run(PagedAttention(isa, 1), window), out)  # same sums


def _meta_with_a_skip() -> PagedAttentionMetadata:
    seqs, block_ids = [(3, 3), (1, 6), (5, 9)], [[1], [4, 2], [3, 5, 0]]
    meta = PagedAttentionMetadata.build([n for n, _ in seqs], [c for _, c in seqs], block_ids, 4)
    slots = meta.slot_mapping.numpy().copy()
    slots[1] = -1  # skipped
    return PagedAttentionMetadata(
        meta.block_tables, meta.query_start, meta.context_lens, paddle.to_tensor(slots)
    )


def test_write_kv_rounds_to_nearest_even_in_the_worker_cache() -> None:
    """KVCache(dtype=bfloat16): the layers view the uint16 buffer as bfloat16, without copies,
    and the write stores the rounded bits of every written value, nothing else changing."""
    rng = np.random.default_rng(1)
    layers, kv_heads, num_blocks, block_size, head_dim = 2, 2, 6, 4, 32
    cache = KVCache(layers, num_blocks, block_size, kv_heads, head_dim, dtype="bfloat16")
    assert cache.array.dtype == np.uint16
    assert cache.array.nbytes == KVCache.nbytes(
        layers, num_blocks, block_size, kv_heads, head_dim, "bfloat16"
    )
    cache.array[:] = rng.integers(0, 0x3F00, cache.array.shape, dtype=np.uint16)  # small finites
    before = cache.array.copy()
    layer = cache.layers[1]
    assert layer.k_blocks.dtype == paddle.bfloat16 and layer.k_slots.dtype == paddle.bfloat16
    assert layer.k_blocks.data_ptr() == cache.array[1, 0].ctypes.data
    assert layer.v_blocks.data_ptr() == cache.array[1, 1].ctypes.data
    meta = _meta_with_a_skip()
    k = rng.standard_normal((9, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((9, kv_heads, head_dim)).astype(np.float32)
    # ties, near-ties and specials among the values
    k[0, 0, :6] = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, np.nan, -np.inf, 3.4028235e38]
    v[2, 1, :2] = [-(1 + 2**-8), 2**-130]
    want_k, want_v = write_kv_reference(
        paddle.to_tensor(k), paddle.to_tensor(v), layer.k_blocks, layer.v_blocks, meta
    )
    PagedAttention.write_kv(
        paddle.to_tensor(k), paddle.to_tensor(v), layer.k_blocks, layer.v_blocks, meta
    )
    assert np.array_equal(cache.array[1, 0], bits_of(want_k))
    assert np.array_equal(cache.array[1, 1], bits_of(want_v))
    assert np.array_equal(cache.array[0], before[0])  # the other layer is untouched
    slots = meta.slot_mapping.numpy()
    expected = before[1].copy()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, row = divmod(int(slot), block_size)
        expected[0, :, block, row] = rne_bits(k[t])
        expected[1, :, block, row] = rne_bits(v[t])
    assert np.array_equal(cache.array[1], expected)
    assert cache.array[1, 0, 0, 1, 0, 0] == 0x3F80  # token 0 -> slot 4: block 1, row 0 (a tie)
    assert np.array_equal(cache.array[1, :, :, 1, 1], before[1, :, :, 1, 1])  # token 1: skipped


@pytest.mark.parametrize("isa", ISAS)
def test_attention_reads_the_worker_cache_it_wrote(isa: str) -> None:
    """Write a prompt's K/V into a bfloat16 KVCache with the kernel, then attend over it: the
    same as the reference over float32 caches holding the rounded values (widened by hand)."""
    rng = np.random.default_rng(2)
    cache = KVCache(1, 8, 16, 2, 64, dtype="bfloat16")
    layer = cache.layers[0]
    meta = PagedAttentionMetadata.build([40, 1], [40, 20], [[3, 1, 7], [2, 5]], 16)
    k = paddle.to_tensor(rng.standard_normal((41, 2, 64)).astype(np.float32))
    v = paddle.to_tensor(rng.standard_normal((41, 2, 64)).astype(np.float32))
    q = paddle.to_tensor(rng.standard_normal((41, 8, 64)).astype(np.float32))
    PagedAttention.write_kv(k, v, layer.k_blocks, layer.v_blocks, meta)
    k32, v32 = (
        paddle.to_tensor((cache.array[0, i].astype(np.uint32) << 16).view(np.float32))
        for i in range(2)
    )
    want = paged_attention_reference(q, k32, v32, meta, 0.125).numpy()
    out = PagedAttention(isa)(q, layer.k_blocks, layer.v_blocks, meta, 0.125).numpy()
    assert _rel_err(out, want) <= TOLERANCE


def test_mixed_cache_dtypes_are_refused() -> None:
    batch = Batch([(1, 20)], kv_heads=1, group=2, head_dim=32, block_size=16)
    half = batch.v_cache.astype("bfloat16")
    with pytest.raises(Exception, match="differ in dtype"):
        PagedAttention("generic")(batch.q, batch.k_cache, half, batch.meta, batch.scale)
    k = paddle.zeros([1, 1, 32])
    with pytest.raises(Exception, match="differ in dtype"):
        PagedAttention.write_kv(k, k, batch.k_cache, half, batch.meta)
    with pytest.raises(Exception, match="float32 or bfloat16"):
        PagedAttention("generic")(
            batch.q, batch.k_cache.astype("float16"), batch.v_cache.astype("float16"),
            batch.meta, batch.scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        KVCache(1, 2, 4, 1, 8, dtype="float16")
