"""Prefill/decode disaggregation across tensor-parallel sizes: a prefill instance of two ranks
hands its KV blocks to a decode instance of one, through their cache managers and the router,
and the outputs equal a mixed instance's. The KV segment has the same layout at any TP size
(each rank views its KV heads in it), so instances of different sizes exchange blocks as is."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from pd_harness import running_pods
from router_harness import Router
from serve_harness import Server
from test_pd_exactness import _complete, _prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    mixed = Server("--max-num-seqs", "32")
    try:
        with running_pods(
            ("prefill", "--tensor-parallel-size", "2", "--max-num-batched-tokens", "48"),
            ("decode",),
        ) as (prefill, decode):
            mixed.wait_ready()
            router = Router("--prefill", prefill.url, "--decode", decode.url)
            try:
                yield {"router": router, "mixed": mixed}
            finally:
                router.stop()
    finally:
        mixed.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_two_rank_prefill_feeds_a_one_rank_decode_exactly(cluster: dict, stream: bool) -> None:
    prompts = _prompts(num_plain=10)
    with ThreadPoolExecutor(4) as pool:
        mixed = list(pool.map(lambda p: _complete(cluster["mixed"].url, p, stream), prompts))
        pd = list(pool.map(lambda p: _complete(cluster["router"].url, p, stream), prompts))
    for prompt, want, got in zip(prompts, mixed, pd, strict=True):
        assert got == want, f"prompt {prompt!r}: disaggregated {got!r} != mixed {want!r}"
