"""A bfloat16 KV cache across processes: P/D transfer, the host prefix tier, and the refusal to
pair instances whose KV caches hold different dtypes.

Pods are real ``ketch serve`` processes with their ``ketch cache-manager`` sidecars. The
reference is the offline engine with the same bfloat16 cache: KV blocks computed on the prefill
instance and copied into the decode instance's cache (or evicted to the host and brought back)
hold the same bits as blocks computed in place, so the greedy text is the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from pd_harness import BLOCK_SIZE, Pod, all_blocks_free, running_pods
from serve_harness import metric, scrape, wait_for

from ketch.engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

BF16 = ("--kv-cache-dtype", "bfloat16")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny", block_size=BLOCK_SIZE, kv_cache_memory="64MiB", kv_cache_dtype="bfloat16")


def _want(reference: LLM, prompts: list) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [out.outputs[0].text for out in reference.generate(prompts, params)]


def _complete(url: str, prompt, headers: dict | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=60)


@pytest.fixture(scope="module")
def pods() -> Iterator[dict[str, Pod]]:
    with running_pods(("prefill", *BF16), ("decode", *BF16), ("prefill",)) as (p, d, f32):
        yield {"prefill": p, "decode": d, "prefill_f32": f32}


def test_prefill_to_decode_in_bfloat16_gives_the_offline_text(pods, reference) -> None:
    prefill, decode = pods["prefill"], pods["decode"]
    headers = {"x-ketch-prefill": prefill.pd_address}
    prompts = [
        "Alice was beginning to get very tired of sitting by her sister on the bank",
        [(7 * i + 3) % 200 + 5 for i in range(5 * BLOCK_SIZE + 3)],  # 6 blocks
        [(5 * i + 1) % 300 + 5 for i in range(2 * BLOCK_SIZE)],  # exactly 2 blocks
    ]
    sent = prefill.cm_metric("cache_manager_kv_sent_bytes_total")
    received = decode.cm_metric("cache_manager_kv_received_bytes_total")
    got = []
    for prompt in prompts:
        response = _complete(decode.url, prompt, headers)
        assert response.status_code == 200, response.text
        got.append(response.json()["choices"][0]["text"])
    assert got == _want(reference, prompts)
    received = decode.cm_metric("cache_manager_kv_received_bytes_total") - received
    sent = prefill.cm_metric("cache_manager_kv_sent_bytes_total") - sent
    # The tiny model: 4 layers x K/V x 2 KV heads x 16 tokens x 32 dims, 2 bytes each.
    block_bytes = 4 * 2 * 2 * BLOCK_SIZE * 32 * 2
    assert received > 0 and received == sent and received % block_bytes == 0


def test_instances_of_different_kv_dtypes_refuse_to_pair(pods) -> None:
    decode, other = pods["decode"], pods["prefill_f32"]
    headers = {"x-ketch-prefill": other.pd_address}
    response = _complete(decode.url, "Hello there", headers)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert (
        "KV cache dtype mismatch: the decode instance's KV cache holds bfloat16, this prefill "
        "instance's float32" in message
    )
    wait_for(lambda: all_blocks_free(decode), 20, "decode's blocks freed", 0.2)


PREFIX_BLOCKS = 4
NUM_PREFIXES = 4  # 16 prefix blocks; the pool below has 15 usable ones


def test_evicted_bfloat16_prefixes_come_back_from_the_host_tier(reference) -> None:
    """As test_swap, with a bfloat16 cache: the prefixes pushed out of a small device pool come
    back from the cache manager's host slots, and the text is the offline engine's."""
    pod = Pod(
        "mixed", *BF16, "--max-model-len", "128", "--num-kv-blocks", "16", "--max-num-seqs", "2"
    )
    try:
        pod.wait_ready()
        prompts = []
        for r in range(3):
            for p in range(NUM_PREFIXES):
                head = [(37 * p + 11 * i) % 400 + 5 for i in range(PREFIX_BLOCKS * BLOCK_SIZE)]
                prompts.append(head + [(13 * (r * 10 + p) + 7 * i) % 400 + 5 for i in range(5)])
        got = []
        for prompt in prompts:
            response = _complete(pod.url, prompt)
            assert response.status_code == 200, response.text
            got.append(response.json()["choices"][0]["text"])
        assert got == _want(reference, prompts)
        swapped_in = pod.cm_metric("cache_manager_swap_in_blocks_total")
        assert pod.cm_metric("cache_manager_swap_out_blocks_total") > 0
        assert swapped_in >= PREFIX_BLOCKS
        assert metric(scrape(pod.url), "prefix_cache_token_num") >= swapped_in * BLOCK_SIZE
    finally:
        pod.stop()
