"""The unmodified ``openai`` client against a real ``ketch serve --model tiny`` (acceptance 1, 2).

Greedy outputs must equal the offline ``LLM.generate`` for the same prompt, including under 64
concurrent streams (no lost or duplicated tokens).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from serve_harness import greedy

MAX_TOKENS = 12
PROMPT = "Alice was beginning to get very tired"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_ready_says_it_runs_without_a_cache_manager(server):
    # No sidecar here: the mixed instance serves, and /ready's detail says what is missing.
    detail = httpx.get(f"{server.url}/ready", timeout=10).json()
    assert detail["ready"] and detail["role"] == "mixed"
    assert detail["cache_manager"] == "not attached (no host swap space, no KV transfer)"


def test_completion_equals_llm_generate(client, reference_llm):
    expected = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.object == "text_completion"
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)


def test_streaming_completion_equals_llm_generate(client, reference_llm):
    expected = greedy(reference_llm, [PROMPT], MAX_TOKENS)[0]
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [expected.finish_reason]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_completion(client, reference_llm):
    messages = [{"role": "user", "content": "Who was tired?"}]
    expected = reference_llm.chat(messages, _greedy_params(MAX_TOKENS))[0].outputs[0]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)


def test_streaming_chat_completion(client, reference_llm):
    messages = [{"role": "user", "content": "Who was tired?"}]
    expected = reference_llm.chat(messages, _greedy_params(MAX_TOKENS))[0].outputs[0]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def _greedy_params(max_tokens: int):
    from ketch.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def test_64_concurrent_streams_equal_llm_generate(server, reference_llm):
    prompts = [f"Request {i}: the {'quick ' * (i % 5)}rabbit number {i * 7} ran" for i in range(64)]
    max_tokens = 16
    expected = greedy(reference_llm, prompts, max_tokens)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list, object]:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finishes, usage = [], [], None
        async for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.text)
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(pieces), finishes, usage

    async def run_all():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    for prompt, want, (text, finishes, usage) in zip(prompts, expected, results, strict=True):
        assert text == want.text, prompt
        assert finishes == [want.finish_reason], prompt
        assert usage is not None, prompt
        assert usage.completion_tokens == len(want.token_ids), prompt
        assert usage.prompt_tokens == len(reference_llm.tokenizer.encode(prompt)), prompt
