"""KV transfers between cache managers that share a peer key: every part and every ack sealed.

A keyed push between two real cache managers moves the blocks exactly; a part from a peer
without the key, with a wrong key, or replayed (out of the window, or a second time within it)
is dropped unanswered, writes nothing, and leaves the receiver healthy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from cm_harness import CacheManagerProcess, FakeEngine, running_managers

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.transport import ACK, PUSH
from ketch.engine.peer_auth import PeerAuth, gate_client

KEY = b"k" * 32


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[tuple[CacheManagerProcess, CacheManagerProcess]]:
    key_file = Path(tmp_path_factory.mktemp("peer-key")) / "key"
    key_file.write_bytes(KEY + b"\n")
    args = ("--swap-space", "0", "--transfer-timeout", "2", "--peer-key-file", str(key_file))
    with running_managers(2, *args) as (a, b):
        yield a, b


def _frames(layout: p.KVLayout, request: str, nonce: str, dest: list[int]) -> list[bytes]:
    header = p.TransferHeader(p.PROTOCOL_VERSION, request, layout, dest, nonce=nonce)
    data = np.full(layout.transfer_shape(len(dest), layout.num_layers), 7.0, dtype=np.float32)
    return [p.encode(header), data.tobytes()]


@pytest.mark.timeout(60)
def test_keyed_push_moves_blocks_and_unkeyed_parts_are_dropped(keyed, segments) -> None:
    sender, receiver = keyed
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(segments[0])
    decode.hello(segments[1])
    done = prefill.reserved_push(decode, "real", [1, 2], receiver.kv_address, [5, 6])
    assert done.ok, done
    assert np.array_equal(segments[1].block(6), segments[0].block(2))

    layout, dest = segments[1].layout, [3, 4]
    nonce = decode.reserve("forged", dest)
    before = segments[1].kv.copy()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    gate_client(peer, KEY, PUSH)  # past the connection gate (test_kv_transfer_gate covers it)
    peer.connect(f"tcp://{receiver.kv_address}")
    frames = _frames(layout, "forged", nonce, dest)
    stale = PeerAuth(KEY, clock=lambda: time.time() - 120)
    for attempt in (
        frames,  # no key at all
        [*frames, PeerAuth(b"w" * 32).seal(PUSH, *frames)],  # a wrong key
        [*frames, PeerAuth(KEY).seal(ACK, *frames)],  # the right key, another channel
        [*frames, stale.seal(PUSH, *frames)],  # captured two minutes ago
        [frames[0], frames[1][:-4] + b"\x00" * 4, PeerAuth(KEY).seal(PUSH, *frames)],  # altered
    ):
        peer.send_multipart(attempt)
        assert not peer.poll(700), "an unauthenticated part was answered"
    assert np.array_equal(segments[1].kv, before), "an unauthenticated part wrote KV"
    assert receiver.health()["status"] == "ok"
    assert "refused a message from a kv-transfer peer" in receiver.log()  # once a minute

    # The same part sealed with the key is stored and acknowledged (with a sealed ack) once;
    # sent again within the window it is a replay.
    sealed = [*frames, PeerAuth(KEY).seal(PUSH, *frames)]
    peer.send_multipart(sealed)
    assert peer.poll(10_000)
    ack, seal = peer.recv_multipart()
    assert PeerAuth(KEY).check(ACK, [ack], seal) is None
    assert p.decode(ack) == p.TransferAck("forged", True)
    assert (segments[1].kv[:, :, :, dest] == 7.0).all()
    segments[1].kv[:] = before
    peer.send_multipart(sealed)
    assert not peer.poll(700), "a replayed part was answered"
    assert np.array_equal(segments[1].kv, before), "a replayed part wrote KV"
    peer.close()
    prefill.close()
    decode.close()


@pytest.mark.timeout(60)
def test_a_sender_without_the_key_gets_no_acknowledgement(keyed, segments) -> None:
    _, receiver = keyed
    with running_managers(1, "--swap-space", "0", "--transfer-timeout", "1") as (plain,):
        prefill, decode = FakeEngine(plain), FakeEngine(receiver)
        prefill.hello(segments[0])
        decode.hello(segments[1])
        before = segments[1].kv.copy()
        done = prefill.reserved_push(decode, "plain", [1], receiver.kv_address, [2])
        assert not done.ok and "acknowledge" in done.error, done
        assert np.array_equal(segments[1].kv, before)
        prefill.close()
        decode.close()
    assert receiver.health()["status"] == "ok"
