"""The engine loop: schedule -> run -> process outputs, one step at a time."""

from __future__ import annotations

import logging
import time

from ketch.engine.cache_manager.protocol import KVLayout
from ketch.engine.capabilities import (
    check_runnable,
    compute_dtype,
    kv_cache_dtype,
    max_model_len,
    num_kv_blocks,
    precision_line,
)
from ketch.engine.config import EngineConfig
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request, RequestStatus
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig
from ketch.engine.core.scheduler_output import ModelRunnerOutput
from ketch.engine.cpu_sizing import cpu_memory
from ketch.engine.device import parse_device
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import resolve_model_path
from ketch.engine.output_state import (
    OutputState,
    embedding_delta,
    request_metrics,
    take_embeddings,
)
from ketch.engine.outputs import TokenDelta, TokenLogprob
from ketch.engine.request_checks import PromptLimits, check_prompt
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.spec_decode.draft_checks import check_draft_model
from ketch.engine.stats import EngineSnapshot, RequestMetrics
from ketch.engine.tokenizer import Tokenizer
from ketch.engine.worker.model_runner import ModelRunner
from ketch.engine.worker.null_runner import NullRunner
from ketch.engine.worker.remote_runner import RemoteRunner, free_tcp_port
from ketch.engine.worker.runner_config import RunnerConfig
from ketch.engine.worker.shm import shm_names

logger = logging.getLogger(__name__)


class LLMEngine:
    """One engine instance: a model, its KV cache, a scheduler and the step loop."""

    def __init__(self, config: EngineConfig, worker_port: int | None = None) -> None:
        """``worker_port`` runs the model in a worker process fed over that loopback port
        (``ketch serve``); without it the model runs in this process (offline ``LLM``)."""
        self.config = config
        self.worker_port = worker_port
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config = ModelConfig.from_dir(path, context_len=config.max_model_len)
        check_runnable(config, self.model_config)  # the refusals the operator checks too
        self.tokenizer = Tokenizer(path)
        self.max_model_len = max_model_len(config, self.model_config)
        # method draft: the draft checkpoint is checked here, before any worker starts
        self.draft_model_config = self._check_draft(config, path)
        num_blocks = num_kv_blocks(config, self.model_config)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        runner_config = RunnerConfig(
            model_path=path,
            model_config=self.model_config,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=config.block_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            dtype=compute_dtype(config, model=self.model_config),
            kv_cache_dtype=kv_cache_dtype(config, model=self.model_config),
            quantization=config.quantization,
            num_threads=config.num_threads,
            backend=config.backend,
            tensor_parallel_size=config.tensor_parallel_size,
            device=config.device,
            max_num_batched_tokens=config.max_num_batched_tokens,
            speculative=config.speculative_config,
        )
        self.runner_config = runner_config
        if config.runner == "null":
            self.runner: ModelRunner | RemoteRunner | NullRunner = NullRunner.for_model(
                self.tokenizer,
                self.model_config.vocab_size,
                self.eos_token_ids,
                self.model_config.hidden_size,
            )
        elif worker_port is None and config.tensor_parallel_size == 1:
            self.runner = ModelRunner(runner_config)
        else:  # offline tensor parallelism: ranks fed over a queue named after a free port
            self.runner = RemoteRunner(runner_config, worker_port or free_tcp_port())
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        spec = config.speculative_config
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                num_lookahead_tokens=0 if spec is None else spec.num_speculative_tokens,
                speculate_max_batch=0 if spec is None else spec.disable_by_batch_size,
            ),
            self.kv_cache,
        )
        self._states: dict[str, OutputState] = {}  # each live request's, by id
        self.failures: list[tuple[str, str]] = []  # requests that failed alone (take_failures)
        self._last_batch_size = 0
        self._num_seeded = 0
        rc = runner_config
        logger.info(
            "engine ready: model %s, max_model_len %d, %d KV blocks of %d tokens; %s",
            path,
            self.max_model_len,
            num_blocks,
            config.block_size,
            precision_line(rc.dtype, rc.quantization, rc.kv_cache_dtype),
        )
        if not self.device_is_gpu and config.runner == "model":
            logger.info(
                "memory (expected): %s",
                cpu_memory(config, self.model_config, draft=self.draft_model_config),
            )
        if spec is not None:
            logger.info("speculative decoding: %s", spec.describe())

    def _check_draft(self, config: EngineConfig, path) -> ModelConfig | None:
        """The draft checkpoint's config (``method: draft``), or a ValueError naming
        ``speculative_config.model`` when it cannot draft for this model."""
        spec = config.speculative_config
        if spec is None or spec.method != "draft" or spec.model is None:
            return None
        _, draft = check_draft_model(
            spec.model,
            path,
            self.model_config,
            self.max_model_len,
            config.backend,
            gpu=self.device_is_gpu,
        )
        return draft

    @property
    def device_is_gpu(self) -> bool:
        return parse_device(self.config.device).is_gpu

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights, every rank's, in the layouts they compute from (0 for
        the null runner)."""
        return int(getattr(self.runner, "weight_bytes", 0))

    def check_health(self) -> None:
        """Raises if a part of the engine (the worker process) has died."""
        if isinstance(self.runner, RemoteRunner):
            self.runner.check_alive()

    def close(self) -> None:
        """Stops the worker process (if any) and releases its shared memory."""
        if isinstance(self.runner, RemoteRunner):
            self.runner.close()

    # ---- requests in ----

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        final_only: bool = False,
        seed: int | None = None,
        queue: bool = True,
    ) -> Request:
        """Queues a request. With ``final_only`` its output comes once, when it finishes. The
        engine makes no text: its deltas carry token ids (``output_processor`` makes the text,
        and ends a request at a stop string with ``end_at_stop_strings``).

        ``seed`` overrides the request's sampling seed (a prefill peer uses the decode side's);
        with ``queue=False`` the request is tracked but not scheduled (its prompt is computed
        elsewhere: see ``accept_first_token``)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if params.n != 1:
            raise ValueError("the engine runs one sequence per request; LLM.generate expands n")
        _, token_ids = self.tokenize_prompt(prompt, params)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if seed is None and params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = hash((self.config.seed, self._num_seeded)) & ((1 << 63) - 1)
            self._num_seeded += 1
        request = Request(request_id, token_ids, params, max_tokens, self.eos_token_ids, seed)
        if queue:
            self.scheduler.add_request(request)
        elif request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._states[request_id] = OutputState(
            logprobs=[] if params.logprobs is not None else None,
            final_only=final_only,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            pooling=params.pooling is not None,
        )
        return request

    def accept_first_token(
        self,
        request: Request,
        logprob: TokenLogprob | None,
        handover_seconds: float | None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> TokenDelta | None:
        """A request whose prompt a prefill peer computed (its KV is in ``request.block_ids``,
        its first token appended, its prompt scored if asked): emits that token, then decodes
        it here unless it is done."""
        state = self._states[request.request_id]
        state.kv_handover_seconds = handover_seconds
        if prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs = prompt_logprobs
        if logprob is not None and state.logprobs is not None:
            state.logprobs.append(logprob)
        token_id = request.token_ids[-1]
        if token_id in request.stop_ids or len(request.token_ids) >= request.max_len:
            request.finish_on(token_id)
        output = self._process(request)
        if request.is_finished:
            self.scheduler.release_reserved(request)
        else:
            self.scheduler.add_request(request, front=True)
        return output

    def forget_request(self, request: Request) -> RequestMetrics | None:
        """Forgets a request that never reached the scheduler; its metrics if it was live."""
        state = self._states.pop(request.request_id, None)
        return None if state is None else request_metrics(request, state)

    @property
    def model_fingerprint(self) -> str:
        """What a prefill peer must serve too for its KV to be usable here."""
        mc = self.model_config
        return (
            f"{mc.architecture}(layers={mc.num_hidden_layers}, hidden={mc.hidden_size}, "
            f"vocab={mc.vocab_size}, kv_heads={mc.num_key_value_heads}, head_dim={mc.head_dim})"
        )

    @property
    def kv_layout(self) -> KVLayout:
        mc = self.model_config
        return KVLayout(
            num_layers=mc.num_hidden_layers,
            kv_heads=mc.num_key_value_heads,
            num_blocks=self.kv_cache.pool.num_blocks,
            block_size=self.config.block_size,
            head_dim=mc.head_dim,
            dtype=self.runner_config.kv_cache_dtype,
            segment=shm_names(self.worker_port)[0] if self.worker_port is not None else "",
        )

    def tokenize_prompt(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> tuple[str | None, list[int]]:
        """Checks a prompt (text or token ids) with the request's ``params``
        (``request_checks.check_prompt``); returns (text, token ids) or raises ValueError."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        check_prompt(self.prompt_limits, token_ids, params or SamplingParams())
        return text, token_ids

    @property
    def prompt_limits(self) -> PromptLimits:
        return PromptLimits(self.model_config.vocab_size, self.max_model_len)

    def abort_request(self, request_ids: list[str]) -> list[RequestMetrics]:
        """Ends the requests and frees their blocks; returns the metrics of those that were live."""
        requests = [self.scheduler.requests.get(rid) for rid in request_ids]
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        aborted = []
        for request in requests:
            state = request and self._states.pop(request.request_id, None)
            if state:
                aborted.append(request_metrics(request, state))
        return aborted

    def end_at_stop_strings(self, kept: dict[str, int]) -> list[TokenDelta]:
        """Ends requests whose text reached a stop string after ``kept[request id]`` output
        tokens (the output processor's finding) and frees their blocks. Each live one gets its
        end delta: finish reason "stop", metrics counting the kept tokens only (those made
        after them are dropped). One that finished here meanwhile has sent its end already."""
        requests = [self.scheduler.requests.get(rid) for rid in kept]
        self.scheduler.finish_requests(list(kept), RequestStatus.FINISHED_STOPPED)
        ends = []
        for request in requests:
            state = request and self._states.pop(request.request_id, None)
            if state:
                metrics = request_metrics(request, state)
                num_kept = max(0, min(kept[request.request_id], metrics.num_generation_tokens))
                metrics.num_generation_tokens = num_kept
                ends.append(
                    TokenDelta(
                        request_id=request.request_id,
                        finish_reason="stop",
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_cached_tokens=request.num_cached_tokens,
                        metrics=metrics,
                    )
                )
        return ends

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step ----

    def step(self) -> list[TokenDelta]:
        """Runs one step: a delta per request it advanced (``final_only`` ones: at the end)."""
        sched = self.scheduler.schedule()
        self._last_batch_size = len(sched.num_scheduled_tokens)
        self.kv_cache.flush()  # evicted blocks reach the host swap before the worker reuses them
        runner_output = self.runner.execute(sched)
        if runner_output.failed:  # before any progress is recorded: nothing of theirs is cached
            self._fail(runner_output.failed)
        self._take_prompt_logprobs(runner_output.prompt_logprobs)
        if runner_output.pooled:  # a bad vector fails its request
            self._fail(take_embeddings(self._states, runner_output.pooled, self.model_config))
        updated = self.scheduler.update_from_output(sched, runner_output)
        self._take_logprobs(runner_output)
        outputs = []
        for request in updated:
            try:
                output = self._process(request)
            except Exception as exc:  # e.g. a missing embedding: that request fails
                logger.exception("request %s failed", request.request_id)
                self._fail({request.request_id: f"{type(exc).__name__}: {exc}"})
                continue
            if output is not None:
                outputs.append(output)
        if not self.scheduler.num_unfinished:  # idle: the block accounting must add up
            self.scheduler.check_integrity()  # BlockAccountingError: a bug; the engine stops
        return outputs

    def _take_logprobs(self, out: ModelRunnerOutput) -> None:
        """The sampler's TokenLogprob of each sampled token, for the requests that asked."""
        if not out.logprobs:
            return
        for request_id, logprob in zip(out.request_ids, out.logprobs, strict=True):
            state = self._states.get(request_id)
            if logprob is not None and state is not None and state.logprobs is not None:
                state.logprobs.append(logprob)
                state.logprobs += out.extra_logprobs.get(request_id, ())

    def _take_prompt_logprobs(self, scored: dict[str, list[TokenLogprob]]) -> None:
        """Appends what a step scored of each prompt (the tokens after those scored before)."""
        for request_id, entries in scored.items():
            state = self._states.get(request_id)
            if state is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs += entries

    def _fail(self, failed: dict[str, str]) -> None:
        """Ends these tracked requests with an error (blocks go back); see ``take_failures``."""
        failed = {rid: why for rid, why in failed.items() if rid in self._states}
        self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        for request_id, error in failed.items():
            del self._states[request_id]
            self.failures.append((request_id, error))

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests that failed alone since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def _process(self, request: Request) -> TokenDelta | None:
        state = self._states[request.request_id]
        if state.pooling:
            if state.embedding is None:  # the runner's reply lacked it
                raise ValueError("the prompt is computed, but no embedding came back")
            del self._states[request.request_id]
            return embedding_delta(request, state)
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
        finished = request.is_finished
        if not finished and state.final_only:
            return None
        delta = self._make_delta(request, state, finished)
        if finished:
            del self._states[request.request_id]
        return delta

    def _make_delta(self, request: Request, state: OutputState, finished: bool) -> TokenDelta:
        """What is new since the request's last delta; nothing the engine keeps is copied."""
        start = request.num_prompt_tokens + state.emitted_tokens
        new_token_ids = request.token_ids[start:]
        state.emitted_tokens += len(new_token_ids)
        logprobs = state.logprobs
        state.logprobs = None if logprobs is None else []
        prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
        return TokenDelta(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            metrics=request_metrics(request, state) if finished else None,
        )

    def snapshot(self, extra_waiting: int = 0, cache_attached: bool = False) -> EngineSnapshot:
        """Gauges and cumulative counters for metrics, as of the last step."""
        scheduler, pool = self.scheduler, self.kv_cache.pool
        stats = scheduler.stats
        return EngineSnapshot(
            num_requests_running=len(scheduler.running),
            num_requests_waiting=len(scheduler.waiting) + extra_waiting,
            cache_manager_attached=cache_attached,
            kv_cache_usage=pool.usage,
            free_kv_blocks=pool.num_free_blocks,
            total_kv_blocks=pool.num_usable_blocks,
            batch_size=self._last_batch_size,
            max_batch_size=self.config.max_num_seqs,
            num_preemptions=stats.num_preemptions,
            prefix_query_tokens=stats.prefix_query_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            speculative=self.config.speculative_config is not None,
            spec_draft_tokens=stats.num_draft_tokens,
            spec_accepted_tokens=stats.num_accepted_tokens,
            spec_emitted_tokens=stats.num_emitted_tokens,
            spec_drafted_steps=stats.num_drafted_steps,
            spec_steps_off=stats.num_steps_speculation_off,
        )
