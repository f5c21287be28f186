"""Prefill + decode + router (+ their cache managers): the same outputs as a mixed instance.

Acceptance: greedy outputs through the router over a prefill and a decode instance equal a mixed
instance's for 32+ prompts, streaming and not, and KV bytes really moved between the cache
managers. Prompts cover one token, exact multiples of the block size, shared prefixes (the
decode instance then reuses its own prefix cache and asks for fewer blocks), chunked prefill on
the prefill side and a seeded sampled request (the decode side continues the same random stream).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from pd_harness import BLOCK_SIZE, Pod, all_blocks_free, running_pods
from router_harness import Router
from serve_harness import Server, wait_for
from test_structured_outputs import MESSAGES, SCHEMAS, City

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    mixed = Server("--max-num-seqs", "32")
    try:
        with running_pods(
            ("prefill", "--max-num-batched-tokens", "48"),  # long prompts prefill in chunks
            ("decode",),
            ("prefill", "--block-size", "32"),  # a KV layout the decode instance can't take
        ) as (prefill, decode, other_layout):
            mixed.wait_ready()
            router = Router("--prefill", prefill.url, "--decode", decode.url)
            try:
                yield {
                    "router": router,
                    "mixed": mixed,
                    "prefill": prefill,
                    "decode": decode,
                    "other_layout": other_layout,
                }
            finally:
                router.stop()
    finally:
        mixed.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompts(num_plain: int = 34) -> list[str | list[int]]:
    text = (
        "Alice was beginning to get very tired of sitting by her sister on the bank and of "
        "having nothing to do once or twice she had peeped into the book her sister was reading"
    )
    words = text.split(" ")
    shared = " ".join(words * 2)
    prompts: list[str | list[int]] = [shared + f" and then number {i}" for i in range(8)]
    prompts += [" ".join(words[: 1 + (i * 5) % len(words)]) for i in range(num_plain)]
    # Token-id prompts of exactly 1, 15, 16, 17, 32 and 80 tokens.
    prompts += [[(7 * i + 3) % 200 + 5 for i in range(n)] for n in (1, 15, 16, 17, 32, 80)]
    return prompts


def _complete(url: str, prompt: str | list[int], stream: bool, **extra) -> tuple[str, list]:
    client = _client(url)
    args = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    args.update(extra)
    if not stream:
        choice = client.completions.create(**args).choices[0]
        return choice.text, [choice.finish_reason]
    text, reasons = "", []
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.text
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return text, reasons


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_disaggregated_outputs_equal_mixed(cluster: dict, stream: bool) -> None:
    prompts = _prompts()
    assert len(prompts) >= 32
    with ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda p: _complete(cluster["mixed"].url, p, stream), prompts))
        pd = list(pool.map(lambda p: _complete(cluster["router"].url, p, stream), prompts))
    for prompt, want, got in zip(prompts, mixed, pd, strict=True):
        assert got == want, f"prompt {prompt!r}: disaggregated {got!r} != mixed {want!r}"


def test_kv_blocks_really_moved(cluster: dict) -> None:
    prefill: Pod = cluster["prefill"]
    decode: Pod = cluster["decode"]
    before = decode.cm_metric("cache_manager_kv_received_bytes_total")
    long_prompt = [(11 * i) % 300 + 4 for i in range(5 * BLOCK_SIZE + 3)]  # 6 blocks
    _complete(cluster["router"].url, long_prompt, stream=False)
    received = decode.cm_metric("cache_manager_kv_received_bytes_total") - before
    sent = prefill.cm_metric("cache_manager_kv_sent_bytes_total")
    assert received > 0 and sent >= received
    assert decode.cm_metric("cache_manager_kv_transfers_total", direction="receive") > 0


def test_seeded_sampling_continues_the_same_random_stream(cluster: dict) -> None:
    prompt = "Once upon a time there was"
    extra = {"temperature": 0.9, "seed": 1234, "top_p": 0.95}
    mixed = _complete(cluster["mixed"].url, prompt, False, **extra)
    pd = _complete(cluster["router"].url, prompt, False, **extra)
    assert pd == mixed


def test_chat_and_logprobs_through_the_router(cluster: dict) -> None:
    messages = [{"role": "user", "content": "Who sat by the bank?"}]
    want = _client(cluster["mixed"].url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    got = _client(cluster["router"].url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert got.choices[0].message.content == want.choices[0].message.content
    want_lp = [t.logprob for t in want.choices[0].logprobs.content]
    got_lp = [t.logprob for t in got.choices[0].logprobs.content]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)


def test_logit_bias_echo_and_prompt_logprobs_through_the_router(cluster: dict) -> None:
    """The prefill peer samples the first token with the request's bias and scores its prompt;
    the decode instance continues with the bias and returns the prefill peer's scores."""
    prompt = "Alice was beginning to get very tired of sitting"
    token = 500  # "Alice" in the tiny model's vocabulary: never its greedy pick here
    requests = [
        {"logit_bias": {str(token): 100}},
        {"logit_bias": {str(token): 5}, "temperature": 0.9, "seed": 7},
        {"echo": True, "logprobs": 2},
        {"extra_body": {"prompt_logprobs": 3}},
    ]
    for extra in requests:
        args = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
        want = _client(cluster["mixed"].url).completions.create(**args).choices[0]
        got = _client(cluster["router"].url).completions.create(**args).choices[0]
        assert got.text == want.text, extra
        if "logit_bias" in extra and "seed" not in extra:
            assert got.text == "Alice" * 6
        if "echo" in extra:
            assert got.text.startswith(prompt)
            assert got.logprobs.tokens == want.logprobs.tokens
            assert got.logprobs.token_logprobs[0] is None
            assert got.logprobs.token_logprobs[1:] == pytest.approx(
                want.logprobs.token_logprobs[1:], abs=1e-4
            )
        if "extra_body" in extra:
            got_scored = got.model_extra["prompt_logprobs"]
            want_scored = want.model_extra["prompt_logprobs"]
            assert got_scored[0] is None and len(got_scored) == len(want_scored)
            for mine, theirs in zip(got_scored[1:], want_scored[1:], strict=True):
                assert mine.keys() == theirs.keys()
                for key in mine:
                    assert mine[key]["logprob"] == pytest.approx(theirs[key]["logprob"], abs=1e-4)


def test_embeddings_through_the_router_equal_mixed(cluster: dict) -> None:
    """/v1/embeddings needs no pair: the router sends it to the prefill instance, which computes
    it alone (no KV moves); a decode instance asked directly computes it too."""
    inputs = [*[p for p in _prompts(4) if isinstance(p, str)][:6], [5] * 80]
    moved = cluster["decode"].cm_metric("cache_manager_kv_received_bytes_total")
    for extra in ({}, {"pooling": "mean"}):
        want = _client(cluster["mixed"].url).embeddings.create(
            model="tiny", input=inputs, extra_body=extra
        )
        for url in (cluster["router"].url, cluster["decode"].url):
            got = _client(url).embeddings.create(model="tiny", input=inputs, extra_body=extra)
            assert got.usage == want.usage
            for a, b in zip(got.data, want.data, strict=True):
                assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
    assert cluster["decode"].cm_metric("cache_manager_kv_received_bytes_total") == moved


def test_decode_instance_refuses_unpaired_requests(cluster: dict) -> None:
    with pytest.raises(openai.BadRequestError, match="ketch router"):
        _complete(cluster["decode"].url, "Hello", stream=False)


def test_kv_layout_mismatch_between_prefill_and_decode_is_refused(cluster: dict) -> None:
    decode, other = cluster["decode"], cluster["other_layout"]
    headers = {"x-ketch-prefill": other.pd_address}
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4}
    response = httpx.post(f"{decode.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 400
    assert "block_size is 16 on the decode instance, 32 here" in response.json()["error"]["message"]
    # Nothing is left reserved on the decode side.
    wait_for(lambda: all_blocks_free(decode), 20, "decode's blocks freed", 0.2)


def test_the_kv_destination_never_comes_from_the_request(cluster: dict) -> None:
    """A client that names another KV destination is ignored: the decode instance's own
    configured address receives the blocks, and the output is the mixed instance's."""
    decode, prefill = cluster["decode"], cluster["prefill"]
    headers = {"x-ketch-prefill": prefill.pd_address, "x-ketch-decode-host": "evil.invalid"}
    body = {"model": "tiny", "prompt": "Down the rabbit hole", "max_tokens": MAX_TOKENS}
    body["temperature"] = 0
    got = httpx.post(f"{decode.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert got.status_code == 200, got.text
    want, _ = _complete(cluster["mixed"].url, body["prompt"], False)
    assert got.json()["choices"][0]["text"] == want


# No shrinking: each example costs a few seconds of both deployments.
@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.generate])
@given(schema=SCHEMAS, stream=st.booleans(), seed=st.none() | st.integers(0, 2**31))
def test_structured_outputs_through_the_router(cluster: dict, schema, stream, seed) -> None:
    """The prefill peer samples the first token under the grammar (a free first token would
    break the decode side's matcher, resumed past it); outputs validate and equal a mixed
    instance's, greedy and seeded, streamed or not."""
    args = {"model": "tiny", "prompt": "Alice was beginning", "max_tokens": 200, "seed": seed}
    args.update(temperature=0.0 if seed is None else 1.0, extra_body={"guided_json": schema})
    want = _client(cluster["mixed"].url).completions.create(**args).choices[0]
    if stream:
        text, reasons = _complete(cluster["router"].url, args.pop("prompt"), True, **args)
    else:
        got = _client(cluster["router"].url).completions.create(**args).choices[0]
        text, reasons = got.text, [got.finish_reason]
    assert (text, reasons[-1]) == (want.text, "stop") == (want.text, want.finish_reason)
    jsonschema.validate(json.loads(text), schema)


def test_parse_through_the_router(cluster: dict) -> None:
    client = _client(cluster["router"].url)
    for temperature in (0.0, 1.0):
        out = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=City, max_tokens=300,
            temperature=temperature, seed=9,
        )  # fmt: skip
        assert isinstance(out.choices[0].message.parsed, City)
