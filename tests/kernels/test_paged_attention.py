"""Paged attention and the KV write: every C++ kernel this CPU can run against the reference.

Batches mix decodes and prefill chunks over shuffled block tables, with contexts on every block
boundary (1, block_size - 1, block_size, block_size + 1, several blocks), GQA groups 1/2/4/8
and head dims 32/64/128, in float32; the error allowed is 1e-5 of the output's largest value.
Sliding windows (shorter than a block, one block, across blocks, longer than the context) on the
same batches.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ketch.kernels import CpuKernels
from ketch.kernels.cpu_features import CpuFeatures
from ketch.kernels.paged_attention import (
    AVX2_OP,
    AVX512_OP,
    PagedAttention,
    PagedAttentionMetadata,
    paged_attention_reference,
    select_paged_attention,
    write_kv_reference,
)

TOLERANCE = 1e-5
# Flags of an AVX2-only Zen 3 and of an AVX-512 Zen 5 (as in test_cpu_features).
ZEN3_FLAGS = "sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 avx2 bmi2"
ZEN5_FLAGS = ZEN3_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl"
_HERE = CpuFeatures.detect({})
ISAS = [
    pytest.param("generic", id="generic"),
    pytest.param(
        "avx2", id="avx2",
        marks=pytest.mark.skipif(not _HERE.can_run(AVX2_OP), reason="this CPU has no AVX2+FMA"),
    ),
    pytest.param(
        "avx512", id="avx512",
        marks=pytest.mark.skipif(not _HERE.can_run(AVX512_OP), reason="this CPU has no AVX-512"),
    ),
]  # fmt: skip


class Batch:
    """Random caches, queries and metadata for sequences given as (new tokens, context)."""

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        kv_heads: int,
        group: int,
        head_dim: int,
        block_size: int,
        seed: int = 0,
    ) -> None:
        rng = np.random.default_rng(seed)
        need = [-(-ctx // block_size) for _, ctx in seqs]
        num_blocks = sum(need) + 3
        ids = rng.permutation(np.arange(1, num_blocks))  # block 0 stays reserved
        offsets = np.cumsum([0, *need])
        block_ids = [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(seqs))]
        shape = (kv_heads, num_blocks, block_size, head_dim)
        self.k_cache = paddle.to_tensor(rng.standard_normal(shape, dtype=np.float32))
        self.v_cache = paddle.to_tensor(rng.standard_normal(shape, dtype=np.float32))
        tokens = sum(n for n, _ in seqs)
        heads = (tokens, kv_heads * group, head_dim)
        self.q = paddle.to_tensor(rng.standard_normal(heads, dtype=np.float32))
        self.meta = PagedAttentionMetadata.build(
            [n for n, _ in seqs], [c for _, c in seqs], block_ids, block_size
        )
        self.scale = head_dim**-0.5

    def reference(self, window: int = 0) -> np.ndarray:
        return paged_attention_reference(
            self.q, self.k_cache, self.v_cache, self.meta, self.scale, window
        ).numpy()

    def run(self, kernel: PagedAttention, window: int = 0) -> np.ndarray:
        return kernel(self.q, self.k_cache, self.v_cache, self.meta, self.scale, window).numpy()


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    assert out.shape == ref.shape
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _boundary_batch(block_size: int) -> list[tuple[int, int]]:
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    decodes = [(1, c) for c in lengths]
    prefills = [(c, c) for c in lengths]  # whole prompts, nothing cached
    chunks = [(block_size + 1, 2 * block_size + 3), (block_size, 3 * block_size), (7, 70)]
    mixed = decodes + prefills + chunks
    order = np.random.default_rng(block_size).permutation(len(mixed))
    return [mixed[i] for i in order]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_on_block_boundaries(isa: str, group: int, head_dim: int) -> None:
    batch = Batch(_boundary_batch(16), kv_heads=2, group=group, head_dim=head_dim, block_size=16)
    assert _rel_err(batch.run(PagedAttention(isa)), batch.reference()) <= TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(isa: str, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    block_size = int(rng.choice([1, 5, 16, 64]))
    seqs = []
    for _ in range(int(rng.integers(1, 9))):
        ctx = int(rng.integers(1, 300))
        seqs.append((1 if rng.random() < 0.5 else int(rng.integers(1, ctx + 1)), ctx))
    batch = Batch(
        seqs, kv_heads=int(rng.integers(1, 4)), group=int(rng.choice([1, 2, 4, 8])),
        head_dim=int(rng.choice([32, 64, 128])), block_size=block_size, seed=seed,
    )  # fmt: skip
    assert _rel_err(batch.run(PagedAttention(isa)), batch.reference()) <= TOLERANCE


@pytest.mark.parametrize("isa", ISAS)
def test_threads_split_the_work_and_agree(isa: str) -> None:
    batch = Batch([(1, 300)] * 5 + [(40, 100)], kv_heads=2, group=4, head_dim=64, block_size=16)
    one = batch.run(PagedAttention(isa, 1))
    assert np.array_equal(batch.run(PagedAttention(isa, 2)), one)  # same order of sums
    assert _rel_err(one, batch.reference()) <= TOLERANCE


def test_write_kv_in_place_on_a_numpy_backed_cache() -> None:
    """The worker's cache is a numpy (shared-memory) buffer seen through from_dlpack."""
    rng = np.random.default_rng(1)
    kv_heads, num_blocks, block_size, head_dim = 2, 6, 4, 32
    buffer = rng.standard_normal((2, kv_heads, num_blocks, block_size, head_dim), np.float32)
    before = buffer.copy()
    k_cache, v_cache = paddle.from_dlpack(buffer[0]), paddle.from_dlpack(buffer[1])
    seqs, block_ids = [(3, 3), (1, 6), (5, 9)], [[1], [4, 2], [3, 5, 0]]
    meta = PagedAttentionMetadata.build([n for n, _ in seqs], [c for _, c in seqs], block_ids, 4)
    assert meta.slot_mapping.tolist() == [4, 5, 6, 9, 20, 21, 22, 23, 0]
    slots = meta.slot_mapping.numpy().copy()
    slots[1] = -1  # skipped
    meta = PagedAttentionMetadata(
        meta.block_tables, meta.query_start, meta.context_lens, paddle.to_tensor(slots)
    )
    k = paddle.to_tensor(rng.standard_normal((9, kv_heads, head_dim), np.float32))
    v = paddle.to_tensor(rng.standard_normal((9, kv_heads, head_dim), np.float32))
    want_k, want_v = write_kv_reference(k, v, k_cache, v_cache, meta)
    PagedAttention.write_kv(k, v, k_cache, v_cache, meta)
    assert np.array_equal(buffer[0], want_k.numpy())
    assert np.array_equal(buffer[1], want_v.numpy())
    assert np.array_equal(buffer[0][:, 1, 0], k.numpy()[0])  # token 0 -> slot 4: block 1, row 0
    assert np.array_equal(buffer[:, :, 1, 1], before[:, :, 1, 1])  # token 1's slot: skipped
    assert not np.array_equal(buffer, before)


def test_bad_metadata_is_refused_not_read() -> None:
    batch = Batch([(1, 20)], kv_heads=1, group=2, head_dim=32, block_size=16)
    tables = batch.meta.block_tables.numpy().copy()
    tables[0, 1] = 10_000
    bad = PagedAttentionMetadata(
        paddle.to_tensor(tables), batch.meta.query_start, batch.meta.context_lens,
        batch.meta.slot_mapping,
    )  # fmt: skip
    with pytest.raises(Exception, match="outside the cache"):
        PagedAttention("generic")(batch.q, batch.k_cache, batch.v_cache, bad, batch.scale)
    with pytest.raises(Exception, match="not a multiple"):
        wide = Batch([(1, 3)], kv_heads=1, group=1, head_dim=20, block_size=4)
        PagedAttention("avx2")(wide.q, wide.k_cache, wide.v_cache, wide.meta, wide.scale)
    with pytest.raises(ValueError, match="unknown isa"):
        PagedAttention("sse2")


def test_the_cpu_picks_the_kernel() -> None:
    zen3 = CpuFeatures(frozenset(ZEN3_FLAGS.split()), "test")
    zen5 = CpuFeatures(frozenset(ZEN5_FLAGS.split()), "test")
    assert select_paged_attention(zen3).isa == "avx2"
    assert select_paged_attention(zen5).isa == "avx512"
    assert select_paged_attention(CpuFeatures(frozenset(), "none")).isa == "generic"
    assert CpuKernels.select(zen3, log=False).paged_attention == PagedAttention("avx2")
    assert CpuKernels.portable().paged_attention is None  # the eager path


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 1000])
@pytest.mark.parametrize("group", [1, 4])
def test_sliding_windows_on_block_boundaries(isa: str, group: int, window: int) -> None:
    batch = Batch(_boundary_batch(16), kv_heads=2, group=group, head_dim=32, block_size=16)
    want = batch.reference(window)
    assert _rel_err(batch.run(PagedAttention(isa), window), want) <= TOLERANCE
    if window < 70:  # the window changes what the longest contexts see
        assert _rel_err(batch.reference(), want) > 1e-2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seed", range(4))
def test_sliding_windows_on_random_shapes(isa: str, seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    block_size = int(rng.choice([1, 5, 16]))
    seqs = []
    for _ in range(int(rng.integers(1, 7))):
        ctx = int(rng.integers(1, 200))
        seqs.append((1 if rng.random() < 0.5 else int(rng.integers(1, ctx + 1)), ctx))
    batch = Batch(
        seqs, kv_heads=int(rng.integers(1, 3)), group=int(rng.choice([1, 2, 8])),
        head_dim=int(rng.choice([32, 64])), block_size=block_size, seed=seed,
    )  # fmt: skip
    window = int(rng.integers(1, 60))
    out = batch.run(PagedAttention(isa, 2), window)
    assert _rel_err(out, batch.reference(window)) <= TOLERANCE


def test_a_window_does_not_read_blocks_before_it() -> None:
    """Blocks wholly before every query's window are skipped, not masked: NaN there is unseen."""
    batch = Batch([(1, 64), (20, 64)], kv_heads=1, group=2, head_dim=32, block_size=8)
    want = batch.reference(16)
    tables = batch.meta.block_tables.numpy()
    k, v = batch.k_cache.numpy().copy(), batch.v_cache.numpy().copy()
    # sequence 0 (position 63) sees keys 48..63; sequence 1 (44..63) sees 29..63
    for b, stale in ((0, range(6)), (1, range(3))):
        for block in stale:
            k[:, tables[b, block]] = np.nan
            v[:, tables[b, block]] = np.nan
    batch.k_cache, batch.v_cache = paddle.to_tensor(k), paddle.to_tensor(v)
    runnable = [i for i, op in (("avx2", AVX2_OP), ("avx512", AVX512_OP)) if _HERE.can_run(op)]
    for isa in ["generic", *runnable]:
        assert _rel_err(batch.run(PagedAttention(isa), 16), want) <= TOLERANCE


def test_a_negative_window_is_refused() -> None:
    batch = Batch([(1, 20)], kv_heads=1, group=2, head_dim=32, block_size=16)
    with pytest.raises(Exception, match="window must be 0"):
        PagedAttention("generic")(batch.q, batch.k_cache, batch.v_cache, batch.meta, 1.0, -1)
