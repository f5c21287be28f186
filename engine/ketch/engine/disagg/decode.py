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
Blocks a peer might still write into are kept out of use for ``QUARANTINE_S`` before they are
freed.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ketch.engine.cache_manager.client import CacheManagerClient
from ketch.engine.core.messages import RequestDelta
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
from ketch.engine.stats import RequestMetrics

logger = logging.getLogger(__name__)

QUARANTINE_S = 10.0
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
        self._quarantine: list[tuple[float, list[int]]] = []
        self._last_ping = 0.0
        self.outputs: list[RequestDelta] = []
        self.errors: list[RequestDelta] = []
        self.failed_peers: set[str] = set()  # silent or restarted since the last tick

    @property
    def num_waiting(self) -> int:
        return len(self._remote)

    def peers_in_use(self) -> set[str]:
        """The prefill peers some request here still waits on."""
        return {remote.peer for remote in self._remote.values()}

    def add(self, request: Request, prefill: str) -> None:
        """Takes a request (created by the engine, not queued) to prefill on ``prefill``."""
        now, timeout = time.monotonic(), self.request_timeout
        self._remote[request.request_id] = _Remote(
            request, prefill, self.kv_transfer_address, now, now + timeout, time.time() + timeout
        )

    def abort(self, request_ids: list[str]) -> list[RequestMetrics]:
        """Client went away: drop unsent ones, ask the peer to stop for sent ones."""
        aborted = []
        for request_id in request_ids:
            remote = self._remote.get(request_id)
            if remote is None or remote.aborted:
                continue
            metrics = self.engine.drop_tracked(remote.request)
            if metrics is not None:
                aborted.append(metrics)
            if remote.sent and remote.pending is None:
                remote.aborted = True  # blocks stay reserved until the peer confirms
                self._send(remote.peer, AbortPrefill(request_id))
            else:  # the peer never heard of it (its reservation, if any, is revoked)
                self._release(request_id, quarantine=False)
        return aborted

    # ---- the loop ----

    def tick(self) -> None:
        now = time.monotonic()
        self._expire(now)
        self._reserve(now)
        self._confirmed()
        self._check_peers(now)
        while self._quarantine and self._quarantine[0][0] <= now:
            _, block_ids = self._quarantine.pop(0)
            self.engine.kv_cache.pool.free(reversed(block_ids))

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
                self._fail(message.request_id, error + ", outside the vocabulary", 502, True)
                return
            self._handed_over(message)
        elif isinstance(message, PrefillFailed):
            remote = self._remote.get(message.request_id)
            if remote is not None and not remote.aborted:
                self._fail(message.request_id, message.error, message.status_code, False)
            elif remote is not None:
                self._release(message.request_id, quarantine=False)
        elif isinstance(message, PdPong):
            for request_id in message.unknown_request_ids:
                if request_id in self._remote and self._remote[request_id].sent:
                    self.failed_peers.add(peer)
                    self._fail(
                        request_id,
                        f"the prefill instance {peer} lost the request (it restarted?); retry",
                        503,
                        True,
                    )

    def _reserve(self, now: float) -> None:
        kv = self.engine.kv_cache
        bs = kv.block_size
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
                    False,
                )
                continue
            request = remote.request
            hits = kv.get_computed_blocks(request)
            prompt = request.num_tokens
            if not kv.allocate_slots(request, prompt - len(hits) * bs, hits):
                if now - remote.queued_at > self.block_timeout:
                    needed = math.ceil(prompt / bs) - len(hits)
                    self._fail(
                        request_id,
                        f"the decode instance has no free KV blocks for this request (it needs "
                        f"{needed}, {kv.pool.num_free_blocks} are free) after waiting "
                        f"{self.block_timeout:.0f} s; retry later or add decode replicas",
                        503,
                        False,
                    )
                    continue
                break  # first come, first served: later requests wait behind this one
            kv.flush()  # evicted blocks go to the host before the peer overwrites them
            remote.sent, remote.heard = True, now
            request.num_cached_tokens = len(hits) * bs
            dest_blocks = request.block_ids[len(hits) :]
            # Only the peer this request is paired with learns the nonce; the reservation
            # outlives every wait the request may do, and is revoked before its blocks go.
            nonce = secrets.token_hex(16)
            ttl = min(self.reservation_ttl, max(remote.deadline - now, 0.0) + QUARANTINE_S)
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
                start_block=len(hits),
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
                self._release(request_id, quarantine=True)
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
            self._fail(request_id, error, 504, told)

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
                self._fail(answer.request_id, error, 503, False)
                continue
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
                    self._fail(request_id, error, 503, False)
                continue
            if now - remote.heard > self.peer_timeout:
                self.failed_peers.add(remote.peer)
                self._fail(
                    request_id,
                    f"the prefill instance {remote.peer} did not answer for "
                    f"{self.peer_timeout:.0f} s; retry",
                    503,
                    True,
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
            self._release(done.request_id, quarantine=False)
            return
        del self._remote[done.request_id]
        if self.cache is not None:  # the blocks hold live KV now: nobody may write them
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

    def _fail(self, request_id: str, error: str, status_code: int, quarantine: bool) -> None:
        remote = self._remote.get(request_id)
        if remote is None:
            return
        logger.warning("request %s failed: %s", request_id, error)
        self.engine.drop_tracked(remote.request)
        self.errors.append(RequestDelta(request_id, error=error, error_code=status_code))
        self._release(request_id, quarantine)

    def _release(self, request_id: str, quarantine: bool) -> None:
        remote = self._remote.pop(request_id)
        block_ids, remote.request.block_ids = remote.request.block_ids, []
        if remote.sent and self.cache is not None:
            self.cache.revoke([request_id])  # before its blocks can go to anyone else
        if not block_ids:
            return
        if quarantine:
            self._quarantine.append((time.monotonic() + QUARANTINE_S, block_ids))
        else:
            self.engine.kv_cache.pool.free(reversed(block_ids))
