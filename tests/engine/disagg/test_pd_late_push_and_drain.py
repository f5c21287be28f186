"""Two prefill pods and one decode pod whose KV-transfer address is a link the test can hold
(``held_link``: the prefill cache managers' messages wait there while both ends stay connected).

1. A late push (acceptance 3 of the hardening issue): a prefill pod's KV push is held up (as
   while the pod restarts, or its node stalls), the request fails, decode gives its blocks to
   other requests; then the held push arrives. It is refused, and the other requests' outputs
   are exactly ``LLM.generate``'s.
2. Prefill drain: a prefill pod gets SIGTERM (engine and sidecar, as Kubernetes sends it) while
   its KV push for a decode pod is on its way; it finishes that work, the client gets the exact
   output, and both its processes exit 0.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from held_link import HeldLink
from pd_harness import BLOCK_SIZE, Pod, all_blocks_free
from serve_harness import KV_MEMORY, wait_for

pytestmark = pytest.mark.timeout(300)

DECODE_BLOCKS = 40  # 39 usable: small, so freed blocks are soon someone else's
BLOCK_BYTES = 4 * 2 * 2 * BLOCK_SIZE * 32 * 4  # tiny: layers x K,V x kv heads x tokens x dim x f32
DRAIN_WATCH_S = 4.0  # how long the draining prefill pod is watched with its push held


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    link = HeldLink()
    pods: list[Pod] = []
    try:
        # p1's pushes give up after 2 s: its request fails while its push is held.
        pods.append(Pod("prefill", cm_args=("--transfer-timeout", "2")))
        pods.append(Pod("prefill", cm_args=("--transfer-timeout", "30")))  # outlasts the hold
        pods.append(Pod(
            "decode", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", str(link.port),
            "--num-kv-blocks", str(DECODE_BLOCKS),
        ))  # fmt: skip
        link.upstream = pods[2].cm.kv_port  # prefill peers push to the link, it forwards
        for pod in pods:
            pod.wait_ready()
        p1, p2, decode = pods
        yield {"p1": p1, "p2": p2, "decode": decode, "link": link}
    finally:
        for pod in pods:
            pod.stop()
        link.close()


@pytest.fixture(scope="module")
def reference_llm():
    from ketch.engine import LLM

    return LLM("tiny", block_size=BLOCK_SIZE, kv_cache_memory=KV_MEMORY)


def _tokens(n: int, seed: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 400 + 5 for i in range(n)]


def _expected(llm, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """``LLM.generate``'s greedy texts."""
    from ketch.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(prompts, params)]


def _client(decode: Pod, prefill: Pod) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{decode.url}/v1", api_key="x", max_retries=0, timeout=120,
        default_headers={"x-ketch-prefill": prefill.pd_address},
    )  # fmt: skip


def _complete(decode: Pod, prefill: Pod, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    headers = {"x-ketch-prefill": prefill.pd_address}
    return httpx.post(f"{decode.url}/v1/completions", json=body, headers=headers, timeout=120)


def test_a_late_push_is_refused_and_other_requests_stay_exact(cluster, reference_llm) -> None:
    p1, p2, decode, link = cluster["p1"], cluster["p2"], cluster["decode"], cluster["link"]
    warm = _complete(decode, p2, _tokens(40, seed=1), 4)  # p2's pushes connect through the link
    assert warm.status_code == 200, warm.text
    failures = "cache_manager_kv_transfer_failures_total"
    refused_before = decode.cm_metric(failures, direction="receive")

    link.hold_next()  # p1's first push to decode: held once sent
    doomed = _complete(decode, p1, _tokens(300, seed=2), 4)  # 19 of decode's blocks
    assert doomed.status_code == 503, doomed.text
    assert "did not acknowledge" in doomed.json()["error"]["message"]
    assert link.held_bytes >= 19 * BLOCK_BYTES  # the whole push waits in the link
    wait_for(lambda: all_blocks_free(decode), 20, "decode freed the failed request's blocks")

    # Three requests take 12 blocks each: 36 of 39, so some of the 19 the push names.
    prompts = [_tokens(150, seed=3 + i) for i in range(3)]
    want = _expected(reference_llm, prompts, 40)
    client = _client(decode, p2)
    streams = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        for prompt in prompts
    ]  # fmt: skip
    chunks = [iter(stream) for stream in streams]
    texts = [next(it).choices[0].text for it in chunks]  # each one decoding now
    assert decode.engine_metric("free_kv_block_num") < DECODE_BLOCKS - 1 - 19

    link.release()  # the late push arrives
    wait_for(
        lambda: decode.cm_metric(failures, direction="receive") > refused_before,
        20,
        "decode's cache manager refusing the late push",
    )
    assert "refused: no KV blocks are reserved for request" in decode.cm.log()
    for i, it in enumerate(chunks):
        texts[i] += "".join(chunk.choices[0].text for chunk in it)
    for prompt, text, expected in zip(prompts, texts, want, strict=True):
        assert text == expected, f"prompt {prompt[:4]}...: {text!r} != {expected!r}"
    wait_for(lambda: all_blocks_free(decode), 20, "decode's blocks free again")
    assert all_blocks_free(p1) and all_blocks_free(p2)


def test_a_draining_prefill_pod_finishes_its_push_in_flight(cluster, reference_llm) -> None:
    p2, decode, link = cluster["p2"], cluster["decode"], cluster["link"]
    prompt = _tokens(100, seed=9)  # 7 blocks
    (want,) = _expected(reference_llm, [prompt], 8)
    link.hold_all()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_complete, decode, p2, prompt, 8)
        wait_for(lambda: link.held_bytes >= 7 * BLOCK_BYTES, 30, "p2's push held on its way")
        for proc in (p2.server.proc, p2.cm.proc):  # Kubernetes signals every container at once
            proc.send_signal(signal.SIGTERM)
        wait_for(lambda: p2.ready() is None, 10, "p2 draining (not ready)")
        # An idle instance would be gone by now; this one waits for its push.
        until = time.monotonic() + DRAIN_WATCH_S
        while time.monotonic() < until:
            assert p2.server.proc.poll() is None, f"p2 exited mid-push:\n{p2.server.log()}"
            assert p2.cm.proc.poll() is None, f"p2's sidecar exited mid-push:\n{p2.cm.log()}"
            time.sleep(0.1)
        link.release()
        response = pending.result()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want
    assert p2.server.proc.wait(60) == 0, p2.server.log()
    assert p2.cm.proc.wait(60) == 0, p2.cm.log()
    wait_for(lambda: all_blocks_free(decode), 20, "decode's blocks free again")
