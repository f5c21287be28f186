"""The HTTP API fuzzed from its own OpenAPI schema (issue 13, acceptance 2).

Bodies for ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``,
``POST /tokenize`` and ``POST /detokenize`` are drawn by hypothesis from the request schemas the
server publishes at ``/openapi.json`` (every declared field, of its type or broken with an
extreme value), derandomized and bounded. Each gets a 200 or a clear 4xx, never a 5xx;
afterwards the instance answers a plain request exactly as ``LLM.generate`` does and every KV
block is free.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_strategies import body_strategy
from serve_harness import assert_exact_and_idle

EXAMPLES = 375  # 75 per path
GENERATION_PATHS = ["/v1/completions", "/v1/chat/completions"]
PATHS = [*GENERATION_PATHS, "/v1/embeddings", "/tokenize", "/detokenize"]
MINIMAL = {
    "/v1/completions": {"model": "tiny", "prompt": "Alice", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
    },
    "/v1/embeddings": {"model": "tiny", "input": "Alice"},
    "/tokenize": {"prompt": "Alice"},
    "/detokenize": {"tokens": [1, 2]},
}  # fmt: skip
# Fields that only decide how long a valid request runs: kept small so the run stays bounded.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "min_tokens": 2}


def _bounded(body: dict) -> dict:
    for name, cap in CAPS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    return body


def test_published_schema_describes_the_bodies(server) -> None:
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()

    def properties(path: str) -> set[str]:
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = schema["schema"]["$ref"].rsplit("/", 1)[1]
        return set(document["components"]["schemas"][name]["properties"])

    for path in GENERATION_PATHS:
        assert {"model", "max_tokens", "temperature", "stop", "seed", "logit_bias"} <= set(
            properties(path)
        )
    assert {"prompt", "echo", "prompt_logprobs"} <= properties("/v1/completions")
    assert "messages" in properties("/v1/chat/completions")
    assert {"prompt", "messages", "add_special_tokens"} <= properties("/tokenize")
    assert properties("/detokenize") >= {"tokens"}
    assert {"input", "encoding_format", "dimensions", "pooling", "normalize"} <= properties(
        "/v1/embeddings"
    )
    assert "get" in document["paths"]["/version"]


def test_schema_fuzz_gets_4xx_or_200_and_leaves_the_instance_exact(server, reference_llm) -> None:
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    statuses: Counter[tuple[str, int]] = Counter()
    client = httpx.Client(base_url=server.url, timeout=60)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(PATHS))
        body = _bounded(data.draw(body_strategy(document, path, {"model": "tiny"})))
        try:
            content = json.dumps(body).encode()
        except (ValueError, UnicodeEncodeError):
            content = json.dumps(body, ensure_ascii=True).encode("utf-8", "surrogatepass")
        reply = client.post(path, content=content, headers={"content-type": "application/json"})
        statuses[path, reply.status_code] += 1
        assert reply.status_code < 500, (path, content[:300], reply.text[:300])
        if reply.status_code >= 400:
            assert reply.json()["error"]["message"]

    try:
        one()
    finally:
        client.close()
    assert sum(statuses.values()) >= EXAMPLES
    # Both sides were exercised on every endpoint. Few drawn bodies are valid (a completions
    # body is valid in about 1 draw in 50, so whether a 300-example run holds one is luck):
    # the fuzz must have drawn some valid body and a refused one for every path, and a minimal
    # valid body of each path's schema is sent too, so the 200 side is never left to chance.
    assert sum(n for (_, code), n in statuses.items() if code == 200) > 0, statuses
    for path in PATHS:
        assert statuses[path, 400] > 0, statuses
        reply = httpx.post(f"{server.url}{path}", json=MINIMAL[path], timeout=60)
        assert reply.status_code == 200, (path, reply.text[:300])
    assert_exact_and_idle(server.url, reference_llm)
