"""The engine-worker queue under hostile input (issue 13, acceptance 2: the worker queue's fuzz).

A real worker process gets, in place of the engine's steps, seeded garbage: random frame counts
and bytes, nesting past every limit, steps of the right shape with one field of the wrong type
or an extreme value, and well-formed steps whose values point past the vocabulary, the KV cache
or the request's own tokens. Every message gets exactly one answer (a refusal, or the requests
it names failed); the worker never dies; afterwards the same engine serves exactly what the
in-process engine does, and every KV block is free again.
"""

from __future__ import annotations

import random
import socket

import pytest
from hostile import frames

from ketch.engine import LLM, EngineConfig, SamplingParams
from ketch.engine.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from ketch.engine.llm_engine import LLMEngine
from ketch.engine.worker.messages import decode_result, encode_step

CONFIG = dict(block_size=16, kv_cache_memory="16MiB", max_num_batched_tokens=64, max_num_seqs=8)
PROMPTS = [[5, 6, 7, 8] * k for k in (1, 3, 9)] + [list(range(40, 90))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def out_of_range_steps(vocab: int, num_blocks: int, seed: int) -> list[SchedulerOutput]:
    """Well-formed steps a broken engine could send: each value is past one bound."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_tokens=4)

    def new(rid: str, **change) -> NewRequestData:
        fields = dict(
            request_id=rid, token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[0],
            num_computed_tokens=0, sampling_params=sampling, seed=rng.randrange(2**63),
        )  # fmt: skip
        fields.update(change)
        return NewRequestData(**fields)

    def step(news: list[NewRequestData], scheduled: dict[str, int], **extra) -> SchedulerOutput:
        return SchedulerOutput(
            new_requests=news,
            cached_requests=extra.pop("cached", CachedRequestData()),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_request_ids=extra.pop("finished", set()),
        )

    cases = [
        step([new("a", token_ids=[vocab])], {"a": 1}),
        step([new("b", token_ids=[2**62, 1, 2])], {"b": 3}),
        step([new("c", token_ids=[-1, 1, 2])], {"c": 3}),
        step([new("d", block_ids=[num_blocks])], {"d": 3}),
        step([new("e", block_ids=[-5])], {"e": 3}),
        step([new("f", num_prompt_tokens=0)], {"f": 3}),
        step([new("g", num_prompt_tokens=99)], {"g": 3}),
        step([new("h", num_computed_tokens=50)], {"h": 3}),
        step([new("i", token_ids=[])], {"i": 0}),
        step([new("j", token_ids=[1] * 40)], {"j": 40}),  # 40 tokens need 3 blocks, 1 held
        step([new("k")], {"k": 4}),  # more tokens than the request has
        step([new("l")], {"l": 0}),
        step([], {"never-sent": 3}),
        step([new("m"), new("m")], {"m": 3}),
        step(
            [new("n")],
            {"n": 3},
            cached=CachedRequestData(["n"], [[num_blocks + 7]], [False], [0]),
        ),
        step([], {}, cached=CachedRequestData(["ghost"], [[1]], [True], [10**6])),
    ]
    return cases


def test_worker_survives_hostile_steps_and_then_serves_exactly() -> None:
    expected = [o.outputs[0].token_ids for o in LLM("tiny", **CONFIG).generate(PROMPTS, GREEDY)]
    engine = LLMEngine(EngineConfig(model="tiny", **CONFIG), worker_port=_free_port())
    try:
        runner = engine.runner
        vocab = engine.model_config.vocab_size
        sock = runner._sockets[0]  # the engine's end of the PAIR: the only peer the worker has
        answered = 0
        for message in frames([SchedulerOutput], seed=13, count=300):
            sock.send_multipart(message)
            reply = decode_result(runner._receive(60, what="answer a hostile step"))
            assert reply.refused is not None or not reply.request_ids or reply.failed
            answered += 1
        num_blocks = engine.scheduler.kv_cache.pool.num_blocks
        for sched in out_of_range_steps(vocab, num_blocks, seed=14):
            sock.send(encode_step(sched))
            reply = decode_result(runner._receive(60, what="answer an out-of-range step"))
            assert reply.refused is None
            assert set(reply.failed) == set(sched.num_scheduled_tokens), (sched, reply)
            assert not reply.request_ids
            answered += 1
        runner.check_alive()
        assert answered == 316
        # The same engine, same worker: exact outputs, every block back.
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                done.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        assert [done[str(i)] for i in range(len(PROMPTS))] == expected
        pool = engine.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
    finally:
        engine.close()


@pytest.mark.parametrize("frames_count", [0, 2, 3])
def test_step_of_wrong_frame_count_is_refused_not_split(frames_count: int) -> None:
    """A multipart step is one refusal, never several steps (one answer per message)."""
    from ketch.engine.wire import BadMessages
    from ketch.engine.worker.worker_process import _execute

    refusals = BadMessages("worker")
    output = _execute(None, [b"{}"] * frames_count, refusals)  # type: ignore[arg-type]
    assert output.refused and f"{frames_count} frames" in output.refused
    assert refusals.total == 1
