"""Prefill peers played by the test: real ROUTER sockets on free loopback ports that a decode
instance connects to, each behaving one way, with a socket monitor telling when the decode
instance connects and when it closes its socket.

One thread serves every peer (ZMQ sockets stay on it); the test reads what they saw.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from ketch.engine.disagg import messages as pd
from procs import free_ports

BEHAVIOURS = ("silent", "refuse", "stall", "forget")
"""silent: never answers; refuse: answers each PrefillRequest with PrefillFailed (400) and
pings with PdPong; stall: answers pings (alive) but never finishes a prefill; forget: answers
pings naming every request as unknown (as a restarted instance does)."""


@dataclass
class FakePrefill:
    behaviour: str
    port: int
    requests: list[tuple[float, pd.PrefillRequest]] = field(default_factory=list)  # (when, msg)
    aborts: list[str] = field(default_factory=list)
    connected: int = 0
    disconnected: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def answer(self, message: pd.PdMessage) -> pd.PdMessage | None:
        if isinstance(message, pd.PrefillRequest):
            self.requests.append((time.time(), message))
            if self.behaviour == "refuse":
                return pd.PrefillFailed(message.request_id, "refused by the test's peer", 400)
        elif isinstance(message, pd.AbortPrefill):
            self.aborts.append(message.request_id)
        elif isinstance(message, pd.PdPing) and self.behaviour in ("refuse", "stall"):
            return pd.PdPong([])
        elif isinstance(message, pd.PdPing) and self.behaviour == "forget":
            return pd.PdPong(list(message.request_ids))
        return None


class FakePrefills:
    """Peers created with ``add``; served until ``close``."""

    def __init__(self) -> None:
        self._context = zmq.Context.instance()
        self._pending: list[FakePrefill] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-prefills", daemon=True)
        self._thread.start()

    def add(self, behaviour: str) -> FakePrefill:
        assert behaviour in BEHAVIOURS, behaviour
        (port,) = free_ports(1)
        peer = FakePrefill(behaviour, port)
        with self._lock:
            self._pending.append(peer)
        deadline = time.monotonic() + 10
        while peer in self._pending:  # bound by the serving thread
            assert time.monotonic() < deadline, "the fake peer was not bound"
            time.sleep(0.01)
        return peer

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        sockets: dict[zmq.Socket, FakePrefill] = {}
        monitors: dict[zmq.Socket, FakePrefill] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._pending = self._pending, []
                for peer in new:
                    sock, monitor = self._bind(peer)
                    sockets[sock], monitors[monitor] = peer, peer
                    poller.register(sock, zmq.POLLIN)
                    poller.register(monitor, zmq.POLLIN)
                for sock, _ in poller.poll(20):
                    if sock in sockets:
                        self._serve(sock, sockets[sock])
                    else:
                        self._note(sock, monitors[sock])
        finally:
            for sock in [*sockets, *monitors]:
                sock.close(linger=0)

    def _bind(self, peer: FakePrefill) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        sock.bind(f"tcp://127.0.0.1:{peer.port}")
        return sock, monitor

    @staticmethod
    def _serve(sock: zmq.Socket, peer: FakePrefill) -> None:
        identity, *frames = sock.recv_multipart()
        answer = peer.answer(pd.decode(frames[0])) if len(frames) == 1 else None
        if answer is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([identity, pd.encode(answer)], zmq.NOBLOCK)

    @staticmethod
    def _note(monitor: zmq.Socket, peer: FakePrefill) -> None:
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_ACCEPTED:
            peer.connected += 1
        elif event == zmq.EVENT_DISCONNECTED:
            peer.disconnected += 1


@contextlib.contextmanager
def fake_prefills() -> Iterator[FakePrefills]:
    peers = FakePrefills()
    try:
        yield peers
    finally:
        peers.close()
