"""Real autoscaling: kube-controller-manager's HorizontalPodAutoscaler controller scales an engine
role on the engine's own queue depth.

Nothing in the chain is ours but the operator and the engine: the operator renders the HPA
(``mode: hpa``); Prometheus (a pod) discovers the engine pods by their ``prometheus.io/*``
annotations and scrapes them; prometheus-adapter (a pod, serving the aggregated custom metrics
API with the rules of ``ketch-operator adapter-rules``) turns ``ketch:num_requests_waiting``
into the ``Pods`` metric ``ketch_num_requests_waiting``; the upstream HPA controller reads it
and scales the Deployment; the scheduler and the node agent start the new engine, which then
serves. The monitoring stack is ``hack/localcluster/metrics.py`` (built by
``hack/build-control-plane.sh metrics``).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_e2e import Cluster, cluster, operator, wait_for  # noqa: F401 (fixtures)

from kubecluster import kubectl
from localcluster import metrics as monitoring

NAME = "hpa-real"
DEPLOYMENT = f"{NAME}-mixed"
METRIC = "ketch_num_requests_waiting"
CONCURRENCY = 8  # with maxNumSeqs 2: ~6 requests wait on one pod, 3 times the target


def autoscaled_service() -> dict[str, Any]:
    """The tiny model with a queue of at most 2 running requests per pod, scaled between 1 and 2
    pods on the waiting requests (target 2 per pod). The node has 2 CPUs: each pod asks for
    half of one, and the cache-manager sidecar (1 CPU) is left out."""
    return {
        "apiVersion": "serving.ketch.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "tiny"},
            "engine": {"maxNumSeqs": 2, "kvCacheMemory": "256MiB"},
            "cacheManager": {"enabled": False},
            "roles": {
                "mixed": {
                    "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi"},
                    "autoscaling": {
                        "mode": "hpa",
                        "minReplicas": 1,
                        "maxReplicas": 2,
                        "metrics": [{"type": "RequestsWaiting", "target": 2}],
                        "behavior": {
                            "scaleUp": {"stabilizationWindowSeconds": 0},
                            "scaleDown": {"stabilizationWindowSeconds": 15},
                        },
                    },
                }
            },
        },
    }


@pytest.fixture(scope="module")
def metrics_stack(kube) -> Iterator[None]:
    """Prometheus and prometheus-adapter in namespace ``monitoring``, until the module ends
    (the APIService is cluster-wide: it goes with them)."""
    try:
        monitoring.deploy_monitoring(kube.kubeconfig)
        monitoring.wait_custom_metrics(kube.kubeconfig)
    except (RuntimeError, TimeoutError) as exc:
        monitoring.delete_monitoring(kube.kubeconfig)
        pytest.fail(f"the monitoring stack did not come up: {exc}")
    yield
    monitoring.delete_monitoring(kube.kubeconfig)


class Load:
    """Completion requests from ``concurrency`` threads until stopped. Each request opens its
    own connection, so requests made after a scale-up reach the new pods too (the Service
    balances connections, not requests)."""

    def __init__(self, url: str, concurrency: int):
        self.url = url
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)
        ]

    def _run(self) -> None:
        while not self._stop.is_set():
            with openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120) as c:
                try:
                    c.completions.create(
                        model="tiny", prompt="Once upon a time", max_tokens=200,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    self.done += 1
                except openai.OpenAIError as exc:
                    self.errors.append(repr(exc))
                    time.sleep(0.5)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def role_status(c: Cluster) -> dict[str, Any]:
    body = c.get("inferenceservices", NAME) or {}
    return ((body.get("status") or {}).get("roles") or {}).get("mixed") or {}


def engine_pods(c: Cluster) -> dict[str, dict[str, Any]]:
    pods = c.items("pods", f"app.kubernetes.io/instance={NAME}")
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def served(pod: dict[str, Any]) -> float:
    """Requests the pod's engine has finished, from its own /metrics."""
    annotations = pod["metadata"]["annotations"]
    url = f"http://{pod['status']['podIP']}:{annotations['prometheus.io/port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ketch:request_success_total{")
    )


def rescales(c: Cluster) -> list[str]:
    """The HPA controller's SuccessfulRescale event messages, oldest first."""
    out = c.run(
        "get",
        "events",
        "--field-selector",
        f"involvedObject.name={DEPLOYMENT},reason=SuccessfulRescale",
        "-o",
        "json",
    ).stdout
    events = sorted(json.loads(out)["items"], key=lambda e: e.get("lastTimestamp") or "")
    return [e["message"] for e in events]


def test_the_hpa_controller_scales_a_role_on_queue_depth(cluster, operator, metrics_stack):  # noqa: F811
    c: Cluster = cluster
    c.apply(autoscaled_service())
    hpa = wait_for(lambda: c.get("hpa", DEPLOYMENT), "the operator's HPA")
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": METRIC},
                "target": {"type": "AverageValue", "averageValue": "2"},
            },
        }
    ]
    wait_for(lambda: role_status(c).get("ready") == 1, "the first engine pod", timeout=240)
    (first,) = engine_pods(c)
    # The pipeline sees the pod (an idle queue) before any load: Prometheus has scraped it and
    # the adapter has listed its series.
    wait_for(
        lambda: monitoring.custom_metric(c.kube.kubeconfig, c.namespace, METRIC).get(first) == 0,
        f"{METRIC} of {first} in the custom metrics API",
        timeout=90,
    )
    ip = c.get("services", DEPLOYMENT)["spec"]["clusterIP"]
    with Load(f"http://{ip}:8000/v1", CONCURRENCY) as load:
        wait_for(lambda: role_status(c).get("desired") == 2, "the HPA to scale up", timeout=90)
        wait_for(lambda: role_status(c).get("ready") == 2, "the second pod ready", timeout=240)
        (second,) = set(engine_pods(c)) - {first}
        wait_for(lambda: served(engine_pods(c)[second]) > 0, f"{second} to serve", timeout=90)
    assert load.done > 0
    assert not load.errors, load.errors[:3]
    assert any("New size: 2" in m and METRIC in m for m in rescales(c)), rescales(c)

    # Idle again: the queue is empty, the scale-down window (15 s) passes, one pod is left.
    wait_for(lambda: role_status(c).get("desired") == 1, "the HPA to scale down", timeout=120)
    wait_for(lambda: len(engine_pods(c)) == 1, "the extra pod to go", timeout=120)
    assert any("New size: 1" in m for m in rescales(c)), rescales(c)
    body = c.get("inferenceservices", NAME)
    assert body["status"]["replicas"] == "1/1"
    kubectl(c.kube, "-n", c.namespace, "delete", "inferenceservice", NAME, "--wait=false")


# --------------------------------------------------------------------------- coordinated P:D

PD = "coord-real"


def coordinated_service() -> dict[str, Any]:
    """Prefill and decode of the tiny model, each scaled by the operator's own loop (mode
    ketch, reading the engines' /metrics) on waiting requests, kept at prefill >= decode by the
    ratio; decode holds at most 2 running sequences, so load queues there."""

    def role() -> dict[str, Any]:
        return {
            "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi"},
            "autoscaling": {
                "mode": "ketch",
                "minReplicas": 1,
                "maxReplicas": 2,
                "metrics": [{"type": "RequestsWaiting", "target": 2}],
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 10}},
            },
        }

    return {
        "apiVersion": "serving.ketch.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": PD},
        "spec": {
            "model": {"uri": "tiny"},
            "engine": {"maxNumSeqs": 2, "kvCacheMemory": "256MiB"},
            "roles": {"prefill": role(), "decode": role()},
            "autoscaling": {"syncPeriodSeconds": 2, "cooldownSeconds": 4, "ratio": {"min": 1}},
            "auth": {"peerKeySecretRef": {"name": f"{PD}-peer-key"}},
        },
    }


def test_coordinated_prefill_decode_scaling_under_load(cluster, operator):  # noqa: F811
    """Load through the router queues on decode: the operator's loop scales decode up on the
    engines' own metric, raises prefill to keep the ratio, the new pods serve; idle again,
    both scale back down. The status's decision history says so."""
    c: Cluster = cluster
    key = base64.b64encode(b"coord-real-peer-key-0123456789").decode()
    c.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{PD}-peer-key"},
            "data": {"peer-key": key},
        }
    )
    c.apply(coordinated_service())

    def replicas(role: str) -> int:
        return (c.get("deployments", f"{PD}-{role}") or {}).get("spec", {}).get("replicas", 0)

    def decisions(role: str) -> list[dict[str, Any]]:
        status = (c.get("inferenceservices", PD) or {}).get("status") or {}
        roles = (status.get("autoscaling") or {}).get("roles") or {}
        return (roles.get(role) or {}).get("decisions") or []

    wait_for(
        lambda: all(c.ready_pods(PD, r) for r in ("prefill", "decode", "router")),
        "one ready pod per role",
        timeout=240,
    )
    ip = c.get("services", f"{PD}-router")["spec"]["clusterIP"]
    with Load(f"http://{ip}:8000/v1", CONCURRENCY) as load:
        wait_for(lambda: replicas("decode") == 2, "decode scaled up", timeout=120)
        wait_for(lambda: replicas("prefill") == 2, "prefill raised by the ratio", timeout=60)
        wait_for(lambda: len(c.ready_pods(PD, "decode")) == 2, "the second decode pod", timeout=240)
        served_before = load.done
        wait_for(lambda: load.done > served_before + 2, "requests served after the scale-up")
    assert not load.errors, load.errors[:3]
    up = [d for d in decisions("decode") if (d["from"], d["to"]) == (1, 2)]
    assert up and "scale up" in up[-1]["rule"], decisions("decode")
    raised = [d for d in decisions("prefill") if (d["from"], d["to"]) == (1, 2)]
    assert raised and "ratio min 1" in raised[-1]["rule"], decisions("prefill")

    # Idle: after the scale-down window (10 s) both come back to one pod.
    wait_for(lambda: replicas("decode") == 1, "decode scaled down", timeout=120)
    wait_for(lambda: replicas("prefill") == 1, "prefill scaled down", timeout=120)
    kubectl(c.kube, "-n", c.namespace, "delete", "inferenceservice", PD, "--wait=false")
