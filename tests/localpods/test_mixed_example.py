"""examples/mixed.yaml, rendered by the operator and run as local processes.

Acceptance (issue 7): through the rendered Service, the ``openai`` client gets the outputs of
``LLM.generate``; a ConfigMap change (an engine flag) rolls the pods one at a time, readiness
respected, without dropping a request in flight.

Acceptance (issue 14): the rollout follows the rendered strategy (RollingUpdate maxSurge 1,
maxUnavailable 0: never more than 3 pods, never fewer than 2 ready) while the Service keeps
sending to deleted pods for a while, as on a cluster; the same rollout with the Deployment
patched to ``Recreate`` drops requests. A pod without the rendered ``preStop`` drops what the
Service still sends it after its deletion; with it, nothing is dropped.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from localpods import LocalCluster, localize
from localpods.cluster import TEMPLATE_HASH
from localpods.pod import LocalPod
from localpods.testing import (
    OK,
    TIME_SCALE,
    RequestStream,
    completion,
    example,
    recreate,
    reference_texts,
    without_pre_stop,
)
from procs import wait_for

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "Alice was beginning to get very tired",
    "The Queen of Hearts",
    "Down, down, down. Would the fall never come to an end",
    "Curiouser and curiouser",
]
MAX_TOKENS = 16
DEPLOYMENT = SERVICE = "tiny-mixed"
REPLICAS = 2
# How late the Service sees a deletion, in the manifests' seconds (0.6 s here): a busy cluster's,
# within the rendered 5 s preStop sleep.
ENDPOINT_LAG_S = 3.0


@dataclass
class Mixed:
    """The running example and the InferenceService it runs now."""

    cluster: LocalCluster
    isvc: dict

    def next_config(self) -> dict:
        """The InferenceService with one engine flag changed: a new config file, new pods."""
        changed = copy.deepcopy(self.isvc)
        changed["spec"]["engine"]["maxNumSeqs"] += 1
        self.isvc = changed
        return changed


@pytest.fixture(scope="module")
def mixed() -> Iterator[Mixed]:
    isvc = localize(example("mixed.yaml"))
    cluster = LocalCluster(isvc, time_scale=TIME_SCALE, endpoint_lag_s=ENDPOINT_LAG_S)
    try:
        cluster.start().wait_ready()
        yield Mixed(cluster, isvc)
    finally:
        cluster.stop()
    assert not cluster.leftover_segments  # every engine removed its /dev/shm segments


class RolloutWatch:
    """Samples the Deployment's pods while a rollout runs: the fewest ready, the most not being
    deleted, and whether a pod of the new template ever existed while an old one still ran."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.old = {p.labels[TEMPLATE_HASH] for p in cluster.pods[DEPLOYMENT]}
        self.least_ready = self.most_pods = len(cluster.pods[DEPLOYMENT])
        self.new_beside_old = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def __enter__(self) -> RolloutWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self._stop.is_set():
            pods = list(self.cluster.pods[DEPLOYMENT])
            self.least_ready = min(self.least_ready, sum(p.ready for p in pods))
            self.most_pods = max(self.most_pods, sum(not p.terminating for p in pods))
            old_running = any(
                p.labels[TEMPLATE_HASH] in self.old and not p.terminated.is_set() for p in pods
            )
            new = any(p.labels[TEMPLATE_HASH] not in self.old for p in pods)
            self.new_beside_old |= old_running and new
            time.sleep(0.02)


def roll_under_load(mixed: Mixed, patch=None) -> tuple[RequestStream, RolloutWatch]:
    """A config change rolled out while clients send requests; returns when the old pods are
    gone and the clients have seen the new ones for a moment."""
    cluster = mixed.cluster
    old_pods = {p.name for p in cluster.pods[DEPLOYMENT]}
    with RequestStream(cluster.service_url(SERVICE)) as load, RolloutWatch(cluster) as watch:
        time.sleep(1.0)
        cluster.apply(mixed.next_config(), patch=patch)
        wait_old_gone(cluster, old_pods)
        time.sleep(0.5)
    new_pods = cluster.pods[DEPLOYMENT]
    assert len(new_pods) == REPLICAS and not old_pods & {p.name for p in new_pods}
    return load, watch


def test_openai_client_through_the_service_gets_llm_generate_outputs(mixed, reference) -> None:
    client = openai.OpenAI(
        base_url=mixed.cluster.service_url(SERVICE) + "/v1", api_key="unused", max_retries=0
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
    load, watch = roll_under_load(mixed)
    print(f"RollingUpdate: {len(load.failures)} of {len(load.results)} requests failed")
    assert not load.failures, load.failures[:5]
    assert len(load.results) > 10
    assert watch.least_ready >= REPLICAS  # maxUnavailable 0
    assert watch.most_pods == REPLICAS + 1  # maxSurge 1: one new pod at a time
    for pod in mixed.cluster.pods[DEPLOYMENT]:  # the new flag is in effect
        port = mixed.cluster.pod_port(pod, "http")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        max_seqs = mixed.isvc["spec"]["engine"]["maxNumSeqs"]
        assert f'ketch:max_batch_size{{model_name="tiny"}} {max_seqs:.1f}' in metrics


def test_the_same_rollout_with_recreate_drops_requests(mixed) -> None:
    load, watch = roll_under_load(mixed, patch=recreate)
    assert not watch.new_beside_old  # every old pod gone before a new one starts
    assert watch.least_ready == 0 and watch.most_pods == REPLICAS
    assert load.failures  # what the rendered RollingUpdate avoids
    print(f"Recreate: {len(load.failures)} of {len(load.results)} requests failed")
    assert completion(mixed.cluster.service_url(SERVICE), {"model": "tiny", "prompt": "A"}) == OK


def test_a_pod_that_exits_on_sigterm_drops_what_the_service_still_sends_it(mixed) -> None:
    cluster = mixed.cluster
    victim = delete_a_pod(cluster)
    assert victim.name in cluster.endpoints(SERVICE)  # the Service has not caught up yet
    assert burst(cluster) == [OK] * 4  # its preStop sleep: it still serves meanwhile
    cluster.apply(mixed.next_config(), patch=without_pre_stop)  # also replaces the deleted pod
    # Without a preStop sleep any lag drops requests; a slower Service (5 s, for the deletions
    # from here on) only keeps the window open long enough for this check on a busy machine.
    cluster.endpoint_lag_s, lag = 5.0, cluster.endpoint_lag_s
    try:
        victim = delete_a_pod(cluster)
        wait_for(lambda: not ready_answers(cluster, victim), 30, "the deleted pod draining")
        assert victim.name in cluster.endpoints(SERVICE), "the Service caught up too early"
        dropped = [r for r in burst(cluster) if r != OK]
    finally:
        cluster.endpoint_lag_s = lag
    assert len(dropped) == 2, dropped  # the deleted pod's share of the round robin
    cluster.apply(mixed.isvc, patch=without_pre_stop)  # its replacement


def delete_a_pod(cluster: LocalCluster) -> LocalPod:
    """Once only the two ready pods are left, deletes the first."""

    def settled() -> bool:
        pods = cluster.pods[DEPLOYMENT]
        return len(pods) == REPLICAS and all(p.ready for p in pods)

    try:
        wait_for(settled, 120, "two ready pods")
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{cluster.describe()}") from None
    victim = cluster.pods[DEPLOYMENT][0]
    cluster.delete_pod(victim)
    return victim


def ready_answers(cluster: LocalCluster, pod: LocalPod) -> bool:
    """Whether the pod's own /ready says 200 (it does not once it drains, nor once it exited)."""
    url = f"http://127.0.0.1:{cluster.pod_port(pod, 'http')}/ready"
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def burst(cluster: LocalCluster, connections: int = 4) -> list[str]:
    """Short completions on that many connections opened at once through the Service: its
    round robin over two pods sends half of them to each."""
    url, body = cluster.service_url(SERVICE), {"model": "tiny", "prompt": "Alice", "max_tokens": 4}
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(completion(url, body)))
        for _ in range(connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    return results


def wait_old_gone(cluster: LocalCluster, old: set[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while {p.name for p in cluster.pods[DEPLOYMENT]} & old:
        assert time.monotonic() < deadline, cluster.describe()
        time.sleep(0.1)
