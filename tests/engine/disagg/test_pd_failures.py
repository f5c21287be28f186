"""Failure injection on a disaggregated deployment: every client gets an error within a bounded
time, and the survivors keep serving and give back the blocks the failed requests held.

Two prefill and two decode pods (each ``ketch serve`` + ``ketch cache-manager``) behind a router.
The tests run in order on one deployment, each leaving it able to serve:

1. a decode instance out of blocks: a later request waits ``--pd-block-timeout`` then gets 503;
2. a prefill instance killed before hand-over: the decode instance gives up on it after
   ``--pd-peer-timeout`` (503), the router routes around it;
3. a decode instance killed mid-stream: the client's stream ends with an error, the prefill
   instance and the router keep serving.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pd_harness import Pod, all_blocks_free, running_pods
from router_harness import Router
from serve_harness import wait_for

pytestmark = pytest.mark.timeout(300)

PEER_TIMEOUT_S = 4
BLOCK_TIMEOUT_S = 2
BOUND_S = 30  # every failing client must have its error well within this
DECODE_ARGS = (
    "--pd-peer-timeout", str(PEER_TIMEOUT_S), "--pd-block-timeout", str(BLOCK_TIMEOUT_S),
    "--num-kv-blocks", "40",
)  # fmt: skip


@pytest.fixture(scope="module")
def pods() -> Iterator[dict[str, Pod]]:
    specs = [("prefill",), ("prefill",), ("decode", *DECODE_ARGS), ("decode", *DECODE_ARGS)]
    with running_pods(*specs) as (p1, p2, d1, d2):
        yield {"p1": p1, "p2": p2, "d1": d1, "d2": d2}


@pytest.fixture(scope="module")
def router(pods: dict[str, Pod]) -> Iterator[Router]:
    prefill = ",".join(pods[p].url for p in ("p1", "p2"))
    decode = ",".join(pods[d].url for d in ("d1", "d2"))
    router = Router("--prefill", prefill, "--decode", decode, "--policy", "round-robin")
    try:
        yield router
    finally:
        router.stop()


def _tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 31 + 17 * i) % 400 + 5 for i in range(n)]


def _paired(decode: Pod, prefill: Pod, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    """A request straight to a decode instance, paired with the given prefill instance."""
    headers = {"x-ketch-prefill": prefill.pd_address}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{decode.url}/v1/completions", json=body, headers=headers, timeout=BOUND_S)


def _serves(router: Router, count: int = 4) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    for i in range(count):
        out = client.completions.create(model="tiny", prompt=_tokens(20, i), max_tokens=4)
        assert out.choices[0].finish_reason in ("length", "stop")


def test_decode_out_of_blocks_answers_503_after_the_timeout(pods: dict[str, Pod]) -> None:
    p1, p2, d1 = pods["p1"], pods["p2"], pods["d1"]
    os.kill(p1.server.engine_pid(), signal.SIGSTOP)  # p1 never answers: d1 keeps the blocks
    try:
        with ThreadPoolExecutor(1) as pool:
            # 32 of d1's 39 blocks, reserved until p1 is given up on.
            holder = pool.submit(_paired, d1, p1, _tokens(500))
            wait_for(lambda: d1.engine_metric("free_kv_block_num") < 10, 20, "d1 reserving")
            refused = _paired(d1, p2, _tokens(200, seed=2))  # needs 13 blocks, 7 are free
            assert refused.status_code == 503, refused.text
            assert "no free KV blocks" in refused.json()["error"]["message"]
            held = holder.result()
        assert held.status_code == 503, held.text
        assert "did not answer" in held.json()["error"]["message"]
    finally:
        os.kill(p1.server.engine_pid(), signal.SIGCONT)
    # The given-up blocks come back (after a quarantine), and d1 serves again.
    wait_for(lambda: all_blocks_free(d1), 40, "d1's blocks freed", 0.5)
    assert _paired(d1, p2, _tokens(200, seed=3)).status_code == 200


def test_prefill_killed_before_hand_over(pods: dict[str, Pod], router: Router) -> None:
    p1, d2 = pods["p1"], pods["d2"]
    os.kill(p1.server.engine_pid(), signal.SIGSTOP)  # the prompt arrives, nothing comes back
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_paired, d2, p1, _tokens(100, seed=4))
        wait_for(lambda: d2.engine_metric("num_requests_waiting") > 0, 20, "d2 waiting on p1")
        p1.kill()
        started = time.monotonic()
        response = pending.result()
    assert response.status_code == 503, response.text
    assert p1.pd_address in response.json()["error"]["message"]
    assert time.monotonic() - started < BOUND_S
    # The router takes p1 out; the rest keeps serving and d2 frees the blocks.
    wait_for(lambda: not router.instances()[p1.url]["healthy"], 20, "router drops p1")
    _serves(router)
    wait_for(lambda: all_blocks_free(d2), 40, "d2's blocks freed", 0.5)


def test_decode_killed_mid_stream(pods: dict[str, Pod], router: Router) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.completions.create(
        model="tiny", prompt=_tokens(20, seed=5), max_tokens=480, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # the first token arrived: the request is decoding on one of d1, d2
    victim = next(
        pods[d] for d in ("d1", "d2") if pods[d].engine_metric("num_requests_running") > 0
    )
    victim.kill()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in chunks:
            pass
    survivor = pods["d2" if victim is pods["d1"] else "d1"]
    wait_for(lambda: not router.instances()[victim.url]["healthy"], 20, "router drops it")
    _serves(router)
    assert all_blocks_free(pods["p2"])
    assert all_blocks_free(survivor)
