"""``Scheduler.check_integrity``: each kind of wrong KV block accounting is caught, the blocks
disaggregation reserves and holds count as held, and the engine runs the check when a step
leaves it idle (a violation is a bug: the step raises and the engine stops)."""

from __future__ import annotations

import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.core.block_pool import BlockAccountingError
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig

BS = 4


def make_request(request_id: str, num_tokens: int, start: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return Request(request_id, list(range(start, start + num_tokens)), params, max_tokens=4)


def scheduled(num_blocks: int = 16, caching: bool = True) -> tuple[Scheduler, Request]:
    """A scheduler with one running request of 3 blocks, its first 2 in the prefix cache."""
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(num_blocks, BS, caching))
    request = make_request("a", 2 * BS + 1)
    sched.add_request(request)
    sched.schedule()
    request.num_computed_tokens = request.num_tokens
    sched.kv_cache.cache_full_blocks(request)
    sched.check_integrity()
    return sched, request


def test_a_block_referenced_by_nobody_is_a_leak() -> None:
    sched, request = scheduled()
    request.block_ids.pop()
    with pytest.raises(BlockAccountingError, match="reference counts differ"):
        sched.check_integrity()


def test_a_block_held_twice_on_one_reference_is_caught() -> None:
    sched, request = scheduled()
    other = make_request("b", BS + 1, start=100)
    sched.add_request(other)
    other.block_ids.append(request.block_ids[-1])  # as if handed out twice
    with pytest.raises(BlockAccountingError, match="reference counts differ"):
        sched.check_integrity()


def test_a_request_holding_a_freed_block_is_caught() -> None:
    sched, request = scheduled()
    pool = sched.kv_cache.pool
    (free_block,) = pool.allocate(1)
    pool.free([free_block])
    request.block_ids.append(free_block)
    pool.ref_counts[free_block] = 1  # the count agrees, but the block is in the free queue
    with pytest.raises(BlockAccountingError, match="in the free queue"):
        sched.check_integrity()


def test_a_block_neither_free_nor_held_is_caught() -> None:
    sched, _ = scheduled()
    pool = sched.kv_cache.pool
    pool._free.popitem()  # lost from the free queue, though nobody references it
    with pytest.raises(BlockAccountingError, match="neither"):
        sched.check_integrity()


def test_reserved_block_zero_and_a_block_out_of_range_are_caught() -> None:
    sched, request = scheduled()
    request.block_ids.append(0)
    with pytest.raises(BlockAccountingError, match="block 0"):
        sched.check_integrity()
    request.block_ids[-1] = sched.kv_cache.pool.num_blocks
    with pytest.raises(BlockAccountingError, match="no such block"):
        sched.check_integrity()


def test_prefix_cache_maps_that_disagree_are_caught() -> None:
    sched, request = scheduled()
    pool = sched.kv_cache.pool
    del pool._tokens_of[request.block_ids[0]]
    with pytest.raises(BlockAccountingError, match="per-block maps"):
        sched.check_integrity()
    sched, request = scheduled()
    pool = sched.kv_cache.pool
    first, second = request.block_ids[:2]
    pool._cached[pool._hash_of[first]] = second  # a hash naming another block's content
    with pytest.raises(BlockAccountingError, match="other content"):
        sched.check_integrity()


def test_a_request_lost_from_the_queues_is_caught() -> None:
    sched, request = scheduled()
    sched.running.remove(request)
    with pytest.raises(BlockAccountingError, match="disagree"):
        sched.check_integrity()


def test_reserved_and_held_blocks_count_as_held() -> None:
    """The disaggregation API: a peer's reservation, its blocks held past the request, then
    freed; the accounting adds up at every point and nothing is left referenced."""
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(8, BS))
    request = make_request("r", 2 * BS + 1)
    assert sched.blocks_to_reserve(request) == 3
    assert sched.reserve_for_peer(request) == 0 and len(request.block_ids) == 3
    assert sched.num_free_blocks == 4
    sched.check_integrity()
    assert sched.reserve_for_peer(make_request("big", 5 * BS, start=50)) is None
    assert sched.release_reserved(request, hold=True) == 3 and not request.block_ids
    assert len(sched.held_blocks("r")) == 3
    sched.check_integrity()
    sched.release_held("r")
    sched.check_integrity()
    assert sched.num_free_blocks == 7 and not sched.reserved and not sched.held


def test_a_reserved_request_that_joins_the_queue_is_no_longer_reserved() -> None:
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(8, BS))
    request = make_request("r", 2 * BS + 1)
    sched.reserve_for_peer(request)
    request.num_computed_tokens = request.num_prompt_tokens
    sched.add_request(request, front=True)
    assert not sched.reserved
    sched.check_integrity()
    sched.reserved["r"] = request  # counted twice: once queued, once reserved
    with pytest.raises(BlockAccountingError):
        sched.check_integrity()


def test_the_engine_checks_when_a_step_leaves_it_idle() -> None:
    """A leak made while requests run is not looked for until the step after which nothing is
    left to run; that step raises (the engine process then exits: a restart, not wrong KV)."""
    llm = LLM("tiny", runner="null", block_size=16, num_kv_blocks=40)
    engine = llm.engine
    engine.add_request("x", "Alice was", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    leaked = engine.kv_cache.pool.allocate(1)  # referenced by nobody
    steps = 0
    with pytest.raises(BlockAccountingError, match="reference counts differ"):
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    assert steps == 1 and not engine.has_unfinished_requests()  # raised at the idle step only
    engine.kv_cache.pool.free(leaked)
    llm.generate(["Alice"], SamplingParams(max_tokens=2))  # adds up again: no raise
