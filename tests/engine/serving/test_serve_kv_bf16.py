"""``ketch serve --kv-cache-dtype bfloat16``: through the openai client, the offline bfloat16
engine's greedy text; the start-up log names the KV cache's precision."""

from __future__ import annotations

import openai
import pytest
from serve_harness import running_server

from ketch.engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Alice was beginning to get very tired", "The Mouse"]
MAX_TOKENS = 24


def test_a_bfloat16_kv_cache_serves_the_offline_engines_text() -> None:
    offline = LLM("tiny", block_size=16, kv_cache_memory="16MiB", kv_cache_dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    with running_server("--kv-cache-dtype", "bfloat16") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        got = [
            client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        log = server.log_path.read_text(errors="replace")
    assert got == want
    assert "bfloat16 KV cache" in log
