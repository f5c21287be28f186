"""Pushing KV blocks to peer cache managers: a bounded queue per destination, a few sender
threads shared fairly between destinations, and a circuit breaker per destination.

The main loop ``submit``s each ``Push`` the engine asks for. It is refused at once, answered
with its ``PushDone`` error, when its destination already has ``max_per_peer`` pushes queued or
being sent, when the destination's circuit is open (``breaker``), or when its deadline passed.
Otherwise it waits in its destination's queue. Destinations with work take turns: a sender
thread takes the next push of the destination at the head of the ready queue, and after the
push that destination goes to the back. One destination is served by at most one thread at a
time (its pushes stay in order), so a peer that never answers costs one thread for at most the
transfer timeout per push, and only ``threshold`` pushes before its circuit opens; pushes to
every other destination go on with the other threads.

Each thread has its own transport sender (its own sockets) and its own gather buffer, and posts
every result, as a ``PushDone``, to the main loop over an inproc socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import zmq

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.breaker import CLOSED, CircuitBreaker
from ketch.engine.cache_manager.metrics import CacheManagerMetrics
from ketch.engine.cache_manager.segment import Attachment, gather, layer_ranges
from ketch.engine.cache_manager.transport import (
    KVTransport,
    PeerRefused,
    TransferError,
    TransferExpired,
)

logger = logging.getLogger("ketch.cache_manager")

IDLE_BUFFER_S = 30.0  # a sender thread idle this long lets its gather buffer go
MAX_BREAKERS = 4096  # destinations whose failures are remembered (closed, healthy ones go first)
MAX_LISTED = 16  # destinations named in /health


@dataclass(frozen=True)
class PushSettings:
    """How many pushes may wait and go at once, and when a destination fails fast."""

    max_per_peer: int
    threads: int
    failure_threshold: int
    cooldown: float
    transfer_timeout: float


class _Outcome(NamedTuple):
    """What a push says about its destination: it answered, or ``failure`` (its fault)."""

    reached: bool = False
    failure: str | None = None


@dataclass
class PushJob:
    identity: bytes  # the engine's, to answer through the cache queue
    push: p.Push
    attachment: Attachment
    deadline: float | None  # time.monotonic() after which it is not started or is abandoned


class Pusher:
    """The sender threads and the per-destination queues between them and the main loop."""

    def __init__(
        self,
        transport: KVTransport,
        context: zmq.Context,
        done_address: str,
        metrics: CacheManagerMetrics,
        settings: PushSettings,
    ) -> None:
        self._transport = transport
        self._context = context
        self._done_address = done_address
        self._metrics = metrics
        self.settings = settings
        self._cond = threading.Condition()
        self._queues: dict[str, deque[PushJob]] = {}
        self._ready: deque[str] = deque()  # destinations with queued pushes, none being sent
        self._sending: set[str] = set()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kv-sender-{i}", daemon=True)
            for i in range(settings.threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def close(self, timeout: float = 2.0) -> bool:
        """Stops the threads (a push on its way ends at its timeout); True if all stopped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        end = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, end - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    # ---- the main loop's side ----

    def submit(self, job: PushJob) -> str | None:
        """Queues the push; or says why not (then nothing was queued)."""
        dest, now = job.push.dest, time.monotonic()
        if job.deadline is not None and now >= job.deadline:
            self._metrics.push_refusals.labels(reason="expired").inc()
            return "the request's deadline passed before its KV push could start; nothing sent"
        with self._cond:
            queue = self._queues.setdefault(dest, deque())
            busy = bool(queue) or dest in self._sending
            breaker = self._breakers.get(dest)
            refusal = breaker.refusal(now, busy) if breaker is not None else None
            if refusal is not None:
                self._metrics.push_refusals.labels(reason="circuit_open").inc()
                if not queue:
                    self._queues.pop(dest)
                return f"pushes to {dest} fail fast: {refusal}"
            if len(queue) + (dest in self._sending) >= self.settings.max_per_peer:
                self._metrics.push_refusals.labels(reason="queue_full").inc()
                return (
                    f"{self.settings.max_per_peer} KV pushes to {dest} are already queued or on "
                    "their way (--max-queued-pushes-per-peer); that peer is not keeping up"
                )
            queue.append(job)
            if dest not in self._sending and len(queue) == 1:
                self._ready.append(dest)
            self._update_gauges(now)
            self._cond.notify()
        return None

    def status(self) -> dict[str, Any]:
        """For /health: pushes waiting and destinations failing fast (a few named)."""
        now = time.monotonic()
        with self._cond:
            failing = {
                dest: breaker.state(now)
                for dest, breaker in self._breakers.items()
                if breaker.state(now) != CLOSED
            }
            return {
                "queued": sum(len(q) for q in self._queues.values()),
                "sending": len(self._sending),
                "destinations": len(self._queues),
                "circuits_open": len(failing),
                "failing_destinations": dict(list(failing.items())[:MAX_LISTED]),
            }

    # ---- the sender threads ----

    def _run(self) -> None:
        done = self._context.socket(zmq.PUSH)
        done.setsockopt(zmq.LINGER, 0)
        done.connect(self._done_address)
        sender = self._transport.sender(self.settings.transfer_timeout)
        worker = _Gatherer()
        try:
            while True:
                job = self._next(worker)
                if job is None:
                    break
                result, outcome = self._send(sender, worker, job)
                # Answered before the destination's next push may go: its answers stay in order.
                done.send_multipart([job.identity, p.encode(result)])
                self._finished(job.push.dest, outcome)
        finally:
            sender.close()
            done.close(linger=0)

    def _next(self, worker: _Gatherer) -> PushJob | None:
        """The next push (of the destination whose turn it is), or None once stopping."""
        with self._cond:
            while not self._stop and not self._ready:
                if not self._cond.wait(IDLE_BUFFER_S):
                    worker.buffer = None  # idle: give its memory back
            if self._stop:
                return None
            dest = self._ready.popleft()
            self._sending.add(dest)
            return self._queues[dest].popleft()

    def _send(self, sender: Any, worker: _Gatherer, job: PushJob) -> tuple[p.PushDone, _Outcome]:
        push, dest, now = job.push, job.push.dest, time.monotonic()
        refusal = None
        if job.deadline is not None and now >= job.deadline:
            self._metrics.push_refusals.labels(reason="expired").inc()
            refusal = "the request's deadline passed while its KV push waited; nothing sent"
        else:
            with self._cond:
                breaker = self._breakers.get(dest)
                refusal = breaker.start(now) if breaker is not None else None
            if refusal is not None:
                self._metrics.push_refusals.labels(reason="circuit_open").inc()
                refusal = f"pushes to {dest} fail fast: {refusal}"
        if refusal is not None:
            return p.PushDone(push.request_id, False, error=refusal), _Outcome()
        start = time.perf_counter()
        try:
            sender.send(dest, worker.parts(job), job.deadline)
        except TransferError as exc:
            return self._failed(worker, job, exc)
        except Exception as exc:  # report it; the thread must stay alive
            logger.exception("push %s to %s failed", push.request_id, dest)
            return self._failed(worker, job, exc)
        seconds = time.perf_counter() - start
        num_bytes = job.attachment.layout.block_bytes * len(push.blocks)
        self._metrics.kv_sent_bytes.inc(num_bytes)
        self._metrics.kv_transfers.labels(direction="send").inc()
        self._metrics.kv_transfer_seconds.observe(seconds)
        logger.info(
            "pushed %d blocks (%d bytes) of %s to %s in %.1f ms",
            len(push.blocks), num_bytes, push.request_id, dest, seconds * 1000,
        )  # fmt: skip
        done = p.PushDone(push.request_id, True, num_bytes=num_bytes, seconds=seconds)
        return done, _Outcome(reached=True)

    def _failed(
        self, worker: _Gatherer, job: PushJob, exc: Exception
    ) -> tuple[p.PushDone, _Outcome]:
        push, dest = job.push, job.push.dest
        error = str(exc) if isinstance(exc, TransferError) else f"push to peer {dest}: {exc}"
        worker.buffer = None  # the transport may still hold the failed one
        self._metrics.kv_transfer_failures.labels(direction="send").inc()
        logger.warning("push %s to %s failed: %s", push.request_id, dest, error)
        if isinstance(exc, TransferExpired):
            self._metrics.push_refusals.labels(reason="expired").inc()
        # A refusal is an answer: the peer is reachable, whatever it thought of the blocks. Only
        # the other transfer errors are the destination's fault and count towards its circuit.
        reached = isinstance(exc, PeerRefused)
        fault = type(exc) is TransferError
        done = p.PushDone(push.request_id, False, error=error)
        return done, _Outcome(reached, error if fault else None)

    def _finished(self, dest: str, outcome: _Outcome) -> None:
        """Records a push's outcome and gives its destination the next turn, at the back of
        the line."""
        now = time.monotonic()
        with self._cond:
            breaker = self._breakers.get(dest)
            if outcome.reached:
                self._breakers.pop(dest, None)  # healthy: nothing to remember
            elif outcome.failure is not None:
                (breaker or self._remember(dest)).failed(now, outcome.failure)
            elif breaker is not None:
                breaker.ended()
            self._sending.discard(dest)
            if self._queues.get(dest):
                self._ready.append(dest)
                self._cond.notify()
            else:
                self._queues.pop(dest, None)
            self._update_gauges(now)

    def _remember(self, dest: str) -> CircuitBreaker:
        if len(self._breakers) >= MAX_BREAKERS:  # forget the oldest; one failing fast last
            now = time.monotonic()
            closed = [d for d, b in self._breakers.items() if b.state(now) == CLOSED]
            self._breakers.pop(closed[0] if closed else next(iter(self._breakers)))
        breaker = CircuitBreaker(self.settings.failure_threshold, self.settings.cooldown)
        self._breakers[dest] = breaker
        return breaker

    def _update_gauges(self, now: float) -> None:
        queued = sum(len(q) for q in self._queues.values()) + len(self._sending)
        self._metrics.push_queue_depth.set(queued)
        failing = sum(1 for b in self._breakers.values() if b.state(now) != CLOSED)
        self._metrics.push_circuits_open.set(failing)


class _Gatherer:
    """One sender thread's gather buffer and the parts of a push, gathered lazily."""

    def __init__(self) -> None:
        self.buffer: np.ndarray | None = None

    def _buffer_for(self, att: Attachment, num_blocks: int) -> np.ndarray:
        """A C-contiguous array for ``num_blocks`` gathered blocks, reused across pushes.

        Reuse spares the page faults of a fresh allocation per push; it is safe because a push
        ends with the peer's acknowledgement (after which the transport holds no reference).
        """
        shape = att.layout.transfer_shape(num_blocks)
        size = int(np.prod(shape))
        if self.buffer is None or self.buffer.size < size or self.buffer.dtype != att.kv.dtype:
            self.buffer = np.empty(size, dtype=att.kv.dtype)
        return self.buffer[:size].reshape(shape)

    def parts(self, job: PushJob) -> Iterator[tuple[p.TransferHeader, np.ndarray]]:
        """The push's parts, each gathered only when the transport asks for it."""
        push, att = job.push, job.attachment
        buffer = self._buffer_for(att, len(push.blocks))
        ranges = layer_ranges(att.layout, len(push.blocks))
        for part, (lo, hi) in enumerate(ranges):
            data = gather(att.kv[lo:hi], push.blocks, buffer[lo:hi])
            header = p.TransferHeader(
                p.PROTOCOL_VERSION,
                push.request_id,
                att.layout,
                list(push.dest_blocks),
                engine_id=push.dest_engine_id,
                nonce=push.dest_nonce,
                layers=[lo, hi],
                part=part,
                parts=len(ranges),
            )
            yield header, data
