"""examples/disaggregated.yaml, rendered by the operator and run as local processes: prefill,
decode and router pods, each engine pod with its cache-manager sidecar, behind the API key.

Acceptance (issue 7): through the router's Service the ``openai`` client gets the outputs of
``LLM.generate``, with KV transfer seen in the cache managers' metrics; an engine process killed
is restarted by the harness, its /health recovers, and the router routes around it meanwhile.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localpods import LocalCluster, localize
from localpods.testing import TIME_SCALE, example, reference_texts

pytestmark = pytest.mark.timeout(300)

API_KEY = "local-test-key"
PEER_KEY = "local-test-peer-key-0123456789"
MODEL = "qwen2.5-7b-instruct"  # the served name the example sets
PROMPTS = ["Alice was beginning to get very tired", "The Queen of Hearts", "Curiouser and"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    isvc = localize(example("disaggregated.yaml"))
    secret = isvc["spec"]["auth"]["apiKeySecretRef"]
    peer = isvc["spec"]["auth"]["peerKeySecretRef"]
    secrets = {secret["name"]: {"api-key": API_KEY}, peer["name"]: {"peer-key": PEER_KEY}}
    local = LocalCluster(isvc, time_scale=TIME_SCALE, secrets=secrets)
    try:
        local.start().wait_ready()
        yield local
    finally:
        local.stop()
    assert not local.leftover_segments  # every engine removed its /dev/shm segments


def _client(cluster: LocalCluster, key: str = API_KEY) -> openai.OpenAI:
    url = cluster.service_url("qwen-pd-router") + "/v1"
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def _cm_metric(cluster: LocalCluster, pod, name: str) -> float:
    port = cluster.pod_port(pod, "cm-http")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in the cache manager's metrics")


def _spawned_child(pid: int) -> int:
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in path.read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"no engine process under {pid}")


def test_outputs_equal_llm_generate_with_kv_moved(cluster: LocalCluster, reference) -> None:
    want = reference_texts(reference, PROMPTS, MAX_TOKENS)
    client = _client(cluster)
    for prompt, text in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert got.choices[0].text == text
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    received = sum(
        _cm_metric(cluster, pod, "ketch:cache_manager_kv_received_bytes_total")
        for pod in cluster.pods["qwen-pd-decode"]
    )
    sent = sum(
        _cm_metric(cluster, pod, "ketch:cache_manager_kv_sent_bytes_total")
        for pod in cluster.pods["qwen-pd-prefill"]
    )
    assert received > 0 and sent == received
    with pytest.raises(openai.AuthenticationError):  # the rendered auth is in force
        _client(cluster, key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_killed_engine_is_restarted_and_routed_around(cluster: LocalCluster) -> None:
    victim = cluster.pods["qwen-pd-decode"][0]
    engine = victim.container("engine")
    assert engine.proc is not None
    health = f"http://127.0.0.1:{cluster.pod_port(victim, 'http')}/health"
    restarts = engine.restarts
    # The engine process (the model's step loop) under `ketch serve`: the server notices, fails
    # fast (/health 503, exit 1) and the harness restarts the container.
    os.kill(_spawned_child(engine.proc.pid), signal.SIGKILL)
    client = _client(cluster)
    served = lost = 0
    deadline = time.monotonic() + 120
    while engine.restarts == restarts or not victim.ready:  # meanwhile, the router serves
        assert time.monotonic() < deadline, cluster.describe()
        try:
            out = client.completions.create(model=MODEL, prompt="Alice", max_tokens=4)
        except openai.InternalServerError as exc:
            # A request the victim took in the moment between the kill and its server seeing
            # the engine gone (a SIGKILLed process is reaped only after its memory is torn
            # down) fails with it: a retryable 503 naming the exit, and only in that window.
            assert exc.status_code == 503 and "engine process exited" in str(exc), exc
            assert exc.response.headers.get("retry-after") == "1"
            lost += 1
            assert lost <= 2, "more than the requests in flight at the kill failed"
            continue
        assert out.choices[0].finish_reason in ("length", "stop")
        served += 1
    assert served > 0
    assert httpx.get(health, timeout=10).status_code == 200  # /health recovered
    router_pod = cluster.pods["qwen-pd-router"][0]
    instances = f"http://127.0.0.1:{cluster.pod_port(router_pod, 'http')}/v1/ketch/instances"
    url = f"http://127.0.0.1:{cluster.pod_port(victim, 'http')}"
    deadline = time.monotonic() + 30
    while True:  # and the router takes it back
        listed = {i["url"]: i for i in httpx.get(instances, timeout=5).json()["instances"]}
        if listed[url]["healthy"]:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
