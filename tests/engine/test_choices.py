"""A request's choices (``ketch.engine.choices``): the one n-expansion, deltas added up."""

from __future__ import annotations

from ketch.engine.choices import expand, group, usage_counts
from ketch.engine.outputs import RequestDelta, TokenLogprob
from ketch.engine.sampling_params import SamplingParams
from ketch.engine.stats import RequestMetrics

METRICS = RequestMetrics(1.0, 1.5, 2.0, 3.0, 3, 2, 1, 0, "length")


def test_expand_gives_each_prompt_its_n_choices_with_seeds_apart() -> None:
    params = [SamplingParams(n=3, seed=2**64 - 2), SamplingParams(n=1)]
    choices = expand([[1, 2], [3]], params)
    assert [(c.index, c.prompt_index, c.index_in_prompt) for c in choices] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0),
    ]  # fmt: skip
    assert [c.params.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0, None]
    assert all(c.params.n == 1 for c in choices)
    assert choices[3].prompt_token_ids == [3]


def _deltas(logprobs: bool) -> list[RequestDelta]:
    scores = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in (7, 8, 9)]
    return [
        RequestDelta("r", [7], "a", num_prompt_tokens=2, num_cached_tokens=1,
                     logprobs=scores[:1] if logprobs else None,
                     prompt_logprobs=[TokenLogprob(2, -1.0)] if logprobs else None),
        RequestDelta("r", [8, 9], "bc", num_prompt_tokens=2, num_cached_tokens=1,
                     logprobs=scores[1:] if logprobs else None),
        RequestDelta("r", [], "", "length", num_prompt_tokens=2, num_cached_tokens=1,
                     logprobs=[] if logprobs else None, metrics=METRICS),
    ]  # fmt: skip


def test_an_accumulating_choice_adds_its_deltas_up_in_place() -> None:
    (choice,) = expand([[1, 2]], [SamplingParams(logprobs=1)])
    kept = choice.output().token_ids
    for i, delta in enumerate(_deltas(logprobs=True)):
        choice.add(delta)
        assert choice.first == (i == 0)
    out = choice.output()
    assert out.token_ids is kept  # extended, never re-copied per delta
    assert (out.text, out.token_ids, out.finish_reason) == ("abc", [7, 8, 9], "length")
    assert out.logprobs is not None and [e.token_id for e in out.logprobs] == [7, 8, 9]
    assert choice.prompt_logprobs == [TokenLogprob(2, -1.0)] and choice.metrics == METRICS
    assert (choice.num_tokens, choice.num_chars, choice.num_deltas) == (3, 3, 3)


def test_a_streaming_choice_counts_what_it_does_not_keep() -> None:
    (choice,) = expand([[1, 2]], [SamplingParams()], accumulate=False)
    for delta in _deltas(logprobs=False):
        choice.add(delta)
    assert (choice.num_tokens, choice.num_chars, choice.finished) == (3, 3, True)
    out = choice.output()
    assert out.text == "" and out.token_ids == [] and out.logprobs is None


def test_group_puts_choices_back_per_prompt_and_usage_counts_each_prompt_once() -> None:
    choices = expand([[1, 2], [3, 4, 5]], [SamplingParams(n=2), SamplingParams(n=1)])
    for choice in choices:
        choice.request_id = f"r{choice.index}"
        for delta in _deltas(logprobs=False):
            choice.add(delta)
    first, second = group(choices, 2)
    assert first.request_id == "r0" and second.request_id == "r2"
    assert [o.index for o in first.outputs] == [0, 1] and [o.index for o in second.outputs] == [0]
    assert first.finished and first.prompt_token_ids == [1, 2] and first.metrics == METRICS
    assert all(o.text == "abc" for o in first.outputs + second.outputs)
    assert usage_counts(choices) == (2 + 3, 3 * 3, 1 + 1)
