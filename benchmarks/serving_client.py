"""The load generator of ``bench_serving.py``: streaming completions, timed as ``vllm bench
serve`` times them (TTFT, ITL, TPOT, end-to-end latency), under a fixed concurrency or Poisson
arrivals. Traffic goes only to the base URL it is given (127.0.0.1 in the benchmark).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

SERVED_MODEL = "bench"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    """One streamed completion; SSE parsed by hand (``data: ...`` events split on blank lines).
    Sent once more, timed afresh, when the server closed the connection before any response
    (a kept-alive connection it had just closed: seen with llama.cpp's llama-server)."""
    result = await _one_request(client, url, prompt, max_tokens)
    if result.error.startswith("no response: "):
        result = await _one_request(client, url, prompt, max_tokens)
    return result


async def _one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    payload = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = start
    chunks = 0
    responded = False
    try:
        async with client.stream("POST", url, json=payload) as response:
            responded = True
            if response.status_code != 200:
                body = await response.aread()
                result.error = f"HTTP {response.status_code}: {body[:200]!r}"
                return result
            buffer = b""
            async for raw in response.aiter_bytes():
                buffer += raw
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    now = time.perf_counter()
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            result.ok = chunks > 0
                            continue
                        message = json.loads(data)
                        if "error" in message:
                            result.error = str(message["error"])[:200]
                            continue
                        if message.get("usage"):
                            result.output_tokens = int(message["usage"]["completion_tokens"])
                        if message.get("choices") and not summary(message):
                            if chunks == 0:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last)
                            last = now
                            chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, httpx.RemoteProtocolError) and not responded:
            result.error = "no response: " + result.error
        result.ok = False
    result.latency = time.perf_counter() - start
    if result.error:
        result.ok = False
    if result.ok and result.output_tokens == 0:
        result.output_tokens = chunks  # no usage chunk: one token per chunk
    return result


def summary(message: dict[str, Any]) -> bool:
    """The stream's closing usage chunk: vLLM and Ketch send it with no choices, llama.cpp's
    llama-server with one choice of empty text (its finish_reason) -- not a token either way."""
    return bool(message.get("usage")) and all(not c.get("text") for c in message["choices"])


@dataclass
class LoadResult:
    label: str
    results: list[RequestResult]
    duration: float

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def req_per_s(self) -> float:
        return len(self.completed) / self.duration

    @property
    def tok_per_s(self) -> float:
        return sum(r.output_tokens for r in self.completed) / self.duration

    def percentiles(self, metric: str) -> tuple[float, float]:
        """(p50, p99) in milliseconds; NaN when there is nothing to measure."""
        done = self.completed
        if metric == "ttft":
            values = [r.ttft for r in done]
        elif metric == "tpot":
            values = [t for r in done if (t := r.tpot) is not None]
        elif metric == "itl":
            values = [gap for r in done for gap in r.itl]
        else:
            values = [r.latency for r in done]
        if not values:
            return float("nan"), float("nan")
        p50, p99 = np.percentile(np.array(values) * 1000.0, [50, 99])
        return float(p50), float(p99)


async def run_load(
    base_url: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    read_timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Sends every prompt once: at most ``concurrency`` at a time, or Poisson at ``rate``/s.
    A request fails when nothing arrives for ``read_timeout`` s (a slow server's queue)."""
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    timeout = httpx.Timeout(read_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        if concurrency is not None:
            queue = list(reversed(prompts))
            results: list[RequestResult] = []

            async def worker() -> None:
                while queue:
                    results.append(await one_request(client, url, queue.pop(), max_tokens))

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        else:
            assert rate is not None
            gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts))
            tasks = []
            for prompt, gap in zip(prompts, gaps, strict=True):
                tasks.append(asyncio.create_task(one_request(client, url, prompt, max_tokens)))
                await asyncio.sleep(float(gap))
            results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def load(base_url: str, label: str, prompts: list[list[int]], max_tokens: int, **shape: Any):
    results, duration = asyncio.run(run_load(base_url, prompts, max_tokens, **shape))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  ! {label}: {len(failed)} failed, first: {failed[0].error}", file=sys.stderr)
    return LoadResult(label, results, duration)
