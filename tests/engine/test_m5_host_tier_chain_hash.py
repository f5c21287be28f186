"""Block hashes are a keyed chain, so the host swap tier cannot be poisoned (security review M5).

The host tier finds a block by its chained hash and checks its parent's hash and its tokens;
with Python's tuple hash (deterministic, each round invertible) a client could build a prefix
P' != P whose chain equals P's, then have its KV of a block T, computed after P', served to a
victim sending P + T. Engineering that collision is ~2^34 work, too much for a test, so the old
hash is given one here: ``hash`` in the manager's module is replaced by one that cannot tell
the attacker's token from the victim's (which is what an engineered collision amounts to). The
keyed BLAKE2b chain does not use ``hash`` at all.
"""

from __future__ import annotations

import hashlib
import time

from ketch.engine.core import kv_cache_manager
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.sampling_params import SamplingParams

BS = 4
ATTACKER_TOKEN, VICTIM_TOKEN = 999, 5


class ContextSwapper:
    """Copies blocks like the cache manager; a block's "KV" is the whole prefix up to its end
    (as real KV depends on every token before it), so a block computed after another prefix
    shows."""

    def __init__(self) -> None:
        self.device: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}

    def swap(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> bool:
        for block, slot in out:
            self.host[slot] = self.device[block]
        for slot, block in into:
            self.device[block] = self.host[slot]
        return True


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), max_tokens=1)


def _run(kv: KVCacheManager, swapper: ContextSwapper, request: Request) -> Request:
    """Admits the request as the scheduler does, computes its blocks (reused ones must hold
    exactly its own prefix), caches its full blocks and frees it."""
    hits = kv.get_computed_blocks(request)
    host = kv.get_host_hits(request, len(hits))
    n = request.num_tokens - (len(hits) + len(host)) * BS
    assert kv.allocate_slots(request, n, hits, host)
    kv.flush()
    for i, block in enumerate(request.block_ids):
        context = tuple(request.token_ids[: (i + 1) * BS])
        if i * BS >= request.num_computed_tokens:
            swapper.device[block] = context
        else:
            assert swapper.device[block] == context, f"block {i} holds another prefix's KV"
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.free(request)
    return request


def _colliding_hash(value: tuple) -> int:
    """Python's tuple hash, blind to the difference between the attacker's token and the
    victim's: an engineered collision of the chain."""
    return hash(tuple(VICTIM_TOKEN if v == ATTACKER_TOKEN else v for v in value))


def test_a_colliding_prefix_does_not_hit_another_users_host_entry(monkeypatch) -> None:
    monkeypatch.setattr(kv_cache_manager, "hash", _colliding_hash, raising=False)
    swapper = ContextSwapper()
    kv = KVCacheManager(6, BS)  # 5 usable blocks
    kv.attach_swap(swapper, 32)
    prefix = [VICTIM_TOKEN, 11, 12, 13, 14, 15, 16, 17]  # P: 2 blocks (a system prompt)
    forged = [ATTACKER_TOKEN, *prefix[1:]]  # P' != P
    target = [40, 41, 42, 43]  # T: the block the victim sends next
    _run(kv, swapper, _request("attacker", [*forged, *target, 1]))
    for i in range(3):  # churn: the attacker's blocks go to the host tier
        _run(kv, swapper, _request(f"filler{i}", [200 + 20 * i + j for j in range(17)]))
    assert kv.num_swapped_out >= 3
    _run(kv, swapper, _request("victim-0", [*prefix, 2]))  # P is cached on the device
    victim = _request("victim", [*prefix, *target, 3])
    assert len(kv.get_computed_blocks(victim)) == 2  # P from the device...
    assert kv.get_host_hits(victim, 2) == []  # ...and T, computed after P', not from the host
    kv.host.unpin_all()
    _run(kv, swapper, victim)
    kv.pool.check_integrity([])


def test_the_victims_own_blocks_still_come_back_from_the_host() -> None:
    swapper = ContextSwapper()
    kv = KVCacheManager(6, BS)
    kv.attach_swap(swapper, 32)
    prefix = [VICTIM_TOKEN, 11, 12, 13, 14, 15, 16, 17, 40, 41, 42, 43]
    _run(kv, swapper, _request("first", [*prefix, 1]))
    for i in range(3):
        _run(kv, swapper, _request(f"filler{i}", [200 + 20 * i + j for j in range(17)]))
    again = _request("again", [*prefix, 2])
    assert len(kv.get_computed_blocks(again)) + len(kv.get_host_hits(again, 0)) == 3
    kv.host.unpin_all()
    _run(kv, swapper, again)
    assert kv.num_swapped_in >= 1


def test_block_hashes_are_keyed_per_manager_and_chain_the_prefix() -> None:
    one, two = KVCacheManager(8, BS), KVCacheManager(8, BS)
    tokens = list(range(1, 14))
    a, b = _request("a", tokens), _request("b", tokens)
    hashes = one._block_hashes(a, 3)
    assert len(hashes) == 3 and all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    assert one._block_hashes(_request("c", tokens), 3) == hashes  # deterministic per manager
    assert two._block_hashes(b, 3) != hashes  # another key: another hash
    unkeyed = hashlib.blake2b(b"" + bytes(8 * BS), digest_size=16).digest()
    assert unkeyed not in hashes
    changed = one._block_hashes(_request("d", [99, *tokens[1:]]), 3)
    assert all(x != y for x, y in zip(changed, hashes, strict=True))  # the chain carries it


def test_hashing_a_block_costs_microseconds() -> None:
    kv = KVCacheManager(8, 64)
    requests = [_request(str(i), list(range(i, i + 64 * 32))) for i in range(20)]
    start = time.perf_counter()
    for request in requests:
        kv._block_hashes(request, 32)
    per_block = (time.perf_counter() - start) / (20 * 32)
    assert per_block < 50e-6, f"{per_block * 1e6:.1f} us a 64-token block"
