"""Review M4, M11 and L4 on the KV transfer port.

- M4: with a peer key, a peer that does not prove it holds the key is dropped at the handshake,
  before libzmq buffers a single message of it; the port refuses frames over MAX_KV_FRAME_BYTES.
- M11: a prefill/decode cache manager without a peer key refuses to start (unless
  ``--insecure-no-peer-key``).
- L4: a mixed instance's cache manager opens no KV transfer port at all.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from cm_harness import SMALL, CacheManagerProcess, FakeEngine, Segment
from zmq.utils.monitor import recv_monitor_message

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.transport import PUSH, TcpReceiver
from ketch.engine.peer_auth import PeerAuth
from procs import free_ports

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _part() -> list[bytes]:
    layout = p.KVLayout(**SMALL)
    header = p.TransferHeader(p.PROTOCOL_VERSION, "forged", layout, [1], nonce="n")
    data = np.zeros(layout.transfer_shape(1), dtype=np.float32).tobytes()
    return [p.encode(header), data]


def test_kv_peers_without_the_key_are_dropped_before_sending_anything() -> None:
    """Before: anyone connected and libzmq buffered what they sent — with no MAXMSGSIZE, one
    frame of any size, or frames that never end — before the seal was looked at. Now the
    handshake refuses a peer without the key's token, so nothing of it is buffered; a keyed
    sender still pushes, sealed."""
    context = zmq.Context()
    (port,) = free_ports(1)
    receiver = TcpReceiver(context, "127.0.0.1", port, KEY)
    sock = receiver._sock  # not started yet: this thread may still use it
    monitor = sock.get_monitor_socket()
    rogues = []
    try:
        for token in (None, b"a-guessed-token"):
            rogue = context.socket(zmq.DEALER)
            rogue.setsockopt(zmq.LINGER, 0)
            if token is not None:
                rogue.setsockopt(zmq.PLAIN_USERNAME, b"ketch")
                rogue.setsockopt(zmq.PLAIN_PASSWORD, token)
            rogue.connect(f"tcp://127.0.0.1:{port}")
            rogues.append(rogue)
        outcomes: list[int] = []
        deadline = time.monotonic() + 5
        while len(outcomes) < 2 and monitor.poll(max(1, int((deadline - time.monotonic()) * 1e3))):
            event = recv_monitor_message(monitor)["event"]
            if event & (zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED):
                outcomes.append(event)
        assert len(outcomes) == 2 and all(e & _FAILED for e in outcomes), outcomes
        frames = _part()
        for rogue in rogues:
            with contextlib.suppress(zmq.Again):
                rogue.send_multipart([*frames, PeerAuth(KEY).seal(PUSH, *frames)], zmq.NOBLOCK)
                for _ in range(8):  # a message whose frames never end
                    rogue.send(b"x" * (1 << 20), zmq.SNDMORE | zmq.NOBLOCK)
        assert not sock.poll(500), "a message of an unauthenticated peer reached the receiver"
        from ketch.engine.cache_manager.transport import MAX_KV_FRAME_BYTES

        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_KV_FRAME_BYTES  # was -1: any size
    except BaseException:
        sock.disable_monitor()  # before its PAIR closes: libzmq would block on the last event
        monitor.close(linger=0)
        receiver.close()
        raise
    finally:
        for rogue in rogues:
            rogue.close(linger=0)
    sock.disable_monitor()
    monitor.close(linger=0)

    from ketch.engine.cache_manager.transport import TcpSender

    stored: list[str] = []

    def handler(peer: bytes, header: p.TransferHeader, data: memoryview) -> p.TransferAck:
        stored.append(header.request_id)
        return p.TransferAck(header.request_id, True)

    receiver.start(handler)
    sender = TcpSender(context, 10.0, KEY)
    try:
        layout = p.KVLayout(**SMALL)
        header = p.TransferHeader(p.PROTOCOL_VERSION, "real", layout, [1], nonce="n")
        sender.send(f"127.0.0.1:{port}", [(header, np.zeros(layout.transfer_shape(1), "f4"))])
        assert stored == ["real"] and receiver.bad_messages.total == 0
    finally:
        sender.close()
        receiver.close()
        context.term()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _role_file(tmp_path: Path, role: str, ports: list[int], key_file: str = "") -> str:
    queue_port, kv_port, http_port = ports
    path = tmp_path / f"{role}.yaml"
    text = (
        f"model: tiny\nrole: {role}\nhost: 127.0.0.1\ncache_queue_port: {queue_port}\n"
        f"kv_transfer_port: {kv_port}\ncache_manager_port: {http_port}\nswap_space: 0\n"
    )
    if key_file:
        text += f"peer_key_file: {key_file}\n"
    path.write_text(text)
    return str(path)


def test_a_mixed_instances_cache_manager_opens_no_kv_transfer_port(tmp_path, segments) -> None:
    """Review L4: the sidecar of a mixed pod (role: mixed in its role file, as the operator
    renders it) used to bind the KV transfer port on 0.0.0.0, unused and without a key."""
    ports = free_ports(3)
    manager = CacheManagerProcess("--config", _role_file(tmp_path, "mixed", ports), ports=ports)
    try:
        manager.wait_ready()
        engine = FakeEngine(manager)
        assert engine.hello(segments[0]).error is None  # it serves its engine
        assert manager.health()["status"] == "ok"
        assert not _listening(ports[1]), "a mixed instance's cache manager opened its KV port"
        refused = engine.ask(p.Push("r", [1], "127.0.0.1:1", [1]))
        assert isinstance(refused, p.PushDone) and not refused.ok and "mixed" in refused.error
        engine.close()
    finally:
        assert manager.stop() == 0, manager.log()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_kv_moving_cache_manager_without_a_peer_key_refuses_to_start(
    tmp_path, monkeypatch, role: str
) -> None:
    """Review M11: it used to log a warning and take KV from anyone; now it exits, naming how to
    give a key (or --insecure-no-peer-key for a trusted network)."""
    monkeypatch.delenv("KETCH_PEER_KEY", raising=False)
    ports = free_ports(3)
    manager = CacheManagerProcess("--config", _role_file(tmp_path, role, ports), ports=ports)
    try:
        deadline = time.monotonic() + 20
        while manager.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert manager.proc.poll() not in (None, 0), f"it runs without a key:\n{manager.log()}"
        log = manager.log()
        assert "needs a peer key" in log and "--insecure-no-peer-key" in log, log
        assert not _listening(ports[1])
    finally:
        manager.stop()
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    keyed = CacheManagerProcess(
        "--config", _role_file(tmp_path, role, ports, str(key_file)), ports=ports
    )
    try:
        keyed.wait_ready()
        assert _listening(ports[1])
    finally:
        assert keyed.stop() == 0, keyed.log()


def test_keyed_cache_managers_still_push_to_each_other(tmp_path) -> None:
    """Two sidecars with the same key, as the operator renders a prefill and a decode pod."""
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    sender_ports, receiver_ports = free_ports(3), free_ports(3)
    sender = CacheManagerProcess(
        "--config", _role_file(tmp_path, "prefill", sender_ports, str(key_file)),
        ports=sender_ports,
    )  # fmt: skip
    (tmp_path / "d").mkdir()
    receiver = CacheManagerProcess(
        "--config", _role_file(tmp_path / "d", "decode", receiver_ports, str(key_file)),
        ports=receiver_ports,
    )  # fmt: skip
    source, target = Segment(seed=1), Segment(seed=2)
    try:
        sender.wait_ready()
        receiver.wait_ready()
        prefill, decode = FakeEngine(sender), FakeEngine(receiver)
        prefill.hello(source)
        decode.hello(target)
        done = prefill.reserved_push(decode, "r1", [1, 2], receiver.kv_address, [5, 6])
        assert done.ok, (done, sender.log(), receiver.log())
        assert np.array_equal(target.block(6), source.block(2))
        prefill.close()
        decode.close()
    finally:
        assert sender.stop() == 0 and receiver.stop() == 0
        source.remove()
        target.remove()
