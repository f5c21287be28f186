"""examples/mixed.yaml, rendered by the operator and run as local processes.

Acceptance (issue 7): through the rendered Service, the ``openai`` client gets the outputs of
``LLM.generate``; a ConfigMap change (an engine flag) rolls the pods one at a time, readiness
respected, without dropping a request in flight.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from localpods import LocalCluster, localize
from localpods.testing import TIME_SCALE, example, reference_texts

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "Alice was beginning to get very tired",
    "The Queen of Hearts",
    "Down, down, down. Would the fall never come to an end",
    "Curiouser and curiouser",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def mixed() -> Iterator[tuple[LocalCluster, dict]]:
    isvc = localize(example("mixed.yaml"))
    cluster = LocalCluster(isvc, time_scale=TIME_SCALE)
    try:
        cluster.start().wait_ready()
        yield cluster, isvc
    finally:
        cluster.stop()


def test_openai_client_through_the_service_gets_llm_generate_outputs(mixed, reference) -> None:
    cluster, _ = mixed
    client = openai.OpenAI(
        base_url=cluster.service_url("tiny-mixed") + "/v1", api_key="unused", max_retries=0
    )
    want = reference_texts(reference, PROMPTS, MAX_TOKENS)
    for prompt, text in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert got.choices[0].text == text
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            if chunk.choices
        )
        assert streamed == text


def test_config_change_rolls_pods_one_at_a_time_without_dropping_requests(mixed) -> None:
    cluster, isvc = mixed
    url = cluster.service_url("tiny-mixed")
    old_pods = {p.name for p in cluster.pods["tiny-mixed"]}
    results: list[str] = []
    stop = threading.Event()
    least_ready = [len(old_pods)]

    def client_loop(stream: bool) -> None:
        # A new connection per request (as a fresh client would make): keep-alive would pin
        # the client to a pod that is going away.
        body = {"model": "tiny", "prompt": "Alice", "max_tokens": 48, "stream": stream}
        fresh = httpx.Limits(max_keepalive_connections=0)
        while not stop.is_set():
            try:
                with httpx.Client(timeout=60, limits=fresh) as c:
                    response = c.post(f"{url}/v1/completions", json=body)
                ok = response.status_code == 200 and (not stream or "[DONE]" in response.text)
                results.append("ok" if ok else f"{response.status_code}: {response.text[:200]}")
            except httpx.HTTPError as exc:
                results.append(f"{type(exc).__name__}: {exc}")

    def watch_readiness() -> None:
        while not stop.is_set():
            ready = sum(p.ready for p in cluster.pods["tiny-mixed"])
            least_ready[0] = min(least_ready[0], ready)
            time.sleep(0.02)

    threads = [threading.Thread(target=client_loop, args=(s,)) for s in (False, True, True)]
    threads.append(threading.Thread(target=watch_readiness))
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)
        changed = copy.deepcopy(isvc)
        changed["spec"]["engine"]["maxNumSeqs"] = 24  # an engine flag: a new config file
        cluster.apply(changed)
        wait_old_gone(cluster, old_pods)
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    failures = [r for r in results if r != "ok"]
    assert not failures, failures[:5]
    assert len(results) > 10
    assert least_ready[0] >= 2  # maxUnavailable 0: never fewer ready pods than replicas
    new_pods = cluster.pods["tiny-mixed"]
    assert len(new_pods) == 2 and not old_pods & {p.name for p in new_pods}
    for pod in new_pods:  # the new flag is in effect
        port = cluster.pod_port(pod, "http")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'ketch:max_batch_size{model_name="tiny"} 24.0' in metrics


def wait_old_gone(cluster: LocalCluster, old: set[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while {p.name for p in cluster.pods["tiny-mixed"]} & old:
        assert time.monotonic() < deadline, cluster.describe()
        time.sleep(0.1)
