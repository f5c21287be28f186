"""The sending side of KV pushes under slow and dead peers: real cache managers, real sockets.

A destination that never answers (a port nobody listens on) must not delay pushes to a healthy
one; a destination gets at most ``--max-queued-pushes-per-peer`` pushes waiting, the rest are
refused at once; after ``--peer-failure-threshold`` failures in a row its circuit opens (pushes
fail at once), and after ``--peer-cooldown`` one probe decides; a push is not started, or is
abandoned, once the request's deadline has passed. Every check is on answers and their order,
never on how long something took.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from cm_harness import CacheManagerProcess, FakeEngine, Segment, free_ports, running_managers

from ketch.engine.cache_manager import protocol as p

pytestmark = pytest.mark.timeout(90)

TRANSFER_TIMEOUT_S = "1.5"
ARGS = (
    "--swap-space", "0", "--transfer-timeout", TRANSFER_TIMEOUT_S,
    "--max-queued-pushes-per-peer", "2", "--peer-failure-threshold", "2",
    "--peer-cooldown", "2",
)  # fmt: skip


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[CacheManagerProcess, CacheManagerProcess]]:
    with running_managers(2, *ARGS) as (sender, receiver):
        yield sender, receiver


@pytest.fixture()
def engines(pair, segments) -> Iterator[tuple[FakeEngine, FakeEngine]]:
    """The prefill engine at the sender and the decode engine at the receiver, attached."""
    sender, receiver = pair
    prefill, decode = FakeEngine(sender), FakeEngine(receiver)
    prefill.hello(segments[0])
    decode.hello(segments[1])
    yield prefill, decode
    prefill.close()
    decode.close()


def _dead() -> str:
    """A destination nobody listens on: its pushes are never acknowledged."""
    (port,) = free_ports(1)
    return f"127.0.0.1:{port}"


def _answers(engine: FakeEngine, count: int, timeout: float = 30.0) -> list[p.PushDone]:
    """The next ``count`` PushDones in the order they came (pinging every second meanwhile,
    as the engine does, so the cache manager keeps it attached)."""
    answers: list[p.PushDone] = []
    deadline, last_ping = time.monotonic() + timeout, 0.0
    while len(answers) < count:
        assert time.monotonic() < deadline, f"only {answers} within {timeout} s"
        if time.monotonic() - last_ping >= 1.0:
            engine.send(p.Ping(engine.engine_id))
            last_ping = time.monotonic()
        if engine.sock.poll(100):
            message = p.decode(engine.sock.recv())
            if isinstance(message, p.PushDone):
                answers.append(message)
    return answers


def _circuit(manager: CacheManagerProcess, dest: str) -> str:
    return manager.health()["pushes"]["failing_destinations"].get(dest, "closed")


def _wait_circuit(manager: CacheManagerProcess, dest: str, state: str, engine: FakeEngine) -> None:
    deadline = time.monotonic() + 20
    while _circuit(manager, dest) != state:
        assert time.monotonic() < deadline, f"{dest} never {state}: {manager.health()}"
        assert isinstance(engine.ask(p.Ping(engine.engine_id)), p.Pong)  # stay attached
        time.sleep(0.1)


def _refusals(manager: CacheManagerProcess, reason: str) -> float:
    return manager.metrics()[("ketch:cache_manager_push_refusals_total", (("reason", reason),))]


def test_an_unreachable_destination_does_not_delay_pushes_to_a_healthy_one(
    pair, engines, segments
) -> None:
    _, receiver = pair
    prefill, decode = engines
    dead = _dead()
    for i in range(2):  # both on their way to the dead peer (each waits the transfer timeout)
        prefill.send(p.Push(f"dead-{i}", [1, 2], dead, [1, 2]))
    nonce = decode.reserve("healthy", [5, 6])
    prefill.send(p.Push("healthy", [3, 4], receiver.kv_address, [5, 6], decode.engine_id, nonce))
    order = _answers(prefill, 3)
    assert [a.request_id for a in order] == ["healthy", "dead-0", "dead-1"], order
    assert order[0].ok, order[0]
    assert np.array_equal(segments[1].block(6), segments[0].block(4))
    assert all(not a.ok and "acknowledge" in a.error for a in order[1:]), order


def test_pushes_beyond_the_per_destination_bound_are_refused_at_once(pair, engines) -> None:
    sender, _ = pair
    prefill, _ = engines
    dead, other = _dead(), _dead()
    before = _refusals(sender, "queue_full")
    for i in range(4):
        prefill.send(p.Push(f"q-{i}", [1], dead, [1]))
    prefill.send(p.Push("other", [1], other, [1]))  # the bound is per destination
    order = _answers(prefill, 5)
    ids = [a.request_id for a in order]
    # The two over the bound are answered before the two taken (which wait for the peer).
    assert sorted(ids[:2]) == ["q-2", "q-3"], order
    for refused in order[:2]:
        assert not refused.ok and "--max-queued-pushes-per-peer" in refused.error, refused
        assert dead in refused.error
    taken = {a.request_id: a for a in order[2:]}
    assert sorted(taken) == ["other", "q-0", "q-1"], order
    assert all("acknowledge" in a.error for a in taken.values()), taken
    assert _refusals(sender, "queue_full") - before == 2


def test_the_circuit_opens_then_lets_one_probe_through(pair, engines, segments) -> None:
    sender, _ = pair
    prefill, _ = engines
    dest = _dead()
    for i in range(2):  # --peer-failure-threshold 2
        prefill.send(p.Push(f"fail-{i}", [1], dest, [1]))
    assert all("acknowledge" in a.error for a in _answers(prefill, 2))
    assert _circuit(sender, dest) == "open"
    assert sender.metrics()[("ketch:cache_manager_push_circuits_open", ())] >= 1
    before = _refusals(sender, "circuit_open")
    (fast,) = _answers_to(prefill, p.Push("while-open", [1], dest, [1]))
    assert not fast.ok and "fail fast" in fast.error and "acknowledge" in fast.error, fast
    assert _refusals(sender, "circuit_open") - before == 1

    # After the cool-down one probe goes; another push meanwhile fails at once.
    _wait_circuit(sender, dest, "half-open", prefill)
    prefill.send(p.Push("probe-1", [1], dest, [1]))
    prefill.send(p.Push("during-probe", [1], dest, [1]))
    order = _answers(prefill, 2)
    assert [a.request_id for a in order] == ["during-probe", "probe-1"], order
    assert "probe push is on its way" in order[0].error and "acknowledge" in order[1].error
    assert _circuit(sender, dest) == "open"  # the probe failed: open for another cool-down

    # The peer comes back (a cache manager on that port): the next probe closes the circuit.
    queue_port, http_port = free_ports(2)
    kv_port = int(dest.rsplit(":", 1)[1])
    flags = ["--host", "127.0.0.1", "--cache-queue-port", str(queue_port)]
    flags += ["--kv-transfer-port", str(kv_port), "--cache-manager-port", str(http_port)]
    flags += ["--role", "decode", "--insecure-no-peer-key"]
    revived = CacheManagerProcess(*flags, *ARGS, ports=[queue_port, kv_port, http_port])
    target = Segment(seed=4)
    try:
        revived.wait_ready()
        decode = FakeEngine(revived)
        decode.hello(target)
        _wait_circuit(sender, dest, "half-open", prefill)
        nonce = decode.reserve("probe-2", [3])
        (probe,) = _answers_to(prefill, p.Push("probe-2", [2], dest, [3], decode.engine_id, nonce))
        assert probe.ok, probe
        assert np.array_equal(target.block(3), segments[0].block(2))
        assert _circuit(sender, dest) == "closed"
        nonce = decode.reserve("after", [4])
        (after,) = _answers_to(prefill, p.Push("after", [1], dest, [4], decode.engine_id, nonce))
        assert after.ok, after
        decode.close()
    finally:
        assert revived.stop() == 0, revived.log()
        target.remove()


def test_a_push_past_its_deadline_is_not_started_or_is_abandoned(pair, engines) -> None:
    sender, _ = pair
    prefill, _ = engines
    before = _refusals(sender, "expired")
    (late,) = _answers_to(prefill, p.Push("late", [1], _dead(), [1], expires_at=time.time() - 1))
    assert not late.ok and "deadline passed before its KV push could start" in late.error

    # Cut short while waiting for the acknowledgement; never the peer's fault (no circuit).
    dest = _dead()
    for i in range(3):  # more than --peer-failure-threshold
        push = p.Push(f"cut-{i}", [1], dest, [1], expires_at=time.time() + 0.3)
        (cut,) = _answers_to(prefill, push)
        assert not cut.ok and "deadline passed before peer" in cut.error, cut
    assert _circuit(sender, dest) == "closed"

    # Expired while queued behind another push to the same peer: nothing is sent.
    dest = _dead()
    prefill.send(p.Push("ahead", [1], dest, [1]))
    prefill.send(p.Push("behind", [1], dest, [1], expires_at=time.time() + 0.3))
    order = _answers(prefill, 2)
    assert [a.request_id for a in order] == ["ahead", "behind"], order
    assert "deadline passed while its KV push waited; nothing sent" in order[1].error
    assert _refusals(sender, "expired") - before == 5


def _answers_to(engine: FakeEngine, push: p.Push) -> list[p.PushDone]:
    engine.send(push)
    return _answers(engine, 1)
