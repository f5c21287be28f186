"""Prefill/decode messaging for one engine process: the pd-comm sockets and their dispatch.

Every prefill or decode engine binds a ROUTER on ``host:pd_comm_port``: a prefill engine gets
``PrefillRequest``/``AbortPrefill``/``PdPing`` there from decode engines; a decode engine only
answers pings on it (so either role can be probed). A decode engine reaches each prefill peer
through its own DEALER, created on first use, and gets the answers back on it.

With a peer key (``--peer-key-file`` or ``$KETCH_PEER_KEY``; these roles refuse to start without
one unless ``--insecure-no-peer-key``) a peer must first prove it holds the key when it connects
(``peer_auth.gate_server``: until then it can send no message), and every message, both ways,
travels as ``[message, seal]`` (see ``peer_auth.PeerAuth``); one without a valid, fresh seal is
counted and dropped unanswered. Without a key a message is one frame and any peer is trusted.

The engine's step loop handles at most ``MAX_MESSAGES_PER_TICK`` messages per socket per tick:
a flood of (even sealed) messages delays its own handling, never the decoding of running
requests for longer than that.
"""

from __future__ import annotations

import contextlib
import logging
import time

import zmq

from ketch.engine.cache_manager.client import CacheManagerClient
from ketch.engine.core.request import Request
from ketch.engine.disagg.decode import DecodeSide, PairingTimeouts
from ketch.engine.disagg.messages import (
    MAX_PD_MESSAGE_BYTES,
    AbortPrefill,
    PdMessage,
    PdPing,
    PdPong,
    PrefillRequest,
    decode,
    encode,
)
from ketch.engine.disagg.prefill import PrefillSide
from ketch.engine.outputs import TokenDelta
from ketch.engine.peer_auth import PeerAuth, gate_client, gate_server, require_peer_key, ungate
from ketch.engine.serving.config import ServerConfig
from ketch.engine.stats import RequestMetrics
from ketch.engine.wire import BadMessages

logger = logging.getLogger(__name__)

TO_ROUTER = b"ketch pd-comm to-router v1"  # channel labels of peer_auth.PeerAuth seals
FROM_ROUTER = b"ketch pd-comm from-router v1"

MAX_PEERS = 64  # prefill peers a decode engine keeps a socket to at once
MAX_MESSAGES_PER_TICK = 64  # per socket; the rest wait for the next tick (the socket stays ready)
PEER_IDLE_S = 60.0  # a peer no request has used for this long loses its socket


class PeerLimitError(ValueError):
    """Too many prefill peers at once: the request is refused (503), nothing is opened."""

    status_code = 503


class PDCoordinator:
    """The pd-comm endpoint of a prefill or decode engine."""

    def __init__(
        self, engine, config: ServerConfig, cache: CacheManagerClient | None
    ) -> None:  # engine: LLMEngine
        self.role = config.role
        self._context = zmq.Context.instance()
        self.router = self._context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # libzmq drops a bigger frame (and the connection that sent it) before it is buffered.
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_PD_MESSAGE_BYTES)
        self.bad_messages = BadMessages(f"{self.role} pd-comm")
        try:
            key = require_peer_key(
                config.peer_key_file, config.insecure_no_peer_key, f"the {self.role} role"
            )
        except ValueError:
            self.router.close()
            raise
        self._key = key
        self.auth = PeerAuth(key) if key else None
        if key is None:
            logger.warning(
                "%s role without a peer key (--insecure-no-peer-key): pd-comm accepts "
                "messages from anyone who reaches port %d; trusted networks only",
                self.role, config.pd_comm_port,
            )  # fmt: skip
        # Unauthenticated peers are dropped at the handshake, before they can send a message.
        self._zap_domain = gate_server(self.router, key, TO_ROUTER)
        try:
            self.router.bind(f"tcp://{config.host}:{config.pd_comm_port}")
        except zmq.ZMQError as exc:
            self.router.close()
            ungate(self._context, self._zap_domain)
            raise ValueError(f"--pd-comm-port {config.pd_comm_port} is not free: {exc}") from exc
        self._peers: dict[str, zmq.Socket] = {}
        self._peer_of: dict[zmq.Socket, str] = {}
        self._peer_used: dict[str, float] = {}  # peer -> when a request last used it
        # Sockets the engine loop must stop polling; it closes them (see take_retired_sockets).
        self.retired_sockets: list[zmq.Socket] = []
        # Sockets the engine loop has not polled yet: the ROUTER, then each peer's DEALER.
        self.new_sockets: list[zmq.Socket] = [self.router]
        self.prefill = PrefillSide(engine, self._reply, cache) if self.role == "prefill" else None
        self.decode: DecodeSide | None = None
        if self.role == "decode":
            self.decode = DecodeSide(
                engine,
                self._send,
                PairingTimeouts(
                    config.pd_block_timeout, config.pd_peer_timeout, config.pd_request_timeout
                ),
                f"{config.kv_transfer_address_host()}:{config.kv_transfer_port}",
                cache,
            )
        self.cache = cache
        logger.info("%s role: pd-comm on %s:%d", self.role, config.host, config.pd_comm_port)

    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *self._peers.values()]

    def take_new_sockets(self) -> list[zmq.Socket]:
        new, self.new_sockets = self.new_sockets, []
        return new

    def take_retired_sockets(self) -> list[zmq.Socket]:
        retired, self.retired_sockets = self.retired_sockets, []
        return retired

    @property
    def num_waiting(self) -> int:
        """Requests here outside the engine's queues: a decode instance's waiting for their
        prefill, a prefill instance's whose KV is on its way (a drain waits for both)."""
        if self.prefill is not None:
            return self.prefill.num_pushing
        return self.decode.num_waiting if self.decode else 0

    def add_remote(self, request: Request, prefill_peer: str) -> None:
        if self.decode is None:
            raise ValueError("only a decode instance takes requests with a prefill peer")
        # A request not yet sent has no socket, but will open one: its peer counts already.
        if self._over_peer_limit(prefill_peer):
            self._retire_idle(0.0)
            if self._over_peer_limit(prefill_peer):
                raise PeerLimitError(
                    f"this decode instance already talks to {MAX_PEERS} prefill instances; "
                    "retry shortly"
                )
        self._peer_used[prefill_peer] = time.monotonic()
        self.decode.add(request, prefill_peer)

    def _over_peer_limit(self, prefill_peer: str) -> bool:
        """Whether a request for ``prefill_peer`` would make more than MAX_PEERS peers (those with a
        socket and those a waiting request will open one to)."""
        peers = set(self._peers) | (self.decode.peers_in_use() if self.decode else set())
        return prefill_peer not in peers and len(peers) >= MAX_PEERS

    def abort(self, request_ids: list[str]) -> list[RequestMetrics]:
        return self.decode.abort(request_ids) if self.decode else []

    def on_cache_detached(self) -> None:
        if self.prefill is not None:
            self.prefill.on_cache_detached()

    def on_step_outputs(self, outputs: list[TokenDelta]) -> None:
        if self.prefill is not None:
            self.prefill.on_step_outputs(outputs)

    def tick(self) -> tuple[list[TokenDelta], list[TokenDelta]]:
        """Handles what arrived, timeouts and reservations; returns deltas and errors for the
        API server."""
        for _ in range(MAX_MESSAGES_PER_TICK):
            if not self.router.poll(0):
                break
            identity, *frames = self.router.recv_multipart()
            data = self._opened(frames, TO_ROUTER, "a pd-comm peer")
            if data is not None:
                self._on_router(identity, data)
        for socket, peer in list(self._peer_of.items()):
            for _ in range(MAX_MESSAGES_PER_TICK):
                if not socket.poll(0):
                    break
                data = self._opened(socket.recv_multipart(), FROM_ROUTER, peer)
                if data is not None:
                    self._on_peer(peer, data)
        if self.prefill is not None and self.cache is not None:
            self.prefill.on_push_results(self.cache.take_push_results())
        if self.prefill is not None:
            self.prefill.tick()
        if self.decode is None:
            return [], []
        self.decode.tick()
        failed, self.decode.failed_peers = self.decode.failed_peers, set()
        self._retire_idle(PEER_IDLE_S, failed)
        outputs, self.decode.outputs = self.decode.outputs, []
        errors, self.decode.errors = self.decode.errors, []
        return outputs, errors

    def close(self) -> None:
        for socket in self.sockets():
            socket.close(linger=0)
        ungate(self._context, self._zap_domain)

    def _opened(self, frames: list[bytes], channel: bytes, peer: str) -> bytes | None:
        """The message of ``frames`` (checked against its seal when there is a key), or None
        (counted) when it is refused."""
        expected = 1 if self.auth is None else 2
        if len(frames) != expected:
            what = "a message and its seal" if self.auth else "1"
            self.bad_messages.note(peer, f"{len(frames)} frames instead of {what}")
            return None
        if self.auth is not None:
            error = self.auth.check(channel, frames[:1], frames[1])
            if error is not None:
                self.bad_messages.note(peer, error)
                return None
        return frames[0]

    def _sealed(self, channel: bytes, message: PdMessage) -> list[bytes]:
        data = encode(message)
        return [data] if self.auth is None else [data, self.auth.seal(channel, data)]

    def _on_router(self, identity: bytes, data: bytes) -> None:
        try:
            message = decode(data)
        except ValueError as exc:
            self.bad_messages.note("a pd-comm peer", exc)
            return
        if isinstance(message, PdPing):
            known = self.prefill.knows if self.prefill else lambda _: False
            unknown = [r for r in message.request_ids if not known(r)]
            self._reply(identity, PdPong(unknown))
        elif self.prefill is None:
            logger.warning("a %s instance got %s; ignored", self.role, type(message).__name__)
        elif isinstance(message, PrefillRequest):
            self.prefill.on_request(identity, message)
        elif isinstance(message, AbortPrefill):
            self.prefill.on_abort(identity, message)

    def _on_peer(self, peer: str, data: bytes) -> None:
        try:
            message = decode(data)
        except ValueError as exc:
            self.bad_messages.note(peer, exc)
            return
        if self.decode is not None:
            self.decode.on_message(peer, message)

    def _reply(self, identity: bytes, message: PdMessage) -> None:
        # A gone peer's messages are dropped by the ROUTER; one not keeping up loses this one.
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([identity, *self._sealed(FROM_ROUTER, message)], zmq.NOBLOCK)

    def _retire_idle(self, idle_s: float, failed: set[str] | None = None) -> None:
        """Closes the sockets of peers no waiting request uses, idle for ``idle_s`` (failed
        ones at once): a peer that failed or went away keeps no socket, nor messages queued
        for when it comes back."""
        if self.decode is None:
            return
        in_use, now, failed = self.decode.peers_in_use(), time.monotonic(), failed or set()
        for peer in [p for p in self._peers if p not in in_use]:
            if peer in failed or now - self._peer_used.get(peer, 0.0) >= idle_s:
                socket = self._peers.pop(peer)
                del self._peer_of[socket]
                self._peer_used.pop(peer, None)
                if socket in self.new_sockets:
                    self.new_sockets.remove(socket)
                    socket.close(linger=0)
                else:
                    self.retired_sockets.append(socket)

    def _send(self, peer: str, message: PdMessage) -> None:
        socket = self._peers.get(peer)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            # No ZMQ_IMMEDIATE: a new socket's first message must wait for its connection.
            # Messages queued for a peer that failed go with its socket (closed, linger 0, as
            # soon as no request uses it); one delivered late is refused (expires_at) or
            # writes nothing (the reservation was revoked).
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_PD_MESSAGE_BYTES)
            gate_client(socket, self._key, TO_ROUTER)
            socket.connect(f"tcp://{peer}")
            self._peers[peer] = socket
            self._peer_of[socket] = peer
            self.new_sockets.append(socket)
        try:
            socket.send_multipart(self._sealed(TO_ROUTER, message), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("the prefill peer %s is not keeping up; message dropped", peer)
