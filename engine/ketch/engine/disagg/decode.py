"""The decode side of prefill/decode disaggregation, inside a decode engine process.

A request arrives with its prefill peer's pd-comm address (the router chose the pair). The
decode engine reserves KV blocks for the whole prompt (reusing its own prefix-cache hits),
waiting up to ``pd_block_timeout`` for them, and asks the prefill engine to compute the prompt and
have its cache manager write the KV into those blocks. ``PrefillDone`` brings the first token:
the request joins the scheduler with its prompt already computed and decodes from there.

Failures end the request with an error the API server turns into a 503: no blocks in time, a
prefill peer that says it failed, or one silent for ``pd_peer_timeout``. Above those, a request
has one deadline, ``pd_request_timeout`` from its arrival, for its prompt's KV to be here,
whatever stage it is in (waiting for blocks, for the reservation, for the peer); the peer gets
it as ``PrefillRequest.expires_at`` and holds to it too. Past it the request fails with 504, the
peer is told to stop (``AbortPrefill``), the reservation is revoked and the blocks are freed.

Blocks are freed only once nothing can land in them any more. Whenever a request that had its
blocks reserved at the cache manager lets them go (its prefill failed, timed out or was aborted)
the reservation is revoked and the blocks are *held* (kept out of the free list) until the cache
manager confirms the revoke (``Revoked``: no part of a push is being stored into them, and none
will be); the step loop never waits for that. Without a confirmation (the link is down) they
are freed once the reservation has surely expired at the cache manager: ``Reserved`` came back
at most its TTL before that, plus ``QUARANTINE_S`` for a part being stored at that moment; a
reservation never confirmed was never told to a peer, so its blocks go ``QUARANTINE_S`` later.
A request handed over needs no wait: the cache manager used its reservation up when it stored
the push's last part, before the peer heard of the acknowledgement.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ketch.engine.cache_manager.client import CacheManagerClient
from ketch.engine.core.request import Request
from ketch.engine.disagg.messages import (
    PD_PROTOCOL_VERSION,
    AbortPrefill,
    PdMessage,
    PdPing,
    PdPong,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
)
from ketch.engine.outputs import TokenDelta
from ketch.engine.stats import RequestMetrics

logger = logging.getLogger(__name__)

QUARANTINE_S = 10.0  # margin past a reservation's end for held blocks without a confirmation
# A reservation ends when its request does (revoked); this only bounds a forgotten one.
RESERVATION_TTL_S = 600.0
PING_INTERVAL_S = 1.0


@dataclass(frozen=True)
class PairingTimeouts:
    """Seconds a paired request may wait: for blocks, on a silent peer, in all."""

    block: float  # --pd-block-timeout
    peer: float  # --pd-peer-timeout
    request: float  # --pd-request-timeout


@dataclass
class _Remote:
    request: Request
    peer: str  # the prefill engine's pd-comm "host:port"
    kv_dest: str
    queued_at: float
    deadline: float  # time.monotonic(): the prompt's KV must be here by then
    expires_at: float  # the same deadline on the wall clock, for the peer
    sent: bool = False
    aborted: bool = False
    heard: float = 0.0
    # Built once its blocks are set aside; sent to the peer when the reservation is confirmed.
    pending: PrefillRequest | None = None
    ttl: float = 0.0  # the reservation's, in seconds
    confirmed_at: float = 0.0  # time.monotonic() when Reserved came back ok (0: not yet)


class DecodeSide:
    """Requests whose prompt a prefill peer computes, from reservation to hand-over."""

    def __init__(
        self,
        engine,  # LLMEngine (untyped: paddle is imported only inside the engine process)
        send: Callable[[str, PdMessage], None],
        timeouts: PairingTimeouts,
        kv_transfer_address: str,
        cache: CacheManagerClient | None,
    ) -> None:
        self.engine = engine
        self._send = send
        self.block_timeout = timeouts.block
        self.peer_timeout = timeouts.peer
        self.request_timeout = timeouts.request
        self.kv_transfer_address = kv_transfer_address  # where peers push: configuration
        self.cache = cache  # None: no cache manager link (requests then fail clearly)
        self.reservation_ttl = RESERVATION_TTL_S
        self._remote: dict[str, _Remote] = {}
        # Request id -> when its held blocks (``Scheduler.held``: a revoked reservation's,
        # kept out of use until the revoke is confirmed) are freed even without a confirmation.
        self._held_until: dict[str, float] = {}
        self._next_fallback = math.inf  # the earliest of them
        self._last_ping = 0.0
        self.outputs: list[TokenDelta] = []
        self.errors: list[TokenDelta] = []
        self.failed_peers: set[str] = set()  # silent or restarted since the last tick

    @property
    def num_waiting(self) -> int:
        return len(self._remote)

    @property
    def num_held_blocks(self) -> int:
        """Blocks kept out of use until the cache manager confirms their revoke."""
        scheduler = self.engine.scheduler
        return sum(len(scheduler.held_blocks(r)) for r in self._held_until)

    def peers_in_use(self) -> set[str]:
        """The prefill peers some request here still waits on."""
        return {remote.peer for remote in self._remote.values()}

    def add(self, request: Request, prefill_peer: str) -> None:
        """Takes a request (created by the engine, not queued) to prefill on its peer."""
        now, timeout = time.monotonic(), self.request_timeout
        self._remote[request.request_id] = _Remote(
            request,
            prefill_peer,
            self.kv_transfer_address,
            now,
            now + timeout,
            time.time() + timeout,
        )

    def abort(self, request_ids: list[str]) -> list[RequestMetrics]:
        """Client went away: drop unsent ones, ask the peer to stop for sent ones."""
        aborted = []
        for request_id in request_ids:
            remote = self._remote.get(request_id)
            if remote is None or remote.aborted:
                continue
            metrics = self.engine.forget_request(remote.request)
            if metrics is not None:
                aborted.append(metrics)
            if remote.sent and remote.pending is None:
                remote.aborted = True  # blocks stay reserved until the peer confirms
                self._send(remote.peer, AbortPrefill(request_id))
            else:  # the peer never heard of it (its reservation, if any, is revoked)
                self._release(request_id)
        return aborted

    # ---- the loop ----

    def tick(self) -> None:
        now = time.monotonic()
        self._expire(now)
        self._reserve(now)
        self._confirmed()
        self._check_peers(now)
        self._free_revoked(now)

    def on_message(self, peer: str, message: PdMessage) -> None:
        now = time.monotonic()
        for remote in self._remote.values():
            if remote.peer == peer:
                remote.heard = now
        if isinstance(message, PrefillDone | PrefillFailed):
            remote = self._remote.get(message.request_id)
            if remote is None or remote.peer != peer:  # only the paired peer speaks for it
                logger.warning("%s answered for %s, not its request", peer, message.request_id)
                return
        if isinstance(message, PrefillDone):
            if not 0 <= message.token_id < self.engine.model_config.vocab_size:
                error = f"the prefill instance {peer} sent token id {message.token_id}"
                self._fail(message.request_id, error + ", outside the vocabulary", 502)
                return
            self._handed_over(message)
        elif isinstance(message, PrefillFailed):
            remote = self._remote.get(message.request_id)
            if remote is not None and not remote.aborted:
                self._fail(message.request_id, message.error, message.status_code)
            elif remote is not None:
                self._release(message.request_id)
        elif isinstance(message, PdPong):
            for request_id in message.unknown_request_ids:
                if request_id in self._remote and self._remote[request_id].sent:
                    self.failed_peers.add(peer)
                    self._fail(
                        request_id,
                        f"the prefill instance {peer} lost the request (it restarted?); retry",
                        503,
                    )

    def _reserve(self, now: float) -> None:
        scheduler = self.engine.scheduler
        bs = scheduler.block_size
        for request_id, remote in list(self._remote.items()):
            if remote.sent:
                continue
            cache = self.cache
            if cache is None or not cache.attached:
                self._fail(
                    request_id,
                    "this decode instance has no cache manager attached, so it cannot receive "
                    "KV blocks; check its cache-manager sidecar",
                    503,
                )
                continue
            request = remote.request
            num_hits = scheduler.reserve_for_peer(request)
            if num_hits is None:
                if now - remote.queued_at > self.block_timeout:
                    needed = scheduler.blocks_to_reserve(request)
                    self._fail(
                        request_id,
                        f"the decode instance has no free KV blocks for this request (it needs "
                        f"{needed}, {scheduler.num_free_blocks} are free) after waiting "
                        f"{self.block_timeout:.0f} s; retry later or add decode replicas",
                        503,
                    )
                    continue
                break  # first come, first served: later requests wait behind this one
            remote.sent, remote.heard = True, now
            request.num_cached_tokens = num_hits * bs
            dest_blocks = request.block_ids[num_hits:]
            # Only the peer this request is paired with learns the nonce; the reservation
            # outlives every wait the request may do, and is revoked before its blocks go.
            nonce = secrets.token_hex(16)
            ttl = min(self.reservation_ttl, max(remote.deadline - now, 0.0) + QUARANTINE_S)
            remote.ttl = ttl
            cache.reserve(request_id, dest_blocks, nonce, ttl)
            remote.pending = PrefillRequest(
                version=PD_PROTOCOL_VERSION,
                request_id=request_id,
                prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
                params=request.sampling_params,
                seed=request.seed,
                model=self.engine.model_fingerprint,
                layout=self.engine.kv_layout,
                kv_dest=remote.kv_dest,
                dest_blocks=dest_blocks,
                start_block=num_hits,
                dest_engine_id=cache.engine_id,
                kv_nonce=nonce,
                expires_at=remote.expires_at,
            )

    def _expire(self, now: float) -> None:
        """Fails the requests whose deadline passed, whatever they wait for."""
        for request_id, remote in list(self._remote.items()):
            if now < remote.deadline:
                continue
            told = remote.sent and remote.pending is None  # the peer may be working on it
            if told:
                self._send(remote.peer, AbortPrefill(request_id))
            if remote.aborted:  # the client is gone; only the blocks are left to free
                self._release(request_id)
                continue
            if not remote.sent:
                stage = "it was still waiting for free KV blocks here"
            elif not told:
                stage = "this instance's cache manager had not confirmed its KV blocks"
            else:
                stage = f"the prefill instance {remote.peer} had not handed its KV over"
            error = (
                f"the request's prompt was not prefilled within --pd-request-timeout "
                f"{self.request_timeout:g} s ({stage}); retry"
            )
            self._fail(request_id, error, 504)

    def _confirmed(self) -> None:
        """Reservations the cache manager confirmed: now the peer may hear of them."""
        if self.cache is None:
            return
        for answer in self.cache.take_reserved():
            remote = self._remote.get(answer.request_id)
            if remote is None or remote.pending is None:
                continue
            if not answer.ok:
                error = (
                    f"this decode instance's cache manager refused the KV blocks: {answer.error}"
                )
                self._fail(answer.request_id, error, 503)
                continue
            remote.confirmed_at = time.monotonic()
            request, remote.pending = remote.pending, None
            self._send(remote.peer, request)

    def _check_peers(self, now: float) -> None:
        waiting: dict[str, list[str]] = {}
        for request_id, remote in list(self._remote.items()):
            if not remote.sent:
                continue
            if remote.pending is not None:  # the peer has not been told yet: nothing to ping
                if now - remote.heard > self.peer_timeout:
                    error = "this decode instance's cache manager did not confirm the KV blocks"
                    self._fail(request_id, error, 503)
                continue
            if now - remote.heard > self.peer_timeout:
                self.failed_peers.add(remote.peer)
                self._fail(
                    request_id,
                    f"the prefill instance {remote.peer} did not answer for "
                    f"{self.peer_timeout:.0f} s; retry",
                    503,
                )
            else:
                waiting.setdefault(remote.peer, []).append(request_id)
        if now - self._last_ping >= PING_INTERVAL_S and waiting:
            self._last_ping = now
            for peer, request_ids in waiting.items():
                self._send(peer, PdPing(request_ids))

    def _handed_over(self, done: PrefillDone) -> None:
        remote = self._remote.get(done.request_id)
        if remote is None:
            return
        if remote.aborted:
            self._release(done.request_id)
            return
        del self._remote[done.request_id]
        if self.cache is not None:  # tidy up: storing the push's last part used it up already
            self.cache.revoke([done.request_id])
        request = remote.request
        engine = self.engine
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = max(request.num_cached_tokens, done.num_cached_tokens)
        request.first_scheduled_time = time.monotonic()
        request.token_ids.append(done.token_id)
        # The prompt was scored by the prefill peer: this worker has nothing more to score.
        request.sampling_params = replace(request.sampling_params, prompt_logprobs=None)
        handover = max(0.0, time.time() - done.finished_at) if done.finished_at else None
        delta = engine.accept_first_token(request, done.logprob, handover, done.prompt_logprobs)
        if delta is not None:
            self.outputs.append(delta)

    def _fail(self, request_id: str, error: str, status_code: int) -> None:
        remote = self._remote.get(request_id)
        if remote is None:
            return
        logger.warning("request %s failed: %s", request_id, error)
        self.engine.forget_request(remote.request)
        self.errors.append(TokenDelta(request_id, error=error, error_code=status_code))
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Frees the request's blocks: at once if they were never reserved at the cache
        manager, else once it confirms the revoke (or surely dropped the reservation)."""
        remote = self._remote.pop(request_id)
        hold = remote.sent and self.cache is not None
        held = self.engine.scheduler.release_reserved(remote.request, hold)
        if not hold:
            return
        self.cache.revoke([request_id])
        if not held:
            return
        now = time.monotonic()
        # Without a confirmation: after the reservation's end at the cache manager (it started
        # before Reserved came back), or, never confirmed, with a nonce no peer learnt.
        ends = remote.confirmed_at + remote.ttl if remote.confirmed_at else now
        until = max(ends, now) + QUARANTINE_S
        # A request id seen twice: both wait for the one confirmation.
        until = max(self._held_until.get(request_id, until), until)
        self._held_until[request_id] = until
        self._next_fallback = min(self._next_fallback, until)

    def _free_revoked(self, now: float) -> None:
        """Frees held blocks whose revoke the cache manager confirmed, or whose fallback time
        passed (checked only when the earliest is due: the loop's usual cost is one call)."""
        scheduler = self.engine.scheduler
        if self.cache is not None:
            for request_id in self.cache.take_revoked():
                if self._held_until.pop(request_id, None) is not None:
                    scheduler.release_held(request_id)
        if not self._held_until:
            self._next_fallback = math.inf
            return
        if now < self._next_fallback:
            return
        for request_id, until in list(self._held_until.items()):
            if until <= now:
                del self._held_until[request_id]
                logger.warning(
                    "request %s: %d KV blocks freed without the cache manager confirming the "
                    "revoke of their reservation (it has expired there)",
                    request_id, len(scheduler.held_blocks(request_id)),
                )  # fmt: skip
                scheduler.release_held(request_id)
        self._next_fallback = min(self._held_until.values(), default=math.inf)
