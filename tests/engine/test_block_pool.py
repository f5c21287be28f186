"""Unit tests of the KV block pool and the KV cache manager built on it.

Covers allocation, reference counts, the reserved block 0, exact prefix-cache hits (hash, parent
and tokens must all match), lazy LRU eviction, and the integrity check that catches leaks.
"""

from __future__ import annotations

import pytest

from ketch.engine.core.block_pool import ROOT, UNCACHED, BlockPool
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig
from ketch.engine.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return Request(request_id, tokens, params, max_tokens=4)


def compute(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    """Admits a request (with its prefix hits) and marks its whole prompt computed and cached."""
    request = make_request(request_id, tokens)
    hits = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - len(hits) * kv.block_size, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return request


def tokens_of(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def cache_block(pool: BlockPool, block_hash: int, tokens: tuple[int, ...]) -> int:
    """Allocates one block and caches it as a first block (parent ROOT)."""
    (block_id,) = pool.allocate(1)
    assert pool.cache(block_id, block_hash, ROOT, tokens) == pool.key(block_id)
    return block_id


# ---- allocate, free, reference counts ----


def test_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocate_hands_out_distinct_blocks_but_never_block_0() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == pool.num_usable_blocks == 7
    blocks = pool.allocate(3) + pool.allocate(4)
    assert sorted(blocks) == list(range(1, 8))
    assert all(pool.ref_counts[b] == 1 for b in blocks)
    assert pool.ref_counts[0] == 0
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_freed_blocks_are_reused_and_block_0_still_never_appears() -> None:
    pool = BlockPool(4)
    for _ in range(5):
        blocks = pool.allocate(3)
        assert 0 not in blocks
        pool.free(blocks)
    assert pool.num_free_blocks == 3
    pool.check_integrity([])


def test_freeing_twice_raises() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_freeing_block_0_or_a_never_allocated_block_raises() -> None:
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.free([0])
    with pytest.raises(RuntimeError):
        pool.free([2])


def test_a_block_is_free_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(4)
    block = cache_block(pool, 11, (1, 2, 3, 4))
    pool.touch([block])
    assert pool.ref_counts[block] == 2
    pool.free([block])
    assert pool.ref_counts[block] == 1
    assert pool.num_free_blocks == 2
    pool.free([block])
    assert pool.ref_counts[block] == 0
    assert pool.num_free_blocks == 3
    pool.check_integrity([])


def test_allocate_slots_grows_block_table_one_block_per_block_size() -> None:
    kv = KVCacheManager(16, BS)
    request = make_request("r", tokens_of(5))
    assert kv.allocate_slots(request, 5)
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 3)  # positions 5..7 fit the second block
    assert len(request.block_ids) == 2
    assert kv.allocate_slots(request, 4)  # positions 5..8 need a third
    assert len(request.block_ids) == 3
    kv.pool.check_integrity([request.block_ids])
    kv.free(request)
    assert request.block_ids == []
    assert kv.pool.num_free_blocks == 15


def test_allocate_slots_out_of_blocks_returns_false_and_changes_nothing() -> None:
    kv = KVCacheManager(3, BS)  # two usable blocks
    request = make_request("r", tokens_of(9))
    assert not kv.allocate_slots(request, 9)
    assert request.block_ids == []
    assert request.num_computed_tokens == 0
    assert kv.pool.num_free_blocks == 2


# ---- prefix cache hits ----


def test_prefix_hit_returns_exactly_the_matching_blocks() -> None:
    kv = KVCacheManager(32, BS)
    first = compute(kv, "a", tokens_of(3 * BS + 2))
    a0, a1, a2, _ = first.block_ids
    kv.free(first)
    # Shares two full blocks, then differs inside the third.
    second = make_request("b", [*tokens_of(2 * BS), 999, *tokens_of(BS, 2 * BS + 1)])
    assert kv.get_computed_blocks(second) == [a0, a1]
    same = make_request("c", tokens_of(3 * BS + 2))
    assert kv.get_computed_blocks(same) == [a0, a1, a2]
    other_start = make_request("d", [999, *tokens_of(3 * BS + 1, 1)])
    assert kv.get_computed_blocks(other_start) == []


def test_allocate_slots_with_hits_references_them_and_counts_them_computed() -> None:
    kv = KVCacheManager(32, BS)
    first = compute(kv, "a", tokens_of(2 * BS + 1))
    second = make_request("b", tokens_of(2 * BS + 3))
    hits = kv.get_computed_blocks(second)
    assert hits == first.block_ids[:2]
    assert kv.allocate_slots(second, 3, hits)
    assert second.block_ids[:2] == hits
    assert second.num_computed_tokens == 2 * BS
    assert [kv.pool.ref_counts[b] for b in hits] == [2, 2]
    kv.pool.check_integrity([first.block_ids, second.block_ids])


def test_equal_hash_with_different_tokens_misses() -> None:
    pool = BlockPool(8)
    block = cache_block(pool, 42, (1, 2, 3, 4))
    assert pool.lookup(42, ROOT, (1, 2, 3, 4)) == block
    assert pool.lookup(42, ROOT, (1, 2, 3, 5)) is None
    assert pool.lookup(42, pool.key(block), (1, 2, 3, 4)) is None  # same tokens, other parent
    (other,) = pool.allocate(1)
    pool.cache(other, 42, ROOT, (1, 2, 3, 5))
    # Whichever block keeps the hash, a lookup never returns a block holding other tokens.
    assert pool.lookup(42, ROOT, (1, 2, 3, 4)) in (block, None)
    assert pool.lookup(42, ROOT, (1, 2, 3, 5)) in (other, None)


def test_manager_checks_tokens_when_block_hashes_collide() -> None:
    kv = KVCacheManager(16, BS)
    first = compute(kv, "a", tokens_of(2 * BS + 1))
    other = make_request("b", tokens_of(2 * BS + 1, 100))
    other.block_hashes = list(first.block_hashes)  # force equal hashes for different tokens
    assert kv.get_computed_blocks(other) == []


def test_caching_the_same_content_twice_keeps_the_first_block_canonical() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", tokens_of(BS + 1))
    b = make_request("b", tokens_of(BS + 1))
    for request in (a, b):  # both computed in the same step: neither could hit the other
        assert kv.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(a)
    kv.cache_full_blocks(b)
    assert b.cache_parent == kv.pool.key(a.block_ids[0])
    assert kv.get_computed_blocks(make_request("c", tokens_of(BS + 1))) == a.block_ids[:1]


def test_last_prompt_tokens_block_is_never_a_hit() -> None:
    kv = KVCacheManager(16, BS)
    first = compute(kv, "a", tokens_of(2 * BS))
    assert first.num_registered_blocks == 2  # both blocks are cached...
    again = make_request("b", tokens_of(2 * BS))
    assert kv.get_computed_blocks(again) == first.block_ids[:1]  # ...but only one may hit
    longer = make_request("c", tokens_of(2 * BS + 1))
    assert kv.get_computed_blocks(longer) == first.block_ids[:2]
    assert kv.get_computed_blocks(make_request("d", tokens_of(BS))) == []


def test_partial_blocks_are_not_cached() -> None:
    kv = KVCacheManager(16, BS)
    first = compute(kv, "a", tokens_of(BS + 3))
    assert first.num_registered_blocks == 1
    assert kv.get_computed_blocks(make_request("b", tokens_of(2 * BS + 1))) == first.block_ids[:1]


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(16, BS, enable_caching=False)
    compute(kv, "a", tokens_of(3 * BS))
    assert kv.get_computed_blocks(make_request("b", tokens_of(3 * BS))) == []
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.allocate(1)
    assert pool.cache(block, 1, ROOT, (1,)) == UNCACHED


def test_reset_prefix_cache_forgets_everything() -> None:
    kv = KVCacheManager(16, BS)
    kv.free(compute(kv, "a", tokens_of(3 * BS)))
    kv.pool.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", tokens_of(3 * BS))) == []
    assert kv.pool.num_free_blocks == 15


# ---- lazy LRU eviction ----


def test_blocks_freed_earlier_are_evicted_first() -> None:
    pool = BlockPool(4)
    blocks = [cache_block(pool, h, (h,)) for h in (1, 2, 3)]
    for block in blocks:
        pool.free([block])
    assert pool.allocate(1) == [blocks[0]]
    assert pool.num_evictions == 1
    assert pool.lookup(1, ROOT, (1,)) is None
    assert pool.lookup(2, ROOT, (2,)) == blocks[1]
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(3, ROOT, (3,)) == blocks[2]


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(5)
    cached = cache_block(pool, 1, (1,))
    plain = pool.allocate(2)
    cached_later = cache_block(pool, 2, (2,))
    pool.free([cached, plain[0], cached_later, plain[1]])
    assert sorted(pool.allocate(2)) == sorted(plain)
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [cached]
    assert pool.lookup(2, ROOT, (2,)) == cached_later


def test_free_cached_blocks_count_as_free_until_evicted() -> None:
    kv = KVCacheManager(4, BS)
    kv.free(compute(kv, "a", tokens_of(2 * BS + 1)))
    assert kv.pool.num_free_blocks == 3
    # An unrelated request may take every block, evicting the cached ones.
    unrelated = make_request("b", tokens_of(3 * BS, 500))
    assert kv.allocate_slots(unrelated, 3 * BS)
    assert kv.pool.num_evictions == 2
    assert kv.get_computed_blocks(make_request("c", tokens_of(2 * BS + 1))) == []


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    first = compute(kv, "a", tokens_of(2 * BS + 1))
    kv.free(first)
    assert kv.pool.num_free_blocks == 4
    second = make_request("b", tokens_of(2 * BS + 1))
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 2
    assert kv.allocate_slots(second, 1, hits)
    assert kv.pool.num_free_blocks == 1
    rest = kv.pool.allocate(1)
    assert not set(rest) & set(hits)
    assert kv.pool.num_evictions == 0
    kv.pool.check_integrity([second.block_ids, rest])


def test_allocate_slots_counts_hits_that_are_free_as_not_allocatable() -> None:
    kv = KVCacheManager(4, BS)  # 3 usable blocks
    kv.free(compute(kv, "a", tokens_of(2 * BS + 1)))
    fits = make_request("b", tokens_of(2 * BS + 1))
    too_big = make_request("c", tokens_of(3 * BS + 1))
    too_big_hits = kv.get_computed_blocks(too_big)
    assert len(too_big_hits) == 2
    # 2 hits + 2 new blocks > 3 blocks: refused, although 3 blocks are "free".
    assert not kv.allocate_slots(too_big, BS + 1, too_big_hits)
    assert too_big.block_ids == []
    assert kv.allocate_slots(fits, 1, kv.get_computed_blocks(fits))
    kv.pool.check_integrity([fits.block_ids])


def test_evicting_a_parent_makes_its_children_unreachable() -> None:
    kv = KVCacheManager(8, BS)  # 7 usable blocks
    pool = kv.pool
    first = compute(kv, "a", tokens_of(2 * BS + 1))
    parent, child, tail = first.block_ids
    child_hash = first.block_hashes[1]
    old_parent_key = pool.key(parent)
    # Free the parent before its child, so the parent is the older free block.
    pool.free([tail])
    pool.free([parent])
    pool.free([child])
    first.block_ids = []
    taken = pool.allocate(6)  # 4 never-used blocks and the tail, then the parent
    assert parent in taken and child not in taken
    assert pool.key(parent) != old_parent_key
    assert kv.get_computed_blocks(make_request("b", tokens_of(2 * BS + 1))) == []
    # The child is still cached under its old parent only: a new copy of the parent's content
    # does not lead to it.
    pool.free(taken)
    again = compute(kv, "c", tokens_of(BS + 1))
    new_parent = again.block_ids[0]
    assert pool.lookup(child_hash, old_parent_key, tuple(tokens_of(BS, BS))) == child
    assert pool.lookup(child_hash, pool.key(new_parent), tuple(tokens_of(BS, BS))) is None


def test_a_prefix_recomputed_after_its_parent_was_evicted_is_cached_again() -> None:
    kv = KVCacheManager(6, BS)  # 5 usable blocks
    pool = kv.pool
    first = compute(kv, "a", tokens_of(2 * BS + 1))
    parent, child, tail = first.block_ids
    pool.free([tail])
    pool.free([parent])
    pool.free([child])
    first.block_ids = []
    pool.free(pool.allocate(4))  # evicts the parent only
    kv.free(compute(kv, "b", tokens_of(2 * BS + 1)))
    assert len(kv.get_computed_blocks(make_request("c", tokens_of(2 * BS + 1)))) == 2


# ---- integrity ----


def test_check_integrity_catches_a_leak_and_a_double_use() -> None:
    kv = KVCacheManager(8, BS)
    request = compute(kv, "a", tokens_of(2 * BS + 1))
    kv.pool.check_integrity([request.block_ids])
    with pytest.raises(AssertionError):
        kv.pool.check_integrity([])  # blocks referenced but owned by nobody: leaked
    with pytest.raises(AssertionError):
        kv.pool.check_integrity([request.block_ids, request.block_ids[:1]])
    with pytest.raises(AssertionError):
        kv.pool.check_integrity([[0]])


def test_scheduler_check_integrity_catches_a_request_losing_a_block() -> None:
    kv = KVCacheManager(8, BS)
    sched = Scheduler(SchedulerConfig(4, 64, 64), kv)
    request = make_request("a", tokens_of(2 * BS + 1))
    sched.add_request(request)
    sched.schedule()
    sched.check_integrity()
    request.block_ids.pop()  # the block is still referenced in the pool: a leak
    with pytest.raises(AssertionError):
        sched.check_integrity()
