"""Sampling: seeded reproducibility, the sampler's processors on crafted logits, and stopping.

The sampler tests call ``sample`` directly on hand-made logits, so every processor (penalties,
min_tokens, top-k/top-p/min-p, temperature, logprobs) is checked against numbers worked out by
hand. The engine tests go through ``LLM.generate`` on a random checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.worker.sampler import SamplingState, sample

EOS = 0
PROMPT = "The quick brown fox jumps over the lazy dog"
SEEDED = SamplingParams(
    seed=123, temperature=0.9, top_p=0.9, top_k=50, max_tokens=24, ignore_eos=True
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ---- the sampler on crafted logits ----


def make_state(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int = 0,
) -> SamplingState:
    prompt = [7] if prompt is None else prompt
    tokens = prompt + (output or [])
    return SamplingState.create(params, tokens, len(prompt), seed, eos_token_ids=(EOS,))


def logits_row(values: dict[int, float], vocab: int = 8, fill: float = -5.0) -> np.ndarray:
    row = np.full((1, vocab), fill, dtype=np.float32)
    for token, value in values.items():
        row[0, token] = value
    return row


def pick(row: np.ndarray, state: SamplingState) -> int:
    tokens, _ = sample(row, [state])
    return tokens[0]


def draws(row: np.ndarray, params: SamplingParams, count: int, seed: int = 0) -> np.ndarray:
    """``count`` tokens drawn by one request (its generator advances once per draw)."""
    state = make_state(params, seed=seed)
    return np.array([pick(row, state) for _ in range(count)])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_and_top_k_one_pick_the_argmax_in_a_mixed_batch() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 3.0, (6, 50)).astype(np.float32)
    states = [
        make_state(SamplingParams(temperature=0.0)),
        make_state(SamplingParams(temperature=1.0, top_k=1), seed=1),
        make_state(SamplingParams(temperature=0.0)),
        make_state(SamplingParams(temperature=2.0, top_k=1), seed=2),
        make_state(SamplingParams(temperature=0.0, repetition_penalty=1.0)),
        make_state(SamplingParams(temperature=0.5, top_k=1), seed=3),
    ]
    for _ in range(20):
        tokens, logprobs = sample(logits, states)
        assert tokens == logits.argmax(axis=-1).tolist()
        assert logprobs is None


@pytest.mark.parametrize("where", ["prompt", "output"])
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(where: str) -> None:
    def winner(values: dict[int, float], seen: int, penalty: float) -> int:
        params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
        prompt, output = ([seen], []) if where == "prompt" else ([7], [seen])
        return pick(logits_row(values), make_state(params, prompt, output))

    positive = {1: 2.0, 2: 1.5}
    assert winner(positive, seen=1, penalty=1.0) == 1
    assert winner(positive, seen=1, penalty=2.0) == 2  # 2.0 / 2 = 1.0 < 1.5
    assert winner(positive, seen=1, penalty=1.2) == 1  # 2.0 / 1.2 = 1.67 > 1.5
    assert winner(positive, seen=2, penalty=2.0) == 1  # only seen tokens are penalised
    negative = {1: -1.0, 2: -1.5}
    assert winner(negative, seen=1, penalty=2.0) == 2  # -1.0 * 2 = -2.0 < -1.5
    assert winner(negative, seen=1, penalty=1.4) == 1  # -1.4 > -1.5
    # Dividing a negative logit would have raised it: the seen token must not start winning.
    assert winner(negative, seen=2, penalty=2.0) == 1


def test_presence_and_frequency_penalties_count_only_output_tokens() -> None:
    row = logits_row({1: 2.0, 2: 1.8})

    def winner(params: SamplingParams, prompt: list[int], output: list[int]) -> int:
        return pick(row, make_state(params, prompt, output))

    presence = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert winner(presence, prompt=[1] * 5, output=[]) == 1
    assert winner(presence, prompt=[7], output=[1]) == 2  # 2.0 - 1.0 < 1.8
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    assert winner(frequency, prompt=[1] * 10, output=[1]) == 1  # 2.0 - 0.1 > 1.8
    assert winner(frequency, prompt=[7], output=[1, 1, 1]) == 2  # 2.0 - 0.3 < 1.8
    negative = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    assert winner(negative, prompt=[7], output=[2]) == 2  # a negative penalty encourages


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    stop_id = 5
    row = logits_row({EOS: 9.0, stop_id: 8.0, 3: 1.0})
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id])
    for num_output in range(3):
        assert pick(row, make_state(params, output=[3] * num_output)) == 3
    assert pick(row, make_state(params, output=[3] * 3)) == EOS
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert pick(row, make_state(ignoring, output=[])) == EOS  # EOS is not a stop token here
    sampled = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop_id])
    state = make_state(sampled, output=[3])
    assert {pick(row, state) for _ in range(200)} <= {1, 2, 3, 4, 6, 7}


ROW = np.log(np.array([[0.30, 0.20, 0.15, 0.12, 0.10, 0.06, 0.04, 0.03]], dtype=np.float32))


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        # cumulative 0.30, 0.50, 0.65, 0.77: the token that crosses 0.6 is kept
        (SamplingParams(top_p=0.6), {0, 1, 2}),
        (SamplingParams(top_p=0.25), {0}),
        # min_p 0.35 keeps probabilities >= 0.105
        (SamplingParams(min_p=0.35), {0, 1, 2, 3}),
        (SamplingParams(top_k=5, top_p=0.7, min_p=0.6), {0, 1}),
        (SamplingParams(top_k=4, temperature=3.0), {0, 1, 2, 3}),
    ],
    ids=["top_k", "top_p", "top_p_one", "min_p", "combined", "top_k_hot"],
)
def test_filters_never_sample_outside_the_allowed_set(
    params: SamplingParams, allowed: set[int]
) -> None:
    seen = set(draws(ROW, params, 1500).tolist())
    assert seen == allowed  # nothing outside, and every allowed token does come up


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_empirical_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    row = np.array([[2.0, 1.0, 0.5, 0.0, -0.5, -3.0]], dtype=np.float32)
    count = 4000
    tokens = draws(row, SamplingParams(temperature=temperature), count, seed=42)
    observed = np.bincount(tokens, minlength=row.shape[1]) / count
    expected = softmax(row[0].astype(np.float64) / temperature)
    # 4 standard errors of a frequency near 0.5 over 4000 draws is ~0.03
    np.testing.assert_allclose(observed, expected, atol=0.03)


def test_logprobs_give_the_chosen_token_and_a_sorted_top_n() -> None:
    rng = np.random.default_rng(1)
    vocab = 16
    logits = rng.normal(0.0, 2.0, (3, vocab)).astype(np.float32)
    states = [
        make_state(SamplingParams(temperature=0.0, logprobs=3)),
        make_state(SamplingParams(temperature=1.0)),  # asks for none
        make_state(SamplingParams(temperature=1.0, logprobs=vocab), seed=9),
    ]
    tokens, logprobs = sample(logits, states)
    assert logprobs is not None and logprobs[1] is None
    expected = [np.log(softmax(row.astype(np.float64))) for row in logits]

    assert logprobs[0].token_id == tokens[0]  # a TokenLogprob, as the engine sends it on
    chosen, top = logprobs[0].logprob, logprobs[0].top
    assert tokens[0] == int(logits[0].argmax())
    assert chosen == pytest.approx(expected[0][tokens[0]], abs=1e-5)
    assert [t for t, _ in top] == np.argsort(-expected[0])[:3].tolist()
    assert top[0] == (tokens[0], pytest.approx(chosen))
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)

    chosen, top = logprobs[2].logprob, logprobs[2].top
    assert chosen == pytest.approx(expected[2][tokens[2]], abs=1e-5)
    assert sorted(t for t, _ in top) == list(range(vocab))
    assert sum(np.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-6)
    for token, lp in top:
        assert lp == pytest.approx(expected[2][token], abs=1e-5)


def test_logprobs_zero_returns_only_the_chosen_token() -> None:
    row = logits_row({3: 4.0})
    tokens, logprobs = sample(row, [make_state(SamplingParams(temperature=0.0, logprobs=0))])
    assert tokens == [3] and logprobs is not None and logprobs[0] is not None
    chosen, top = logprobs[0].logprob, logprobs[0].top
    assert top == [] and chosen == pytest.approx(float(np.log(softmax(row[0])[3])), abs=1e-6)


# ---- logit bias ----


def test_logit_bias_moves_the_greedy_pick_and_leaves_the_other_rows_alone() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0.0, 3.0, (4, 40)).astype(np.float32)
    argmax = logits.argmax(axis=-1)
    up = int(np.argsort(logits[0])[0])  # the least likely token of row 0
    down = int(argmax[2])
    states = [
        make_state(SamplingParams(temperature=0.0, logit_bias={up: 100.0})),
        make_state(SamplingParams(temperature=0.0)),
        make_state(SamplingParams(temperature=0.0, logit_bias={down: -100.0})),
        make_state(SamplingParams(temperature=0.0)),
    ]
    assert not states[0].plain_greedy and states[1].plain_greedy  # the fast path is not taken
    before = logits.copy()
    tokens, _ = sample(logits, states)
    assert tokens[0] == up
    assert tokens[1] == argmax[1] and tokens[3] == argmax[3]
    assert tokens[2] == int(np.argsort(logits[2])[-2])  # the runner-up
    np.testing.assert_array_equal(logits, before)  # the batch's logits are not written to


def test_logit_bias_shifts_sampling_and_keeps_logprobs_the_models_own() -> None:
    row = logits_row({1: 2.0, 2: 1.0})
    params = SamplingParams(temperature=1.0, logit_bias={5: 100.0}, logprobs=1)
    state = make_state(params, seed=3)
    for _ in range(50):
        tokens, logprobs = sample(row, [state])
        assert tokens == [5]
        assert logprobs is not None and logprobs[0] is not None
        chosen, top = logprobs[0].logprob, logprobs[0].top
        assert chosen == pytest.approx(float(np.log(softmax(row[0].astype(np.float64))[5])))
        assert top[0][0] == 1  # the most likely token without the bias
    small = SamplingParams(temperature=1.0, logit_bias={2: 1.0})
    counts = np.bincount(draws(row, small, 4000, seed=2), minlength=8) / 4000
    expected = softmax(row[0].astype(np.float64) + np.eye(8)[2])
    np.testing.assert_allclose(counts, expected, atol=0.03)


def test_logit_bias_ids_past_the_row_are_ignored_by_the_sampler() -> None:
    # The worker's step check refuses them; the sampler must still not index past the row.
    row = logits_row({3: 4.0})
    params = SamplingParams(temperature=0.0, logit_bias={100: 100.0, 1: 50.0})
    assert pick(row, make_state(params)) == 1


@pytest.mark.parametrize(
    ("bias", "word"),
    [
        ({1: 100.5}, "[-100, 100]"),
        ({1: float("nan")}, "numbers"),
        ({1: True}, "numbers"),
        ({-1: 1.0}, "non-negative"),
        ({"1": 1.0}, "token ids"),
        ([(1, 2.0, 3.0)], "map"),
        (5, "map"),
    ],
)
def test_logit_bias_is_validated(bias: object, word: str) -> None:
    with pytest.raises(ValueError, match="logit_bias") as info:
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert word in str(info.value)


def test_logit_bias_is_kept_as_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert params.logit_bias == [(2, -3.5), (9, 1.0)]
    assert SamplingParams(logit_bias=[(9, 1.0), (2, -3.5)]).logit_bias == params.logit_bias


# ---- through the engine ----


@pytest.fixture(scope="module")
def model_path(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[LLM]:
    yield LLM(str(model_path), block_size=16, kv_cache_memory="64MiB", max_model_len=256)


def other_requests() -> tuple[list[str | list[int]], list[SamplingParams]]:
    """Six requests of different lengths and kinds to share a batch with the seeded one."""
    rng = np.random.default_rng(5)
    prompts: list[str | list[int]] = [
        "A journey of a thousand miles",
        rng.integers(1, 300, 70).tolist(),
        "To be",
        rng.integers(1, 300, 33).tolist(),
        "All that glitters is not gold; all who wander are not lost.",
        rng.integers(1, 300, 5).tolist(),
    ]
    params = [
        SamplingParams(seed=1, temperature=1.0, max_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(seed=99, temperature=0.7, top_k=5, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, max_tokens=12),  # unseeded
        SamplingParams(seed=7, temperature=0.5, min_p=0.1, max_tokens=3, logprobs=2),
    ]
    return prompts, params


def seeded_in_batch(llm: LLM, position: int) -> list[int]:
    prompts, params = other_requests()
    prompts.insert(position, PROMPT)
    params.insert(position, SEEDED)
    outputs = llm.generate(prompts, params)
    assert outputs[position].prompt_token_ids == llm.tokenizer.encode(PROMPT)
    return outputs[position].outputs[0].token_ids


def test_seeded_sampling_is_the_same_alone_in_any_batch_and_under_any_config(
    llm: LLM, model_path: Path
) -> None:
    alone = llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    assert len(alone) == SEEDED.max_tokens
    for position in (0, 3, 6):
        assert seeded_in_batch(llm, position) == alone, f"differs at batch position {position}"
    # Bigger blocks, prefills chunked 16 tokens at a time, and a pool small enough to preempt.
    other = LLM(
        str(model_path),
        block_size=32,
        max_num_batched_tokens=16,
        num_kv_blocks=7,
        max_model_len=128,
        max_num_seqs=8,
    )
    assert other.generate(PROMPT, SEEDED)[0].outputs[0].token_ids == alone
    assert seeded_in_batch(other, 2) == alone
    assert other.engine.scheduler.stats.num_preemptions > 0


def test_different_seeds_give_different_outputs(llm: LLM) -> None:
    base = llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    others = llm.generate(
        [PROMPT] * 3,
        [replace(SEEDED, seed=seed) for seed in (1, 2, 3)],
    )
    assert any(o.outputs[0].token_ids != base for o in others)


@pytest.fixture(scope="module")
def greedy_output(llm: LLM) -> tuple[list[int], str]:
    completion = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    return completion.token_ids, completion.text


def test_stop_token_ids_end_the_output_at_that_token(
    llm: LLM, greedy_output: tuple[list[int], str]
) -> None:
    tokens, _ = greedy_output
    at = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    params = replace(GREEDY, stop_token_ids=[tokens[at]])
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    assert completion.token_ids == tokens[: at + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == tokens[at]


def test_stop_string_truncates_text_before_it(
    llm: LLM, greedy_output: tuple[list[int], str]
) -> None:
    _, text = greedy_output
    start = next(
        i
        for i in range(len(text) // 3, len(text) - 2)
        if text[i : i + 2].isprintable()
        and "\ufffd" not in text[i : i + 2]
        and text.find(text[i : i + 2]) == i
    )
    stop = text[start : start + 2]
    params = replace(GREEDY, stop=[stop])
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    assert completion.text == text[:start]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.token_ids == greedy_output[0][: len(completion.token_ids)]


def test_a_stop_string_on_the_last_allowed_token_still_reports_stop(
    llm: LLM, greedy_output: tuple[list[int], str]
) -> None:
    tokens, _ = greedy_output
    texts = [llm.tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)]
    # A token that adds one new printable character: stop on it with max_tokens ending there.
    k = next(
        k
        for k in range(2, len(tokens))
        if len(texts[k]) == len(texts[k - 1]) + 1
        and texts[k][-1].isprintable()
        and texts[k][-1] != "\ufffd"
        and texts[k].find(texts[k][-1]) == len(texts[k]) - 1
    )
    stop = texts[k][-1]
    completion = llm.generate(PROMPT, replace(GREEDY, max_tokens=k, stop=[stop]))[0].outputs[0]
    assert completion.token_ids == tokens[:k]
    assert completion.text == texts[k - 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    assert len(completion.token_ids) == 5
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None


def test_n_with_a_seed_returns_n_reproducible_outputs(llm: LLM) -> None:
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPT, params)[0]
    again = llm.generate(["To be", PROMPT], params)[1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_n_seeds_wrap_at_64_bits(llm: LLM) -> None:
    params = SamplingParams(n=2, seed=2**64 - 1, temperature=1.0, max_tokens=8, ignore_eos=True)
    last, wrapped = llm.generate(PROMPT, params)[0].outputs
    assert not llm.engine.has_unfinished_requests()
    for seed, completion in ((-1, last), (0, wrapped)):
        same = llm.generate(PROMPT, replace(params, n=1, seed=seed))[0].outputs[0]
        assert completion.token_ids == same.token_ids


def test_greedy_logprobs_put_the_chosen_token_first(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    completion = llm.generate(PROMPT, params)[0].outputs[0]
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids) == 10
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry.token_id == token_id
        assert len(entry.top) == 2
        assert entry.top[0] == (token_id, pytest.approx(entry.logprob))
        assert entry.top[0][1] >= entry.top[1][1]
        assert entry.logprob <= 0.0
