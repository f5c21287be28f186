"""One request's output is bounded before it runs, and a client that goes away frees its work
(security review H2 and M9; issue 28, deliverables 2 and 3), against real ``ketch serve``.

The disconnect case is the one the issue reported: three non-streaming requests with n=128 and
max_tokens=400 whose clients go away after one second held 256 sequences' slots (and their
engine work), and a fourth client's 4-token request got ``429 too many requests in flight``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_harness import Server, metric, running_server, scrape, sse_events

from ketch.engine.sampling_params import SamplingParams
from ketch.engine.serving.admission import check_output_size
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.protocol import ProtocolError
from procs import wait_for

FAN_OUT = {"model": "tiny", "prompt": "Alice was", "n": 128, "max_tokens": 400}
FAN_OUT_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Alice was"}],
    "n": 128,
    "max_tokens": 400,
}
BYSTANDER = {"model": "tiny", "prompt": "The Mouse", "max_tokens": 4, "temperature": 0}


# ---- bounded output ----


def test_the_output_bound_counts_sequences_tokens_and_logprobs() -> None:
    config = ServerConfig()  # the default, 2 M entries
    attack = SamplingParams(n=128, max_tokens=4096, logprobs=20, ignore_eos=True)
    with pytest.raises(ProtocolError) as refused:
        check_output_size(config, attack, [[1, 2, 3]], max_model_len=8192)
    assert refused.value.status_code == 400
    assert "--max-output-entries" in refused.value.message
    assert "2000000" in refused.value.message and "11010048" in refused.value.message
    # What people ask for passes: a whole 128 k context, 16 choices of 4 k tokens, logprobs.
    check_output_size(config, SamplingParams(max_tokens=None), [[1] * 8], 131072)
    check_output_size(config, SamplingParams(n=16, max_tokens=4096), [[1] * 8], 131072)
    check_output_size(config, SamplingParams(max_tokens=8192, logprobs=20), [[1] * 8], 131072)
    # max_tokens unset counts the room left; the prompt's own scores count too, per choice.
    small = ServerConfig(max_output_entries=1000)
    check_output_size(small, SamplingParams(max_tokens=None), [[1] * 24], 1024)
    with pytest.raises(ProtocolError):
        check_output_size(small, SamplingParams(max_tokens=None), [[1] * 23], 1024)
    scored = SamplingParams(n=2, max_tokens=1, prompt_logprobs=4)  # 2 x (1 + 99 x 5) = 992
    check_output_size(small, scored, [[1] * 99], 512)
    with pytest.raises(ProtocolError):
        check_output_size(small, scored, [[1] * 100], 512)


@pytest.fixture(scope="module")
def bounded() -> Iterator[Server]:
    with running_server("--max-output-entries", "200000") as srv:
        yield srv


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {**FAN_OUT, "logprobs": 5}),  # 128 x 400 x 6
        ("/v1/completions", {**FAN_OUT, "max_tokens": None, "logprobs": 3}),  # room left: 509
        ("/v1/completions", {**FAN_OUT, "prompt": "Alice was " * 60, "max_tokens": 1,
                              "prompt_logprobs": 20}),  # the prompt scored, per choice
        ("/v1/completions", {**FAN_OUT, "stream": True, "logprobs": 5}),  # streaming too
        ("/v1/chat/completions", {**FAN_OUT_CHAT, "logprobs": True, "top_logprobs": 20}),
    ],
)  # fmt: skip
def test_output_over_the_limit_is_400_naming_the_flag(bounded, path: str, body: dict) -> None:
    response = httpx.post(f"{bounded.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]["message"]
    assert "--max-output-entries" in message and "200000" in message
    assert httpx.post(f"{bounded.url}/v1/completions", json=BYSTANDER, timeout=60).is_success


def test_output_under_the_limit_is_served(bounded) -> None:
    body = {**BYSTANDER, "n": 4, "logprobs": 5, "max_tokens": 8, "prompt_logprobs": 5}
    response = httpx.post(f"{bounded.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["choices"]) == 4


# ---- disconnects free work ----


@pytest.fixture(scope="module")
def busy() -> Iterator[Server]:
    """The defaults the issue ran with (--max-concurrency 256, --max-choices 128)."""
    with running_server("--max-num-seqs", "64") as srv:
        yield srv


async def _abandon(url: str, path: str, body: dict, stream: bool) -> str:
    """A client that sends ``body`` and goes away after one second (a streaming one after its
    first event or one second, whichever comes first); what it saw."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=1.0)) as client:
        try:
            if not stream:
                response = await client.post(url + path, json=body)
                return str(response.status_code)
            async with client.stream("POST", url + path, json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    return str(r.status_code)
                async with asyncio.timeout(1.0):
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
                return "left"
        except (httpx.TimeoutException, TimeoutError):
            return "left"


def _served(url: str, deadline_s: float = 3.0) -> httpx.Response:
    """The bystander's request, retried on 429 for a few seconds (Retry-After says 1 s)."""
    deadline = time.monotonic() + deadline_s
    while True:
        response = httpx.post(f"{url}/v1/completions", json=BYSTANDER, timeout=60)
        if response.status_code != 429 or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def _engine_idle(url: str) -> bool:
    samples = scrape(url)
    return (
        metric(samples, "num_requests_running") == 0
        and metric(samples, "num_requests_waiting") == 0
        and metric(samples, "free_kv_block_num") == metric(samples, "max_kv_block_num")
    )


@pytest.mark.parametrize(
    "path, body, stream",
    [
        ("/v1/completions", FAN_OUT, False),  # the case
        ("/v1/chat/completions", FAN_OUT_CHAT, False),
        ("/v1/completions", FAN_OUT, True),
    ],
    ids=["completions", "chat", "stream"],
)
def test_abandoned_fan_outs_free_their_slots_and_the_engine(
    busy, path: str, body: dict, stream: bool
) -> None:
    fan_out = {**body, "ignore_eos": True}

    async def three() -> list[str]:
        return list(
            await asyncio.gather(*(_abandon(busy.url, path, fan_out, stream) for _ in range(3)))
        )

    aborted_before = _aborted(busy.url)
    seen = asyncio.run(three())
    assert seen.count("left") >= 2, seen  # 2 x 128 sequences fill --max-concurrency 256
    assert set(seen) <= {"left", "429"}, seen
    response = _served(busy.url)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["completion_tokens"] == 4
    # Their engine requests were aborted, not left running: the engine is idle again at once
    # (it would have 256 sequences x 400 tokens to go otherwise).
    wait_for(lambda: _engine_idle(busy.url), 5, "the engine to drop the abandoned requests")
    assert _aborted(busy.url) - aborted_before >= 256


def _aborted(url: str) -> float:
    return metric(scrape(url), "request_success_total", finish_reason="abort")


def test_a_stream_that_is_left_is_aborted(busy) -> None:
    """A single streaming choice, left after its first token: the engine drops it at once."""
    body = {**BYSTANDER, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{busy.url}/v1/completions", json=body, timeout=60) as r:
        for event in sse_events(r.iter_lines()):
            assert isinstance(event, dict)
            break
    wait_for(lambda: _engine_idle(busy.url), 5, "the engine to drop the stream's request")
    with contextlib.suppress(httpx.HTTPError):
        assert _served(busy.url).status_code == 200
