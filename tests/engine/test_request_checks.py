"""One request check, one wording: ``request_checks.check_prompt`` is what ``LLM`` and the
engine's add-request path refuse with (the API server's side: tests/engine/serving/
test_serve_errors.py), and nothing of a refused request stays in the engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.request_checks import (
    PromptLimits,
    RequestCheckError,
    check_prompt,
    check_token_ids,
)

LIMITS = PromptLimits(vocab_size=100, max_model_len=8)
GENERATE = SamplingParams(max_tokens=2)
EMBED = SamplingParams(pooling="last")


def refusal(ids: list[int], params: SamplingParams, *where) -> RequestCheckError:
    with pytest.raises(RequestCheckError) as info:
        check_prompt(LIMITS, ids, params, *where)
    return info.value


@pytest.mark.parametrize(
    ("ids", "params", "message", "param"),
    [
        ([], GENERATE, "prompt is empty (no tokens)", "prompt"),
        ([1, 100, -2, 5], GENERATE,
         "prompt has token ids [100, -2] outside the vocabulary [0, 100)", "prompt"),
        ([1] * 8, GENERATE, "prompt is 8 tokens, but max_model_len is 8: it must be shorter to "
         "leave room for output", "prompt"),
        ([1] * 9, EMBED, "prompt is 9 tokens, but max_model_len is 8", "prompt"),
        ([1], SamplingParams(stop_token_ids=[3, 100, 7, 101]),
         "stop_token_ids has token ids [100, 101] outside the vocabulary [0, 100)",
         "stop_token_ids"),
        ([1], SamplingParams(logit_bias={250: 1.0}),
         "logit_bias has token ids [250] outside the vocabulary [0, 100)", "logit_bias"),
    ],
    ids=["empty", "outside-vocab", "too-long", "too-long-embedding", "stop-ids", "logit-bias"],
)  # fmt: skip
def test_each_failure_has_one_wording(ids, params, message: str, param: str) -> None:
    error = refusal(ids, params)
    assert (str(error), error.param) == (message, param)
    assert isinstance(error, ValueError)  # what LLM and the engine's callers catch


def test_what_passes_and_how_a_request_names_its_field() -> None:
    check_prompt(LIMITS, [0] * 7, GENERATE)  # one token of room left for output
    check_prompt(LIMITS, [99] * 8, EMBED)  # an embedding may fill the context
    error = refusal([1] * 9, EMBED, "input", 3)
    assert (str(error), error.param) == ("input 3 is 9 tokens, but max_model_len is 8", "input")
    assert str(refusal([], GENERATE, "prompt", 0)) == "prompt 0 is empty (no tokens)"
    check_token_ids(100, [], "tokens")
    with pytest.raises(RequestCheckError, match=r"^tokens has token ids \[1, 2, 3, 4, 5\] "):
        check_token_ids(1, list(range(1, 20)), "tokens")  # at most five are listed


@pytest.fixture(scope="module")
def llm(checkpoint) -> Iterator[LLM]:
    yield LLM(str(checkpoint("llama")), block_size=16, num_kv_blocks=32, max_model_len=32)


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        ("", GENERATE),
        ([], GENERATE),
        ([1, 10**6], GENERATE),
        ([1] * 32, GENERATE),
        ([1] * 33, EMBED),
        ([1, 2], SamplingParams(stop_token_ids=[10**6])),
        ([1, 2], SamplingParams(logit_bias={10**6: 1.0})),
    ],
    ids=["empty-text", "empty-ids", "outside-vocab", "too-long", "too-long-embedding",
         "stop-ids", "logit-bias"],
)  # fmt: skip
def test_llm_and_the_engine_refuse_with_the_check_s_words(
    llm: LLM, prompt, params: SamplingParams
) -> None:
    engine = llm.engine
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) and prompt else prompt
    with pytest.raises(RequestCheckError) as checked:
        check_prompt(engine.prompt_limits, ids or [], params)
    expected = str(checked.value)
    with pytest.raises(ValueError) as raised:
        if params.pooling is not None:
            llm.embed([[5, 6], prompt])
        else:
            llm.generate([[5, 6], prompt], params)
    assert str(raised.value) == expected
    with pytest.raises(RequestCheckError) as raised:  # the engine process's add-request path
        engine.add_request("refused", prompt, params)
    assert str(raised.value) == expected
    assert not engine.has_unfinished_requests()  # the good first prompt was not queued either
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_usable_blocks
