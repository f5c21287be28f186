"""Prefill/decode messaging for one engine process: the pd-comm sockets and their dispatch.

Every prefill or decode engine binds a ROUTER on ``host:pd_comm_port``: a prefill engine gets
``PrefillRequest``/``AbortPrefill``/``PdPing`` there from decode engines; a decode engine only
answers pings on it (so either role can be probed). A decode engine reaches each prefill peer
through its own DEALER, created on first use, and gets the answers back on it.
"""

from __future__ import annotations

import contextlib
import logging

import zmq

from ketch.engine.cache_manager.client import CacheManagerClient
from ketch.engine.core.messages import RequestDelta
from ketch.engine.core.request import Request
from ketch.engine.disagg.decode import DecodeSide
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
from ketch.engine.outputs import RequestOutput
from ketch.engine.serving.config import ServerConfig
from ketch.engine.stats import RequestMetrics
from ketch.engine.wire import BadMessages

logger = logging.getLogger(__name__)


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
            self.router.bind(f"tcp://{config.host}:{config.pd_comm_port}")
        except zmq.ZMQError as exc:
            self.router.close()
            raise ValueError(f"--pd-comm-port {config.pd_comm_port} is not free: {exc}") from exc
        self._peers: dict[str, zmq.Socket] = {}
        self._peer_of: dict[zmq.Socket, str] = {}
        # Sockets the engine loop has not polled yet: the ROUTER, then each peer's DEALER.
        self.new_sockets: list[zmq.Socket] = [self.router]
        self.prefill = PrefillSide(engine, self._reply, cache) if self.role == "prefill" else None
        self.decode: DecodeSide | None = None
        if self.role == "decode":
            self.decode = DecodeSide(
                engine,
                self._send,
                config.pd_block_timeout,
                config.pd_peer_timeout,
                config.kv_transfer_port,
                cache,
            )
        self.cache = cache
        logger.info("%s role: pd-comm on %s:%d", self.role, config.host, config.pd_comm_port)

    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *self._peers.values()]

    def take_new_sockets(self) -> list[zmq.Socket]:
        new, self.new_sockets = self.new_sockets, []
        return new

    @property
    def num_waiting(self) -> int:
        return self.decode.num_waiting if self.decode else 0

    def add_remote(self, request: Request, prefill: str, decode_host: str) -> None:
        if self.decode is None:
            raise ValueError("only a decode instance takes requests with a prefill peer")
        self.decode.add(request, prefill, decode_host)

    def abort(self, request_ids: list[str]) -> list[RequestMetrics]:
        return self.decode.abort(request_ids) if self.decode else []

    def on_cache_detached(self) -> None:
        if self.prefill is not None:
            self.prefill.on_cache_detached()

    def on_step_outputs(self, outputs: list[RequestOutput]) -> None:
        if self.prefill is not None:
            self.prefill.on_step_outputs(outputs)

    def tick(self) -> tuple[list[RequestOutput], list[RequestDelta]]:
        """Handles what arrived, timeouts and reservations; returns outputs and errors for the
        API server."""
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            if len(frames) != 2:  # [peer identity, message]
                self.bad_messages.note("a pd-comm peer", f"{len(frames) - 1} frames instead of 1")
                continue
            self._on_router(*frames)
        for socket, peer in list(self._peer_of.items()):
            while socket.poll(0):
                frames = socket.recv_multipart()
                if len(frames) != 1:
                    self.bad_messages.note(peer, f"{len(frames)} frames instead of 1")
                    continue
                self._on_peer(peer, frames[0])
        if self.prefill is not None and self.cache is not None:
            self.prefill.on_push_results(self.cache.take_push_results())
        if self.decode is None:
            return [], []
        self.decode.tick()
        outputs, self.decode.outputs = self.decode.outputs, []
        errors, self.decode.errors = self.decode.errors, []
        return outputs, errors

    def close(self) -> None:
        for socket in self.sockets():
            socket.close(linger=0)

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
            self.router.send_multipart([identity, encode(message)], zmq.NOBLOCK)

    def _send(self, peer: str, message: PdMessage) -> None:
        socket = self._peers.get(peer)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_PD_MESSAGE_BYTES)
            socket.connect(f"tcp://{peer}")
            self._peers[peer] = socket
            self._peer_of[socket] = peer
            self.new_sockets.append(socket)
        try:
            socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("the prefill peer %s is not keeping up; message dropped", peer)
