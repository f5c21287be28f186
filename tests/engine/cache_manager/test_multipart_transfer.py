"""Multi-part (pipelined) KV transfers between real cache managers, and their refusals.

A push is sent as several messages of a few layers each; the receiver stores each part and
acknowledges the push once, after the last part, or refuses it at the first bad part and never
acknowledges it as a success.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from cm_harness import CacheManagerProcess, FakeEngine, Segment, running_managers

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.segment import gather, layer_ranges, runs, scatter

# 64 KiB per block and layer: a push of 36 blocks is sent one layer per part (6 parts).
BIG = {"num_layers": 6, "kv_heads": 2, "num_blocks": 48, "block_size": 64, "head_dim": 64}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[CacheManagerProcess, CacheManagerProcess]]:
    with running_managers(2, "--swap-space", "0", "--transfer-timeout", "2") as (a, b):
        yield a, b


def test_layer_ranges_cover_every_layer_in_order() -> None:
    layout = p.KVLayout(**BIG)
    assert layer_ranges(layout, 36) == [(i, i + 1) for i in range(6)]
    assert layer_ranges(layout, 1) == [(0, 6)]
    assert layer_ranges(layout, 12, part_bytes=2 * 12 * (64 << 10)) == [(0, 2), (2, 4), (4, 6)]
    assert layer_ranges(layout, 12, part_bytes=4 * 12 * (64 << 10)) == [(0, 4), (4, 6)]


def test_gather_and_scatter_by_runs_match_fancy_indexing() -> None:
    assert runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((3, 2, 2, 12, 4, 2)).astype(np.float32)
    blocks = [3, 4, 5, 9, 1, 2, 11]
    out = np.empty((2, 2, 2, len(blocks), 4, 2), np.float32)
    assert np.array_equal(gather(kv[1:3], blocks, out), kv[1:3][:, :, :, blocks])
    target = np.zeros_like(kv)
    scatter(target[1:3], blocks, out)
    assert np.array_equal(target[1:3][:, :, :, blocks], out)
    assert not target[0].any()


@pytest.mark.timeout(60)
def test_multipart_push_moves_blocks_exactly() -> None:
    source, dest = Segment(seed=3, **BIG), Segment(seed=4, **BIG)
    managers = [CacheManagerProcess("--swap-space", "0", "--transfer-timeout", "5")]
    managers.append(CacheManagerProcess("--swap-space", "0"))
    try:
        sender, receiver = (m.wait_ready() for m in managers)
        prefill, decode = FakeEngine(sender), FakeEngine(receiver)
        prefill.hello(source)
        decode.hello(dest)
        blocks = [*range(5, 25), 40, 2, 3, *range(30, 43)]  # runs and single blocks: 36
        dest_blocks = [*range(1, 37)][::-1]
        assert len(layer_ranges(source.layout, len(blocks))) == 6
        done = prefill.reserved_push(decode, "req-mp", blocks, receiver.kv_address, dest_blocks)
        assert isinstance(done, p.PushDone) and done.ok, done
        assert done.num_bytes == len(blocks) * source.layout.block_bytes
        assert np.array_equal(dest.kv[:, :, :, dest_blocks], source.kv[:, :, :, blocks])
        metrics = receiver.metrics()
        name = "ketch:cache_manager_kv_transfers_total"
        assert metrics[(name, (("direction", "receive"),))] == 1
        prefill.close()
        decode.close()
    finally:
        for manager in managers:
            manager.stop()
        source.remove()
        dest.remove()


NONCE = "n" * 32  # what the tests' reservations use


def _part(
    layout: p.KVLayout, request: str, dest: list[int], layers: list[int], part: int, parts: int
) -> list[bytes]:
    header = p.TransferHeader(
        p.PROTOCOL_VERSION,
        request,
        layout,
        dest,
        layers=layers,
        part=part,
        parts=parts,
        nonce=NONCE,
    )
    shape = layout.transfer_shape(len(dest), layers[1] - layers[0])
    data = np.full(shape, float(part + 1), dtype=np.float32)
    return [p.encode(header), data.tobytes()]


@pytest.mark.timeout(60)
def test_bad_or_missing_parts_are_refused_and_never_acknowledged(pair, segments) -> None:
    _, receiver = pair
    decode = FakeEngine(receiver)
    decode.hello(segments[1])
    for request in ("ok", "gap", "drop", "moved", "early", "range", "many", "size", "swap", "cut"):
        answer = decode.ask(p.Reserve(request, [2, 3, 4, 5, 6, 7], NONCE, 60.0))
        assert answer == p.Reserved(request, True), answer
    layout = segments[0].layout  # 2 layers
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://{receiver.kv_address}")

    def answer(timeout_ms: int = 10_000) -> p.TransferAck | None:
        if not peer.poll(timeout_ms):
            return None
        ack = p.decode(peer.recv())
        assert isinstance(ack, p.TransferAck), ack
        return ack

    # A good two-part push: one ack, after the second part.
    peer.send_multipart(_part(layout, "ok", [3, 4], [0, 1], 0, 2))
    assert answer(300) is None
    peer.send_multipart(_part(layout, "ok", [3, 4], [1, 2], 1, 2))
    assert answer() == p.TransferAck("ok", True)
    assert (segments[1].kv[0, :, :, [3, 4]] == 1).all()
    assert (segments[1].kv[1, :, :, [3, 4]] == 2).all()
    # A second part with a gap in the layers: refused at once; no success ever follows.
    peer.send_multipart(_part(layout, "gap", [5], [0, 1], 0, 2))
    peer.send_multipart(_part(layout, "gap", [5], [0, 1], 1, 2))  # layer 1 was due
    ack = answer()
    assert ack is not None and not ack.ok and "layer 1 is due" in ack.error, ack
    # A refused first part: the push's later parts are dropped unanswered.
    peer.send_multipart([*_part(layout, "drop", [5], [0, 1], 0, 2)[:1], b"xy"])
    ack = answer()
    assert ack is not None and not ack.ok and "2 bytes" in ack.error, ack
    peer.send_multipart(_part(layout, "drop", [5], [1, 2], 1, 2))
    assert answer(500) is None
    # Other dest_blocks in a later part, a part without its predecessors, a short last part,
    # a wrong data size, layers out of range.
    for frames, words in (
        (_part(layout, "moved", [6], [1, 2], 1, 2), "without the parts before it"),
        (_part(layout, "early", [6], [0, 1], 0, 1), "last part ends at layer 1 of 2"),
        (_part(layout, "range", [6], [1, 3], 0, 2), "outside [0, 2)"),
        (_part(layout, "many", [6], [0, 1], 0, 9), "part 0 of 9 is out of range"),
        ([*_part(layout, "size", [6, 7], [0, 1], 0, 2)[:1], b"xy"], "2 bytes"),
    ):
        peer.send_multipart(frames)
        ack = answer()
        assert ack is not None and not ack.ok and words in ack.error, (words, ack)
    peer.send_multipart(_part(layout, "swap", [6], [0, 1], 0, 2))
    peer.send_multipart(_part(layout, "swap", [7], [1, 2], 1, 2))
    ack = answer()
    assert ack is not None and not ack.ok and "other dest_blocks" in ack.error, ack
    # An interrupted push (its last part never comes) is never acknowledged; a retry works.
    peer.send_multipart(_part(layout, "cut", [2], [0, 1], 0, 2))
    assert answer(2_500) is None
    peer.send_multipart(
        [*_part(layout, "cut", [2], [0, 2], 0, 1)[:1], b"\x00" * layout.block_bytes]
    )
    assert answer() == p.TransferAck("cut", True)
    peer.close()
    assert receiver.health()["status"] == "ok"
    decode.close()
