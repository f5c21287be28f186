"""A TCP forwarder that can hold back one side's ZMQ messages: a network that delays a push.

``HeldLink(port)`` listens on a port of its own and forwards every connection to ``upstream``
(set before the first connection). Each connection is a ZMTP stream: the client's greeting and
handshake command always pass (so the ZMQ sockets on both ends connect), and after them, while
the connection is held, the client's bytes (its messages) stay here, in order; ``release()``
delivers them. The server's bytes always pass. A held connection whose client closed meanwhile
is delivered on release too, then closed a moment later: the server gets the messages as if
they had been stuck in the network.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from procs import free_ports

_GREETING = 64  # ZMTP 3 greeting; the NULL mechanism's READY command follows it
_CLOSE_AFTER_S = 2.0  # a delivered connection whose client is gone closes this much later


class _Handshake:
    """Tells which leading bytes of a client stream are its greeting and READY command."""

    def __init__(self) -> None:
        self._state, self._need, self._size = "greeting", _GREETING, b""

    @property
    def done(self) -> bool:
        return self._state == "done"

    def split(self, data: bytes) -> tuple[bytes, bytes]:
        """``data`` as (handshake bytes, message bytes)."""
        head = bytearray()
        while data and not self.done:
            take, data = data[: self._need], data[self._need :]
            head += take
            self._need -= len(take)
            if self._need == 0:
                self._advance(take)
        return bytes(head), data

    def _advance(self, last: bytes) -> None:
        if self._state == "greeting":
            self._state, self._need = "flags", 1
        elif self._state == "flags":  # bit 1: an 8-byte size follows, else a 1-byte one
            self._state, self._need, self._size = "size", 8 if last[0] & 0x02 else 1, b""
        elif self._state == "size":
            self._size += last
            self._state, self._need = "body", int.from_bytes(self._size, "big")
            if self._need == 0:
                self._state = "done"
        else:
            self._state = "done"


class _Connection:
    def __init__(self, client: socket.socket, upstream: socket.socket, held: bool) -> None:
        self.client, self.upstream = client, upstream
        self.lock = threading.Lock()
        self.held = held
        self.kept = bytearray()
        self.client_closed = False
        self.handshake = _Handshake()

    def up(self) -> None:
        """Client -> server: the handshake at once, then messages unless held."""
        with contextlib.suppress(OSError):
            while data := self.client.recv(1 << 16):
                with self.lock:
                    head, rest = self.handshake.split(data)
                    if head:
                        self.upstream.sendall(head)
                    if self.held:
                        self.kept += rest
                    elif rest:
                        self.upstream.sendall(rest)
        with self.lock:
            self.client_closed = True
            if not self.held:
                self._close_upstream_later()

    def down(self) -> None:
        """Server -> client, always (to a client that went away: dropped)."""
        with contextlib.suppress(OSError):
            while data := self.upstream.recv(1 << 16):
                with contextlib.suppress(OSError):
                    self.client.sendall(data)
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.close()

    def release(self) -> None:
        with self.lock:
            self.held = False
            with contextlib.suppress(OSError):
                self.upstream.sendall(bytes(self.kept))
            self.kept.clear()
            if self.client_closed:
                self._close_upstream_later()

    def hold(self) -> None:
        with self.lock:
            self.held = True

    def _close_upstream_later(self) -> None:
        def close() -> None:
            time.sleep(_CLOSE_AFTER_S)
            with contextlib.suppress(OSError):
                self.upstream.shutdown(socket.SHUT_WR)

        threading.Thread(target=close, daemon=True).start()


class HeldLink:
    """Forwards connections on ``port`` to ``upstream``; ``hold_next``/``hold_all``/``release``."""

    def __init__(self) -> None:
        (self.port,) = free_ports(1)
        self.upstream: int | None = None
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._hold_next = self._hold_all = False
        threading.Thread(target=self._accept, name="held-link", daemon=True).start()

    def hold_next(self) -> None:
        """The next connection made is held (those open now are not)."""
        with self._lock:
            self._hold_next = True

    def hold_all(self) -> None:
        """Every connection, open now or made until ``release``, is held."""
        with self._lock:
            self._hold_all = True
            for connection in self._connections:
                connection.hold()

    def release(self) -> None:
        with self._lock:
            self._hold_next = self._hold_all = False
            for connection in self._connections:
                connection.release()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(c.kept) for c in self._connections)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for connection in self._connections:
                for sock in (connection.client, connection.upstream):
                    with contextlib.suppress(OSError):
                        sock.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                assert self.upstream is not None, "HeldLink.upstream is not set"
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
                with self._lock:
                    held = self._hold_next or self._hold_all
                    self._hold_next = False
                    connection = _Connection(client, upstream, held)
                    self._connections.append(connection)
                threading.Thread(target=connection.up, daemon=True).start()
                threading.Thread(target=connection.down, daemon=True).start()
