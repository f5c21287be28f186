"""The cache manager's main loop: serve the engine's cache queue, push and receive KV blocks.

Threads (ZMQ sockets never cross them):

- main: a ROUTER on the run directory's ``cache-<cache_queue_port>.sock`` for the engine (Hello,
  Ping, Swap, Push, Reserve, Revoke) and a PULL on an inproc address where the senders post
  finished pushes. Swaps are done here, at once (the engine waits on them inside its step loop).
  A ``Revoke`` is answered (``Revoked``) once no part of a push is being stored into its
  blocks; while one is, the answer waits (polled every ``_REVOKE_POLL_MS``), never the loop.
- senders (``push.Pusher``): a few threads that take pushes from per-destination queues, in
  turn, gather the blocks and send them with the transport, a few layers per part (the next
  part is gathered while the last one travels); so a slow or dead peer never delays the
  engine's swaps, nor (beyond its own bounded queue and circuit breaker) pushes to other peers.
- receiver (the transport's): stores blocks arriving from peers into the attached engine's cache
  (``receive.TransferReceiver``). Prefill and decode roles only: a mixed instance's cache manager
  binds no KV transfer port (nothing would use it; it would only be one more open port).
- http: ``/health`` and ``/metrics``.

The engine decides everything (blocks, slots, destinations); this process copies, checks the
indices and reports. Nothing a peer or the engine sends can crash it: bad input is answered
with an error and logged.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from typing import Any

import zmq

from ketch.engine import rundir
from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.config import CacheManagerConfig
from ketch.engine.cache_manager.http import HttpEndpoint
from ketch.engine.cache_manager.metrics import CacheManagerMetrics
from ketch.engine.cache_manager.push import Pusher, PushJob, PushSettings
from ketch.engine.cache_manager.receive import TransferReceiver
from ketch.engine.cache_manager.reservations import Reservations
from ketch.engine.cache_manager.segment import Attachment, bad_blocks, map_segment
from ketch.engine.cache_manager.swap import SwapStore
from ketch.engine.cache_manager.transport import MAX_KV_FRAME_BYTES, make_transport, parse_dest
from ketch.engine.peer_auth import require_peer_key

logger = logging.getLogger("ketch.cache_manager")

ENGINE_SILENCE_S = 5.0
"""An engine that sent nothing for this long is detached (its mapping dropped)."""
_POLL_MS = 100
_REVOKE_POLL_MS = 1  # while a revoke waits for a part being stored (a memory copy)
# SIGTERM waits this long for queued KV pushes (a pod's grace period is 30 s by default).
DRAIN_TIMEOUT_S = 60.0
ENGINE_GONE_AFTER_S = 2.5  # an attached engine pings every second
_DONE_ADDRESS = "inproc://ketch-cache-manager-push-done"


class CacheManager:
    """One cache-manager process: construct (binds every port), then ``run()`` until signalled."""

    def __init__(self, config: CacheManagerConfig) -> None:
        self.config = config
        self.id = uuid.uuid4().hex[:12]
        self.metrics = CacheManagerMetrics()
        self.attachment: Attachment | None = None
        self._engine_seen = 0.0
        self._stop = threading.Event()
        self._drain_deadline: float | None = None  # set by SIGTERM: finish queued pushes first
        self._pushes_pending = 0  # queued or sending, until their PushDone goes to the engine
        # Every attachment's reservations (cleared at each attach and detach): a part still
        # being stored for an engine that re-attached holds back its request's Revoked.
        self.reservations = Reservations()
        self._revoking: list[tuple[bytes, list[str]]] = []  # Revoked not sent yet: (to, ids)
        self._context = zmq.Context()
        self._closers: list[Any] = []
        try:
            self._bind()
        except BaseException:
            self.close()
            raise

    def _bind(self) -> None:
        cfg = self.config
        self._queue = self._context.socket(zmq.ROUTER)
        self._queue.setsockopt(zmq.LINGER, 0)
        self._closers.append(self._queue)
        self._queue_address = rundir.cache_queue_address(cfg.cache_queue_port)
        rundir.claim(self._queue_address, f"--cache-queue-port {cfg.cache_queue_port}")
        try:
            self._queue.bind(self._queue_address)
        except zmq.ZMQError as exc:
            msg = f"--cache-queue-port {cfg.cache_queue_port}: cannot bind: {exc}"
            raise ValueError(msg) from exc
        self._closers.append(rundir.SocketFile(self._queue_address))
        self._done = self._context.socket(zmq.PULL)
        self._closers.append(self._done)
        self._done.bind(_DONE_ADDRESS)
        key = None
        if cfg.moves_kv:
            what = f"the cache manager of the {cfg.role} role"
            key = require_peer_key(cfg.peer_key_file, cfg.insecure_no_peer_key, what)
            if key is None:
                logger.warning(
                    "no peer key (--insecure-no-peer-key): the KV transfer port %d accepts "
                    "blocks from anyone who reaches it; trusted networks only",
                    cfg.kv_transfer_port,
                )
        self.transport = make_transport(cfg.kv_transport, self._context, key)
        self.receiver = None
        if cfg.moves_kv:
            self.receiver = self.transport.receiver(cfg.host, cfg.kv_transfer_port)
            self._closers.append(self.receiver)
        try:
            self.http = HttpEndpoint(cfg.host, cfg.cache_manager_port, self.health, self.metrics)
        except OSError as exc:
            msg = f"--cache-manager-port {cfg.cache_manager_port} on {cfg.host} is not free"
            raise ValueError(f"{msg}: {exc.strerror}") from exc
        self._closers.append(self.http)
        settings = PushSettings(
            cfg.max_queued_pushes_per_peer,
            cfg.push_threads,
            cfg.peer_failure_threshold,
            cfg.peer_cooldown,
            cfg.transfer_timeout,
        )
        self.pusher = Pusher(self.transport, self._context, _DONE_ADDRESS, self.metrics, settings)

    # ---- lifecycle ----

    def run(self) -> int:
        cfg = self.config
        if self.receiver is not None:
            self.receiver.start(
                TransferReceiver(lambda: self.attachment, self.metrics, cfg.transfer_timeout)
            )
        self.pusher.start()
        self.http.start()
        transfers = (
            f"KV transfers ({cfg.kv_transport}) on {cfg.host}:{cfg.kv_transfer_port}"
            if self.receiver is not None
            else "no KV transfer port (mixed role)"
        )
        logger.info(
            "cache manager %s (%s role): engine queue on %s, %s, HTTP on %s:%d, swap space %d "
            "bytes",
            self.id, cfg.role, self._queue_address, transfers, cfg.host, cfg.cache_manager_port,
            cfg.swap_bytes,
        )  # fmt: skip
        poller = zmq.Poller()
        poller.register(self._queue, zmq.POLLIN)
        poller.register(self._done, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_REVOKE_POLL_MS if self._revoking else _POLL_MS))
            if self._queue in events:
                self._serve_engine()
            if self._revoking:
                self._answer_revokes()
            if self._done in events:
                identity, data = self._done.recv_multipart()
                self._queue.send_multipart([identity, data])
                self._pushes_pending -= 1
            self._check_engine_silence()
            self._check_drained()
        logger.info("cache manager %s: stopping", self.id)
        return 0

    def stop(self, *_: Any) -> None:
        """SIGTERM: finish the queued pushes and stay while the engine beside it is still there
        (it gets SIGTERM at the same moment and drains: the requests it finishes need their
        swaps and pushes, so pushes are still taken); at most DRAIN_TIMEOUT_S."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + DRAIN_TIMEOUT_S

    def _check_drained(self) -> None:
        if self._drain_deadline is None:
            return
        engine_there = (
            self.attachment is not None
            and time.monotonic() - self._engine_seen < ENGINE_GONE_AFTER_S
        )
        if self._pushes_pending <= 0 and not engine_there:
            self._stop.set()
        elif time.monotonic() > self._drain_deadline:
            logger.warning("drain timeout: %d KV pushes not finished", self._pushes_pending)
            self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)

    def close(self) -> None:
        self._stop.set()
        pusher = getattr(self, "pusher", None)
        stopped = pusher is None or pusher.close()
        for item in reversed(self._closers):
            try:
                item.close()
            except Exception:  # closing is best effort; the process is going away
                logger.debug("closing %r failed", item, exc_info=True)
        if stopped:  # a push stuck on a peer keeps its socket
            self._context.term()

    def health(self) -> tuple[bool, dict[str, Any]]:
        att = self.attachment
        broken = [
            name
            for name, alive in (
                ("sender", self.pusher.alive()),
                ("receiver", self.receiver is None or self.receiver.is_alive()),
            )
            if not alive
        ]
        body = {
            "status": "ok" if not broken else "broken: " + ", ".join(broken) + " thread died",
            "cache_manager_id": self.id,
            "engine_attached": att is not None,
            "engine_id": att.engine_id if att else None,
            "swap_slots": att.swap.slots if att else 0,
            "swap_used": len(att.swap.used) if att else 0,
            "kv_transport": self.config.kv_transport,
            "pushes": self.pusher.status(),
        }
        return not broken, body

    # ---- the engine's queue ----

    def _serve_engine(self) -> None:
        frames = self._queue.recv_multipart()
        identity = frames[0]
        try:
            message = p.decode(frames[-1])
        except ValueError as exc:
            logger.warning("engine queue: %s", exc)
            return
        self._engine_seen = time.monotonic()
        reply: p.Message | None = None
        if isinstance(message, p.Hello):
            reply = self._hello(message)
        elif isinstance(message, p.Ping):
            att = self.attachment
            if att is not None and att.engine_id == message.engine_id:
                reply = p.Pong(self.id)
            else:  # silence tells the engine to say Hello again
                logger.debug("ping from unattached engine %s ignored", message.engine_id)
        elif isinstance(message, p.Swap):
            reply = self._swap(message)
        elif isinstance(message, p.Push):
            reply = self._push(identity, message)
        elif isinstance(message, p.Reserve):
            reply = self._reserve(message)
        elif isinstance(message, p.Revoke):
            reply = self._revoke(identity, message)
        else:
            logger.warning("engine queue: unexpected %s ignored", type(message).__name__)
        if reply is not None:
            self._queue.send_multipart([identity, p.encode(reply)])

    def _hello(self, hello: p.Hello) -> p.HelloAck:
        if hello.version != p.PROTOCOL_VERSION:
            error = (
                f"protocol version mismatch: the engine speaks {hello.version}, this cache "
                f"manager {p.PROTOCOL_VERSION}; run matching ketch versions"
            )
            logger.error("refusing engine %s: %s", hello.engine_id, error)
            return p.HelloAck(self.id, p.PROTOCOL_VERSION, 0, error)
        att = self.attachment
        # Whoever says Hello starts without reservations: a new engine, or this one after it
        # was silent (it treats that as a detach), so nothing reserved before lands from now on
        # (a part being stored meanwhile holds back its request's Revoked, see _revoke).
        dropped = self.reservations.clear()
        if dropped:
            logger.warning(
                "engine %s said Hello: %d KV reservations from before dropped",
                hello.engine_id, dropped,
            )  # fmt: skip
        if att is not None and att.engine_id == hello.engine_id and att.layout == hello.layout:
            return p.HelloAck(self.id, p.PROTOCOL_VERSION, att.swap.slots)
        try:
            kv = map_segment(hello.layout)
            swap = SwapStore(hello.layout, self.config.swap_bytes)
        except (ValueError, OSError, TypeError, KeyError) as exc:
            logger.error("refusing engine %s: %s", hello.engine_id, exc)
            return p.HelloAck(self.id, p.PROTOCOL_VERSION, 0, str(exc))
        if att is not None and att.engine_id == hello.engine_id:
            logger.info("engine %s re-attached with a new layout; swap reset", att.engine_id)
        elif att is not None:
            old, new = att.engine_id, hello.engine_id
            logger.info("engine %s replaced by engine %s; swap reset", old, new)
        self.attachment = Attachment(hello.engine_id, hello.layout, kv, swap, self.reservations)
        lay = hello.layout
        logger.info(
            "attached to engine %s: segment %s, %d layers x %d KV heads x %d blocks of %d tokens "
            "x head_dim %d (%s, %d bytes/block); swap %d slots",
            hello.engine_id, lay.segment, lay.num_layers, lay.kv_heads, lay.num_blocks,
            lay.block_size, lay.head_dim, lay.dtype, lay.block_bytes, swap.slots,
        )  # fmt: skip
        self.metrics.engine_attached.set(1)
        self.metrics.swap_total_blocks.set(swap.slots)
        self.metrics.swap_used_blocks.set(0)
        return p.HelloAck(self.id, p.PROTOCOL_VERSION, swap.slots)

    def _check_engine_silence(self) -> None:
        att = self.attachment
        if att is None or time.monotonic() - self._engine_seen < ENGINE_SILENCE_S:
            return
        logger.warning(
            "engine %s silent for %.0f s: detached (mapping dropped)",
            att.engine_id,
            ENGINE_SILENCE_S,
        )
        self.attachment = None
        self.reservations.clear()
        self.metrics.engine_attached.set(0)
        self.metrics.swap_total_blocks.set(0)
        self.metrics.swap_used_blocks.set(0)

    def _revoke(self, identity: bytes, message: p.Revoke) -> p.Revoked | None:
        """Ends the reservations (attached or not: an unknown id is already ended); answered
        at once unless a part is being stored into them, then once it is stored."""
        if self.reservations.revoke(message.request_ids, timeout=0):
            return p.Revoked(message.request_ids)
        self._revoking.append((identity, message.request_ids))
        return None

    def _answer_revokes(self) -> None:
        waiting = []
        for identity, request_ids in self._revoking:
            if self.reservations.idle(request_ids):
                self._queue.send_multipart([identity, p.encode(p.Revoked(request_ids))])
            else:
                waiting.append((identity, request_ids))
        self._revoking = waiting

    def _reserve(self, message: p.Reserve) -> p.Reserved:
        att = self.attachment
        error = "no engine attached: send Hello first" if att is None else None
        if att is not None:
            error = bad_blocks(message.blocks, att.layout.num_blocks, "reserved block")
        if att is None or error is not None:
            logger.warning("reservation for %s refused: %s", message.request_id, error)
            return p.Reserved(message.request_id, False, error)
        att.reservations.reserve(message.request_id, message.blocks, message.nonce, message.ttl)
        return p.Reserved(message.request_id, True)

    def _swap(self, swap: p.Swap) -> p.SwapDone:
        att = self.attachment
        if att is None:
            return p.SwapDone(swap.seq, False, "no engine attached: send Hello first")
        try:
            error = att.swap.swap(att.kv, swap.out, swap.into)
        except (TypeError, IndexError, ValueError) as exc:
            error = f"bad swap: {exc}"
        if error is not None:
            logger.warning("swap %s refused: %s", swap.seq, error)
            return p.SwapDone(swap.seq, False, error)
        self.metrics.swap_out_blocks.inc(len(swap.out))
        self.metrics.swap_in_blocks.inc(len(swap.into))
        self.metrics.swap_used_blocks.set(len(att.swap.used))
        return p.SwapDone(swap.seq, True)

    def _push(self, identity: bytes, push: p.Push) -> p.PushDone | None:
        att = self.attachment
        error = None
        if not self.config.moves_kv:
            error = "this cache manager serves a mixed instance (--role mixed): it pushes no KV"
        elif att is None:
            error = "no engine attached: send Hello first"
        elif not isinstance(push.blocks, list) or not isinstance(push.dest_blocks, list):
            error = "blocks and dest_blocks must be lists"
        elif not push.blocks or len(push.blocks) != len(push.dest_blocks):
            n, m = len(push.blocks), len(push.dest_blocks)
            error = f"push needs as many dest_blocks as blocks (at least 1), got {n} and {m}"
        else:
            error = bad_blocks(push.blocks, att.layout.num_blocks, "device block")
            layer_bytes = att.layout.block_bytes // att.layout.num_layers * len(push.blocks)
            if error is None and layer_bytes > MAX_KV_FRAME_BYTES:
                error = (
                    f"one layer of {len(push.blocks)} blocks is {layer_bytes} bytes, more than a "
                    f"KV transfer frame may carry ({MAX_KV_FRAME_BYTES})"
                )
            if error is None:
                try:
                    parse_dest(push.dest)
                except ValueError as exc:
                    error = str(exc)
        if error is None and att is not None:
            # The engine's wall-clock deadline, as a point on this process's monotonic clock.
            deadline = None
            if push.expires_at:
                deadline = time.monotonic() + (push.expires_at - time.time())
            error = self.pusher.submit(PushJob(identity, push, att, deadline))
        if error is not None or att is None:
            logger.warning("push %s refused: %s", push.request_id, error)
            self.metrics.kv_transfer_failures.labels(direction="send").inc()
            return p.PushDone(str(push.request_id), False, error=error)
        self._pushes_pending += 1
        return None


def run(config: CacheManagerConfig) -> int:
    """Binds, serves until SIGTERM/SIGINT, closes; returns the exit code."""
    manager = CacheManager(config)
    manager.install_signal_handlers()
    try:
        return manager.run()
    finally:
        manager.close()
