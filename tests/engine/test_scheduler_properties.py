"""Property tests of the scheduler and KV cache manager over random workloads.

Random prompts with shared prefixes arrive at random steps, some are aborted, pools are small
enough to force preemption and budgets small enough to chunk prefills. After every step no KV
block may be leaked or double-owned, the step must respect ``max_num_batched_tokens`` and
``max_num_seqs``, and the fake runner (``fake_runner.py``) checks the block tables it is sent.
Every request must finish within a bound, and its output must equal that of the same request run
alone with an unconstrained pool: preemption, chunking and prefix caching never change outputs.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fake_runner import VOCAB_SIZE, FakeRunner, reference_output
from ketch.engine.core.kv_cache_manager import KVCacheManager
from ketch.engine.core.request import Request, RequestStatus
from ketch.engine.core.scheduler import Scheduler, SchedulerConfig
from ketch.engine.core.scheduler_output import SchedulerOutput
from ketch.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload and what happens to it."""

    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int
    abort_at: int | None = None
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Workload:
    """An engine configuration and the requests sent to it."""

    block_size: int
    enable_caching: bool
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    requests: tuple[RequestSpec, ...]

    @property
    def step_bound(self) -> int:
        """Steps by which everything must be done.

        The oldest running request is served first every step and is never preempted (the
        pool holds one max_model_len request), so each step advances it by a token at least.
        """
        last_arrival = max(spec.arrival for spec in self.requests)
        work = sum(len(spec.prompt) + spec.max_tokens for spec in self.requests)
        return last_arrival + work + 2


@dataclass
class RunResult:
    """The requests after a run (finished, with their outputs) and the scheduler's stats."""

    requests: list[Request]
    scheduler: Scheduler
    runner: FakeRunner
    num_steps: int


def make_request(request_id: str, spec: RequestSpec, max_model_len: int) -> Request:
    max_tokens = min(spec.max_tokens, max_model_len - len(spec.prompt))
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=not spec.stop_token_ids
    )
    return Request(request_id, list(spec.prompt), params, max_tokens, spec.stop_token_ids)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """The per-step limits the scheduler promises."""
    config = sched.config
    total = sum(out.num_scheduled_tokens.values())
    assert total == out.total_num_scheduled_tokens
    assert total <= config.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= config.max_num_seqs
    assert len(sched.running) <= config.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())


def run_workload(workload: Workload) -> RunResult:
    """Drives the scheduler with the fake runner until every request is done."""
    kv = KVCacheManager(workload.num_blocks, workload.block_size, workload.enable_caching)
    config = SchedulerConfig(
        workload.max_num_seqs, workload.max_num_batched_tokens, workload.max_model_len
    )
    sched = Scheduler(config, kv)
    runner = FakeRunner(workload.block_size)
    requests = [
        make_request(f"r{i}", spec, workload.max_model_len)
        for i, spec in enumerate(workload.requests)
    ]
    last_arrival = max(spec.arrival for spec in workload.requests)
    step = 0
    while step <= last_arrival or sched.num_unfinished:
        assert step <= workload.step_bound, f"not done after {step} steps"
        _arrive_and_abort(sched, workload, requests, step)
        out = sched.schedule()
        check_step(sched, out)
        sched.update_from_output(out, runner.execute(out))
        sched.check_integrity()
        for request_id, request in sched.requests.items():
            state = runner.requests.get(request_id)
            assert state is None or state.token_ids == request.token_ids
        step += 1
    # One more step delivers the last finished ids: the runner must then hold nothing.
    runner.execute(sched.schedule())
    assert not runner.requests
    assert not sched.requests
    assert kv.pool.num_free_blocks == workload.num_blocks - 1
    sched.check_integrity()
    return RunResult(requests, sched, runner, step)


def _arrive_and_abort(
    sched: Scheduler, workload: Workload, requests: list[Request], step: int
) -> None:
    for spec, request in zip(workload.requests, requests, strict=True):
        if spec.arrival == step:
            sched.add_request(request)
        if spec.abort_at is not None and max(spec.abort_at, spec.arrival) == step:
            sched.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)


@functools.lru_cache(maxsize=4096)
def run_alone(spec: RequestSpec, max_model_len: int, block_size: int) -> tuple[int, ...]:
    """The request's output when it is the only one and the pool and budget are unlimited."""
    lone = RequestSpec(spec.prompt, spec.max_tokens, 0, None, spec.stop_token_ids)
    blocks = -(-max_model_len // block_size) + 1
    workload = Workload(block_size, False, blocks, 1, max_model_len, max_model_len, (lone,))
    result = run_workload(workload)
    assert result.scheduler.stats.num_preemptions == 0
    return tuple(result.requests[0].output_token_ids)


def check_outputs(workload: Workload, result: RunResult) -> None:
    for spec, request in zip(workload.requests, result.requests, strict=True):
        alone = run_alone(spec, workload.max_model_len, workload.block_size)
        max_tokens = min(spec.max_tokens, workload.max_model_len - len(spec.prompt))
        expected = reference_output(
            spec.prompt, max_tokens, workload.max_model_len, spec.stop_token_ids
        )
        assert list(alone) == expected
        output = request.output_token_ids
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert output == expected[: len(output)]
        else:
            assert request.is_finished
            assert output == expected, f"{request.request_id} differs from its solo run"


# ---- workloads ----


@dataclass(frozen=True)
class PromptParts:
    """Material prompts are built from, so that blocks repeat across requests."""

    rng: random.Random
    block_size: int
    prefixes: list[tuple[int, ...]]
    segments: list[tuple[int, ...]]
    """Block-sized token runs that reappear at different positions (same block, other parent)."""

    def tail(self, length: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(VOCAB_SIZE) for _ in range(length))


@st.composite
def prompts(draw: st.DrawFn, parts: PromptParts, earlier: list[RequestSpec]) -> tuple[int, ...]:
    kind = draw(st.sampled_from(["prefix", "prefix", "mosaic", "same"] if earlier else ["prefix"]))
    if kind == "same":
        return draw(st.sampled_from(earlier)).prompt
    bs = parts.block_size
    if kind == "mosaic":
        blocks = draw(st.lists(st.sampled_from(parts.segments), min_size=1, max_size=5))
        return (*(t for block in blocks for t in block), *parts.tail(draw(st.integers(0, bs))))
    prefix = draw(st.sampled_from(parts.prefixes))
    return (*prefix, *parts.tail(draw(st.integers(0 if prefix else 1, 2 * bs))))


@st.composite
def request_specs(draw: st.DrawFn, parts: PromptParts, earlier: list[RequestSpec]) -> RequestSpec:
    prompt = draw(prompts(parts, earlier))
    rng = parts.rng
    stop: frozenset[int] = frozenset()
    if draw(st.integers(0, 3)) == 0:
        stop = frozenset(rng.randrange(VOCAB_SIZE) for _ in range(draw(st.integers(1, 8))))
    abort_at = draw(st.none() | st.integers(0, 80)) if draw(st.integers(0, 4)) == 0 else None
    return RequestSpec(
        prompt=prompt,
        max_tokens=draw(st.integers(1, 64)),
        arrival=draw(st.integers(0, 24)),
        abort_at=abort_at,
        stop_token_ids=stop,
    )


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([16, 32, 64]))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    parts = PromptParts(rng, block_size, [], [])
    for _ in range(draw(st.integers(1, 3))):
        parts.prefixes.append(parts.tail(draw(st.integers(0, 3 * block_size))))
    for _ in range(draw(st.integers(1, 3))):
        parts.segments.append(parts.tail(block_size))
    specs: list[RequestSpec] = []
    for _ in range(draw(st.integers(1, 12))):
        specs.append(draw(request_specs(parts, specs)))
    longest = max(len(spec.prompt) for spec in specs)
    max_model_len = longest + draw(st.integers(1, 64))
    # The pool always holds one request of max_model_len (the engine checks that too).
    one_request = -(-max_model_len // block_size) + 1
    return Workload(
        block_size=block_size,
        enable_caching=draw(st.booleans()),
        num_blocks=one_request
        + draw(st.integers(0, one_request) | st.integers(0, 6 * one_request)),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(4, 96) | st.just(4096)),
        max_model_len=max_model_len,
        requests=tuple(specs),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_match_solo_runs(workload: Workload) -> None:
    result = run_workload(workload)
    check_outputs(workload, result)
    stats = result.scheduler.stats
    assert stats.prefix_hit_tokens <= stats.prefix_query_tokens
    if not workload.enable_caching:
        assert stats.prefix_hit_tokens == 0
    if stats.num_preemptions:
        event("preempted")
    if stats.prefix_hit_tokens:
        event("prefix hit")


# ---- deterministic examples the properties above must cover ----


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(length))


def test_small_pool_preempts_and_outputs_still_match() -> None:
    specs = tuple(RequestSpec(_prompt(i, 40), 40, 0) for i in range(4))
    # 5 usable blocks of 16 hold one 80-token request; four requests must take turns.
    workload = Workload(16, True, 6, 4, 64, 80, specs)
    result = run_workload(workload)
    assert result.scheduler.stats.num_preemptions > 0
    assert any(r.num_preemptions for r in result.requests)
    check_outputs(workload, result)


def test_preempted_request_recomputes_from_its_own_cached_blocks() -> None:
    specs = tuple(RequestSpec(_prompt(i, 40), 40, 0) for i in range(2))
    workload = Workload(16, True, 7, 2, 64, 80, specs)
    result = run_workload(workload)
    assert result.scheduler.stats.num_preemptions > 0
    # The resumed request's full blocks were found in the cache, not recomputed.
    assert result.runner.num_resumed_with_hits > 0
    check_outputs(workload, result)


def test_shared_prefix_hits_the_cache() -> None:
    prefix = _prompt(7, 3 * 32)
    specs = (
        RequestSpec((*prefix, *_prompt(8, 10)), 8, 0),
        RequestSpec((*prefix, *_prompt(9, 20)), 8, 5),
        RequestSpec((*prefix, *_prompt(8, 10)), 8, 12),
    )
    workload = Workload(32, True, 64, 4, 4096, 512, specs)
    result = run_workload(workload)
    stats = result.scheduler.stats
    assert [r.num_cached_tokens for r in result.requests] == [0, 3 * 32, 3 * 32]
    assert stats.prefix_hit_tokens == 6 * 32
    check_outputs(workload, result)


def test_without_caching_nothing_hits() -> None:
    prefix = _prompt(7, 3 * 32)
    specs = (RequestSpec((*prefix, 1), 8, 0), RequestSpec((*prefix, 2), 8, 5))
    workload = Workload(32, False, 64, 4, 4096, 512, specs)
    result = run_workload(workload)
    assert result.scheduler.stats.prefix_hit_tokens == 0
    check_outputs(workload, result)


def test_chunked_prefill_respects_the_budget_and_matches() -> None:
    specs = tuple(RequestSpec(_prompt(i, 150 + 10 * i), 12, i) for i in range(5))
    workload = Workload(16, True, 200, 3, 7, 256, specs)
    result = run_workload(workload)
    assert result.num_steps > sum(len(s.prompt) for s in specs) // 7
    check_outputs(workload, result)


def test_identical_prompts_at_once_share_after_both_computed() -> None:
    prompt = _prompt(3, 100)
    specs = (RequestSpec(prompt, 10, 0), RequestSpec(prompt, 10, 0), RequestSpec(prompt, 4, 30))
    workload = Workload(16, True, 64, 4, 4096, 256, specs)
    result = run_workload(workload)
    assert result.requests[2].num_cached_tokens == (100 - 1) // 16 * 16
    check_outputs(workload, result)


def test_aborts_free_everything() -> None:
    specs = (
        RequestSpec(_prompt(1, 70), 30, 0, abort_at=3),  # aborted while decoding
        RequestSpec(_prompt(2, 70), 30, 0, abort_at=0),  # aborted before it ever ran
        RequestSpec(_prompt(3, 300), 30, 1, abort_at=4),  # aborted mid chunked prefill
        RequestSpec(_prompt(4, 40), 5, 2),
    )
    workload = Workload(16, True, 40, 4, 64, 400, specs)
    result = run_workload(workload)
    statuses = [r.status for r in result.requests]
    assert statuses[:3] == [RequestStatus.FINISHED_ABORTED] * 3
    assert statuses[3] == RequestStatus.FINISHED_LENGTH
    check_outputs(workload, result)


def test_abort_while_the_step_runs() -> None:
    kv = KVCacheManager(16, 16)
    sched = Scheduler(SchedulerConfig(4, 64, 128), kv)
    runner = FakeRunner(16)
    spec = RequestSpec(_prompt(5, 20), 4, 0)
    sched.add_request(make_request("a", spec, 128))
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_out) == []
    sched.check_integrity()
