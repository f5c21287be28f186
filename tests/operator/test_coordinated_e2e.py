"""Coordinated autoscaling (mode ketch) end to end: the operator (KopfRunner) against the test
run's cluster, whose node agent runs the engine pods from a fake engine image
(``tests/operator/fake_engine/ketch``, added to the cluster's image table for this module). The
operator scrapes the pods' ``/metrics`` for real, at their pod IPs.

Each fake engine answers ``/metrics`` with what the test's control server (``FakeMetrics``, on
the pods' gateway address) says for the pod asking (known by its address): the test sets a
role's total RequestsWaiting, and each of its ready pods reports an even share, as a load
balancer would give; or ``up = False``, and every pod answers 503.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from test_e2e import Cluster, cluster, condition, operator, wait_for  # noqa: F401 (fixtures)

from ketch.engine.metrics import PREFIX
from ketch.operator import api_names
from ketch.operator.labels import LABEL_ROLE

FAKE_IMAGE = "localhost/ketch-fake-engine:test"
FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine"
NAME = "coord"
ENGINE_PODS = "app.kubernetes.io/name=ketch"
PEER_KEY = "coordpd-peer-key"
LIST_EVERY = 0.5  # seconds: how stale the control server's view of the pods may be


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
    )


class FakeMetrics:
    """The control server the fake engines ask for their ``/metrics``: by the asking pod's
    address, its share of its role's load (per InferenceService and role), or a 503."""

    def __init__(self, kube: Any, namespace: str, host: str):
        self.kube = kube
        self.namespace = namespace
        self.load: dict[str, float] = {}  # role -> total requests waiting
        self.up = True
        self.asked: dict[str, int] = {}  # pod IP -> /metrics requests
        self.changed = threading.Condition()
        self.listing = threading.Lock()
        self.listed: list[dict[str, Any]] = []
        self.listed_at = -math.inf
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = fake.answer(self.client_address[0])
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def pods(self) -> list[dict[str, Any]]:
        """The namespace's pods, listed at most every ``LIST_EVERY`` seconds (a scrape times
        out after 0.8 s: the answer must not wait for the API server each time)."""
        with self.listing:
            if time.monotonic() - self.listed_at > LIST_EVERY:
                path = f"/api/v1/namespaces/{self.namespace}/pods"
                self.listed = self.kube.get(path).ok()["items"]
                self.listed_at = time.monotonic()
            return self.listed

    def answer(self, ip: str) -> tuple[int, bytes]:
        with self.changed:
            self.asked[ip] = self.asked.get(ip, 0) + 1
            self.changed.notify_all()
        if not self.up:
            return 503, b"metrics are down\n"
        pods = self.pods()
        mine = [p for p in pods if (p.get("status") or {}).get("podIP") == ip]
        mine.sort(key=lambda p: bool(p["metadata"].get("deletionTimestamp")))  # live first
        if not mine:
            return 404, f"no pod has address {ip}\n".encode()
        labels = mine[0]["metadata"].get("labels") or {}
        group = {k: labels.get(k) for k in (LABEL_ROLE, "app.kubernetes.io/instance")}
        peers = sum(
            1
            for p in pods
            if _ready(p) and all((p["metadata"].get("labels") or {}).get(k) == v
                                 for k, v in group.items())
        )  # fmt: skip
        share = self.load.get(labels.get(LABEL_ROLE, ""), 0.0) / max(peers, 1)
        name = PREFIX + "num_requests_waiting"
        text = (
            f"# HELP {name} Requests waiting.\n# TYPE {name} gauge\n"
            f'{name}{{model_name="tiny"}} {share}\n'
        )
        return 200, text.encode()

    def scraped(self, pods: list[str], times: int, timeout: float = 60.0) -> None:
        """Waits until each of ``pods`` (IPs) has been scraped ``times`` more times (sync
        periods)."""
        with self.changed:
            start = {p: self.asked.get(p, 0) for p in pods}
            done = self.changed.wait_for(
                lambda: all(self.asked.get(p, 0) >= start[p] + times for p in pods), timeout
            )
        assert done, f"{pods} not scraped {times} times in {timeout} s: {self.asked}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def metrics(kube, cluster) -> Iterator[FakeMetrics]:  # noqa: F811
    """The control server on the pods' gateway, and the fake engine image in the cluster's
    image table (as it was again afterwards)."""
    if kube.layout is None:
        pytest.skip("the fake engine image needs the test run's own cluster (its image table)")
    fake = FakeMetrics(kube, cluster.namespace, str(kube.layout.gateway))
    table = kube.layout.directory / "images.json"
    before = table.read_text()
    entry = {
        "image": FAKE_IMAGE,
        "path": [str(FAKE_ENGINE), "{venv}/bin"],
        "user": "1000:1000",
        "env": {"PYTHONDONTWRITEBYTECODE": "1", "KETCH_FAKE_CONTROL": fake.url},
        "expose": ["{venv}", "{python_home}", "{repo}"],
    }
    _write(table, json.dumps([entry, *json.loads(before)], indent=1))
    try:
        yield fake
    finally:
        _write(table, before)
        fake.stop()


def _write(path: Path, text: str) -> None:
    """Replaces the file at once: the node agent never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(autouse=True)
def _delete_what_the_test_made(cluster) -> Iterator[None]:  # noqa: F811
    """Every InferenceService (and Secret) a test made is deleted after it, and its pods are
    waited out: the next test starts from an empty namespace."""
    yield
    cluster.run("delete", api_names.PLURAL, "--all", check=False)
    # and their Deployments at once: on a cluster just started the garbage collector finds the
    # InferenceService resource (a CRD) only at its next discovery, up to 30 s later
    cluster.run("delete", "deployments", "-l", ENGINE_PODS, "--wait=false", check=False)
    cluster.run("delete", "secret", PEER_KEY, "--ignore-not-found", check=False)
    wait_for(lambda: not cluster.items("pods", ENGINE_PODS), "the engine pods to go", timeout=180)


def ketch_role(**autoscaling: Any) -> dict[str, Any]:
    """A role of fake engine pods (small CPU requests: the node has 16 CPUs for every test). The
    memory is what the operator wants for the real engine the spec names (the tiny model, the
    example's 256MiB KV cache and the processes' headroom: ``runnable._memory_problems``); the
    node agent does not hold the fake pods to it."""
    return {
        "resources": {"gpus": 0, "cpu": "100m", "memory": "1Gi"},
        "autoscaling": {"mode": "ketch", **autoscaling},
    }


def base(name: str) -> dict[str, Any]:
    from test_e2e import cpu_example

    b = cpu_example(name)
    b["spec"]["engine"]["image"] = FAKE_IMAGE
    b["spec"]["cacheManager"] = {"cpu": "100m", "memory": "128Mi"}
    return b


def body(**top: Any) -> dict[str, Any]:
    b = base(NAME)
    b["spec"]["roles"]["mixed"] = ketch_role(
        minReplicas=1,
        maxReplicas=4,
        metrics=[{"type": "RequestsWaiting", "target": 4}],
        behavior={"scaleDown": {"stabilizationWindowSeconds": 4}},
    )
    b["spec"]["autoscaling"] = {"syncPeriodSeconds": 1, "cooldownSeconds": 1, **top}
    return b


def replicas(cluster: Cluster, name: str = NAME) -> int:  # noqa: F811
    return cluster.get("deployments", f"{name}-mixed")["spec"]["replicas"]


def decisions(cluster: Cluster) -> list[dict]:  # noqa: F811
    status = (cluster.get(api_names.PLURAL, NAME) or {}).get("status") or {}
    return ((status.get("autoscaling") or {}).get("roles") or {}).get("mixed", {}).get(
        "decisions"
    ) or []


def scaling(cluster: Cluster, name: str = NAME) -> dict:  # noqa: F811
    return condition(cluster.get(api_names.PLURAL, name), "ScalingActive")


def ready_pods(cluster: Cluster, name: str) -> list[str]:  # noqa: F811
    """The IPs of the InferenceService's ready pods."""
    pods = cluster.items("pods", f"app.kubernetes.io/instance={name}")
    return [p["status"]["podIP"] for p in pods if _ready(p)]


def test_coordinated_scaling(cluster, operator, metrics):  # noqa: F811
    metrics.load["mixed"] = 0
    cluster.apply(body())
    wait_for(lambda: scaling(cluster).get("status") == "True", "ScalingActive=True")
    assert cluster.get("hpa", f"{NAME}-mixed") is None
    assert replicas(cluster) == 1

    # a load step: 12 waiting on one pod (target 4 per pod) -> 3 pods in one decision
    metrics.load["mixed"] = 12
    wait_for(lambda: replicas(cluster) == 3, "scale-up to 3")
    up = wait_for(lambda: [d for d in decisions(cluster) if d["to"] == 3], "the decision")[-1]
    assert up["from"] == 1 and "scale up" in up["rule"] and up["metrics"]["RequestsWaiting"] >= 4

    # load removed: held by the scale-down stabilisation window first, then down to 1
    metrics.load["mixed"] = 0
    wait_for(lambda: replicas(cluster) == 1, "scale-down to 1")
    history = decisions(cluster)
    down = max(i for i, d in enumerate(history) if d["to"] == 1 and d["from"] == 3)
    hold = [i for i, d in enumerate(history) if "stabilisation" in d["rule"] and d["to"] == 3]
    assert hold and hold[-1] < down, history

    # stale metrics: ScalingActive=False with the reason and the pods, and no scaling
    left = wait_for(lambda: (p := ready_pods(cluster, NAME)) and len(p) == 1 and p, "one pod")
    metrics.up = False
    metrics.load["mixed"] = 40
    cond = wait_for(
        lambda: (c := scaling(cluster)).get("status") == "False" and c, "ScalingActive=False"
    )
    assert cond["reason"] == "MetricsUnavailable" and "HTTP 503" in cond["message"]
    seen = decisions(cluster)
    metrics.scraped(left, 3)  # three more sync periods: still nothing decided, nothing scaled
    assert replicas(cluster) == 1 and decisions(cluster) == seen

    # advisory: the decision is recorded, the replicas stay
    metrics.load["mixed"] = 12
    cluster.apply(body(advisory=True))
    wait_for(
        lambda: cluster.get(api_names.PLURAL, NAME)["status"]["autoscaling"]["advisory"],
        "the advisory loop",
    )
    metrics.up = True  # only now: the loop before it would scale
    wait_for(lambda: scaling(cluster).get("reason") == "Advisory", "ScalingActive=True, Advisory")
    advised = wait_for(
        lambda: (d := decisions(cluster)[-1])["to"] == 3 and d, "an advisory decision"
    )
    assert advised["from"] == 1 and "scale up" in advised["rule"]
    metrics.scraped(left, 2)  # and later periods do not scale either
    assert replicas(cluster) == 1
    assert cluster.get(api_names.PLURAL, NAME)["status"]["autoscaling"]["advisory"] is True


def test_prefill_follows_decode_within_the_ratio(cluster, operator, metrics):  # noqa: F811
    name = "coordpd"
    b = base(name)
    b["spec"]["roles"] = {
        "prefill": ketch_role(maxReplicas=4, metrics=[{"type": "RequestsWaiting", "target": 4}]),
        "decode": ketch_role(maxReplicas=6, metrics=[{"type": "RequestsWaiting", "target": 4}]),
    }
    b["spec"]["auth"] = {"peerKeySecretRef": {"name": PEER_KEY}}
    b["spec"]["autoscaling"] = {"syncPeriodSeconds": 1, "ratio": {"min": 0.5, "max": 1}}
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": PEER_KEY},
            "data": {"peer-key": base64.b64encode(b"coordpd-peer-key-0123456789abcd").decode()},
        }
    )
    metrics.load.update(prefill=0, decode=0)
    cluster.apply(b)

    def count(r: str) -> int:
        return cluster.get("deployments", f"{name}-{r}")["spec"]["replicas"]

    def status() -> dict:
        return (cluster.get(api_names.PLURAL, name) or {}).get("status") or {}

    wait_for(lambda: condition({"status": status()}, "ScalingActive").get("status") == "True", "on")
    # decode load only: decode goes to 4 pods, prefill is raised to 2 to keep prefill/decode >= 0.5
    metrics.load["decode"] = 16
    wait_for(lambda: (count("decode"), count("prefill")) == (4, 2), "decode 4, prefill 2")
    roles = status()["autoscaling"]["roles"]
    assert [d for d in roles["decode"]["decisions"] if (d["from"], d["to"]) == (1, 4)]
    raised = [d for d in roles["prefill"]["decisions"] if (d["from"], d["to"]) == (1, 2)]
    assert raised and "ratio min 0.5" in raised[-1]["rule"], roles["prefill"]
    assert cluster.get("hpa", f"{name}-prefill") is None


def test_leaving_mode_ketch_stops_it_and_clears_its_status(cluster, operator, metrics):  # noqa: F811
    name = "coordoff"
    b = body()
    b["metadata"]["name"] = name
    metrics.load["mixed"] = 0
    cluster.apply(b)

    def status() -> dict:
        return (cluster.get(api_names.PLURAL, name) or {}).get("status") or {}

    wait_for(
        lambda: condition({"status": status()}, "ScalingActive").get("status"), "ScalingActive"
    )
    assert "autoscaling" in status()
    b["spec"]["roles"]["mixed"]["autoscaling"]["mode"] = "hpa"
    cluster.apply(b)
    wait_for(lambda: cluster.get("hpa", f"{name}-mixed"), "the HPA")
    wait_for(
        lambda: (
            "autoscaling" not in status() and not condition({"status": status()}, "ScalingActive")
        ),
        "status.autoscaling and ScalingActive gone",
    )
    assert (operator.loop is not None) and (
        cluster.namespace,
        name,
    ) not in operator.autoscaling.states


def test_sawtooth_load_does_not_flap(cluster, operator, metrics):  # noqa: F811
    """Load that comes and goes faster than the scale-down window: the role scales up once and
    stays there (no down-up reversals), every decision in between is a hold."""
    name = "coordsaw"
    b = body()
    b["metadata"]["name"] = name
    b["spec"]["roles"]["mixed"]["autoscaling"]["behavior"] = {
        "scaleDown": {"stabilizationWindowSeconds": 30}
    }
    metrics.load["mixed"] = 0
    cluster.apply(b)
    wait_for(lambda: scaling(cluster, name).get("status") == "True", "ScalingActive")
    metrics.load["mixed"] = 12
    wait_for(lambda: replicas(cluster, name) == 3, "the first scale-up")
    # the teeth start once the three pods serve (the load shared among them): each tooth a few
    # sync periods (1 s) of every pod, well within the window
    pods = wait_for(lambda: (p := ready_pods(cluster, name)) and len(p) == 3 and p, "3 pods up")
    samples = []
    for tooth in range(6):  # high, low, high, low, ...
        metrics.load["mixed"] = 12 if tooth % 2 == 0 else 0
        for _ in range(3):
            metrics.scraped(pods, 1)
            samples.append(replicas(cluster, name))
    changes = [b for a, b in itertools.pairwise(samples) if a != b]
    assert changes == [], samples  # after the first scale-up: no change at all
    assert samples[0] == 3
    status = cluster.get(api_names.PLURAL, name)["status"]["autoscaling"]["roles"]["mixed"]
    moves = [(d["from"], d["to"]) for d in status["decisions"] if d["from"] != d["to"]]
    assert moves == [(1, 3)], status["decisions"]
