"""A bfloat16 KV cache through ``ketch cache-manager``: swap out and back, and P -> D pushes.

Real processes and sockets, as test_cache_manager. The segments are written the way the worker
writes them: a ``KVCache(dtype="bfloat16")`` on the /dev/shm file, every slot filled by the C++
KV write (float32 keys and values rounded to bfloat16). The cache manager copies raw 16-bit
words: a block that comes back (from a swap slot or from the peer) must hold the same bits, and
the attention kernel must read it as it read the original.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import paddle
import pytest
from cm_harness import CacheManagerProcess, FakeEngine, Segment, running_managers

from ketch.engine.cache_manager import protocol as p
from ketch.engine.worker.kv_cache import KVCache
from ketch.kernels.paged_attention import PagedAttention, PagedAttentionMetadata

SWAP_BYTES = 16384
DIMS = {"num_layers": 2, "kv_heads": 2, "num_blocks": 8, "block_size": 16, "head_dim": 32}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[CacheManagerProcess, CacheManagerProcess]]:
    """Two cache managers (sender and receiver); both must exit 0 on SIGTERM at the end."""
    args = ("--swap-space", f"{SWAP_BYTES}B", "--transfer-timeout", "2")
    with running_managers(2, *args) as (a, b):
        yield a, b


class Bf16Segment(Segment):
    """A bfloat16 segment whose every slot the C++ KV write filled, through the worker's
    ``KVCache`` views of the file (as ``worker_process`` maps it)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed, dtype="bfloat16", **DIMS)
        lay = self.layout
        self.cache = KVCache(
            lay.num_layers, lay.num_blocks, lay.block_size, lay.kv_heads, lay.head_dim,
            dtype="bfloat16", buffer=memoryview(self.kv).cast("B"),
        )  # fmt: skip
        rng = np.random.default_rng(seed)
        tokens = (lay.num_blocks - 1) * lay.block_size  # blocks 1.. (0 is the padding block)
        self.meta = PagedAttentionMetadata.build(
            [tokens], [tokens], [list(range(1, lay.num_blocks))], lay.block_size
        )
        for layer in self.cache.layers:
            k, v = (
                paddle.to_tensor(rng.standard_normal((tokens, lay.kv_heads, lay.head_dim), "f4"))
                for _ in range(2)
            )
            PagedAttention.write_kv(k, v, layer.k_blocks, layer.v_blocks, self.meta)

    def attend(self, layer: int, blocks: list[int]) -> np.ndarray:
        """Attention of fixed queries over ``blocks`` (a whole-block context) of ``layer``."""
        lay = self.layout
        context = len(blocks) * lay.block_size
        meta = PagedAttentionMetadata.build([1], [context], [blocks], lay.block_size)
        rng = np.random.default_rng(99)
        q = paddle.to_tensor(rng.standard_normal((1, 2 * lay.kv_heads, lay.head_dim), "f4"))
        cache = self.cache.layers[layer]
        return PagedAttention("generic")(q, cache.k_blocks, cache.v_blocks, meta, 0.125).numpy()

    def remove(self) -> None:
        del self.cache
        super().remove()


@pytest.fixture()
def segments() -> Iterator[list[Bf16Segment]]:
    made = [Bf16Segment(seed=1), Bf16Segment(seed=2)]
    yield made
    for segment in made:
        segment.remove()


def test_the_segment_holds_what_the_kernel_wrote(segments) -> None:
    seg = segments[0]
    assert seg.kv.dtype == np.uint16 and seg.layout.dtype == "bfloat16"
    assert seg.path.stat().st_size == seg.layout.num_blocks * seg.layout.block_bytes
    block = seg.block(3)
    assert block.any() and not np.isnan((block.astype(np.uint32) << 16).view(np.float32)).any()
    # The worker's layer view is the file itself: a word written there is read by paddle.
    seg.kv[0, 0, 0, 3, 0, 0] = 0x3F80  # 1.0
    assert float(seg.cache.layers[0].k_blocks[0, 3, 0, 0]) == 1.0


def test_swap_slots_take_the_layouts_bytes() -> None:
    """--swap-space bytes hold that many bytes of slots: bfloat16 words, not float32 copies."""
    from ketch.engine.cache_manager.swap import SwapStore

    layout = p.KVLayout(**DIMS, dtype="bfloat16")
    store = SwapStore(layout, 3 * layout.block_bytes + 100)
    kv = np.arange(np.prod(layout.shape), dtype=np.uint64).astype(np.uint16)
    kv = kv.reshape(layout.shape)
    assert store.swap(kv, [(3, 2)], []) is None
    assert store.slots == 3
    assert store._buffer().dtype == np.uint16
    assert store._buffer().nbytes == 3 * layout.block_bytes
    assert store.swap(kv, [], [(2, 1)]) is None
    assert np.array_equal(kv[:, :, :, 1], kv[:, :, :, 3])


@pytest.mark.timeout(60)
def test_swap_out_and_back_in_is_bit_exact(pair, segments) -> None:
    manager, _ = pair
    seg = segments[0]
    engine = FakeEngine(manager)
    ack = engine.hello(seg)
    # A slot is one bfloat16 block: half a float32 one, so twice the slots for the same bytes.
    assert ack.error is None and seg.layout.block_bytes == 2 * 2 * 2 * 16 * 32 * 2
    assert ack.swap_slots == SWAP_BYTES // seg.layout.block_bytes == 2
    originals = {b: seg.block(b) for b in (3, 5)}
    seen = seg.attend(1, [3, 5])
    assert engine.ask(p.Swap(seq=1, out=[(3, 0), (5, 1)])) == p.SwapDone(1, True)
    seg.kv[:, :, :, 3] = 0  # the engine reuses the blocks
    seg.kv[:, :, :, 5] = 0x7FC0
    assert engine.ask(p.Swap(seq=2, into=[(0, 6), (1, 2)])) == p.SwapDone(2, True)
    assert np.array_equal(seg.block(6), originals[3])
    assert np.array_equal(seg.block(2), originals[5])
    assert np.array_equal(seg.attend(1, [6, 2]), seen)  # the kernel reads the same values
    # A slot keeps its block: swapped in again elsewhere, still the same bits.
    assert engine.ask(p.Swap(seq=3, into=[(1, 7)])) == p.SwapDone(3, True)
    assert np.array_equal(seg.block(7), originals[5])
    engine.close()


@pytest.mark.timeout(60)
def test_push_to_a_peer_is_bit_exact(pair, segments) -> None:
    sender, receiver = pair
    source, dest = segments
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(source)
    decode.hello(dest)
    blocks, dest_blocks = [1, 5, 2, 3], [7, 3, 4, 5]
    untouched = dest.block(6)
    seen = source.attend(0, blocks)
    done = prefill.reserved_push(decode, "req-bf16", blocks, receiver.kv_address, dest_blocks)
    assert isinstance(done, p.PushDone) and done.ok, done
    assert done.num_bytes == len(blocks) * source.layout.block_bytes
    for b, d in zip(blocks, dest_blocks, strict=True):
        assert np.array_equal(dest.block(d), source.block(b))
    assert np.array_equal(dest.block(6), untouched)
    assert np.array_equal(dest.attend(0, dest_blocks), seen)
    prefill.close()
    decode.close()


@pytest.mark.timeout(60)
def test_a_push_into_a_float32_cache_is_refused_naming_both_dtypes(pair) -> None:
    sender, receiver = pair
    source, dest = Bf16Segment(seed=3), Segment(seed=4, **DIMS)
    try:
        prefill, decode = FakeEngine(sender), FakeEngine(receiver)
        prefill.hello(source)
        decode.hello(dest)
        before = np.array(dest.kv)
        nonce = decode.reserve("req-mixed", [4])
        push = p.Push("req-mixed", [1], receiver.kv_address, [4], decode.engine_id, nonce)
        done = prefill.ask(push)
        assert isinstance(done, p.PushDone) and not done.ok
        assert "dtype is bfloat16 on the sender, float32 here" in done.error, done.error
        assert np.array_equal(np.array(dest.kv), before)
        prefill.close()
        decode.close()
    finally:
        source.remove()
        dest.remove()
