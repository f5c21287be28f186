"""Coordinated autoscaling (mode ketch) end to end: the operator (KopfRunner) against its own
API-server emulator whose pods have loopback IPs (127.3.x.y), and a fake engine ``/metrics``
server on every such address. The operator scrapes for real.

The fake server answers per role: the test sets the role's total RequestsWaiting, and each of
its ready pods reports an even share, as a load balancer would give.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_e2e import Cluster, cluster, condition, operator, wait_for  # noqa: F401 (fixtures)

from ketch.engine.metrics import PREFIX
from ketch.operator import crd, objects
from kubeemu import start_emulator

NAME = "coord"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


class FakeMetrics:
    """/metrics for every pod, by the local address a request arrived on."""

    def __init__(self, kube, namespace: str, port: int):
        self.kube = kube
        self.namespace = namespace
        self.load: dict[str, float] = {}  # role -> total requests waiting
        self.up = True
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake.requests += 1
                ip = self.connection.getsockname()[0]
                if not fake.up or self.path != "/metrics":
                    self.send_error(503)
                    return
                body = fake.exposition(ip).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def exposition(self, ip: str) -> str:
        pods = self.kube.get(f"/api/v1/namespaces/{self.namespace}/pods").ok()["items"]
        role, peers = None, 0
        for pod in pods:
            if (pod.get("status") or {}).get("podIP") == ip:
                role = pod["metadata"]["labels"].get(objects.LABEL_ROLE)
        for pod in pods:
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (pod.get("status") or {}).get("conditions") or []
            )
            if ready and pod["metadata"]["labels"].get(objects.LABEL_ROLE) == role:
                peers += 1
        share = self.load.get(role or "", 0.0) / max(peers, 1)
        name = PREFIX + "num_requests_waiting"
        return (
            f"# HELP {name} Requests waiting.\n# TYPE {name} gauge\n"
            f'{name}{{model_name="tiny"}} {share}\n'
        )

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def kube() -> Iterator:
    import os

    if os.environ.get("KETCH_TEST_KUBECONFIG"):
        pytest.skip("fake pod metrics need the emulator's loopback pod IPs")
    emu = start_emulator(pod_ip_prefix="127.3")
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture(scope="module")
def port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def metrics(kube, cluster, port) -> Iterator[FakeMetrics]:  # noqa: F811
    fake = FakeMetrics(kube, cluster.namespace, port)
    yield fake
    fake.stop()


def body(port: int, **top) -> dict:
    from test_e2e import cpu_example

    b = cpu_example(NAME)
    b["spec"]["ports"] = {"http": port}
    b["spec"]["roles"]["mixed"] = {
        "resources": {"gpus": 0},
        "autoscaling": {
            "mode": "ketch",
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [{"type": "RequestsWaiting", "target": 4}],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 4}},
        },
    }
    b["spec"]["autoscaling"] = {"syncPeriodSeconds": 1, "cooldownSeconds": 1, **top}
    return b


def replicas(cluster: Cluster) -> int:  # noqa: F811
    return cluster.get("deployments", f"{NAME}-mixed")["spec"]["replicas"]


def decisions(cluster: Cluster) -> list[dict]:  # noqa: F811
    status = (cluster.get(crd.PLURAL, NAME) or {}).get("status") or {}
    return ((status.get("autoscaling") or {}).get("roles") or {}).get("mixed", {}).get(
        "decisions"
    ) or []


def scaling(cluster: Cluster) -> dict:  # noqa: F811
    return condition(cluster.get(crd.PLURAL, NAME), "ScalingActive")


def test_coordinated_scaling(cluster, operator, metrics, port):  # noqa: F811
    metrics.load["mixed"] = 0
    cluster.apply(body(port))
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
    metrics.up = False
    metrics.load["mixed"] = 40
    cond = wait_for(
        lambda: (c := scaling(cluster)).get("status") == "False" and c, "ScalingActive=False"
    )
    assert cond["reason"] == "MetricsUnavailable" and "HTTP 503" in cond["message"]
    seen = len(decisions(cluster))
    time.sleep(2.5)  # a few sync periods (1 s): still nothing decided, nothing scaled
    assert replicas(cluster) == 1 and len(decisions(cluster)) == seen

    # advisory: the decision is recorded, the replicas stay
    metrics.load["mixed"] = 12
    cluster.apply(body(port, advisory=True))
    wait_for(
        lambda: cluster.get(crd.PLURAL, NAME)["status"]["autoscaling"]["advisory"],
        "the advisory loop",
    )
    metrics.up = True  # only now: the loop before it would scale
    wait_for(lambda: scaling(cluster).get("reason") == "Advisory", "ScalingActive=True, Advisory")
    advised = wait_for(
        lambda: (d := decisions(cluster)[-1])["to"] == 3 and d, "an advisory decision"
    )
    assert advised["from"] == 1 and "scale up" in advised["rule"]
    assert replicas(cluster) == 1
    assert cluster.get(crd.PLURAL, NAME)["status"]["autoscaling"]["advisory"] is True


def test_prefill_follows_decode_within_the_ratio(cluster, operator, metrics, port):  # noqa: F811
    from test_e2e import cpu_example

    name = "coordpd"
    b = cpu_example(name)
    b["spec"]["ports"] = {"http": port}

    def role(high: int) -> dict:
        return {
            "resources": {"gpus": 0},
            "autoscaling": {
                "mode": "ketch",
                "maxReplicas": high,
                "metrics": [{"type": "RequestsWaiting", "target": 4}],
            },
        }

    b["spec"]["roles"] = {"prefill": role(4), "decode": role(6)}
    b["spec"]["auth"] = {"peerKeySecretRef": {"name": "coordpd-peer-key"}}
    b["spec"]["autoscaling"] = {"syncPeriodSeconds": 1, "ratio": {"min": 0.5, "max": 1}}
    metrics.load.update(prefill=0, decode=0)
    cluster.apply(b)

    def count(r: str) -> int:
        return cluster.get("deployments", f"{name}-{r}")["spec"]["replicas"]

    def status() -> dict:
        return (cluster.get(crd.PLURAL, name) or {}).get("status") or {}

    wait_for(lambda: condition({"status": status()}, "ScalingActive").get("status") == "True", "on")
    # decode load only: decode goes to 4 pods, prefill is raised to 2 to keep prefill/decode >= 0.5
    metrics.load["decode"] = 16
    wait_for(lambda: (count("decode"), count("prefill")) == (4, 2), "decode 4, prefill 2")
    roles = status()["autoscaling"]["roles"]
    assert [d for d in roles["decode"]["decisions"] if (d["from"], d["to"]) == (1, 4)]
    raised = [d for d in roles["prefill"]["decisions"] if (d["from"], d["to"]) == (1, 2)]
    assert raised and "ratio min 0.5" in raised[-1]["rule"], roles["prefill"]
    assert cluster.get("hpa", f"{name}-prefill") is None


def test_leaving_mode_ketch_stops_it_and_clears_its_status(cluster, operator, metrics, port):  # noqa: F811
    name = "coordoff"
    b = body(port)
    b["metadata"]["name"] = name
    metrics.load["mixed"] = 0
    cluster.apply(b)

    def status() -> dict:
        return (cluster.get(crd.PLURAL, name) or {}).get("status") or {}

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


def test_sawtooth_load_does_not_flap(cluster, operator, metrics, port):  # noqa: F811
    """Load that comes and goes faster than the scale-down window: the role scales up once and
    stays there (no down-up reversals), every decision in between is a hold."""
    name = "coordsaw"
    # the fake metrics share a role's load among all its ready pods in the namespace
    cluster.run("delete", crd.PLURAL, "--all")
    wait_for(lambda: not cluster.items("pods", "app.kubernetes.io/name=ketch"), "no other pods")
    b = body(port)
    b["metadata"]["name"] = name
    b["spec"]["roles"]["mixed"]["autoscaling"]["behavior"] = {
        "scaleDown": {"stabilizationWindowSeconds": 30}
    }
    metrics.load["mixed"] = 0
    cluster.apply(b)

    def count() -> int:
        return cluster.get("deployments", f"{name}-mixed")["spec"]["replicas"]

    wait_for(
        lambda: condition(cluster.get(crd.PLURAL, name), "ScalingActive").get("status") == "True",
        "ScalingActive",
    )
    samples = []
    for tooth in range(6):  # high, low, high, low, ... each a few sync periods (1 s)
        metrics.load["mixed"] = 12 if tooth % 2 == 0 else 0
        if tooth == 0:
            wait_for(lambda: count() == 3, "the first scale-up")
        for _ in range(6):
            samples.append(count())
            time.sleep(0.3)
    changes = [b for a, b in itertools.pairwise(samples) if a != b]
    assert changes == [], samples  # after the first scale-up: no change at all
    assert samples[0] == 3
    status = cluster.get(crd.PLURAL, name)["status"]["autoscaling"]["roles"]["mixed"]
    moves = [(d["from"], d["to"]) for d in status["decisions"] if d["from"] != d["to"]]
    assert moves == [(1, 3)], status["decisions"]
    cluster.run("delete", crd.PLURAL, name)
