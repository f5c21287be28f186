"""Review M4 and M11 on pd-comm: no peer gets in before it authenticates, the engine loop's share
of pd-comm work per tick is bounded, and a prefill/decode role without a peer key fails closed.

The coordinator runs in this process (it only stores the engine until a request arrives), so
the tests see what reached the application: ``bad_messages`` counts every message that got past
libzmq, and the ROUTER's monitor says how each connection's handshake ended.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ketch.engine.disagg import messages as m
from ketch.engine.disagg.coordinator import FROM_ROUTER, TO_ROUTER, PDCoordinator
from ketch.engine.peer_auth import PeerAuth
from ketch.engine.serving.config import ServerConfig
from procs import free_ports

pytestmark = pytest.mark.timeout(60)

KEY = b"peer-key-of-this-inference-service"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _coordinator(role: str, **config: object) -> PDCoordinator:
    (port,) = free_ports(1)
    settings = {"role": role, "host": "127.0.0.1", "pd_comm_port": port, **config}
    return PDCoordinator(object(), ServerConfig(**settings), None)


@pytest.fixture()
def keyed(tmp_path, monkeypatch) -> Iterator[PDCoordinator]:
    monkeypatch.delenv("KETCH_PEER_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    coordinator = _coordinator("prefill", peer_key_file=str(key_file))
    try:
        yield coordinator
    finally:
        coordinator.close()


def _address(coordinator: PDCoordinator) -> str:
    return coordinator.router.getsockopt_string(zmq.LAST_ENDPOINT)


def _handshakes(monitor: zmq.Socket, wanted: int, timeout: float = 5.0) -> list[int]:
    """The handshake outcomes (events) of the next ``wanted`` connections."""
    outcomes: list[int] = []
    deadline = time.monotonic() + timeout
    while len(outcomes) < wanted and monitor.poll(max(1, int((deadline - time.monotonic()) * 1e3))):
        event = recv_monitor_message(monitor)["event"]
        if event & (zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED):
            outcomes.append(event)
    return outcomes


def test_peers_without_the_key_are_dropped_at_the_handshake(keyed: PDCoordinator) -> None:
    """Before: any peer connected, and libzmq buffered whatever it sent (a message whose frames
    never end grows without limit) before the seal was even looked at. Now a peer that does not
    present the key's token is dropped at the handshake: nothing it sends reaches the engine."""
    monitor = keyed.router.get_monitor_socket()
    context = zmq.Context()
    rogues = []
    try:
        for credentials in (None, b"wrong-key-wrong-key-wrong"):
            rogue = context.socket(zmq.DEALER)
            rogue.setsockopt(zmq.LINGER, 0)
            if credentials is not None:  # a peer that speaks PLAIN with a guessed token
                rogue.setsockopt(zmq.PLAIN_USERNAME, b"ketch")
                rogue.setsockopt(zmq.PLAIN_PASSWORD, credentials)
            rogue.connect(_address(keyed))
            rogues.append(rogue)
        outcomes = _handshakes(monitor, 2)
        assert len(outcomes) == 2 and all(e & _HANDSHAKE_FAILED for e in outcomes), outcomes
        ping = m.encode(m.PdPing(["x"]))
        for rogue in rogues:
            with contextlib.suppress(zmq.Again):  # queued at most: the connection never opens
                rogue.send_multipart([ping, PeerAuth(KEY).seal(TO_ROUTER, ping)], zmq.NOBLOCK)
                for _ in range(8):  # then a message whose frames never end
                    rogue.send(b"x" * (1 << 20), zmq.SNDMORE | zmq.NOBLOCK)
        time.sleep(0.3)
        keyed.tick()
        assert keyed.bad_messages.total == 0, "a message of an unauthenticated peer got through"
        assert not keyed.router.poll(0)
    finally:
        for rogue in rogues:
            rogue.close(linger=0)
        context.term()
        keyed.router.disable_monitor()
        monitor.close(linger=0)


def test_a_peer_with_the_key_connects_and_is_answered(keyed: PDCoordinator) -> None:
    from ketch.engine.peer_auth import gate_client

    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    gate_client(peer, KEY, TO_ROUTER)
    peer.connect(_address(keyed))
    try:
        ping = m.encode(m.PdPing(["x"]))
        peer.send_multipart([ping, PeerAuth(KEY).seal(TO_ROUTER, ping)])
        deadline = time.monotonic() + 10
        while not peer.poll(50) and time.monotonic() < deadline:
            keyed.tick()
        answer, seal = peer.recv_multipart()
        assert PeerAuth(KEY).check(FROM_ROUTER, [answer], seal) is None
        assert m.decode(answer) == m.PdPong(["x"])
    finally:
        peer.close(linger=0)


def test_one_tick_handles_a_bounded_number_of_messages(keyed: PDCoordinator) -> None:
    """Before: ``tick`` drained pd-comm with no cap, inside the engine's step loop, so a flood of
    messages (each one an HMAC over up to 16 MiB) starved decoding. Now each tick handles at
    most MAX_MESSAGES_PER_TICK of them; the rest wait for the next tick."""
    from ketch.engine.disagg.coordinator import MAX_MESSAGES_PER_TICK
    from ketch.engine.peer_auth import gate_client

    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    gate_client(peer, KEY, TO_ROUTER)
    peer.connect(_address(keyed))
    count = 4 * MAX_MESSAGES_PER_TICK
    try:
        auth = PeerAuth(KEY)
        for i in range(count):
            ping = m.encode(m.PdPing([f"r{i}"]))
            peer.send_multipart([ping, auth.seal(TO_ROUTER, ping)])
        deadline = time.monotonic() + 10
        while keyed.router.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # let every message arrive
        keyed.tick()
        answered = 0
        while peer.poll(200):
            peer.recv_multipart()
            answered += 1
        assert answered == MAX_MESSAGES_PER_TICK
        for _ in range(3):
            keyed.tick()
        while peer.poll(200):
            peer.recv_multipart()
            answered += 1
        assert answered == count
    finally:
        peer.close(linger=0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_role_without_a_peer_key_refuses_to_start(role: str, monkeypatch) -> None:
    """Review M11: no key used to mean a warning and an open pd-comm port; now it is an error
    naming how to give a key, unless --insecure-no-peer-key says the network is trusted."""
    monkeypatch.delenv("KETCH_PEER_KEY", raising=False)
    with pytest.raises(ValueError, match=r"needs a peer key.*--insecure-no-peer-key"):
        _coordinator(role).close()
    insecure = _coordinator(role, insecure_no_peer_key=True)
    try:
        assert insecure.auth is None
    finally:
        insecure.close()
