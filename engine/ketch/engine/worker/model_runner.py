"""Runs the model for one scheduled step: builds inputs, executes, samples.

The runner keeps its own copy of every live request (tokens, blocks, sampler state) and applies
only the changes the scheduler sends, so a step's message stays small however long the
requests are. It never decides what to run.

A request with a grammar is never waited for without limit. Its matcher compiles on the grammar
compiler's threads from the moment the request arrives; when its first token is to be sampled
and the matcher is not ready, the step waits a few milliseconds at most (``GRAMMAR_WAIT_S``,
``GRAMMAR_IDLE_WAIT_S`` when nothing else is in the batch), then *defers* the row: no token this
step, and its last position counts as not computed (``ModelRunnerOutput.deferred``: the scheduler
rolls its count back the same way), so the next step computes that position again (the KV slot
is rewritten with the same values; the block is the request's own, never a shared prefix-cache
block, as the last token's block is never a cache hit nor registered before it is full of
computed tokens) and samples then. A matcher not ready ``grammar_compile_timeout_s`` after its
request arrived, or whose compile failed, fails that request alone.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import paddle

from ketch.engine.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from ketch.engine.device import parse_device, rank_device
from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.backend import build_model
from ketch.engine.models.forward import forward_rows
from ketch.engine.models.loader import load_weights
from ketch.engine.models.protocol import DecoderModel
from ketch.engine.models.sharding import Shard
from ketch.engine.spec_decode.runner_side import Speculation
from ketch.engine.structured.compiler import (
    PENDING,
    UNUSABLE,
    GrammarCompiler,
    RequestGrammar,
    precompute_masks,
    wait_compiled,
)
from ketch.engine.worker.host_memory import release_freed_memory
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.pooling import Pooler
from ketch.engine.worker.runner_config import RunnerConfig
from ketch.engine.worker.sampler import SamplingState, prompt_logprobs, sample
from ketch.engine.worker.step_checks import StepError, check_blocks, check_new, check_scheduled
from ketch.engine.worker.step_inputs import RequestState, StepInputs, add_prompt_rows
from ketch.engine.worker.tensor_parallel import StepSync
from ketch.kernels.collective import Group

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005
"""The most one step waits, in all, for the grammars of rows to sample that are still compiling,
when other requests are in the batch (they would wait too)."""
GRAMMAR_IDLE_WAIT_S = 0.05
"""The same when the batch is nothing but such rows (recomputing them sooner gains nothing)."""


def configure_paddle(num_threads: int | None) -> int:
    """Thread count and flags for fast CPU inference; returns the thread count used."""
    threads = num_threads or len(os.sched_getaffinity(0))
    paddle.base.core.set_num_threads(threads)
    # The stride kernels make transpose/contiguous and small SDPA calls many times slower.
    paddle.set_flags({"FLAGS_use_stride_kernel": False})
    paddle.disable_static()
    return threads


class ModelRunner:
    """Owns the model weights, the KV cache tensors and per-request sampler state."""

    def __init__(
        self,
        config: RunnerConfig,
        kv_buffer: memoryview | None = None,
        rank: int = 0,
        group: Group | None = None,
    ) -> None:
        """``rank`` and ``group``: one tensor-parallel rank of ``config.tensor_parallel_size``
        (the worker processes of ``RemoteRunner``); rank 0 samples."""
        self.config = config
        mc = config.model_config
        self.device = rank_device(parse_device(config.device), rank)
        threads = configure_paddle(config.num_threads)
        self.shard = Shard.of(mc, rank, config.tensor_parallel_size)
        self.sync = StepSync(group) if self.shard.world > 1 else None
        if self.device.is_gpu:  # never run: docs/gpu.md
            from ketch.engine.worker.gpu_setup import gpu_model_and_cache

            self.model, self.kv_cache = gpu_model_and_cache(config, self.device, self.shard, group)
        else:
            self.model, self.kv_cache = self._cpu_model_and_cache(threads, kv_buffer, group)
            release_freed_memory()  # what loading and packing freed: not resident from here on
        self.model: DecoderModel
        self.requests: dict[str, RequestState] = {}
        self._grammars: GrammarCompiler | None = None  # built for the first grammar request
        self._advanced: list[RequestGrammar] = []  # by the last step (prepare_next_step)
        self.spec = (
            Speculation(config, self.model, self.shard.first, self.sync)
            if config.speculative is not None
            else None
        )
        # Every rank computes the hidden rows a hidden-state proposer reads (the ranks' last
        # layers must compute the same rows); only rank 0 has the proposer.
        self.spec_hidden = self.spec is not None and self.spec.wants_hidden
        self.weight_bytes = self.model.weight_bytes()
        quantized = ", int8 linear layers" if config.quantization == "int8" else ""
        logger.info(
            "model runner ready: %s on the %s backend%s, weights %.1f MiB (%s%s), %d KV blocks x "
            "%d tokens (%s), %d threads%s",
            mc.architecture,
            self.model.backend_name,
            f" ({self.device})" if self.device.is_gpu else "",
            self.weight_bytes / 2**20,
            config.dtype,
            quantized,
            config.num_blocks,
            config.block_size,
            config.kv_cache_dtype,
            threads,
            f", tensor-parallel rank {rank} of {self.shard.world}" if self.sync else "",
        )

    def _cpu_model_and_cache(
        self, threads: int, kv_buffer: memoryview | None, group: Group | None
    ) -> tuple[DecoderModel, KVCache]:
        config, mc = self.config, self.config.model_config
        weights = load_weights(config.model_path, mc, config.dtype, self.shard, "float32")
        model = build_model(
            config.backend,
            mc,
            weights,
            config.max_model_len,
            threads,
            shard=self.shard,
            group=group,
            dtype=config.dtype,
            quantization=config.quantization,
        )
        kv_cache = KVCache.for_model(mc, config, buffer=kv_buffer, heads=self.shard.kv_heads)
        return model, kv_cache

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step's sampled tokens (on a tensor-parallel rank other than 0: what rank 0
        sampled, which the engine never reads)."""
        failed = self._apply_changes(sched)
        if self.sync is not None:
            failed = self.sync.agree_failed(failed, self._forget)
        if sched.is_empty or all(r in failed for r in sched.num_scheduled_tokens):
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], failed=failed)
        drafts = (
            self.spec.propose(sched, self.requests, failed)
            if self.spec is not None and sched.num_lookahead_tokens
            else {}
        )
        batch = self._prepare_inputs(sched, failed, drafts)
        # A step of only partial prefill chunks still runs (it fills the KV cache); it computes
        # one throwaway logits row.
        rows = batch.logit_rows + batch.prompt_rows + batch.spec_rows
        logits, hidden = self._forward(batch, rows or [0])
        if logits is None:  # a tensor-parallel rank other than 0
            return self._follow(failed)
        before = set(failed)
        output = self._sample(batch, logits, failed)
        if hidden is not None and batch.hidden.spans:
            pooled_rows = hidden[batch.hidden.rows] if self.spec_hidden else hidden
            poolers = {r: s.pooler for r, s in self.requests.items() if s.pooler is not None}
            pooled = batch.hidden.pool(pooled_rows, poolers)
            output.pooled = self._finite_only(pooled, output.failed)
        if hidden is not None and self.spec_hidden:
            self.spec.observe(batch, hidden, output, self.requests)
        if self.sync is not None:
            self.sync.share(output, before)
        return output

    def _finite_only(
        self, pooled: dict[str, list[float]], failed: dict[str, str]
    ) -> dict[str, list[float]]:
        """The pooled vectors, less those not finite (broken hidden states): their requests
        fail here, as the engine would fail them, since JSON cannot carry such a vector."""
        for request_id in [r for r, v in pooled.items() if not np.isfinite(v).all()]:
            del pooled[request_id]
            failed[request_id] = "the pooled hidden state is not finite"
            self._forget(request_id)
        return pooled

    def _follow(self, failed: dict[str, str]) -> ModelRunnerOutput:
        ids, tokens, dropped, deferred, extra = self.sync.follow()
        for request_id, token in zip(ids, tokens, strict=True):
            state = self.requests[request_id]
            state.sampling.accept(token)
            for token in extra.get(request_id, ()):  # drafts rank 0 kept, and the next token
                state.sampling.accept(token)
                state.num_computed_tokens += 1
        for request_id in dropped:
            self.requests.pop(request_id, None)
            failed[request_id] = "failed on rank 0"
        for request_id in deferred:  # as rank 0 did: the last position is computed again
            self.requests[request_id].num_computed_tokens -= 1
        return ModelRunnerOutput(
            request_ids=ids, sampled_token_ids=tokens, failed=failed, deferred=deferred
        )

    def _sample(
        self, batch: StepInputs, logits: np.ndarray, failed: dict[str, str]
    ) -> ModelRunnerOutput:
        scored = self._score_prompts(batch, logits[len(batch.logit_rows) :])
        ids, rows, deferred = self._grammars_ready(batch, logits, failed)
        if not ids:
            return ModelRunnerOutput(
                [], [], failed=failed, prompt_logprobs=scored, deferred=deferred
            )
        states = [self.requests[rid].sampling for rid in ids]
        tokens, logprobs = sample(rows, states)
        for state, token in zip(states, tokens, strict=True):
            state.accept(token)
        output = ModelRunnerOutput(
            request_ids=ids,
            sampled_token_ids=tokens,
            logprobs=logprobs,
            failed=failed,
            prompt_logprobs=scored,
            deferred=deferred,
        )
        if batch.drafts:
            spec_logits = logits[len(batch.logit_rows) + len(batch.prompt_rows) :]
            self.spec.verify(batch.drafts, spec_logits, output, self.requests)
        self._advanced = [s.grammar for s in states if s.grammar is not None]
        return output

    def prepare_next_step(self) -> None:
        """What the next step needs that can be done while the engine schedules it (the worker
        calls this once a step's result is sent): the masks of the grammars that just advanced
        (the sampler finds them computed; one that fails here fails when it is sampled)."""
        advanced, self._advanced = self._advanced, []
        precompute_masks(advanced)

    def _grammars_ready(
        self, batch: StepInputs, logits: np.ndarray, failed: dict[str, str]
    ) -> tuple[list[str], np.ndarray, list[str]]:
        """(the requests to sample, their logits rows, the requests deferred). A request whose
        grammar (compiling since the request came) is not ready after a short wait is deferred:
        its last position counts as not computed, so the next step computes it again and
        samples then. One whose grammar did not compile, or not within the deadline, fails."""
        ids = batch.sampling_ids
        requests = self.requests
        grammars = [requests[r].sampling.grammar for r in ids]
        compiling = [g for g in grammars if g is not None and not g.compiled]
        now = 0.0
        if compiling:
            alone = len(compiling) == len(batch.spans)  # no other request waits on this step
            wait_compiled(compiling, GRAMMAR_IDLE_WAIT_S if alone else GRAMMAR_WAIT_S)
            now = time.monotonic()
        keep, deferred = [], []
        for i, (request_id, grammar) in enumerate(zip(ids, grammars, strict=True)):
            problem = grammar and grammar.problem(now, self.config.grammar_compile_timeout_s)
            if problem is None:
                keep.append(i)
            elif problem is PENDING:
                deferred.append(request_id)
                requests[request_id].num_computed_tokens -= 1
            else:
                failed[request_id] = f"{UNUSABLE}{problem}"
                self._forget(request_id)
        if len(keep) == len(ids):
            return ids, logits[: len(ids)], deferred
        return [ids[i] for i in keep], logits[keep], deferred

    def _score_prompts(self, batch: StepInputs, logits: np.ndarray) -> dict[str, list]:
        """prompt_logprobs: each scored row against the prompt token that follows it."""
        scored = {}
        start = 0
        for request_id, first, count in batch.prompt_spans:
            sampling = self.requests[request_id].sampling
            targets = sampling.token_ids[first : first + count]
            top_n = sampling.params.prompt_logprobs or 0
            scored[request_id] = prompt_logprobs(logits[start : start + count], targets, top_n)
            start += count
        return scored

    def _forward(
        self, batch: StepInputs, logit_rows: list[int]
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(logits, the hidden rows embedding requests asked for, or None; with a proposer
        that reads hidden states, every row's); (None, None) on a tensor-parallel rank other
        than 0."""
        hidden_rows = batch.hidden.rows if batch.hidden.spans else None
        if self.spec_hidden and len(batch.input_ids):
            hidden_rows = list(range(len(batch.input_ids)))
        cfg = self.config
        out = forward_rows(
            self.model,
            batch.input_ids,
            batch.positions,
            self.kv_cache.layers,
            batch.spans,
            logit_rows,
            cfg.block_size,
            cfg.num_blocks,
            hidden_rows,
        )
        if out is None:
            return None, None
        logits, hidden = out if hidden_rows is not None else (out, None)
        return logits.numpy(), None if hidden is None else hidden.astype("float32").numpy()

    def _apply_changes(self, sched: SchedulerOutput) -> dict[str, str]:
        """Takes the step's changes; returns the new requests it could not take (id -> why):
        one request's bad state fails that request, not the step."""
        for request_id in sched.finished_request_ids:
            self._forget(request_id)
        failed: dict[str, str] = {}
        cfg = self.config
        for new in sched.new_requests:
            try:
                if new.request_id in self.requests:
                    raise StepError("a request with this id is running already")
                check_new(new, cfg.model_config.vocab_size, cfg.num_blocks, cfg.max_model_len)
                self.requests[new.request_id] = self._new_state(new)
            except StepError as exc:
                self._refuse(failed, new.request_id, exc)
            except Exception as exc:
                logger.exception("request %s cannot run", new.request_id)
                failed[new.request_id] = f"{type(exc).__name__}: {exc}"
        cached = sched.cached_requests
        for request_id, blocks, resumed, computed in zip(
            cached.request_ids,
            cached.new_block_ids,
            cached.resumed,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = self.requests.get(request_id)
            if state is None:
                continue  # one this runner could not take
            try:
                check_blocks(blocks, cfg.num_blocks)
                if not 0 <= computed <= len(state.sampling.token_ids):
                    raise StepError(f"num_computed_tokens {computed} out of range")
            except StepError as exc:
                self._refuse(failed, request_id, exc)
                continue
            if resumed:
                state.block_ids = list(blocks)
                if self.spec is not None:
                    self.spec.forget(request_id)
            else:
                state.block_ids.extend(blocks)
            state.num_computed_tokens = computed
        for request_id, n in sched.num_scheduled_tokens.items():
            state = self.requests.get(request_id)
            if request_id in failed:
                continue
            try:
                if state is None:
                    raise StepError("scheduled, but never sent to the runner")
                length = len(state.sampling.token_ids)
                computed, blocks = state.num_computed_tokens, len(state.block_ids)
                check_scheduled(n, computed, blocks, cfg.block_size, length)
            except StepError as exc:
                self._refuse(failed, request_id, exc)
        return failed

    def _refuse(self, failed: dict[str, str], request_id: str, exc: StepError) -> None:
        logger.error("request %s refused by the runner: %s", request_id, exc)
        failed[request_id] = f"the runner refused the step: {exc}"
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """Drops a request's state (and its grammar's compile, if it has not started)."""
        state = self.requests.pop(request_id, None)
        if state is not None and state.sampling.grammar is not None:
            state.sampling.grammar.cancel()
        if self.spec is not None:
            self.spec.forget(request_id)

    def _new_state(self, new: NewRequestData) -> RequestState:
        sampling = SamplingState.create(
            new.sampling_params,
            list(new.token_ids),
            new.num_prompt_tokens,
            new.seed,
            self.config.eos_token_ids,
        )
        # Output tokens sampled elsewhere (a prefill peer's first token) used the generator:
        # take the same draws, so a seeded request samples exactly as on one instance.
        sampling.skip_draws(len(new.token_ids) - new.num_prompt_tokens)
        if new.sampling_params.grammar is not None and self.shard.first:
            # its matcher resumes past those tokens too (only rank 0 samples)
            sampling.grammar = self._grammar_compiler().matcher(
                new.sampling_params.grammar, new.token_ids[new.num_prompt_tokens :]
            )
        pooling = new.sampling_params.pooling
        return RequestState(
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=sampling,
            pooler=None if pooling is None else Pooler(pooling, new.num_prompt_tokens),
        )

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            cfg = self.config
            self._grammars = GrammarCompiler(
                cfg.model_path / "tokenizer.json", cfg.model_config.vocab_size, cfg.eos_token_ids
            )
        return self._grammars

    def _prepare_inputs(
        self, sched: SchedulerOutput, failed: dict[str, str], drafts: dict[str, list[int]]
    ) -> StepInputs:
        """The step's flat inputs. A request with drafts computes them after its scheduled
        token, in its own span: rows that score each draft (``StepInputs.spec_rows``); its
        computed count covers the scheduled tokens only until the drafts are checked."""
        scheduled = {r: n for r, n in sched.num_scheduled_tokens.items() if r not in failed}
        total = sum(scheduled.values()) + sum(len(d) for d in drafts.values())
        batch = StepInputs(np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64))
        start = 0
        for request_id, n in scheduled.items():
            state = self.requests[request_id]
            begin = state.num_computed_tokens
            tokens = state.sampling.token_ids
            batch.input_ids[start : start + n] = tokens[begin : begin + n]
            proposed = drafts.get(request_id, ())
            if proposed:  # only ever given to a request at its last token
                batch.input_ids[start + n : start + n + len(proposed)] = proposed
                batch.drafts[request_id] = (list(proposed), len(batch.spec_rows))
                batch.spec_rows.extend(range(start + n, start + n + len(proposed)))
            width = n + len(proposed)
            batch.positions[start : start + width] = np.arange(begin, begin + width)
            batch.spans.append(SequenceSpan(start, width, begin + width, state.block_ids))
            batch.span_ids.append(request_id)
            if state.pooler is not None:
                batch.hidden.add(request_id, state.pooler, begin, n, start)
            elif begin + n == len(tokens):
                batch.sampling_ids.append(request_id)
                batch.logit_rows.append(start + n - 1)
            if state.sampling.params.prompt_logprobs is not None:
                add_prompt_rows(batch, request_id, state, start, n)
            state.num_computed_tokens = begin + n
            start += width
        return batch
