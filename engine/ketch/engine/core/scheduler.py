"""Continuous-batching scheduler with FastDeploy ResourceManagerV1 semantics.

There are no prefill or decode phases. Each step has one token budget; running requests are
served first (a decode needs one token, an unfinished prefill its next chunk), then waiting
requests are admitted while budget, batch slots and KV blocks last. When a running request
cannot get a block, the newest running request is preempted: its blocks are freed and it goes
back to the head of the queue to be recomputed later (the prefix cache usually makes that cheap).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ketch.engine.core.block_pool import BlockAccountingError
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request, RequestStatus
from ketch.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Speculative decoding: room for this many proposed tokens per decode request, in steps
    # with at most ``speculate_max_batch`` running requests (0: any number).
    num_lookahead_tokens: int = 0
    speculate_max_batch: int = 0


@dataclass
class SchedulerStats:
    """Counters since start; the engine turns them into metrics."""

    num_preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_steps: int = 0
    # Speculative decoding: tokens proposed, proposed tokens kept, tokens emitted by the
    # request-steps that had proposals (kept ones plus the model's own after them), and steps
    # that did not speculate because the batch was larger than ``speculate_max_batch``.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_drafted_steps: int = 0
    num_steps_speculation_off: int = 0


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        self._sent_to_runner: set[str] = set()
        # Blocks kept out of use past their request's end, by request id: a finished
        # ``keep_blocks`` request's (a prefill for a peer, until its KV is sent), or a decode
        # request's that a peer may still write (until the cache manager confirms the revoke).
        self.held: dict[str, list[int]] = {}
        # Requests whose prompt a prefill peer computes into blocks reserved here
        # (``reserve_for_peer``), until they join the queue or give their blocks back.
        self.reserved: dict[str, Request] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request, front: bool = False) -> None:
        """Queues a request (``front``: ahead of the others, e.g. one whose KV is ready)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.max_len = min(request.max_len, self.config.max_model_len)
        self.requests[request.request_id] = request
        self.reserved.pop(request.request_id, None)  # its prompt's KV came from a peer
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        preempted: list[Request] = []
        lookahead: dict[str, int] = {}
        budget = self._schedule_running(budget, scheduled, cached, preempted, lookahead)
        new_requests: list[NewRequestData] = []
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, cached, new_requests)
        finished, self._finished_ids = self._finished_ids, set()
        self.stats.num_steps += 1
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens
            - budget
            - sum(lookahead.values()),
            finished_request_ids=finished,
            preempted_request_ids=[r.request_id for r in preempted],
            num_lookahead_tokens=lookahead,
        )

    def _lookahead(self) -> int:
        """How many proposed tokens a decode request may have this step."""
        k = self.config.num_lookahead_tokens
        limit = self.config.speculate_max_batch
        if k and limit and len(self.running) > limit:
            self.stats.num_steps_speculation_off += 1
            return 0
        return k

    def _schedule_running(
        self,
        budget: int,
        scheduled: dict[str, int],
        cached: CachedRequestData,
        preempted: list[Request],
        lookahead: dict[str, int],
    ) -> int:
        running = self.running
        kv_cache = self.kv_cache
        bs = self.block_size
        ids, new_blocks = cached.request_ids, cached.new_block_ids
        resumed, computed = cached.resumed, cached.num_computed_tokens
        k = self._lookahead() if running else 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed_before = request.num_computed_tokens
            n = len(request.token_ids) - computed_before
            if n > budget:
                n = budget
            num_blocks = len(request.block_ids)
            extra = 0
            if k and n == 1 and request.speculates:
                # A decode: room for proposed tokens, in blocks that are free beyond one per
                # running request (speculation never preempts, and leaves every request a block
                # to grow into; without the blocks the request decodes without it).
                extra = min(k, request.max_len - len(request.token_ids) - 1, budget - 1)
                if extra > 0 and computed_before + 1 + extra > num_blocks * bs:
                    spare = kv_cache.pool.num_free_blocks - len(running)
                    if -(-(computed_before + 1 + extra) // bs) - num_blocks > spare or (
                        not kv_cache.allocate_slots(request, 1 + extra)
                    ):
                        extra = 0
                if extra > 0:
                    lookahead[request.request_id] = extra
                    budget -= extra
            if computed_before + n > num_blocks * bs or len(request.block_ids) > num_blocks:
                while not kv_cache.allocate_slots(request, n):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if request.status != RequestStatus.RUNNING:
                    break
                # Only requests whose block table grew are listed; the runner advances its own
                # computed counts from num_scheduled_tokens.
                ids.append(request.request_id)
                new_blocks.append(request.block_ids[num_blocks:])
                resumed.append(False)
                computed.append(computed_before)
            scheduled[request.request_id] = n
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: dict[str, int],
        cached: CachedRequestData,
        new_requests: list[NewRequestData],
    ) -> int:
        waiting, running = self.waiting, self.running
        kv_cache = self.kv_cache
        bs = self.block_size
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            request = waiting[0]
            # Handed over by a prefill peer: its prompt KV is here. Asking for prompt_logprobs
            # or a mean-pooled embedding: every prompt position is computed, for its logits or
            # its hidden state.
            if request.block_ids or _scores_every_position(request):
                hits: list[int] = []
                host: list[int] = []
            else:
                hits = kv_cache.get_computed_blocks(request)
                host = kv_cache.get_host_hits(request, len(hits))
            n = request.num_tokens - request.num_computed_tokens - (len(hits) + len(host)) * bs
            if not kv_cache.allocate_slots(request, min(n, budget), hits, host):
                break
            # A failed swap-in leaves those blocks to compute: n is what is really left.
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = request.num_computed_tokens
                self.stats.prefix_hit_tokens += request.num_cached_tokens
                self.stats.prefix_query_tokens += request.num_tokens
            request.status = RequestStatus.RUNNING
            running.append(request)
            scheduled[request.request_id] = n
            budget -= n
            if request.request_id in self._sent_to_runner:
                cached.request_ids.append(request.request_id)
                cached.new_block_ids.append(list(request.block_ids))
                cached.resumed.append(True)
                cached.num_computed_tokens.append(request.num_computed_tokens)
            else:
                self._sent_to_runner.add(request.request_id)
                new_requests.append(_new_request_data(request))
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advances progress, appends sampled tokens and finishes requests that stopped.

        Returns the requests that got a new token (finished ones included), and the embedding
        requests whose prompt this step finished (``SamplingParams.pooling``). A request the
        runner deferred (``ModelRunnerOutput.deferred``) got no token; its last token is
        scheduled again.
        """
        pooled: list[Request] = []
        requests = self.requests
        kv_cache = self.kv_cache
        bs = self.block_size
        deferred = set(runner_output.deferred) if runner_output.deferred else None
        extra = self._extra_tokens(scheduler_output, runner_output)
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None:
                continue  # finished (aborted) while the step ran
            if deferred and request_id in deferred and n > 0:
                n -= 1  # sampled nothing (its grammar was compiling): the last token again
            request.num_computed_tokens += n
            if request.num_computed_tokens >= (request.num_registered_blocks + 1) * bs:
                kv_cache.cache_full_blocks(request)
            done = request.num_computed_tokens >= request.num_tokens
            if done and request.sampling_params.pooling is not None:
                # An embedding request ends with its prompt; it samples no token.
                request.status = RequestStatus.FINISHED_STOPPED
                self._release(request)
                pooled.append(request)
        updated = pooled
        for request_id, token_id in zip(
            runner_output.request_ids, runner_output.sampled_token_ids, strict=True
        ):
            request = requests.get(request_id)
            if request is None:
                continue  # finished (aborted) while the step ran
            token_ids = request.token_ids
            token_ids.append(token_id)
            if (
                token_id in request.stop_ids or len(token_ids) >= request.max_len
            ) and request.finish_on(token_id):
                self._release(request)
            elif extra and request_id in extra:
                self._append_extra(request, extra[request_id])
            updated.append(request)
        return updated

    def _append_extra(self, request: Request, tokens: list[int]) -> None:
        """Appends the tokens a request emitted after its first, up to the first that ends it;
        the positions of those kept before the last were computed (their KV is the step's), so
        the blocks they fill join the prefix cache, as if decoded one by one."""
        token_ids = request.token_ids
        finished = False
        for token_id in tokens:
            token_ids.append(token_id)
            if (
                token_id in request.stop_ids or len(token_ids) >= request.max_len
            ) and request.finish_on(token_id):
                finished = True
                break
        request.num_computed_tokens = len(token_ids) - 1
        if request.num_computed_tokens >= (request.num_registered_blocks + 1) * self.block_size:
            self.kv_cache.cache_full_blocks(request)
        if finished:
            self._release(request)

    def _extra_tokens(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[str, list[int]]:
        """The tokens each request emitted after its first (speculative decoding), no more than
        its lookahead allowed; counts the proposals and what was kept of them."""
        drafted = runner_output.num_draft_tokens
        if not drafted:
            return {}
        room = scheduler_output.num_lookahead_tokens
        stats = self.stats
        extra = {}
        for request_id, num_drafts in drafted.items():
            allowed = room.get(request_id, 0)
            tokens = runner_output.extra_token_ids.get(request_id, [])[:allowed]
            stats.num_draft_tokens += min(num_drafts, allowed)
            stats.num_accepted_tokens += len(tokens)
            stats.num_emitted_tokens += len(tokens) + 1
            stats.num_drafted_steps += 1
            if tokens:
                extra[request_id] = tokens
        return extra

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Ends requests from outside the step (stop strings, aborts)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.keep_blocks:
            self.held[request.request_id] = request.block_ids
            request.block_ids = []
        else:
            self.kv_cache.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_ids.add(request.request_id)

    # ---- KV blocks outside the step loop: all that disaggregation (disagg/) does with them ----

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.pool.num_free_blocks

    def reserve_for_peer(self, request: Request) -> int | None:
        """Blocks for the whole prompt of a request a prefill peer computes (its
        ``block_ids``: prefix-cache hits, then fresh blocks); the number of hits, or None while
        too few blocks are free. Blocks evicted to make room reach the host tier first."""
        kv = self.kv_cache
        hits = kv.get_computed_blocks(request)
        if not kv.allocate_slots(request, request.num_tokens - len(hits) * self.block_size, hits):
            return None
        kv.flush()  # before the peer overwrites the evicted blocks
        self.reserved[request.request_id] = request
        return len(hits)

    def blocks_to_reserve(self, request: Request) -> int:
        """The blocks ``reserve_for_peer`` would allocate for ``request`` now (its prompt's,
        less the prefix-cache hits)."""
        hits = len(self.kv_cache.get_computed_blocks(request))
        return -(-request.num_tokens // self.block_size) - hits

    def release_reserved(self, request: Request, hold: bool = False) -> int:
        """Takes a request's blocks back (one ``reserve_for_peer`` gave, or none): frees them,
        or with ``hold`` keeps them in ``held`` (with any held under its id already) until
        ``release_held``. Returns how many it took."""
        self.reserved.pop(request.request_id, None)
        block_ids, request.block_ids = request.block_ids, []
        if hold and block_ids:
            self.held.setdefault(request.request_id, []).extend(block_ids)
        else:
            self.kv_cache.pool.free(reversed(block_ids))
        return len(block_ids)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks held under ``request_id`` (none: [])."""
        return self.held.get(request_id, [])

    def release_held(self, request_id: str) -> None:
        """Frees the blocks held under ``request_id`` (idempotent)."""
        block_ids = self.held.pop(request_id, None)
        if block_ids:
            self.kv_cache.pool.free(reversed(block_ids))

    def check_integrity(self) -> None:
        """Raises ``BlockAccountingError`` if any KV block is leaked or held twice, a freed
        block is still held, or the prefix cache's maps disagree (``BlockPool.check_integrity``
        over every holder: queued and running requests, reserved ones, held blocks)."""
        reserved = [r.block_ids for r in self.reserved.values()]
        owners = [r.block_ids for r in self.requests.values()]
        self.kv_cache.pool.check_integrity([*owners, *reserved, *self.held.values()])
        queued = len(self.running) + len(self.waiting)
        if queued != len(self.requests) or self.requests.keys() & self.reserved.keys():
            raise BlockAccountingError(
                f"{len(self.running)} running and {len(self.waiting)} waiting requests, "
                f"{len(self.requests)} known, {len(self.reserved)} reserved: they disagree"
            )
        if len(self.running) > self.config.max_num_seqs:
            raise BlockAccountingError("more running requests than max_num_seqs")


def _scores_every_position(request: Request) -> bool:
    params = request.sampling_params
    return params.prompt_logprobs is not None or params.pooling == "mean"


def _new_request_data(request: Request) -> NewRequestData:
    return NewRequestData(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        block_ids=list(request.block_ids),
        num_computed_tokens=request.num_computed_tokens,
        sampling_params=request.sampling_params,
        seed=request.seed,
    )
