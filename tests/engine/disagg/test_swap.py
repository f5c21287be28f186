"""Host swap space: prefix blocks evicted from a too-small device KV pool come back from the
cache manager's host memory instead of being recomputed, and outputs do not change.

Acceptance: with a device pool that cannot keep the shared prefixes and swap space enabled, the
outputs equal an unconstrained run's and the swap-in count is above zero.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from pd_harness import BLOCK_SIZE, Pod
from serve_harness import metric, scrape

pytestmark = pytest.mark.timeout(240)

PREFIX_BLOCKS = 4
NUM_PREFIXES = 4  # 16 prefix blocks; the pool below has 15 usable ones
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def small_pool() -> Iterator[Pod]:
    # max_model_len 128 needs 9 blocks per request; 16 blocks (15 usable) cannot hold 4 prefixes
    # of 4 blocks each plus their suffixes, so the prefixes are evicted and come back.
    pod = Pod("mixed", "--max-model-len", "128", "--num-kv-blocks", "16", "--max-num-seqs", "2")
    try:
        yield pod.wait_ready()
    finally:
        pod.stop()


@pytest.fixture(scope="module")
def reference():
    from ketch.engine import LLM

    return LLM("tiny", block_size=BLOCK_SIZE, kv_cache_memory="64MiB")


def _prompt(prefix: int, suffix: int) -> list[int]:
    head = [(37 * prefix + 11 * i) % 400 + 5 for i in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    return head + [(13 * suffix + 7 * i) % 400 + 5 for i in range(5)]


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_evicted_prefixes_come_back_from_host_swap_with_identical_outputs(
    small_pool: Pod, reference
) -> None:
    from ketch.engine import SamplingParams

    # Three rounds over the prefixes, each with new suffixes: from the second round on, every
    # prefix has been pushed out of the device pool by the others.
    prompts = [_prompt(p, r * 10 + p) for r in range(3) for p in range(NUM_PREFIXES)]
    got = [_complete(small_pool.url, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    want = [out.outputs[0].text for out in reference.generate(prompts, params)]
    assert got == want

    swapped_in = small_pool.cm_metric("cache_manager_swap_in_blocks_total")
    swapped_out = small_pool.cm_metric("cache_manager_swap_out_blocks_total")
    assert swapped_out > 0
    assert swapped_in >= PREFIX_BLOCKS  # at least one whole prefix came back from the host
    # The engine counted those blocks as prefix-cache hits (not recomputed).
    hits = metric(scrape(small_pool.url), "prefix_cache_token_num")
    assert hits >= swapped_in * BLOCK_SIZE
    print(f"swapped out {swapped_out:.0f}, in {swapped_in:.0f} blocks; {hits:.0f} hit tokens")


def test_ready_reports_the_attached_cache_manager(small_pool: Pod) -> None:
    info = small_pool.ready()
    assert info is not None and info["cache_manager"] == "attached"
