"""Issue 16's request parameters against a real ``ketch serve --model tiny``, with the official
``openai`` client: ``logit_bias``, ``echo``, ``prompt_logprobs``, the logprobs maximum,
``best_of``, ``suffix``, ``user``, and that ``min_p``, ``repetition_penalty`` and a ``seed`` with
``n > 1`` keep giving what the offline engine gives.
"""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest
import torch
from serve_harness import greedy

from hf_models import hf_model
from ketch.engine import SamplingParams
from ketch.engine.models.loader import TINY_MODEL_DIR

PROMPT = "Alice was beginning to get very tired"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(reference_llm):
    return reference_llm.tokenizer


@pytest.fixture(scope="module")
def biased_token(tokenizer) -> int:
    """A printable token that is not the model's greedy pick for PROMPT."""
    return tokenizer.encode(" Queen", add_special_tokens=False)[-1]


def complete(client: openai.OpenAI, **fields):
    fields = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, **fields}
    return client.completions.create(**fields)


def bad_request(call, *args, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call(*args, **kwargs)
    return info.value


# ---- logit_bias ----


def test_plus_100_makes_greedy_pick_the_token(client, reference_llm, tokenizer, biased_token):
    plain = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    assert biased_token not in plain.token_ids
    out = complete(client, temperature=0, logit_bias={str(biased_token): 100})
    assert out.choices[0].text == tokenizer.decode([biased_token] * MAX_TOKENS)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Who was tired?"}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(biased_token): 100},
    )
    assert chat.choices[0].message.content == tokenizer.decode([biased_token] * 4)


def test_minus_100_on_the_greedy_token_changes_the_output(client, reference_llm):
    plain = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    first = plain.token_ids[0]
    out = complete(client, temperature=0, logit_bias={str(first): -100})
    assert out.choices[0].text != plain.text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={first: -100})
    offline = reference_llm.generate(PROMPT, params)[0].outputs[0]
    assert out.choices[0].text == offline.text and first not in offline.token_ids


def test_sampled_with_a_bias_equals_the_offline_engine(client, reference_llm, biased_token):
    bias = {biased_token: 4.0}
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, logit_bias=bias)
    want = reference_llm.generate(PROMPT, params)[0].outputs[0].text
    out = complete(
        client, temperature=1.0, seed=11, max_tokens=12, logit_bias={str(biased_token): 4}
    )
    assert out.choices[0].text == want


def test_a_bias_does_not_leak_into_concurrent_requests(
    server, reference_llm, tokenizer, biased_token
):
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    expected = greedy(reference_llm, prompts, 16)

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        bias = {str(biased_token): 100} if i % 2 == 0 else None
        out = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=16, temperature=0, logit_bias=bias
        )
        return out.choices[0].text

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    for i, (text, want) in enumerate(zip(asyncio.run(run_all()), expected, strict=True)):
        assert text == (tokenizer.decode([biased_token] * 16) if i % 2 == 0 else want.text), i


@pytest.mark.parametrize(
    ("bias", "word"),
    [
        ({"1024": 5}, "outside"),  # the tiny model's vocabulary is 1024 tokens
        ({"5": 100.5}, "[-100, 100]"),
        ({str(t): 1 for t in range(1025)}, "at most 1024"),
        ({"a5": 1}, "token ids"),
    ],
)
def test_bad_logit_bias_is_400_naming_it(client, bias: dict, word: str):
    error = bad_request(complete, client, logit_bias=bias)
    assert error.body["param"].startswith("logit_bias") and word in error.body["message"]


# ---- echo and prompt_logprobs ----


def test_echo_prepends_the_prompt(client, reference_llm, tokenizer):
    want = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    out = complete(client, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + want.text
    ids = tokenizer.encode(PROMPT)
    by_ids = complete(client, prompt=ids, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + want.text
    two = complete(client, prompt=[PROMPT, "The Queen"], n=2, temperature=0, echo=True)
    starts = [
        c.text[: len(p)]
        for c, p in zip(two.choices, [PROMPT, PROMPT, "The Queen", "The Queen"], strict=True)
    ]
    assert starts == [PROMPT, PROMPT, "The Queen", "The Queen"]


def test_echo_streams_the_prompt_first(client, reference_llm):
    want = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    chunks = list(complete(client, temperature=0, echo=True, stream=True, n=2))
    for index in (0, 1):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
        assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + want.text


def _hf_log_softmax(ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(TINY_MODEL_DIR)(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_prompt_logprobs_equal_transformers(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = complete(client, temperature=0, max_tokens=2, extra_body={"prompt_logprobs": 2})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    want = _hf_log_softmax(ids)
    got = np.array([scored[k][str(ids[k])]["logprob"] for k in range(1, len(ids))])
    expected = want[np.arange(len(ids) - 1), ids[1:]]
    assert np.abs(got - expected).max() / np.abs(expected).max() <= 1e-4
    for k in range(1, len(ids)):
        top = np.argsort(-want[k - 1])[:2].tolist()
        ranked = {int(t): e["rank"] for t, e in scored[k].items() if e["rank"] is not None}
        assert ranked == {top[0]: 1, top[1]: 2}, k
        assert scored[k][str(ids[k])]["decoded_token"] == tokenizer.decode([ids[k]], False)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )
    chat_scored = chat.model_extra["prompt_logprobs"]
    assert chat_scored[0] is None and len(chat_scored) == len(chat_ids)
    assert [list(e) for e in chat_scored[1:]] == [[str(t)] for t in chat_ids[1:]]


def test_echo_with_logprobs_scores_the_prompt_tokens(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    scored = complete(client, temperature=0, max_tokens=2, extra_body={"prompt_logprobs": 1})
    scored = scored.choices[0].model_extra["prompt_logprobs"]
    for stream in (False, True):
        out = complete(client, temperature=0, max_tokens=2, echo=True, logprobs=1, stream=stream)
        chunks = list(out) if stream else [out]
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        values = [v for lp in logprobs for v in lp.token_logprobs]
        assert len(tokens) == len(ids) + 2 and values[0] is None
        assert values[1 : len(ids)] == [
            scored[k][str(ids[k])]["logprob"] for k in range(1, len(ids))
        ]
        assert logprobs[0].top_logprobs[0] is None and len(logprobs[0].top_logprobs[1]) == 2


def test_prompt_logprobs_are_not_streamed(client):
    error = bad_request(complete, client, stream=True, extra_body={"prompt_logprobs": 1})
    assert error.body["param"] == "prompt_logprobs"


# ---- logprobs maximum, best_of, suffix, user ----


def test_logprobs_up_to_20_and_no_more(client):
    out = complete(client, temperature=0, max_tokens=2, logprobs=20)
    assert all(len(top) >= 20 for top in out.choices[0].logprobs.top_logprobs)
    assert bad_request(complete, client, logprobs=21).body["param"] == "logprobs"
    chat = client.chat.completions.create
    messages = [{"role": "user", "content": "hi"}]
    ok = chat(model="tiny", messages=messages, max_tokens=2, logprobs=True, top_logprobs=20)
    assert all(len(e.top_logprobs) == 20 for e in ok.choices[0].logprobs.content)
    error = bad_request(chat, model="tiny", messages=messages, logprobs=True, top_logprobs=21)
    assert error.body["param"] == "top_logprobs"


def test_best_of_n_is_accepted_and_more_refused(client, reference_llm):
    want = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    assert complete(client, temperature=0, best_of=1).choices[0].text == want.text
    error = bad_request(complete, client, best_of=3)
    assert error.body["param"] == "best_of" and "not supported" in error.body["message"]


def test_suffix_is_refused_and_user_ignored(client, reference_llm):
    error = bad_request(complete, client, suffix="The end.")
    assert error.body["param"] == "suffix" and "suffix" in error.body["message"]
    want = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    assert complete(client, temperature=0, user="alice").choices[0].text == want.text


# ---- what keeps working ----


@pytest.mark.parametrize(
    "fields",
    [{"min_p": 0.2}, {"repetition_penalty": 1.4}, {"min_p": 0.05, "repetition_penalty": 0.8}],
)
def test_min_p_and_repetition_penalty_equal_the_offline_engine(client, reference_llm, fields):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, **fields)
    want = reference_llm.generate(PROMPT, params)[0].outputs[0].text
    extra = {k: v for k, v in fields.items()}
    out = complete(client, temperature=1.0, seed=3, max_tokens=16, extra_body=extra)
    assert out.choices[0].text == want


def test_a_seed_with_n_above_1_is_reproducible(client, reference_llm):
    params = SamplingParams(n=3, temperature=2.0, seed=5, max_tokens=12)
    want = [c.text for c in reference_llm.generate(PROMPT, params)[0].outputs]
    runs = [
        [c.text for c in complete(client, n=3, temperature=2.0, seed=5, max_tokens=12).choices]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] == want
    assert len(set(want)) > 1  # each choice has its own seed
