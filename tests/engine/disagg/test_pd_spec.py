"""Speculative decoding on the decode side of P/D (issue 31): the prompt's KV comes from a
prefill instance, the decode instance speculates (n-gram) from its first step on, and the text
is the offline engine's without speculation. Pods are real ``ketch serve`` processes with their
``ketch cache-manager`` sidecars."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from pd_harness import BLOCK_SIZE, Pod, all_blocks_free, running_pods
from serve_harness import metric, scrape, wait_for

from ketch.engine import LLM, SamplingParams
from ketch.engine.models.paths import TINY_MODEL_DIR

pytestmark = pytest.mark.timeout(300)

SPEC = (
    "--speculative-config",
    '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1}',
)
MAX_TOKENS = 40
CORPUS = (TINY_MODEL_DIR / "corpus.txt").read_text()


@pytest.fixture(scope="module")
def pods() -> Iterator[tuple[Pod, Pod]]:
    with running_pods(("prefill",), ("decode", *SPEC)) as (prefill, decode):
        yield prefill, decode


def test_decode_side_speculates_on_handed_over_kv(pods) -> None:
    prefill, decode = pods
    prompts = [CORPUS[800:1200] + CORPUS[800:880], CORPUS[3000:3300] + CORPUS[3000:3050]]
    reference = LLM("tiny", block_size=BLOCK_SIZE, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    want = [o.outputs[0].text for o in reference.generate(prompts, params)]
    received = decode.cm_metric("cache_manager_kv_received_bytes_total")
    got = []
    for prompt in prompts:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(
            f"{decode.url}/v1/completions",
            json=body,
            headers={"x-ketch-prefill": prefill.pd_address},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        got.append(response.json()["choices"][0]["text"])
    assert got == want
    assert decode.cm_metric("cache_manager_kv_received_bytes_total") > received
    samples = scrape(decode.url)
    assert metric(samples, "spec_decode_num_accepted_tokens_total") > 0
    wait_for(lambda: all_blocks_free(decode), 20, "decode's blocks freed", 0.2)
