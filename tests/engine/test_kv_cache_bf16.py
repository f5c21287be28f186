"""``kv_cache_dtype="bfloat16"`` end to end on the tiny model, through the offline API.

The bfloat16 cache rounds every key and value as it is written, so logits move a little (about
0.01 in log-probability here) but the model's choices should not: teacher-forced on a few
hundred tokens (the float32 engine's own greedy continuations), the top-1 token at each
position agrees with the float32-KV engine's at 99% of the positions or more, the bfloat16
engine's greedy continuations are (almost everywhere) what the float32 engine would pick after
the same tokens, and two tensor-parallel ranks sharing one bfloat16 segment give the one-rank
text. (``ketch serve --kv-cache-dtype bfloat16``: serving/test_serve_kv_bf16.py.)
"""

from __future__ import annotations

import pytest

from ketch.engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "Alice was beginning to get very tired",
    "The Mouse",
    "Down, down, down. Would the fall never come to an end",
]
NEW_TOKENS = 150
AGREEMENT = 0.99


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    f32 = LLM("tiny", block_size=16, kv_cache_memory="64MiB")
    # Chunked prefill: later chunks attend over the bfloat16 blocks the earlier ones wrote.
    b16 = LLM(
        "tiny", block_size=16, kv_cache_memory="64MiB", kv_cache_dtype="bfloat16",
        max_num_batched_tokens=48,
    )  # fmt: skip
    return f32, b16


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def _teacher_forced(llm: LLM, seqs: list[list[int]]):
    """Per sequence, per position after the first: (the model's top-1 token, the logprob of
    the token that is there)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    return [
        [(e.top[0][0], e.logprob) for e in out.prompt_logprobs]
        for out in llm.generate(seqs, params)
    ]


def _prompt_ids(llm: LLM) -> list[list[int]]:
    return [list(llm.engine.tokenize_prompt(p)[1]) for p in PROMPTS]


def test_the_engine_holds_a_bfloat16_cache(engines) -> None:
    f32, b16 = engines
    assert f32.engine.kv_layout.dtype == "float32"
    assert b16.engine.kv_layout.dtype == "bfloat16"
    assert b16.engine.kv_layout.block_bytes * 2 == f32.engine.kv_layout.block_bytes


def test_teacher_forced_top1_agrees_with_the_float32_cache(engines) -> None:
    f32, b16 = engines
    seqs = [p + g for p, g in zip(_prompt_ids(f32), _greedy(f32), strict=True)]
    assert sum(len(s) - 1 for s in seqs) >= 300
    want, got = _teacher_forced(f32, seqs), _teacher_forced(b16, seqs)
    pairs = [(w, g) for ws, gs in zip(want, got, strict=True) for w, g in zip(ws, gs, strict=True)]
    agree = sum(w[0] == g[0] for w, g in pairs) / len(pairs)
    assert agree >= AGREEMENT, f"top-1 agrees at {agree:.1%} of {len(pairs)} positions"
    moved = max(abs(w[1] - g[1]) for w, g in pairs)
    assert 0 < moved < 0.1, moved  # rounded keys and values: close, not the same numbers


def test_greedy_generation_picks_what_the_float32_cache_would(engines) -> None:
    f32, b16 = engines
    prompts = _prompt_ids(b16)
    generated = _greedy(b16)
    assert all(len(g) == NEW_TOKENS for g in generated)
    # The float32 engine, teacher-forced on the bfloat16 engine's output, would have chosen the
    # same next tokens.
    forced = _teacher_forced(f32, [p + g for p, g in zip(prompts, generated, strict=True)])
    picks = [
        top == token
        for p, g, f in zip(prompts, generated, forced, strict=True)
        for (top, _), token in zip(f[len(p) - 1 :], g, strict=True)
    ]
    assert len(picks) == NEW_TOKENS * len(PROMPTS)
    assert sum(picks) / len(picks) >= AGREEMENT


def test_tensor_parallel_ranks_share_one_bfloat16_segment(engines) -> None:
    """Two ranks, each viewing its KV heads of one bfloat16 /dev/shm segment: the one-rank
    engine's greedy text."""
    _, b16 = engines
    params = SamplingParams(temperature=0, max_tokens=40)
    two = LLM(
        "tiny", block_size=16, kv_cache_memory="64MiB", kv_cache_dtype="bfloat16",
        max_num_batched_tokens=48, tensor_parallel_size=2,
    )  # fmt: skip
    try:
        want = [o.outputs[0].text for o in b16.generate(PROMPTS, params)]
        assert [o.outputs[0].text for o in two.generate(PROMPTS, params)] == want
    finally:
        two.engine.close()
