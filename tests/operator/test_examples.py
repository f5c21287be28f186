"""examples/*.yaml on the real control plane: the operator (as its ServiceAccount, with the
manifests' RBAC) reconciles each example, sized for this machine (tests/operator/examples.py:
the tiny model, 2 CPUs a role), into pods the node agent runs as real engine processes; the
``openai`` client gets, through the Service's ClusterIP, exactly what ``LLM.generate`` gives.

Rollouts come from the real Deployment controller with readiness from the engines' real probes:
a config change under load drops no request (RollingUpdate maxSurge 1, maxUnavailable 0, and
the preStop sleep that covers the Service's lag), while losing every pod at once does.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import operator_rbac
import pytest
from example_pods import (
    OK,
    PodWatch,
    RequestStream,
    completion,
    container_log,
    container_pid,
    example,
    is_ready,
    localize,
    metric,
    pod_dir,
    pod_url,
    reference_texts,
    restarts,
    role_pods,
    service_url,
)
from test_e2e import Cluster, fresh_namespace, ready, running_operator, wait_for

from ketch.operator import api_names

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["Alice was beginning to get very tired", "The Queen of Hearts", "Curiouser and"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(kube) -> Iterator[Cluster]:
    with fresh_namespace(kube, "examples") as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    kubeconfig = operator_rbac.install(
        cluster.kube, cluster.namespace, tmp_path_factory.mktemp("operator")
    )
    with running_operator(cluster, kubeconfig) as controller:
        yield controller


@pytest.fixture(scope="module")
def reference():
    """The offline engine with the tiny model (``LLM.generate``), the outputs' reference."""
    from ketch.engine import LLM

    return LLM("tiny", kv_cache_memory="64MiB")


def secret(cluster: Cluster, name: str, key: str, value: str) -> None:
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "data": {key: base64.b64encode(value.encode()).decode()},
        }
    )


@pytest.fixture
def serve(cluster, operator) -> Iterator:
    """``serve(isvc)`` applies it, waits until it is Ready and returns it; everything it applied
    is deleted after the test."""
    names: list[str] = []

    def run(isvc: dict, timeout: float = 240) -> dict:
        names.append(isvc["metadata"]["name"])
        cluster.apply(isvc)
        name = isvc["metadata"]["name"]
        return wait_for(lambda: ready(cluster, name), f"{name} Ready", timeout=timeout)

    yield run
    for name in names:
        cluster.run("delete", api_names.PLURAL, name, "--wait=false", check=False)
    for name in names:
        wait_for(
            lambda n=name: not cluster.items("pods", f"app.kubernetes.io/instance={n}"),
            f"{name}'s pods gone",
        )


def assert_generates(client: openai.OpenAI, model: str, reference) -> None:
    want = reference_texts(reference, PROMPTS, MAX_TOKENS)
    for prompt, text in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert got.choices[0].text == text
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text


# --------------------------------------------------------------------------- mixed


def test_mixed_serves_llm_generate_and_rolls_without_dropping(cluster, serve, reference):
    isvc = localize(example("mixed"))
    serve(isvc)
    url = service_url(cluster, "tiny-mixed")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert_generates(client, "tiny", reference)

    # A config change under load: the Deployment controller replaces the pods one at a time
    # (maxSurge 1, maxUnavailable 0), each new pod taking traffic once its readiness probe
    # passes, each old one draining behind its preStop sleep while the Service catches up.
    selector = "app.kubernetes.io/instance=tiny,serving.ketch.dev/role=mixed"
    old = {p["metadata"]["name"] for p in cluster.items("pods", selector)}
    isvc["spec"]["engine"]["maxNumSeqs"] += 1
    with RequestStream(url) as load, PodWatch(cluster, selector) as watch:
        time.sleep(1.0)
        cluster.apply(isvc)
        wait_for(
            lambda: (b := ready(cluster, "tiny")) and b["metadata"]["generation"] == 2 and b,
            "tiny Ready at generation 2",
            timeout=240,
        )
        time.sleep(1.0)
    print(f"RollingUpdate: {len(load.failures)} of {len(load.results)} requests failed")
    assert not load.failures, load.failures[:5]
    assert len(load.results) > 10
    assert watch.least_ready >= 2, watch.least_ready  # maxUnavailable 0
    assert watch.most_pods == 3, watch.most_pods  # maxSurge 1: one new pod at a time
    new = [p for p in cluster.items("pods", selector) if not p["metadata"].get("deletionTimestamp")]
    assert len(new) == 2 and not old & {p["metadata"]["name"] for p in new}
    for pod in new:  # the new flag is in effect
        assert metric(pod_url(pod, "http"), "ketch:max_batch_size") == 33.0


def test_deleting_a_pod_drops_nothing_losing_all_does(cluster, serve):
    """The rendered preStop sleep keeps a deleted pod serving while the Service still sends it
    requests; with every pod gone at once, clients see the outage (so the stream can fail)."""
    serve(localize(example("mixed")))
    url = service_url(cluster, "tiny-mixed")
    selector = "app.kubernetes.io/instance=tiny,serving.ketch.dev/role=mixed"
    [victim, _] = cluster.items("pods", selector)
    with RequestStream(url) as load:
        time.sleep(1.0)
        cluster.run("delete", "pod", victim["metadata"]["name"], "--wait=false")
        wait_for(
            lambda: (
                sum(map(is_ready, cluster.items("pods", selector))) == 2
                and victim["metadata"]["name"]
                not in {p["metadata"]["name"] for p in cluster.items("pods", selector)}
            ),
            "the replacement Ready and the victim gone",
        )
    assert not load.failures, load.failures[:5]
    assert len(load.results) > 5

    with RequestStream(url) as load:
        time.sleep(1.0)
        cluster.run("delete", "pods", "-l", selector, "--wait=false")
        wait_for(lambda: load.failures, "clients to see the outage")
    assert load.failures


def test_tensor_parallel_ranks_answer_exactly(cluster, serve, reference):
    isvc = localize(example("mixed"))
    isvc["metadata"]["name"] = "tiny-tp"
    isvc["spec"]["engine"]["tensorParallelSize"] = 2
    isvc["spec"]["roles"]["mixed"]["replicas"] = 1
    serve(isvc)
    [pod] = role_pods(cluster, "tiny-tp", "mixed")
    log = container_log(cluster, pod, "engine")
    assert "tensor-parallel rank 1 of 2" in log, log[-3000:]  # the second rank's worker
    shm = pod_dir(cluster, pod) / ".volumes" / "dshm"
    assert list(shm.glob("ketch-tp-*")), f"no tensor-parallel segment in the pod's /dev/shm {shm}"
    url = service_url(cluster, "tiny-tp-mixed")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert_generates(client, "tiny", reference)


# --------------------------------------------------------------------------- disaggregated

API_KEY = "example-test-key"
PD_MODEL = "qwen2.5-7b-instruct"  # the served name the example sets


def _spawned_child(pid: int) -> int:
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in path.read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"no engine process under {pid}")


def test_disaggregated_moves_kv_and_survives_a_killed_engine(cluster, serve, reference):
    isvc = localize(example("disaggregated"))
    auth = isvc["spec"]["auth"]
    secret(cluster, auth["apiKeySecretRef"]["name"], "api-key", API_KEY)
    secret(cluster, auth["peerKeySecretRef"]["name"], "peer-key", "example-peer-key-0123456789")
    serve(isvc)
    url = service_url(cluster, "qwen-pd-router")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert_generates(client, PD_MODEL, reference)
    received = sum(
        metric(pod_url(p, "cm-http"), "ketch:cache_manager_kv_received_bytes_total")
        for p in role_pods(cluster, "qwen-pd", "decode")
    )
    sent = sum(
        metric(pod_url(p, "cm-http"), "ketch:cache_manager_kv_sent_bytes_total")
        for p in role_pods(cluster, "qwen-pd", "prefill")
    )
    assert received > 0 and sent == received
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # the rendered auth is in force
        wrong.completions.create(model=PD_MODEL, prompt="x", max_tokens=1)

    # The engine process (the step loop under `ketch serve`) of one decode pod killed: its
    # server fails fast (/health 503, exit 1), the node agent restarts the container, the
    # router routes around it meanwhile and takes it back once it is healthy.
    victim = role_pods(cluster, "qwen-pd", "decode")[0]
    name, before = victim["metadata"]["name"], restarts(victim, "engine")
    os.kill(_spawned_child(container_pid(cluster, victim, "engine")), signal.SIGKILL)

    def current() -> dict:
        return cluster.get("pods", name)

    served = lost = 0
    deadline = time.monotonic() + 180
    while restarts(current(), "engine") == before or not is_ready(current()):
        assert time.monotonic() < deadline, "the killed engine was not restarted"
        try:
            out = client.completions.create(model=PD_MODEL, prompt="Alice", max_tokens=4)
        except openai.InternalServerError as exc:
            # A request the victim took between the kill and its server seeing the engine gone
            # fails with it: a retryable 503 naming the exit, and only in that window.
            assert exc.status_code == 503 and "engine process exited" in str(exc), exc
            lost += 1
            assert lost <= 2, "more than the requests in flight at the kill failed"
            continue
        assert out.choices[0].finish_reason in ("length", "stop")
        served += 1
    assert served > 0
    assert (
        completion(url, {"model": PD_MODEL, "prompt": "A"}, {"Authorization": f"Bearer {API_KEY}"})
        == OK
    )


# --------------------------------------------------------------------------- autoscaled


@pytest.mark.parametrize("name", ["autoscaled", "coordinated"])
def test_autoscaled_examples_come_up_and_serve(cluster, serve, name):
    """The autoscaled examples at their minimum replicas (the HPA, or the operator's own
    coordinated loop, owns the count); completions through the serving Service."""
    isvc = localize(example(name))
    auth = isvc["spec"].get("auth") or {}
    if "peerKeySecretRef" in auth:
        secret(cluster, auth["peerKeySecretRef"]["name"], "peer-key", "example-peer-key-0123456789")
    body = serve(isvc)
    model = isvc["spec"]["model"].get("name", "tiny")
    served_by = body["status"]["url"].split("//", 1)[1].split(".", 1)[0]
    url = service_url(cluster, served_by)
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                completion(url, {"model": model, "prompt": "Alice", "max_tokens": 4})
            )
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert results == [OK] * 3, results
