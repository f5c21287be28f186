"""The host swap tier's index and the block manager's use of it, with a real copying swapper.

The swapper here is the cache manager's job done in-process on numpy arrays: device blocks and
host slots hold data, and a block that comes back from the host must hold exactly what was
evicted. What is checked is the engine's bookkeeping: which slots, when, and in what order.
"""

from __future__ import annotations

import numpy as np

from ketch.engine.core.host_cache import HostCache
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.sampling_params import SamplingParams

BS = 4


class CopyingSwapper:
    """Copies block contents like the cache manager: outs first, then ins."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.device = np.zeros((num_blocks, BS), dtype=np.int64)
        self.host = np.full((num_slots, BS), -1, dtype=np.int64)
        self.calls: list[tuple[list, list]] = []
        self.fail = False

    def swap(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> bool:
        self.calls.append((list(out), list(into)))
        if self.fail:
            return False
        for block, slot in out:
            self.host[slot] = self.device[block]
        for slot, block in into:
            self.device[block] = self.host[slot]
        return True


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), max_tokens=1)


def _run(kv: KVCacheManager, swapper: CopyingSwapper, request: Request) -> None:
    """Admits a request as the scheduler does, 'computes' it (writes its tokens into its
    blocks), caches its full blocks and frees it."""
    hits = kv.get_computed_blocks(request)
    host = kv.get_host_hits(request, len(hits))
    n = request.num_tokens - (len(hits) + len(host)) * BS
    assert kv.allocate_slots(request, n, hits, host)
    kv.flush()
    for i, block in enumerate(request.block_ids):
        chunk = request.token_ids[i * BS : (i + 1) * BS]
        if i * BS >= request.num_computed_tokens:  # only what is computed is written
            swapper.device[block, : len(chunk)] = chunk
        else:  # reused (device hit or swapped in): must already hold the right tokens
            assert list(swapper.device[block, : len(chunk)]) == chunk, (i, block)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.free(request)


def test_lru_store_lookup_and_pinning() -> None:
    cache = HostCache(2)
    a = cache.store(1, 0, (1,))
    b = cache.store(2, 1, (2,))
    assert {a, b} == {0, 1}
    assert cache.lookup(1, 0, (1,)) == a  # now most recent, and pinned
    assert cache.lookup(1, 0, (9,)) is None  # tokens must match
    assert cache.lookup(1, 5, (1,)) is None  # and the parent
    c = cache.store(3, 2, (3,))  # evicts 2 (least recent), not the pinned 1
    assert c == b and cache.lookup(2, 1, (2,)) is None
    cache.store(4, 3, (4,))  # 1 is pinned, 3 was just stored: evicts 3
    assert cache.lookup(1, 0, (1,)) == a
    assert cache.lookup(4, 3, (4,)) is not None
    assert cache.store(5, 0, (5,)) is None  # both slots pinned now: no room
    cache.unpin_all()
    assert cache.store(5, 0, (5,)) is not None
    cache.reset(0)
    assert cache.store(6, 0, (6,)) is None and len(cache) == 0


def test_evicted_prefixes_come_back_with_their_exact_contents() -> None:
    swapper = CopyingSwapper(num_blocks=9, num_slots=16)  # 8 usable device blocks
    kv = KVCacheManager(9, BS)
    kv.attach_swap(swapper, 16)
    prefixes = [[100 * p + i for i in range(3 * BS)] for p in range(4)]  # 3 blocks each
    for round_ in range(3):
        for p, prefix in enumerate(prefixes):
            _run(kv, swapper, _request(f"r{round_}-{p}", [*prefix, 7, round_]))
    assert kv.num_swapped_out > 0
    assert kv.num_swapped_in >= 3  # some prefix came back from the host, checked in _run
    kv.pool.check_integrity([])


def test_a_failed_swap_in_falls_back_to_computing() -> None:
    swapper = CopyingSwapper(num_blocks=5, num_slots=8)
    kv = KVCacheManager(5, BS)
    kv.attach_swap(swapper, 8)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _run(kv, swapper, _request("a", first))
    _run(kv, swapper, _request("b", [50 + i for i in range(9)]))  # pushes "a" out
    swapper.fail = True
    again = _request("c", first)
    hits = kv.get_computed_blocks(again)
    host = kv.get_host_hits(again, len(hits))
    assert host  # the host has it...
    assert kv.allocate_slots(again, again.num_tokens - (len(hits) + len(host)) * BS, hits, host)
    assert again.num_computed_tokens == len(hits) * BS  # ...but the copy failed: compute it
    kv.free(again)
    kv.pool.check_integrity([])


def test_detach_forgets_the_host_tier() -> None:
    swapper = CopyingSwapper(num_blocks=5, num_slots=8)
    kv = KVCacheManager(5, BS)
    kv.attach_swap(swapper, 8)
    _run(kv, swapper, _request("a", list(range(1, 10))))
    _run(kv, swapper, _request("b", list(range(50, 59))))
    assert len(kv.host) > 0
    kv.detach_swap()
    assert len(kv.host) == 0
    assert kv.get_host_hits(_request("c", list(range(1, 10))), 0) == []
