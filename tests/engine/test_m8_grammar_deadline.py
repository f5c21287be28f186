"""The worker never waits without limit on a grammar's compile (security review M8).

A request whose matcher is still compiling when its first token is due is deferred: no token
that step, its last position is computed again the next, while every other request of the batch
goes on producing a token each step. Past the compile deadline it fails alone. A compile is made
slow deterministically: ``llguidance.LLMatcher`` is wrapped so that a grammar holding a marker
blocks until the test lets it go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import llguidance
import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.core.scheduler_output import ModelRunnerOutput
from ketch.engine.structured import grammars

MARKER = "slow-grammar-marker"
SLOW = grammars.choice([f"{MARKER} one", f"{MARKER} two"])
FAST = grammars.regex("[a-d]{3,6}")
RELEASE_AFTER_S = 10.0  # the old code's step waits this long for the slow compile
PLAIN_TOKENS = 24


@pytest.fixture(scope="module")
def random_path(checkpoint) -> Path:
    return checkpoint("llama")


@pytest.fixture
def slow_compiles(monkeypatch) -> Iterator[threading.Event]:
    """Compiles of grammars holding MARKER block until the event is set (at the latest after
    RELEASE_AFTER_S, so that code that waits for them cannot hang the test)."""
    release = threading.Event()
    real = llguidance.LLMatcher

    def matcher(tokenizer, grammar, *args, **kwargs):
        if MARKER in grammar:
            release.wait(RELEASE_AFTER_S)
        return real(tokenizer, grammar, *args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", matcher)
    yield release
    release.set()


def _request(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    llm.engine.add_request(request_id, prompt, params)


def test_a_slow_grammar_does_not_stop_the_batch(random_path, slow_compiles):
    greedy = dict(temperature=0, max_tokens=PLAIN_TOKENS)
    want = {  # what each gives with no slow compile
        name: LLM(str(random_path), block_size=16).generate([[5, 6, 7, 8]], params)[0]
        for name, params in (
            ("fast", SamplingParams(**greedy, grammar=FAST)),
            ("plain", SamplingParams(**greedy)),
        )
    }
    llm = LLM(str(random_path), block_size=16)
    _request(llm, "plain", [5, 6, 7, 8], SamplingParams(**greedy))
    _request(llm, "fast", [5, 6, 7, 8], SamplingParams(**greedy, grammar=FAST))
    _request(llm, "slow", [9, 10, 11], SamplingParams(temperature=0, max_tokens=48, grammar=SLOW))
    tokens: dict[str, list[int]] = {"plain": [], "fast": [], "slow": []}
    deferred_steps = 0
    start = time.monotonic()
    while "plain" in llm.engine.scheduler.requests:  # the slow compile is held all along
        step = time.monotonic()
        deltas = llm.engine.step()
        assert time.monotonic() - step < 1.0, "a step waited for the slow grammar"
        assert not llm.engine.take_failures()
        got = {d.request_id for d in deltas}
        assert "slow" not in got
        if llm.engine.scheduler.stats.num_steps > 1:  # the first step is the prefills'
            assert "plain" in got, "the plain request produced no token this step"
            deferred_steps += 1
        for delta in deltas:
            tokens[delta.request_id] += delta.new_token_ids
    assert time.monotonic() - start < RELEASE_AFTER_S
    assert deferred_steps >= PLAIN_TOKENS - 1
    assert not slow_compiles.is_set()
    slow_compiles.set()
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            tokens[delta.request_id] += delta.new_token_ids
        assert not llm.engine.take_failures()
    assert tokens["plain"] == want["plain"].outputs[0].token_ids
    assert tokens["fast"] == want["fast"].outputs[0].token_ids  # greedy: as without the wait
    text = llm.tokenizer.decode(tokens["slow"])  # the engine sends token ids, no text
    assert text in (f"{MARKER} one", f"{MARKER} two")
    llm.engine.scheduler.check_integrity()


def test_a_deferred_row_recomputes_its_last_position(random_path, slow_compiles):
    """While deferred, a request is scheduled one token a step (its last, computed again) and
    the runner's count of computed tokens agrees with the scheduler's."""
    llm = LLM(str(random_path), block_size=16)
    prompt = [(7 * i) % 200 + 3 for i in range(32)]  # fills its last block exactly
    params = SamplingParams(temperature=0, max_tokens=48, grammar=SLOW)
    _request(llm, "slow", prompt, params)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    seen: list[ModelRunnerOutput] = []
    execute = runner.execute

    def spy(sched):
        seen.append(execute(sched))
        return seen[-1]

    runner.execute = spy
    for _ in range(3):
        llm.engine.step()
        request = scheduler.requests["slow"]
        assert seen[-1].deferred == ["slow"] and not seen[-1].request_ids
        assert request.num_computed_tokens == 31 == runner.requests["slow"].num_computed_tokens
        assert request.num_registered_blocks == 1  # the last token's block is not cached yet
    slow_compiles.set()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert not llm.engine.take_failures()
    scheduler.check_integrity()


def test_a_grammar_past_the_deadline_fails_only_its_request(random_path, slow_compiles):
    llm = LLM(str(random_path), block_size=16)
    llm.engine.runner.config.grammar_compile_timeout_s = 0.5
    greedy = dict(temperature=0, max_tokens=PLAIN_TOKENS)
    _request(llm, "plain", [5, 6, 7, 8], SamplingParams(**greedy))
    _request(llm, "slow", [9, 10, 11], SamplingParams(temperature=0, max_tokens=8, grammar=SLOW))
    failures: list[tuple[str, str]] = []
    tokens: list[int] = []
    start = time.monotonic()
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            tokens += delta.new_token_ids if delta.request_id == "plain" else []
        failures += llm.engine.take_failures()
        assert time.monotonic() - start < RELEASE_AFTER_S - 1, "the slow compile was waited for"
    assert [r for r, _ in failures] == ["slow"]
    assert "did not compile within 0.5 s" in failures[0][1]
    assert len(tokens) == PLAIN_TOKENS
    slow_compiles.set()
    # the compiler is still usable
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(**greedy, grammar=FAST))[0]
    assert out.outputs[0].finish_reason == "stop"
    llm.engine.scheduler.check_integrity()


def _heavy_grammar(n: int = 1500) -> str:
    """A JSON schema that takes a few hundred milliseconds to compile (a unique one each call,
    so no cache helps)."""
    tag = time.monotonic_ns()
    properties = {
        f"p{k}_{tag}": {"type": "string", "pattern": f"[a-z]{{{k % 7 + 1}}}(x|y)*z{{{k % 5}}}"}
        for k in range(n)
    }
    schema = {"type": "object", "properties": properties, "required": list(properties)[:50]}
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


def test_tensor_parallel_ranks_defer_together(random_path):
    """Rank 0 decides which rows wait for their grammar; every rank recomputes them (a rank
    that did not would build a different batch next step and the all-reduces would not line
    up). Greedy outputs equal those of one process."""
    heavy = _heavy_grammar()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12, grammar=heavy),
        SamplingParams(temperature=0, max_tokens=12, grammar=FAST),
    ]
    want = LLM(str(random_path), block_size=16).generate(prompts, params)
    llm = LLM(str(random_path), block_size=16, tensor_parallel_size=2)
    deferred: list[str] = []
    execute = llm.engine.runner.execute

    def spy(sched):
        output = execute(sched)
        deferred.extend(output.deferred)
        return output

    llm.engine.runner.execute = spy
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    assert deferred, "nothing was deferred: the heavy grammar compiled within the wait"
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_grammar_failure_is_the_senders_400_not_an_internal_error() -> None:
    from ketch.engine.engine_process import _failure
    from ketch.engine.structured.compiler import UNUSABLE

    grammar = _failure("r1", f"{UNUSABLE}it did not compile within 10 s")
    assert (grammar.error_code, grammar.error) == (400, f"{UNUSABLE}it did not compile within 10 s")
    other = _failure("r2", "the pooled vector is not finite")
    assert other.error_code == 500 and other.error.startswith("internal error: ")
