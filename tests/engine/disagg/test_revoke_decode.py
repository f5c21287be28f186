"""Review M7 on the decode engine: blocks a prefill peer might still write are not reused before
the cache manager confirms their reservation's revoke.

``DecodeSide`` with the engine's real block manager and a cache-manager link played by the test.
Before, a failed prefill's blocks went back to the free list at once (and to the next request),
while the revoke was still on its way (or skipped), so a late part of its push could overwrite
the next request's KV. Now they are held until ``Revoked`` comes, or, with no answer (the link is
down), until the reservation has surely expired at the cache manager; the step loop never waits.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ketch.engine.cache_manager import protocol as p
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig
from ketch.engine.disagg import decode as decode_module
from ketch.engine.disagg.decode import DecodeSide, PairingTimeouts
from ketch.engine.disagg.messages import PrefillDone, PrefillFailed, PrefillRequest
from ketch.engine.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12  # 11 usable (block 0 is the pool's padding block)
PEER = "127.0.0.1:9"


class FakeEngine:
    """What DecodeSide uses of LLMEngine."""

    def __init__(self) -> None:
        self.kv_cache = KVCacheManager(NUM_BLOCKS, BS)
        self.scheduler = Scheduler(SchedulerConfig(4, 64, 256), self.kv_cache)
        self.model_config = SimpleNamespace(vocab_size=1000)
        self.model_fingerprint = "tiny"
        self.kv_layout = p.KVLayout(2, 2, NUM_BLOCKS, BS, 8)

    def forget_request(self, request: Request) -> None:
        return None

    def accept_first_token(self, request: Request, *_: object) -> None:
        return None


class FakeLink:
    """What DecodeSide uses of CacheManagerClient: reservations are confirmed at once, revokes
    only when the test says so."""

    attached = True
    engine_id = "decode-engine"

    def __init__(self) -> None:
        self.reserved: list[p.Reserved] = []
        self.revokes: list[str] = []
        self.confirmed: list[str] = []

    def reserve(self, request_id: str, blocks: list[int], nonce: str, ttl: float) -> bool:
        self.reserved.append(p.Reserved(request_id, True))
        return True

    def take_reserved(self) -> list[p.Reserved]:
        answers, self.reserved = self.reserved, []
        return answers

    def revoke(self, request_ids: list[str]) -> None:
        self.revokes += request_ids

    def take_revoked(self) -> list[str]:
        answers, self.confirmed = self.confirmed, []
        return answers


def _side() -> tuple[DecodeSide, FakeEngine, FakeLink, list]:
    engine, link, sent = FakeEngine(), FakeLink(), []
    side = DecodeSide(
        engine,
        lambda peer, message: sent.append(message),
        PairingTimeouts(block=30, peer=10, request=60),
        "127.0.0.1:8",
        link,
    )
    return side, engine, link, sent


def _paired(side: DecodeSide, request_id: str, num_tokens: int, sent: list) -> Request:
    """A request whose prompt the peer now computes (its reservation confirmed, sent)."""
    request = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(), 4)
    side.add(request, PEER)
    side.tick()
    assert any(isinstance(m, PrefillRequest) and m.request_id == request_id for m in sent)
    return request


def test_blocks_of_a_failed_prefill_are_not_reused_before_the_revoke_is_confirmed() -> None:
    side, engine, link, sent = _side()
    pool = engine.kv_cache.pool
    free_at_start = pool.num_free_blocks
    old = _paired(side, "old", 6 * BS, sent)
    old_blocks = list(old.block_ids)
    assert len(old_blocks) == 6 and pool.num_free_blocks == free_at_start - 6

    side.on_message(PEER, PrefillFailed("old", "sending the KV failed: timeout", 503))
    assert [e.request_id for e in side.errors] == ["old"]
    assert link.revokes == ["old"]
    for _ in range(3):  # the loop goes on; the blocks stay out of use
        side.tick()
    assert pool.num_free_blocks == free_at_start - 6, "freed before the revoke was confirmed"
    assert side.num_held_blocks == 6
    engine.scheduler.check_integrity()  # the held blocks are accounted for

    # A request that needs every free block gets none of the held ones.
    new = _paired(side, "new", pool.num_free_blocks * BS, sent)
    assert not set(new.block_ids) & set(old_blocks)
    assert pool.num_free_blocks == 0
    engine.scheduler.check_integrity()  # and the new reservation's

    link.confirmed.append("old")  # Revoked: nothing lands in them any more
    side.tick()
    assert pool.num_free_blocks == 6 and side.num_held_blocks == 0


def test_without_a_confirmation_blocks_are_freed_after_the_reservation_surely_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The link is down: no Revoked ever comes. The blocks go once the reservation's TTL
    (counted from its confirmation, which came after the cache manager started it) plus
    QUARANTINE_S passed, and not before."""
    monkeypatch.setattr(decode_module, "QUARANTINE_S", 0.5)
    side, engine, link, sent = _side()
    side.reservation_ttl = 0.5
    pool = engine.kv_cache.pool
    free_at_start = pool.num_free_blocks
    confirmed = time.monotonic()
    _paired(side, "old", 3 * BS, sent)
    side.on_message(PEER, PrefillFailed("old", "sending the KV failed: timeout", 503))
    link.attached = False
    until = confirmed + 1.0  # TTL 0.5 + QUARANTINE_S 0.5
    while time.monotonic() < until - 0.2:
        side.tick()
        assert pool.num_free_blocks == free_at_start - 3, "freed while the reservation may live"
        time.sleep(0.05)
    time.sleep(max(0.0, until - time.monotonic()) + 0.1)
    side.tick()
    assert pool.num_free_blocks == free_at_start and side.num_held_blocks == 0


def test_a_client_abort_or_timeout_holds_the_blocks_too_and_a_hand_over_does_not() -> None:
    side, engine, link, sent = _side()
    pool = engine.kv_cache.pool
    free_at_start = pool.num_free_blocks
    _paired(side, "gone", 2 * BS, sent)
    side.abort(["gone"])  # the peer is told to stop; the blocks wait for its answer
    side.on_message(PEER, PrefillFailed("gone", "aborted", 499))
    assert link.revokes == ["gone"] and pool.num_free_blocks == free_at_start - 2
    _paired(side, "late", 2 * BS, sent)
    side._remote["late"].deadline = 0.0  # --pd-request-timeout passed
    side.tick()
    assert link.revokes == ["gone", "late"] and pool.num_free_blocks == free_at_start - 4
    link.confirmed += ["late", "gone"]
    side.tick()
    assert pool.num_free_blocks == free_at_start
    # Handed over: the request keeps its blocks (the push's last part used the reservation up).
    done = _paired(side, "done", 2 * BS, sent)
    side.on_message(PEER, PrefillDone("done", token_id=7))
    assert len(done.block_ids) == 2 and side.num_held_blocks == 0
