"""``ketch serve --speculative-config`` (issue 31) through the openai client: the completions,
streamed or not, with stop strings, logprobs and n > 1, are the offline engine's without
speculation; /metrics counts proposals and the startup log names the method and k."""

from __future__ import annotations

import json

import openai
import pytest
from serve_harness import KV_MEMORY, metric, running_server, scrape

from ketch.engine import LLM, SamplingParams
from ketch.engine.models.paths import TINY_MODEL_DIR

CORPUS = (TINY_MODEL_DIR / "corpus.txt").read_text()
# A passage and then its own beginning: the tiny model has memorised the corpus, so it goes on
# with text the prompt already holds, which the n-gram lookup finds.
PROMPTS = [CORPUS[800:1300] + CORPUS[800:900], CORPUS[4000:4400] + CORPUS[4000:4060]]
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", block_size=16, kv_cache_memory=KV_MEMORY)


@pytest.fixture(scope="module")
def server():
    with running_server("--speculative-config", SPEC) as srv:
        yield srv


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_completions_equal_decoding_without_speculation(server, offline):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, params)]
    client = client_of(server)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0)
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=64, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    samples = scrape(server.url)
    assert metric(samples, "spec_decode_num_draft_tokens_total") > 0
    accepted = metric(samples, "spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    rate = metric(samples, "spec_decode_draft_acceptance_rate")
    assert rate == pytest.approx(accepted / metric(samples, "spec_decode_num_draft_tokens_total"))
    assert metric(samples, "spec_decode_mean_accepted_length") > 1.0
    assert "speculative decoding: ngram, k=4" in server.log()


def test_stop_strings_logprobs_and_n(server, offline):
    client = client_of(server)
    prompt = PROMPTS[0]
    full = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64))
    text = full[0].outputs[0].text
    stop = text[30:34]  # met inside a run of kept proposals: the text is cut there all the same
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=[stop], logprobs=2)
    want = offline.generate(prompt, params)[0].outputs[0]
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=64, temperature=0, stop=[stop], logprobs=2
    )
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == "stop"
    assert len(choice.logprobs.tokens) == len(want.token_ids)
    for lp, expected in zip(choice.logprobs.token_logprobs, want.logprobs, strict=True):
        assert lp == pytest.approx(expected.logprob, abs=1e-4)
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=64, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    # n > 1, sampled with a seed: reproducible, and each choice its own sequence
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0.9, n=3, seed=4)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    again = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == again and len(set(first)) > 1


def test_json_object_with_speculation(server):
    client = client_of(server)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": 'Answer in JSON: {"a": 1, "a": 1, "a": 1'}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        json.loads(choice.message.content)
    else:  # cut by max_tokens: still a prefix the grammar allowed
        assert choice.message.content.lstrip().startswith("{")


def test_draft_model_server(offline):
    """method draft (the tiny model drafting for itself: every proposal is right), streamed and
    not: the offline engine's text without speculation."""
    config = '{"method": "draft", "num_speculative_tokens": 3, "model": "tiny"}'
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    with running_server("--speculative-config", config) as server:
        client = client_of(server)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            got = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=40, temperature=0
            )
            assert got.choices[0].text == want
            stream = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
        samples = scrape(server.url)
        assert metric(samples, "spec_decode_draft_acceptance_rate") > 0.9
        assert "speculative decoding: draft, k=3" in server.log()
