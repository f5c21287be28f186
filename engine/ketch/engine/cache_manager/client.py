"""The engine process's link to its cache manager (``ketch cache-manager``), which is optional.

The engine connects a DEALER to the cache manager's ROUTER on the Unix socket
``cache-<cache_queue_port>.sock`` in the private run directory (``ketch.engine.rundir``)
and says ``Hello`` with its KV layout every second until answered; once attached it pings every
second and detaches after ``SILENCE_S`` without a word (the sidecar died or restarted), which
drops the swap tier. Nothing here blocks the step loop for long: ``tick`` never waits; ``swap``
waits at most ``SWAP_TIMEOUT_S`` for plain memory copies and detaches if that passes.

Revokes (decode role) are a barrier the engine waits on without blocking: ``revoke`` queues the
request ids, sends them when attached (at once, again every ``REVOKE_RESEND_S`` until answered,
and on every (re-)attach, so one issued or lost while detached is replayed), and
``take_revoked`` reports those the cache manager confirmed with ``Revoked``: nothing more lands
in their blocks. A re-attach also drops, at the cache manager, every reservation made before.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import zmq

from ketch.engine import rundir
from ketch.engine.cache_manager.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    KVLayout,
    Ping,
    Pong,
    Push,
    PushDone,
    Reserve,
    Reserved,
    Revoke,
    Revoked,
    Swap,
    SwapDone,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

HELLO_INTERVAL_S = 1.0
SILENCE_S = 3.0
SWAP_TIMEOUT_S = 5.0
REVOKE_RESEND_S = 1.0  # an unanswered Revoke is sent again this often (while attached)
REVOKE_BATCH = 1024  # request ids per Revoke message
MAX_REVOKING = 1 << 16  # unanswered revokes kept (the oldest is forgotten first): a bound


class CacheManagerClient:
    """Attach/detach, swaps (synchronous) and pushes (asynchronous) for one engine process."""

    def __init__(
        self,
        port: int,
        layout: KVLayout,
        on_attach: Callable[[int], None],
        on_detach: Callable[[str], None],
    ) -> None:
        """``on_attach(swap_slots)`` runs when a cache manager (re)attaches; ``on_detach(why)``
        when it goes; pushes in flight are then lost (``take_push_results`` won't report them)."""
        self.layout = layout
        self.engine_id = uuid.uuid4().hex
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # send nothing while no cache manager listens
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(rundir.cache_queue_address(port))
        self.port = port
        self.cache_manager_id: str | None = None
        self.swap_slots = 0
        self._on_attach = on_attach
        self._on_detach = on_detach
        self._last_heard = 0.0
        self._last_sent = 0.0
        self._seq = 0
        self._push_results: list[PushDone] = []
        self._reserved: list[Reserved] = []
        # Revokes not confirmed yet: request id -> when last sent (0: not since (re-)attach).
        self._revoking: dict[str, float] = {}
        self._revoked: list[str] = []
        self._next_revoke_send = 0.0
        self._last_error: str | None = None

    @property
    def attached(self) -> bool:
        return self.cache_manager_id is not None

    def tick(self) -> None:
        """Handles whatever arrived and keeps the link alive; never blocks."""
        while self.socket.poll(0):
            self._handle(self.socket.recv())
        now = time.monotonic()
        if self.attached and now - self._last_heard > SILENCE_S:
            self._detach(f"the cache manager was silent for {SILENCE_S:.0f} s")
        # Only messages answered at once count: a steady stream of Reserve/Revoke must not
        # hold back the pings that keep the link alive.
        if now - self._last_sent >= HELLO_INTERVAL_S:
            if self.attached:
                self._send(Ping(self.engine_id))
            else:
                self._send(Hello(self.engine_id, PROTOCOL_VERSION, self.layout))
        if self._revoking and now >= self._next_revoke_send:
            self._send_revokes(now)

    def swap(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> bool:
        """Copies blocks out to swap slots, then slots into blocks; True once confirmed."""
        if not self.attached:
            return False
        self._seq += 1
        seq = self._seq
        if not self._send(Swap(seq, out, into)):
            return False
        deadline = time.monotonic() + SWAP_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                continue
            message = self._handle(self.socket.recv())
            if isinstance(message, SwapDone) and message.seq == seq:
                if not message.ok:
                    logger.warning("the cache manager refused a swap: %s", message.error)
                return message.ok
        self._detach(f"the cache manager did not answer a swap within {SWAP_TIMEOUT_S:.0f} s")
        return False

    def push(
        self,
        request_id: str,
        blocks: list[int],
        dest: str,
        dest_blocks: list[int],
        dest_engine_id: str = "",
        dest_nonce: str = "",
        expires_at: float = 0.0,
    ) -> bool:
        """Asks the cache manager to send blocks to a peer, not after ``expires_at`` (wall
        clock; 0: no deadline); the result comes through ``take_push_results``. False if it
        could not even be asked."""
        message = Push(
            request_id, blocks, dest, dest_blocks, dest_engine_id, dest_nonce, expires_at
        )
        return self.attached and self._send(message)

    def reserve(self, request_id: str, blocks: list[int], nonce: str, ttl: float) -> bool:
        """Lets a peer that shows ``nonce`` write ``blocks`` for ``request_id`` (decode role)."""
        return self.attached and self._send(Reserve(request_id, blocks, nonce, ttl))

    def revoke(self, request_ids: list[str]) -> None:
        """Ends reservations; their blocks may be freed once ``take_revoked`` names them.
        Sent now if attached, else on the next attach; repeated until answered."""
        if not request_ids:
            return
        for request_id in request_ids:
            self._revoking.pop(request_id, None)
            self._revoking[request_id] = 0.0
        while len(self._revoking) > MAX_REVOKING:
            forgotten = next(iter(self._revoking))
            del self._revoking[forgotten]
            logger.warning("too many unanswered revokes: %s is not waited for", forgotten)
        if self.attached:
            self._send_revokes(time.monotonic(), request_ids)

    def take_revoked(self) -> list[str]:
        """The request ids whose revoke the cache manager confirmed since the last call."""
        answers, self._revoked = self._revoked, []
        return answers

    def take_reserved(self) -> list[Reserved]:
        """The cache manager's answers to ``reserve`` since the last call."""
        answers, self._reserved = self._reserved, []
        return answers

    def take_push_results(self) -> list[PushDone]:
        results, self._push_results = self._push_results, []
        return results

    def close(self) -> None:
        self.socket.close(linger=0)

    def _send_revokes(self, now: float, request_ids: list[str] | None = None) -> None:
        """Sends ``request_ids`` (default: every revoke not sent within REVOKE_RESEND_S)."""
        if request_ids is None:
            self._next_revoke_send = now + REVOKE_RESEND_S
        if not self.attached:
            return
        if request_ids is None:
            due = [r for r, sent in self._revoking.items() if now - sent >= REVOKE_RESEND_S]
        else:
            due = [r for r in request_ids if r in self._revoking]
        for start in range(0, len(due), REVOKE_BATCH):
            batch = due[start : start + REVOKE_BATCH]
            if not self._send(Revoke(batch)):
                return  # no cache manager connected: tried again later
            for request_id in batch:
                self._revoking[request_id] = now

    def _send(self, message: object) -> bool:
        try:
            self.socket.send(encode(message), zmq.NOBLOCK)  # type: ignore[arg-type]
        except zmq.Again:
            return False  # no cache manager connected
        if not isinstance(message, Reserve | Revoke):
            self._last_sent = time.monotonic()
        return True

    def _handle(self, data: bytes) -> object | None:
        try:
            message = decode(data)
        except ValueError as exc:
            logger.warning("ignoring a malformed message from the cache manager: %s", exc)
            return None
        self._last_heard = time.monotonic()
        if isinstance(message, HelloAck):
            self._attach(message)
        elif isinstance(message, Pong) and message.cache_manager_id != self.cache_manager_id:
            self._detach("the cache manager restarted")  # a new one: say Hello again
        elif isinstance(message, PushDone):
            self._push_results.append(message)
        elif isinstance(message, Reserved):
            # One that comes while detached was dropped by the Hello that re-attaches.
            if self.attached:
                self._reserved.append(message)
        elif isinstance(message, Revoked):  # confirmed whatever the link's state
            for request_id in message.request_ids:
                if self._revoking.pop(request_id, None) is not None:
                    self._revoked.append(request_id)
        return message

    def _attach(self, ack: HelloAck) -> None:
        if ack.error:
            if ack.error != self._last_error:
                logger.error("the cache manager refused to attach: %s", ack.error)
                self._last_error = ack.error
            return
        if ack.cache_manager_id == self.cache_manager_id:
            return  # a late answer to a repeated Hello
        if self.attached:
            self._detach("the cache manager restarted")
        self.cache_manager_id = ack.cache_manager_id
        self.swap_slots = ack.swap_slots
        self._last_error = None
        self._reserved.clear()  # answers from before this Hello: those reservations are gone
        logger.info(
            "cache manager attached on port %d: %d host swap slots (%.1f MiB)",
            self.port,
            ack.swap_slots,
            ack.swap_slots * self.layout.block_bytes / 2**20,
        )
        self._on_attach(ack.swap_slots)
        if self._revoking:  # replayed: issued while detached, or lost with the last link
            logger.info("replaying %d revokes to the cache manager", len(self._revoking))
            for request_id in self._revoking:
                self._revoking[request_id] = 0.0
            self._send_revokes(time.monotonic())

    def _detach(self, why: str) -> None:
        if not self.attached:
            return
        logger.warning("cache manager detached: %s; host swap and KV transfer are off", why)
        self.cache_manager_id = None
        self.swap_slots = 0
        self._push_results.clear()
        self._reserved.clear()
        self._on_detach(why)
