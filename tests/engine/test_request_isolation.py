"""One request's fault fails that request alone: the step, the runner and every other request
go on with unchanged output, and its KV blocks come back.

The fault is injected where a request's sampler state is built (a value the edge let through
that the sampler cannot take); everything around it is the real engine and model.
"""

from __future__ import annotations

import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.worker import model_runner

POISON_SEED = 666


@pytest.fixture
def poisoned(monkeypatch):
    real = model_runner.SamplingState.create

    def create(params, *args, **kwargs):
        if params.seed == POISON_SEED:
            raise OverflowError("Python int too large to convert to C long")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(model_runner.SamplingState, "create", staticmethod(create))


def _greedy(seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=seed)


def test_a_failing_request_fails_alone_and_its_blocks_come_back(poisoned) -> None:
    llm = LLM("tiny", block_size=16, kv_cache_memory="16MiB")
    prompts = ["Alice was beginning", "The Mouse", "Curiouser and curiouser"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    engine = llm.engine
    engine.add_request("good-0", prompts[0], _greedy())
    engine.add_request("bad", "Down the rabbit hole", _greedy(POISON_SEED))
    engine.add_request("good-1", prompts[1], _greedy())
    got: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    failures: list[tuple[str, str]] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                got[delta.request_id] = tokens[delta.request_id]
        failures += engine.take_failures()
    assert [rid for rid, _ in failures] == ["bad"]
    assert "OverflowError" in failures[0][1]
    assert got == {"good-0": want[0], "good-1": want[1]}
    pool = engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    engine.scheduler.check_integrity()
    # The offline API reports it, and serves on afterwards.
    with pytest.raises(RuntimeError, match=r"request .* failed: OverflowError"):
        llm.generate(["Down the rabbit hole", prompts[2]], [_greedy(POISON_SEED), _greedy()])
    assert not engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())] == want


def test_a_failure_reported_for_an_id_the_engine_does_not_track_is_ignored(monkeypatch) -> None:
    """A runner reply naming a request that already finished (or was never this engine's) must
    not produce an error for anyone, nor disturb the requests running."""
    llm = LLM("tiny", block_size=16, kv_cache_memory="16MiB")
    want = [o.outputs[0].token_ids for o in llm.generate(["The Mouse"], _greedy())]
    engine = llm.engine
    real = engine.runner.execute

    def execute(sched):
        out = real(sched)
        out.failed = {**out.failed, "finished-long-ago": "RuntimeError: stale", "": "x"}
        return out

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("live", "The Mouse", _greedy())
    got, tokens = {}, {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                got[delta.request_id] = tokens[delta.request_id]
        assert engine.take_failures() == []
    assert got == {"live": want[0]}
    engine.scheduler.check_integrity()
