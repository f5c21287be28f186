"""How KV blocks travel between cache managers: a pluggable transport, chosen by name.

A transport has two halves. The *sender* (``KVSender.send``) delivers the parts of one push (a
header and a buffer of block data each, produced lazily so the next part is gathered while the
previous one travels) to a peer and returns once the peer acknowledged the push, or raises
``TransferError`` (``PeerRefused`` when the peer answered no, ``TransferExpired`` when the push's
deadline passed first: neither says the peer is down). The *receiver* (``KVReceiver``) listens
on the KV transfer port and hands every arriving ``(peer, header, data)`` to a handler of the
cache manager, which checks and stores the blocks and returns the ``TransferAck`` to send back
(None: no answer yet). The transport moves bytes; what they mean is the cache manager's
business, so RDMA/NIXL-style transports can be added next to ``tcp`` with the same two methods.

``tcp`` (ZMQ): the sender keeps one DEALER per destination and sends each part as its own
message ``[header, data]`` with ``copy=False`` (ZMQ starts writing part k while part k+1 is
gathered); the receiver is a ROUTER receiving without copies and answering one ``TransferAck``
frame per push. A DEALER whose
peer timed out or failed is closed with linger 0 (queued data dropped) and made anew next time;
a sender keeps at most ``MAX_SOCKETS`` (the least recently used goes first).
With a peer key a sender must first prove it holds the key when it connects
(``peer_auth.gate_server``: an unauthenticated peer is dropped at the handshake, before it can
send a single message), then every part travels as ``[header, data, seal]`` and every answer as
``[ack, seal]`` (``peer_auth.PeerAuth``: one HMAC over the header and the data); a part without a
valid, fresh seal is counted and dropped unanswered (no KV is written), an answer without one
fails the push. The receiver drops a connection that sends a frame over ``MAX_KV_FRAME_BYTES``
(libzmq refuses it before buffering it), and a sender refuses to build such a part.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np
import zmq

from ketch.engine.cache_manager.protocol import (
    TransferAck,
    TransferHeader,
    decode,
    encode,
)
from ketch.engine.peer_auth import PeerAuth, gate_client, gate_server, ungate
from ketch.engine.wire import BadMessages

logger = logging.getLogger("ketch.cache_manager.transport")

ReceiveHandler = Callable[[bytes, TransferHeader, memoryview], TransferAck | None]
"""Checks and stores one part (peer identity, header, data); runs on the receiver's thread."""

Parts = Iterable[tuple[TransferHeader, np.ndarray]]
"""The parts of one push, in order; the data must stay untouched until ``send`` returns."""

_POLL_MS = 100
MAX_SOCKETS = 64  # DEALERs one sender keeps open (one per recent destination)
PUSH = b"ketch kv-transfer push v1"  # channel labels of peer_auth.PeerAuth seals
ACK = b"ketch kv-transfer ack v1"
MAX_KV_FRAME_BYTES = 1 << 30
"""The largest frame a KV transfer port takes: a part's data is one or more whole layers of the
pushed blocks (``segment.layer_ranges``), so this allows one layer of 16 384 blocks of 64 KiB."""


class TransferError(Exception):
    """A push did not reach its peer (or the peer refused it); the message says why."""


class PeerRefused(TransferError):
    """The peer answered, and refused the blocks (it is reachable)."""


class TransferExpired(TransferError):
    """The push's deadline passed before the peer acknowledged it; the rest was not sent."""


class KVSender(ABC):
    """Sends block data to peers; used from one thread only."""

    @abstractmethod
    def send(self, dest: str, parts: Parts, deadline: float | None = None) -> None:
        """Delivers the parts (C-contiguous data) to ``dest`` ("host:port") and waits for the
        push's acknowledgement, at most until ``deadline`` (``time.monotonic()``); raises
        TransferError."""

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Receives block data from peers on its own thread, bound when constructed."""

    @abstractmethod
    def start(self, handler: ReceiveHandler) -> None: ...

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...


class KVTransport(ABC):
    """A named way to move KV blocks: makes the sender and the (bound) receiver."""

    name: str

    @abstractmethod
    def sender(self, timeout: float) -> KVSender: ...

    key: bytes | None = None
    """The peer key both halves seal and check every message with (None: trusted network)."""

    @abstractmethod
    def receiver(self, host: str, port: int) -> KVReceiver:
        """Binds ``host:port``; raises OSError-like ValueError if the port is taken."""


def parse_dest(dest: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> (host, port); raises ValueError naming ``dest``."""
    host, sep, port = str(dest).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"push destination {dest!r} is not 'host:port'")
    return host, int(port)


class TcpSender(KVSender):
    """One DEALER per destination; waits for the TransferAck up to ``timeout`` seconds."""

    def __init__(self, context: zmq.Context, timeout: float, key: bytes | None = None) -> None:
        self._context = context
        self._timeout_ms = int(timeout * 1000)
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._key = key
        self._auth = PeerAuth(key) if key else None

    def _socket(self, dest: str) -> zmq.Socket:
        sock = self._sockets.get(dest)
        if sock is not None:
            self._sockets.move_to_end(dest)
        else:
            host, port = parse_dest(dest)
            while len(self._sockets) >= MAX_SOCKETS:
                self._drop(next(iter(self._sockets)))
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            gate_client(sock, self._key, PUSH)
            address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
            self._sockets[dest] = sock
        return sock

    def _drop(self, dest: str) -> None:
        sock = self._sockets.pop(dest, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, dest: str, parts: Parts, deadline: float | None = None) -> None:
        try:
            sock = self._socket(dest)
        except (ValueError, zmq.ZMQError) as exc:
            raise TransferError(f"cannot connect to peer {dest}: {exc}") from exc
        request_id = None
        ack = None
        try:
            for header, data in parts:
                request_id = header.request_id
                if deadline is not None and time.monotonic() >= deadline:
                    self._drop(dest)  # the parts already queued go with the socket
                    raise TransferExpired(
                        f"the request's deadline passed after {header.part} of {header.parts} "
                        f"parts; the push to {dest} was abandoned"
                    )
                head = encode(header)
                sock.send(head, zmq.SNDMORE)
                if self._auth is None:
                    sock.send(data, copy=False)
                else:
                    sock.send(data, zmq.SNDMORE, copy=False)
                    sock.send(self._auth.seal(PUSH, head, data))
                if sock.poll(0, zmq.POLLIN):  # an early answer: a part was refused
                    ack = self._answer(sock, dest, request_id)
                    if ack is not None:
                        break
            waited_until = time.monotonic() + self._timeout_ms / 1000
            while ack is None:
                until = waited_until if deadline is None else min(waited_until, deadline)
                if not sock.poll(max(0, int((until - time.monotonic()) * 1000)), zmq.POLLIN):
                    self._drop(dest)
                    if until < waited_until:
                        raise TransferExpired(
                            f"the request's deadline passed before peer {dest} acknowledged "
                            "the push"
                        )
                    raise TransferError(
                        f"peer {dest} did not acknowledge within {self._timeout_ms / 1000:g} s "
                        "(is its cache manager running, its --kv-transfer-port reachable and its "
                        "peer key the same?)"
                    )
                ack = self._answer(sock, dest, request_id)
        except zmq.ZMQError as exc:
            self._drop(dest)
            raise TransferError(f"sending to peer {dest} failed: {exc}") from exc
        if not ack.ok:
            raise PeerRefused(f"peer {dest} refused the blocks: {ack.error}")

    def _answer(self, sock: zmq.Socket, dest: str, request_id: str | None) -> TransferAck | None:
        """Reads one answer: the push's TransferAck, or None for a stale one (dropped)."""
        frames = sock.recv_multipart()
        if self._auth is not None:
            error = "no seal" if len(frames) != 2 else self._auth.check(ACK, frames[:1], frames[1])
            if error is not None:
                self._drop(dest)
                raise TransferError(f"peer {dest} answered without a valid seal: {error}")
        try:
            ack = decode(frames[0] if self._auth is not None else frames[-1])
        except ValueError as exc:
            self._drop(dest)
            raise TransferError(f"peer {dest} answered garbage: {exc}") from exc
        if isinstance(ack, TransferAck) and ack.request_id == request_id:
            return ack
        logger.debug("peer %s: dropping a stale answer %r", dest, ack)
        return None

    def close(self) -> None:
        for dest in list(self._sockets):
            self._drop(dest)


class TcpReceiver(KVReceiver):
    """A ROUTER on ``host:port``, served by its own thread."""

    def __init__(
        self, context: zmq.Context, host: str, port: int, key: bytes | None = None
    ) -> None:
        self._auth = PeerAuth(key) if key else None
        self.bad_messages = BadMessages("cache manager kv-transfer")
        self._context = context
        self._sock = context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a bigger frame (and the connection that sent it) before buffering it.
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_KV_FRAME_BYTES)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._zap_domain = gate_server(self._sock, key, PUSH)
        bind_host = "*" if host in ("0.0.0.0", "::") else host
        bind_host = f"[{bind_host}]" if ":" in bind_host else bind_host
        try:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            ungate(context, self._zap_domain)
            raise ValueError(f"--kv-transfer-port {port} on {host} is not free: {exc}") from exc
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, handler: ReceiveHandler) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(handler,), name="kv-receiver", daemon=True
        )
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, handler: ReceiveHandler) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(copy=False)
                if self._auth is not None and not self._authentic(self._auth, frames):
                    continue
                answer = self._answer(frames, handler)
                if answer is not None:
                    ack = encode(answer)
                    seal = [self._auth.seal(ACK, ack)] if self._auth is not None else []
                    sock.send_multipart([frames[0].bytes, ack, *seal])
        finally:
            sock.close(linger=0)

    def _authentic(self, auth: PeerAuth, frames: list[zmq.Frame]) -> bool:
        """Whether ``[identity, header, data, seal]`` carries a valid, fresh seal; the seal is
        removed. A refused part is counted and dropped: nothing is stored or answered."""
        if len(frames) != 4:
            error = f"{len(frames) - 1} frames instead of header, data and seal"
        else:
            error = auth.check(PUSH, [f.buffer for f in frames[1:3]], frames[3].buffer)
        if error is not None:
            self.bad_messages.note("a kv-transfer peer", error)
            return False
        del frames[3]
        return True

    @staticmethod
    def _answer(frames: list[zmq.Frame], handler: ReceiveHandler) -> TransferAck | None:
        if len(frames) != 3:
            logger.warning("malformed KV transfer: %d frames instead of 2", len(frames) - 1)
            error = f"expected 2 frames (header, data), got {len(frames) - 1}"
            return TransferAck("", False, error)
        try:
            header = decode(frames[1].bytes)
        except ValueError as exc:
            logger.warning("malformed KV transfer header: %s", exc)
            return TransferAck("", False, str(exc))
        if not isinstance(header, TransferHeader):
            name = type(header).__name__
            logger.warning("KV transfer port got a %s instead of a TransferHeader", name)
            return TransferAck("", False, f"expected a TransferHeader, got {name}")
        try:
            return handler(frames[0].bytes, header, frames[2].buffer)
        except Exception as exc:  # a bug in handling one transfer must not end the receiver
            logger.exception("storing KV transfer %s failed", header.request_id)
            return TransferAck(str(header.request_id), False, f"internal error: {exc}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        else:
            self._sock.close(linger=0)
        ungate(self._context, self._zap_domain)


class TcpTransport(KVTransport):
    """ZMQ over TCP (the default; works anywhere pods can reach each other)."""

    name = "tcp"

    def __init__(self, context: zmq.Context, key: bytes | None = None) -> None:
        self._context = context
        self.key = key

    def sender(self, timeout: float) -> KVSender:
        return TcpSender(self._context, timeout, self.key)

    def receiver(self, host: str, port: int) -> KVReceiver:
        return TcpReceiver(self._context, host, port, self.key)


TRANSPORTS: dict[str, Callable[[zmq.Context, bytes | None], KVTransport]] = {"tcp": TcpTransport}


def make_transport(name: str, context: zmq.Context, key: bytes | None = None) -> KVTransport:
    try:
        return TRANSPORTS[name](context, key)
    except KeyError:
        known = sorted(TRANSPORTS)
        raise ValueError(f"--kv-transport {name!r} is unknown; choose from {known}") from None
