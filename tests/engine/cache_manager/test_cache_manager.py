"""``ketch cache-manager`` end to end: real processes, real sockets, a real /dev/shm segment.

The test plays the engine over the cache queue (Hello, Ping, Swap, Push) and checks the bytes
that land in the KV segments, the replies, and the /health and /metrics endpoints.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from cm_harness import CacheManagerProcess, FakeEngine, Segment, free_ports, running_managers

from ketch.engine import rundir
from ketch.engine.cache_manager import protocol as p

SWAP_SLOTS = 4


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[CacheManagerProcess, CacheManagerProcess]]:
    """Two cache managers (sender and receiver); both must exit 0 on SIGTERM at the end."""
    swap = f"{SWAP_SLOTS * 4096}B"
    with running_managers(2, "--swap-space", swap, "--transfer-timeout", "2") as (a, b):
        yield a, b


@pytest.mark.timeout(60)
def test_swap_out_and_back_in_copies_exact_bytes(pair, segments) -> None:
    manager, _ = pair
    engine = FakeEngine(manager)
    ack = engine.hello(segments[0])
    assert ack.error is None and ack.swap_slots == SWAP_SLOTS
    assert ack.version == p.PROTOCOL_VERSION
    assert isinstance(engine.ask(p.Ping(engine.engine_id)), p.Pong)
    before = manager.metrics()
    original = segments[0].block(3)
    done = engine.ask(p.Swap(seq=1, out=[(3, 0), (4, 1)]))
    assert done == p.SwapDone(1, True)
    segments[0].kv[:, :, :, 3] = 0  # the engine reuses the block
    done = engine.ask(p.Swap(seq=2, into=[(0, 6)]))
    assert done == p.SwapDone(2, True)
    assert np.array_equal(segments[0].block(6), original)
    health = manager.health()
    assert health["engine_attached"] and health["engine_id"] == engine.engine_id
    assert health["swap_slots"] == SWAP_SLOTS and health["status"] == "ok"
    after = manager.metrics()
    assert (
        after[("ketch:cache_manager_swap_out_blocks_total", ())]
        - before.get(("ketch:cache_manager_swap_out_blocks_total", ()), 0)
        == 2
    )
    assert after[("ketch:cache_manager_swap_in_blocks_total", ())] >= 1
    # Both slots still hold their blocks (slot 0 may be swapped in again).
    assert after[("ketch:cache_manager_swap_used_blocks", ())] == 2
    assert after[("ketch:cache_manager_swap_total_blocks", ())] == SWAP_SLOTS
    assert after[("ketch:cache_manager_engine_attached", ())] == 1
    engine.close()


@pytest.mark.timeout(60)
def test_bad_swap_indices_are_refused_and_nothing_is_copied(pair, segments) -> None:
    manager, _ = pair
    engine = FakeEngine(manager)
    engine.hello(segments[0])
    kv_before = np.array(segments[0].kv)
    for bad, words in (
        (p.Swap(seq=3, out=[(2, 0), (8, 1)]), "device block 8"),
        (p.Swap(seq=4, out=[(2, SWAP_SLOTS)]), f"swap slot {SWAP_SLOTS}"),
        (p.Swap(seq=5, into=[(0, 0)]), "device block 0"),
    ):
        done = engine.ask(bad)
        assert isinstance(done, p.SwapDone) and not done.ok and words in done.error, done
    assert np.array_equal(np.array(segments[0].kv), kv_before)
    engine.sock.send(b"not json at all")  # garbage is logged, never fatal
    assert isinstance(engine.ask(p.Ping(engine.engine_id)), p.Pong)
    engine.close()


@pytest.mark.timeout(60)
def test_push_moves_blocks_exactly_and_counts_bytes(pair, segments) -> None:
    sender, receiver = pair
    source, dest = segments
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(source)
    decode.hello(dest)
    before_s, before_r = sender.metrics(), receiver.metrics()
    blocks, dest_blocks = [1, 5, 2], [7, 3, 4]
    done = prefill.reserved_push(decode, "req-1", blocks, receiver.kv_address, dest_blocks)
    assert isinstance(done, p.PushDone) and done.ok, done
    assert done.num_bytes == 3 * source.layout.block_bytes and done.seconds > 0
    for b, d in zip(blocks, dest_blocks, strict=True):
        assert np.array_equal(dest.block(d), source.block(b))
    after_s, after_r = sender.metrics(), receiver.metrics()

    def grew(after: dict, before: dict, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert grew(after_s, before_s, "ketch:cache_manager_kv_sent_bytes_total") == done.num_bytes
    assert grew(after_r, before_r, "ketch:cache_manager_kv_received_bytes_total") == done.num_bytes
    name = "ketch:cache_manager_kv_transfers_total"
    assert grew(after_s, before_s, name, direction="send") == 1
    assert grew(after_r, before_r, name, direction="receive") == 1
    assert grew(after_s, before_s, "ketch:cache_manager_kv_transfer_seconds_count") == 1
    prefill.close()
    decode.close()


@pytest.mark.timeout(60)
def test_push_refusals_name_the_problem(pair, segments) -> None:
    sender, receiver = pair
    other = Segment(seed=3, head_dim=16)
    try:
        prefill, decode = FakeEngine(sender), FakeEngine(receiver)
        prefill.hello(segments[0])
        decode.hello(other)  # the receiver's engine has another head_dim
        done = prefill.ask(p.Push("req-2", [1], receiver.kv_address, [2]))
        assert not done.ok and "head_dim" in done.error and receiver.kv_address in done.error
        decode.hello(segments[1])  # same engine id, new layout: re-attached
        done = prefill.ask(p.Push("req-3", [1, 2], receiver.kv_address, [3, 8]))
        assert not done.ok and "destination block 8" in done.error, done
        done = prefill.ask(p.Push("req-4", [0], receiver.kv_address, [3]))
        assert not done.ok and "device block 0" in done.error, done
        push = p.Push("req-6", [1], receiver.kv_address, [3], dest_engine_id="restarted")
        done = prefill.ask(push)
        assert not done.ok and "for engine restarted" in done.error, done
        push = p.Push("req-7", [1], receiver.kv_address, [3], dest_engine_id=decode.engine_id)
        done = prefill.ask(push)
        assert not done.ok and "no KV blocks are reserved for request 'req-7'" in done.error
        assert prefill.reserved_push(decode, "req-7", [1], receiver.kv_address, [3]).ok
        done = prefill.ask(p.Push("req-5", [1], "nowhere", [3]))
        assert not done.ok and "'nowhere'" in done.error, done
        fails = receiver.metrics()[
            ("ketch:cache_manager_kv_transfer_failures_total", (("direction", "receive"),))
        ]
        assert fails >= 2
        prefill.close()
        decode.close()
    finally:
        other.remove()


@pytest.mark.timeout(60)
def test_peer_protocol_errors_are_answered_not_fatal(pair, segments) -> None:
    _, receiver = pair
    decode = FakeEngine(receiver)
    decode.hello(segments[1])
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://{receiver.kv_address}")
    header = p.TransferHeader(99, "old", segments[0].layout, [1])
    nonce = decode.reserve("short", [1])
    short = p.TransferHeader(p.PROTOCOL_VERSION, "short", segments[0].layout, [1], nonce=nonce)
    data = np.zeros(segments[0].layout.block_bytes, dtype=np.uint8)
    for frames, words in (
        ([p.encode(header), data.tobytes()], "version mismatch: peer speaks 99, this cache"),
        ([b"garbage"], "expected 2 frames"),
        ([b"{]", b""], "malformed"),
        ([p.encode(short), b"1234"], "4 bytes"),
    ):
        peer.send_multipart(frames)
        assert peer.poll(10_000), "no TransferAck"
        ack = p.decode(peer.recv())
        assert isinstance(ack, p.TransferAck) and not ack.ok and words in ack.error, ack
    peer.close()
    assert receiver.health()["status"] == "ok"
    decode.close()


@pytest.mark.timeout(60)
def test_dead_peer_fails_within_timeout_and_swaps_keep_flowing(pair, segments) -> None:
    sender, receiver = pair
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(segments[0])
    decode.hello(segments[1])
    (dead_port,) = free_ports(1)
    dead = f"127.0.0.1:{dead_port}"
    prefill.send(p.Push("req-dead", [1, 2], dead, [1, 2]))
    # The push is in flight (the peer never answers): a swap is answered meanwhile.
    assert prefill.ask(p.Swap(seq=10, out=[(3, 2)])) == p.SwapDone(10, True)
    done = prefill.receive(timeout=15)
    assert isinstance(done, p.PushDone) and not done.ok
    assert done.request_id == "req-dead" and dead in done.error and "acknowledge" in done.error
    done = prefill.reserved_push(decode, "req-live", [1, 2], receiver.kv_address, [5, 6])
    assert done.ok, done
    assert np.array_equal(segments[1].block(6), segments[0].block(2))
    prefill.close()
    decode.close()


@pytest.mark.timeout(60)
def test_new_engine_id_reattaches_and_resets_swap(pair, segments) -> None:
    manager, _ = pair
    first = FakeEngine(manager)
    first.hello(segments[0])
    assert first.ask(p.Swap(seq=1, out=[(1, 0)])).ok
    assert manager.health()["swap_used"] >= 1
    first.close()
    second = FakeEngine(manager)
    ack = second.hello(segments[1])
    assert ack.error is None and ack.swap_slots == SWAP_SLOTS
    health = manager.health()
    assert health["engine_id"] == second.engine_id and health["swap_used"] == 0
    assert isinstance(second.ask(p.Ping(second.engine_id)), p.Pong)
    second.close()


@pytest.mark.timeout(60)
def test_hello_refusals(pair, segments) -> None:
    manager, _ = pair
    engine = FakeEngine(manager)
    ack = engine.hello(segments[0], version=p.PROTOCOL_VERSION + 1)
    assert ack.error and f"engine speaks {p.PROTOCOL_VERSION + 1}" in ack.error
    assert f"this cache manager {p.PROTOCOL_VERSION}" in ack.error
    missing = p.KVLayout(**{**vars(segments[0].layout), "segment": "ketch-test-missing"})
    ack = engine.ask(p.Hello(engine.engine_id, p.PROTOCOL_VERSION, missing))
    assert ack.error and "does not exist" in ack.error
    wrong = p.KVLayout(**{**vars(segments[0].layout), "num_blocks": 9})
    ack = engine.ask(p.Hello(engine.engine_id, p.PROTOCOL_VERSION, wrong))
    assert ack.error and "bytes" in ack.error
    engine.close()


@pytest.mark.timeout(60)
def test_a_late_push_cannot_write_blocks_reassigned_to_another_request(pair, segments) -> None:
    """A prefill pod that comes back after decode gave up on a request (revoked, blocks freed
    and given to a new request) pushes too late: refused, and the new request's KV is intact."""
    sender, receiver = pair
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(segments[0])
    decode.hello(segments[1])
    old_nonce = decode.reserve("old", [3, 4])
    # decode timed out: revoke, then free the blocks once the revoke is confirmed
    assert decode.ask(p.Revoke(["old"])) == p.Revoked(["old"])
    new = prefill.reserved_push(decode, "new", [1, 2], receiver.kv_address, [3, 4])
    assert new.ok, new
    kept = np.array(segments[1].kv)
    decode.reserve("next", [3, 4])  # the stored push used "new"'s reservation up
    for push, words in [
        (p.Push("old", [5, 6], receiver.kv_address, [3, 4], decode.engine_id, old_nonce),
         "no KV blocks are reserved for request 'old'"),
        (p.Push("new", [5, 6], receiver.kv_address, [3, 4], decode.engine_id, old_nonce),
         "no KV blocks are reserved for request 'new'"),
        (p.Push("next", [5, 6], receiver.kv_address, [3, 4], decode.engine_id, old_nonce),
         "does not carry its reservation's nonce"),
        (p.Push("next", [5], receiver.kv_address, [7], decode.engine_id, "x" * 32),
         "nonce"),
    ]:  # fmt: skip
        done = prefill.ask(push)
        assert not done.ok and words in done.error, done
    assert np.array_equal(np.array(segments[1].kv), kept)
    assert np.array_equal(segments[1].block(3), segments[0].block(1))
    prefill.close()
    decode.close()


@pytest.mark.timeout(120)
def test_hostile_frames_on_both_ports_change_nothing_and_break_nothing(pair, segments) -> None:
    """300 hostile multipart messages on the cache queue and 300 on the KV-transfer port (wrong
    frame counts, garbage, deep nesting, valid-looking messages with broken fields): the
    attached engine's KV is untouched, the sidecar stays healthy, and swaps and pushes work."""
    from hostile import frames

    sender, receiver = pair
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(segments[0])
    decode.hello(segments[1])
    kept = np.array(segments[1].kv)
    context = zmq.Context.instance()
    for address, kinds, seed in (
        (
            rundir.cache_queue_address(receiver.queue_port),
            [p.Hello, p.Ping, p.Swap, p.Push, p.Reserve, p.Revoke],
            5,
        ),
        (f"tcp://127.0.0.1:{receiver.kv_port}", [p.TransferHeader], 6),
    ):
        attacker = context.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(address)
        for message in frames(kinds, seed=seed, count=300):
            attacker.send_multipart(message)
        attacker.close()
    # The decode engine's own link still works (and re-says Hello if an attacker's was taken).
    decode.hello(segments[1])
    assert isinstance(decode.ask(p.Ping(decode.engine_id)), p.Pong)
    assert np.array_equal(np.array(segments[1].kv), kept)
    health = receiver.health()
    assert health["status"] == "ok", health
    assert receiver.proc.poll() is None
    done = prefill.reserved_push(decode, "after-fuzz", [1, 2], receiver.kv_address, [3, 4])
    assert done.ok, done
    assert np.array_equal(segments[1].block(4), segments[0].block(2))
    prefill.close()
    decode.close()


@pytest.mark.timeout(60)
def test_sigterm_finishes_queued_pushes_and_still_takes_the_engines(segments) -> None:
    """SIGTERM reaches the engine and its sidecar at once; the draining engine's last requests
    still need their pushes, so those are taken and answered, and the sidecar exits 0 once
    they are and the engine has gone."""
    import signal

    manager = CacheManagerProcess("--swap-space", "0", "--transfer-timeout", "2").wait_ready()
    engine = FakeEngine(manager)
    try:
        engine.hello(segments[0])
        (dead_port,) = free_ports(1)
        engine.send(p.Push("in-flight", [1, 2], f"127.0.0.1:{dead_port}", [1, 2]))
        assert isinstance(engine.ask(p.Ping(engine.engine_id)), p.Pong)  # the push is queued
        manager.proc.send_signal(signal.SIGTERM)
        engine.send(p.Push("late", [1], f"127.0.0.1:{dead_port}", [1]))
        answers = {}
        while len(answers) < 2:  # both are answered before the exit (the peer is dead)
            done = engine.receive(timeout=15)
            if isinstance(done, p.PushDone):
                answers[done.request_id] = done
            engine.send(p.Ping(engine.engine_id))  # the engine is still there, draining
        assert sorted(answers) == ["in-flight", "late"], answers
        assert all("acknowledge" in done.error for done in answers.values()), answers
        assert manager.proc.poll() is None  # it waits for the engine to go
        engine.close()
        assert manager.proc.wait(15) == 0
    finally:
        engine.close()
        manager.stop()
