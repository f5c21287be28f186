"""Review M7: a revoke is a barrier on the decode side's cache manager.

Once the cache manager confirms a revoke (``Revoked``), nothing more lands in the reservation's
blocks: a part being stored at that moment is stored first (the confirmation waits), and no
part is stored after (it is refused). The engine then gives the blocks to another request, whose
data must stay intact. A push whose last part is stored uses its reservation up, and an engine
that says Hello again (it re-attaches after being silent) starts without its old reservations.

The race is made certain, not likely: ``receive.scatter`` (the copy into the KV segment) is
wrapped to stop until the test lets it go, so a revoke arrives between a part's check and its
store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
from cm_harness import SMALL, CacheManagerProcess, FakeEngine, Segment

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager import receive
from ketch.engine.cache_manager.metrics import CacheManagerMetrics
from ketch.engine.cache_manager.receive import TransferReceiver
from ketch.engine.cache_manager.reservations import Reservations
from ketch.engine.cache_manager.segment import Attachment
from ketch.engine.cache_manager.swap import SwapStore
from procs import free_ports

pytestmark = pytest.mark.timeout(60)

BLOCKS = [3, 4]
NONCE = "n" * 32
QUIET_S = 0.4  # how long "nothing happens" is watched for


class HeldScatter:
    """``receive.scatter`` that stops at its start until ``release`` (one part at a time)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.stored = threading.Event()
        original = receive.scatter

        def held(*args, **kwargs) -> None:
            self.entered.set()
            assert self.go.wait(30), "the test never let the part be stored"
            original(*args, **kwargs)
            self.stored.set()

        monkeypatch.setattr(receive, "scatter", held)

    def release(self) -> None:
        self.go.set()


def _part(
    layout: p.KVLayout, request_id: str, part: int, parts: int, value: float, nonce: str = NONCE
) -> tuple[p.TransferHeader, bytes]:
    """Part ``part`` of ``parts`` (one layer each) of a push of ``BLOCKS``, all ``value``."""
    per = layout.num_layers // parts
    lo, hi = part * per, (part + 1) * per
    header = p.TransferHeader(
        p.PROTOCOL_VERSION, request_id, layout, BLOCKS, nonce=nonce, layers=[lo, hi],
        part=part, parts=parts,
    )  # fmt: skip
    data = np.full(layout.transfer_shape(len(BLOCKS), hi - lo), value, dtype=np.float32)
    return header, data.tobytes()


def test_a_part_being_stored_holds_back_the_revoke_and_reassigned_blocks_keep_their_data(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The receiver checked a part of request "old" and is storing it when "old" is revoked.
    The engine gives the blocks to a new owner as soon as the revoke returns. Before: the revoke
    returned at once, the new owner wrote its KV, then the old part landed on top of it. Now the
    revoke returns only after the part is stored, so the new owner's KV is what stays."""
    layout = p.KVLayout(**SMALL)
    kv = np.zeros(layout.shape, dtype=np.float32)
    att = Attachment("engine", layout, kv, SwapStore(layout, 0))
    att.reservations.reserve("old", BLOCKS, NONCE, 60)
    receiver = TransferReceiver(lambda: att, CacheManagerMetrics(), timeout=10)
    held = HeldScatter(monkeypatch)
    acks: list[p.TransferAck | None] = []
    header, data = _part(layout, "old", 0, 2, value=1.0)
    store = threading.Thread(
        target=lambda: acks.append(receiver(b"peer", header, memoryview(data)))
    )
    store.start()
    request.addfinalizer(held.release)
    assert held.entered.wait(10), "the part never reached the store"

    reassigned = threading.Event()

    def engine() -> None:  # revoke, and on its return give the blocks to the new owner
        att.reservations.revoke(["old"])
        kv[:, :, :, BLOCKS] = 7.0
        reassigned.set()

    revoking = threading.Thread(target=engine)
    revoking.start()
    # The revoke waits for the part being stored (before: it returned, the blocks went).
    assert not reassigned.wait(QUIET_S), "the revoke returned while a part was being stored"
    held.release()
    revoking.join(10)
    store.join(10)
    assert reassigned.is_set() and held.stored.is_set()
    assert acks == [None]  # part 0 of 2 stored, part 1 due
    assert (kv[:, :, :, BLOCKS] == 7.0).all(), "the old push's part landed on the new owner's KV"

    header, data = _part(layout, "old", 1, 2, value=1.0)  # the rest comes after the revoke
    ack = receiver(b"peer", header, memoryview(data))
    assert ack is not None and not ack.ok and "no KV blocks are reserved" in ack.error, ack
    assert (kv[:, :, :, BLOCKS] == 7.0).all()


def test_reservations_barrier_semantics() -> None:
    """``begin`` after a revoke is refused; a revoke waits for writes in progress; the last
    part stored uses the reservation up; ``clear`` drops everything."""
    res = Reservations()
    res.reserve("a", [1, 2], NONCE, 60)
    assert res.begin("a", NONCE, [1]) is None
    assert not res.revoke(["a"], timeout=0)  # a part is being stored into "a"
    assert not res.idle(["a"]) and res.idle(["b"])
    assert "no KV blocks are reserved" in res.begin("a", NONCE, [1])
    res.end("a")
    assert res.idle(["a"]) and res.revoke(["a"], timeout=0)
    res.reserve("b", [1], NONCE, 60)
    assert res.begin("b", NONCE, [1]) is None
    res.end("b", NONCE)  # the push's last part: "b" is used up
    assert "no KV blocks are reserved" in res.begin("b", NONCE, [1])
    res.reserve("c", [1], NONCE, 60)
    res.reserve("d", [2], NONCE, 60)
    assert res.clear() == 2 and len(res) == 0
    assert res.revoke(["never-reserved"], timeout=0)


# ---- the cache manager process (in this process, to hold a part in its store) ----


@contextlib.contextmanager
def _cache_manager() -> Iterator[tuple[object, str, int]]:
    from ketch.engine.cache_manager.config import CacheManagerConfig
    from ketch.engine.cache_manager.server import CacheManager

    queue_port, kv_port, http_port = free_ports(3)
    config = CacheManagerConfig(
        host="127.0.0.1", role="decode", cache_queue_port=queue_port, kv_transfer_port=kv_port,
        cache_manager_port=http_port, swap_space="0", insecure_no_peer_key=True,
        transfer_timeout=10,
    )  # fmt: skip
    manager = CacheManager(config)
    thread = threading.Thread(target=manager.run, name="cache-manager", daemon=True)
    thread.start()
    try:
        yield manager, f"127.0.0.1:{kv_port}", queue_port
    finally:
        manager._stop.set()
        thread.join(10)
        manager.close()


def _peer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    return sock


def _ack(sock: zmq.Socket) -> p.TransferAck:
    assert sock.poll(10_000), "no TransferAck"
    ack = p.decode(sock.recv())
    assert isinstance(ack, p.TransferAck), ack
    return ack


def test_the_cache_manager_answers_revoked_only_after_the_part_being_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end through the cache manager's sockets: part 0 of a 2-part push is being stored
    when the engine revokes; ``Revoked`` comes only after it is stored, the engine then writes
    the new owner's KV, and part 1 (late) is refused: the new owner's KV stays. Before: a Revoke
    was never answered, so the engine freed the blocks at once."""
    held = HeldScatter(monkeypatch)
    segment = Segment(seed=5)
    try:
        with _cache_manager() as (_, kv_address, queue_port):
            engine = FakeEngine(SimpleNamespace(queue_port=queue_port))
            engine.hello(segment)
            nonce = engine.reserve("old", BLOCKS)
            peer = _peer(kv_address)
            header, data = _part(segment.layout, "old", 0, 2, value=1.0, nonce=nonce)
            peer.send_multipart([p.encode(header), data])
            assert held.entered.wait(10), "part 0 never reached the store"
            engine.send(p.Revoke(["old"]))
            assert not engine.sock.poll(int(QUIET_S * 1000)), "Revoked while a part was stored"
            held.release()
            assert engine.receive(10) == p.Revoked(["old"])
            assert held.stored.is_set()
            segment.kv[:, :, :, BLOCKS] = 7.0  # the blocks go to a new owner
            header, data = _part(segment.layout, "old", 1, 2, value=1.0, nonce=nonce)
            peer.send_multipart([p.encode(header), data])
            ack = _ack(peer)
            assert not ack.ok and "no KV blocks are reserved for request 'old'" in ack.error
            assert (segment.kv[:, :, :, BLOCKS] == 7.0).all()
            # A revoke with nothing being stored is answered at once, attached or not.
            assert engine.ask(p.Revoke(["old", "unknown"]), 5) == p.Revoked(["old", "unknown"])
            peer.close()
            engine.close()
    finally:
        held.release()  # never leave the receiver thread stuck
        segment.remove()


# ---- a real ``ketch cache-manager`` process ----


@pytest.fixture(scope="module")
def manager() -> Iterator[CacheManagerProcess]:
    proc = CacheManagerProcess("--swap-space", "0", "--transfer-timeout", "5").wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def _push(peer: zmq.Socket, layout: p.KVLayout, request_id: str, nonce: str, value: float):
    header, data = _part(layout, request_id, 0, 1, value=value, nonce=nonce)
    header = p.TransferHeader(**{**vars(header), "layers": None})  # the one-part format
    peer.send_multipart([p.encode(header), data])
    return _ack(peer)


def test_an_engine_saying_hello_again_drops_its_old_reservations(manager) -> None:
    """An engine that was silent (it detached) says Hello again with the same id and layout.
    Before: its old reservations stayed valid until their TTL, so a late push for a request it
    had given up on (and whose revoke it could not send) still landed. Now they are gone."""
    segment = Segment(seed=6)
    try:
        engine = FakeEngine(manager)
        engine.hello(segment)
        stale = engine.reserve("stale", BLOCKS)
        engine.hello(segment)  # re-attached after being silent
        peer = _peer(manager.kv_address)
        segment.kv[:, :, :, BLOCKS] = 7.0  # the blocks belong to someone else now
        ack = _push(peer, segment.layout, "stale", stale, value=1.0)
        assert not ack.ok and "no KV blocks are reserved for request 'stale'" in ack.error, ack
        assert (segment.kv[:, :, :, BLOCKS] == 7.0).all()
        assert "KV reservations from before dropped" in manager.log()
        # A reservation made after the Hello works, once: the stored push uses it up.
        fresh = engine.reserve("fresh", BLOCKS)
        assert _push(peer, segment.layout, "fresh", fresh, value=2.0).ok
        assert (segment.kv[:, :, :, BLOCKS] == 2.0).all()
        ack = _push(peer, segment.layout, "fresh", fresh, value=3.0)  # a replay, or a retry
        assert not ack.ok and "no KV blocks are reserved for request 'fresh'" in ack.error, ack
        assert (segment.kv[:, :, :, BLOCKS] == 2.0).all()
        assert engine.ask(p.Revoke(["fresh"])) == p.Revoked(["fresh"])
        peer.close()
        engine.close()
    finally:
        segment.remove()
