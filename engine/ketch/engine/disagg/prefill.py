"""The prefill side of prefill/decode disaggregation, inside a prefill engine process.

A decode engine sends ``PrefillRequest``: the prompt, the sampling settings and seed, and where
the KV goes. This side checks that the two instances can share KV at all (protocol version,
model, KV cache dtype, KV layout), runs the prompt as a one-token request that keeps its
blocks when it finishes, has its cache manager push the blocks into the decode instance's cache,
and only then hands the first token over (``PrefillDone``). Any failure answers
``PrefillFailed`` and frees the blocks; nothing is left behind when a decode peer disappears.

The request's deadline (``PrefillRequest.expires_at``, the decode side's wall clock) holds at
every stage here: a request that arrives late is refused, one still waiting or computing when
it passes is aborted, its push is not started after it, and the cache manager abandons a push
still on its way then (``Push.expires_at``); each answers ``PrefillFailed`` with 504.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ketch.engine.cache_manager.client import CacheManagerClient
from ketch.engine.cache_manager.protocol import PushDone
from ketch.engine.disagg.messages import (
    PD_PROTOCOL_VERSION,
    AbortPrefill,
    PdMessage,
    PrefillDone,
    PrefillFailed,
    PrefillRequest,
    prompt_scores_problem,
)
from ketch.engine.outputs import TokenDelta

logger = logging.getLogger(__name__)

EXPIRY_CHECK_S = 0.05  # how often requests still in the engine are checked against deadlines


@dataclass
class _Prefill:
    identity: bytes  # the decode engine's DEALER, to answer through the ROUTER
    message: PrefillRequest
    pushing: bool = False
    aborted: bool = False
    done: PrefillDone | None = None


class PrefillSide:
    """Prompts computed for decode peers, from request to hand-over."""

    def __init__(
        self,
        engine,  # LLMEngine
        reply: Callable[[bytes, PdMessage], None],
        cache: CacheManagerClient | None,
    ) -> None:
        self.engine = engine
        self._reply = reply
        self.cache = cache
        self._prefills: dict[str, _Prefill] = {}
        self._last_expiry_check = 0.0

    def knows(self, request_id: str) -> bool:
        return request_id in self._prefills

    @property
    def num_pushing(self) -> int:
        """Prefills whose KV is on its way (done in the engine, not yet handed over)."""
        return sum(1 for prefill in self._prefills.values() if prefill.pushing)

    def tick(self) -> None:
        """Aborts the prefills still in the engine whose deadline passed."""
        now = time.monotonic()
        if now - self._last_expiry_check < EXPIRY_CHECK_S:
            return
        self._last_expiry_check = now
        expired = [
            request_id
            for request_id, prefill in self._prefills.items()
            if not prefill.pushing and _expired(prefill.message)
        ]
        if expired:
            self.engine.abort_request(expired)
        for request_id in expired:
            error = "the request's deadline passed while it waited or computed on this instance"
            self._finish(request_id, PrefillFailed(request_id, error, 504))

    def on_request(self, identity: bytes, message: PrefillRequest) -> None:
        request_id = message.request_id
        problem = self._check(message)
        if problem is None and request_id in self._prefills:
            problem = f"request id {request_id!r} is already being prefilled here"
        status = 400
        if problem is None and _expired(message):
            status, problem = 504, "the request's deadline passed before it reached this instance"
        if problem is None and (self.cache is None or not self.cache.attached):
            status, problem = (
                503,
                (
                    "the prefill instance has no cache manager attached, so it cannot send KV "
                    "blocks; retry (and check its cache-manager sidecar)"
                ),
            )
        if problem is not None:
            logger.warning("refusing prefill request %s: %s", request_id, problem)
            self._reply(identity, PrefillFailed(request_id, problem, status))
            return
        p = message.params
        # One token here; stop strings and the rest of the output are the decode side's.
        params = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1), stop=[])
        try:
            request = self.engine.add_request(
                request_id, message.prompt_token_ids, params, final_only=True, seed=message.seed
            )
        except ValueError as exc:
            self._reply(identity, PrefillFailed(request_id, str(exc), 400))
            return
        request.keep_blocks = True
        self._prefills[request_id] = _Prefill(identity, message)

    def _check(self, message: PrefillRequest) -> str | None:
        engine = self.engine
        if message.version != PD_PROTOCOL_VERSION:
            return (
                f"version mismatch: the decode instance speaks prefill/decode protocol "
                f"{message.version}, this prefill instance {PD_PROTOCOL_VERSION}; run the same "
                "Ketch version on both roles"
            )
        if message.model != engine.model_fingerprint:
            return (
                f"model mismatch: the decode instance serves {message.model}, this prefill "
                f"instance {engine.model_fingerprint}"
            )
        theirs, kv_dtype = message.layout.dtype, engine.kv_layout.dtype
        if theirs != kv_dtype:  # said in the flag's words before the layout's field-by-field check
            return (
                f"KV cache dtype mismatch: the decode instance's KV cache holds {theirs}, this "
                f"prefill instance's {kv_dtype}; start both with the same --kv-cache-dtype (KV "
                "blocks are copied as they are)"
            )
        mismatch = engine.kv_layout.mismatch(message.layout, "the decode instance")
        if mismatch is not None:
            return mismatch
        if message.params.pooling is not None:
            return "an embedding request (pooling) is computed where it is sent, not prefilled"
        scores = prompt_scores_problem(
            len(message.prompt_token_ids), message.params.prompt_logprobs
        )
        if scores is not None:
            return scores
        blocks = math.ceil(len(message.prompt_token_ids) / engine.scheduler.block_size)
        if len(message.dest_blocks) != blocks - message.start_block or message.start_block < 0:
            return (
                f"the decode instance offered {len(message.dest_blocks)} blocks from block "
                f"{message.start_block} for a {blocks}-block prompt"
            )
        return None

    def on_abort(self, identity: bytes, message: AbortPrefill) -> None:
        prefill = self._prefills.get(message.request_id)
        if prefill is None:  # unknown or finished: nothing more will be written
            self._reply(identity, PrefillFailed(message.request_id, "aborted", 499))
        elif prefill.pushing:
            prefill.aborted = True  # answered when the push ends
        else:
            self.engine.abort_request([message.request_id])
            self._finish(message.request_id, PrefillFailed(message.request_id, "aborted", 499))

    def on_step_outputs(self, deltas: list[TokenDelta]) -> None:
        """Pushes the KV of prefills that just produced their token (their one delta)."""
        for delta in deltas:
            prefill = self._prefills.get(delta.request_id)
            if prefill is None or not delta.finished or prefill.pushing:
                continue
            message = prefill.message
            if _expired(message):
                error = "the request's deadline passed before its KV could be sent"
                self._finish(message.request_id, PrefillFailed(message.request_id, error, 504))
                continue
            prefill.done = PrefillDone(
                message.request_id,
                delta.new_token_ids[0],
                delta.logprobs[0] if delta.logprobs else None,
                delta.num_cached_tokens,
                finished_at=time.time(),
                prompt_logprobs=delta.prompt_logprobs,
            )
            held = self.engine.scheduler.held_blocks(message.request_id)
            start = message.start_block
            blocks = held[start : start + len(message.dest_blocks)]
            pushed = len(blocks) == len(message.dest_blocks) and self.cache is not None
            if pushed:
                pushed = self.cache.push(
                    message.request_id,
                    blocks,
                    message.kv_dest,
                    message.dest_blocks,
                    message.dest_engine_id,
                    message.kv_nonce,
                    message.expires_at,
                )
            if pushed:
                prefill.pushing = True
            else:
                error = "the prefill instance's cache manager is not attached; retry"
                self._finish(message.request_id, PrefillFailed(message.request_id, error))

    def on_push_results(self, results: list[PushDone]) -> None:
        for result in results:
            prefill = self._prefills.get(result.request_id)
            if prefill is None or prefill.done is None:
                continue
            if prefill.aborted:
                answer: PdMessage = PrefillFailed(result.request_id, "aborted", 499)
            elif result.ok:
                answer = dataclasses.replace(
                    prefill.done, num_bytes=result.num_bytes, transfer_seconds=result.seconds
                )
            else:
                error = f"sending the KV to {prefill.message.kv_dest} failed: {result.error}"
                status = 504 if _expired(prefill.message) else 503
                answer = PrefillFailed(result.request_id, error, status)
            self._finish(result.request_id, answer)

    def on_cache_detached(self) -> None:
        """Pushes in flight are lost with the cache manager."""
        for request_id, prefill in list(self._prefills.items()):
            if prefill.pushing:
                error = "the prefill instance's cache manager went away during the KV transfer"
                self._finish(request_id, PrefillFailed(request_id, error))

    def on_failures(self, failures: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Failed requests that were a peer's prefills are answered here; returns the rest."""
        rest = []
        for request_id, error in failures:
            if request_id in self._prefills:
                self._finish(request_id, PrefillFailed(request_id, f"internal error: {error}", 500))
            else:
                rest.append((request_id, error))
        return rest

    def _finish(self, request_id: str, answer: PdMessage) -> None:
        prefill = self._prefills.pop(request_id)
        self.engine.scheduler.release_held(request_id)
        self._reply(prefill.identity, answer)


def _expired(message: PrefillRequest) -> bool:
    return bool(message.expires_at) and time.time() >= message.expires_at
