"""What the example tests share: an example made to run on this machine, its pods as the node
agent runs them (IPs, processes, logs), requests through a Service's ClusterIP, the reference
outputs of ``LLM.generate``."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from test_e2e import Cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OK = "ok"

Obj = dict[str, Any]


def example(name: str) -> Obj:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


def localize(isvc: Obj) -> Obj:
    """The same InferenceService sized for a CPU machine: the built-in tiny model, 2 CPUs and
    2 GiB per role, a small KV cache, shared memory and swap space, the model's own context
    length. Everything else (roles, replicas, scheduling, ports, router, auth, cache manager,
    autoscaling) is kept."""
    out = copy.deepcopy(isvc)
    spec = out["spec"]
    spec["model"]["uri"] = "tiny"
    spec["model"].pop("credentialsSecretRef", None)  # tiny is built in: nothing to fetch
    engine = spec.setdefault("engine", {})
    for key in ("tensorParallelSize", "maxModelLen", "dtype", "numKvBlocks"):
        engine.pop(key, None)
    engine["kvCacheMemory"] = "128MiB"
    if "shmSize" in engine:
        engine["shmSize"] = "512Mi"
    for role in spec.get("roles", {}).values():
        role.setdefault("resources", {}).update(gpus=0, cpu="2", memory="2Gi")
    if "cacheManager" in spec:
        spec["cacheManager"]["hostSwapSpace"] = "64Mi"
    return out


def reference_texts(llm: Any, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy ``LLM.generate`` texts: what every served answer must equal."""
    from ketch.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0].text for out in llm.generate(prompts, params)]


def service_url(cluster: Cluster, name: str, port: str = "http") -> str:
    """``http://<ClusterIP>:<port>``: the service proxy forwards it to a ready endpoint."""
    svc = cluster.get("services", name)
    assert svc, f"no Service {name}"
    number = next(p["port"] for p in svc["spec"]["ports"] if p.get("name") == port)
    return f"http://{svc['spec']['clusterIP']}:{number}"


def pods(cluster: Cluster, selector: str) -> list[Obj]:
    return cluster.items("pods", selector)


def role_pods(cluster: Cluster, name: str, role: str) -> list[Obj]:
    return pods(cluster, f"app.kubernetes.io/instance={name},serving.ketch.dev/role={role}")


def is_ready(pod: Obj) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def pod_url(pod: Obj, port_name: str) -> str:
    """``http://<pod IP>:<container port named port_name>``."""
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == port_name:
                return f"http://{pod['status']['podIP']}:{port['containerPort']}"
    raise AssertionError(f"pod {pod['metadata']['name']} has no port {port_name}")


def pod_dir(cluster: Cluster, pod: Obj) -> Path:
    """Where the node agent keeps the pod: ``<container>/pid``, ``<container>/<n>.log``."""
    meta = pod["metadata"]
    root = Path(cluster.kube.layout.directory) / "pods"
    return root / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


def container_log(cluster: Cluster, pod: Obj, container: str) -> str:
    logs = sorted((pod_dir(cluster, pod) / container).glob("*.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


def container_pid(cluster: Cluster, pod: Obj, container: str) -> int:
    # "<pid> <start time>" (the node agent checks both before it signals a process)
    return int((pod_dir(cluster, pod) / container / "pid").read_text().split()[0])


def restarts(pod: Obj, container: str) -> int:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status["name"] == container:
            return status.get("restartCount", 0)
    return 0


def completion(url: str, body: Obj, headers: dict[str, str] | None = None) -> str:
    """One ``/v1/completions`` on a new connection: ``OK``, or what went wrong. A new
    connection per request, as a fresh client makes: keep-alive would pin a client to a pod
    that is going away."""
    fresh = httpx.Limits(max_keepalive_connections=0)
    try:
        with httpx.Client(timeout=60, limits=fresh, headers=headers) as client:
            response = client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code == 200 and (not body.get("stream") or "[DONE]" in response.text):
        return OK
    return f"{response.status_code}: {response.text[:200]}"


class RequestStream:
    """Clients sending completions through a Service, one after another, until the block ends;
    ``results`` holds every outcome. A failed one is retried after a short pause, as a client
    would, and counted each time."""

    RETRY_PAUSE_S = 0.05

    def __init__(self, url: str, streams: tuple[bool, ...] = (False, True, True)) -> None:
        self.url = url
        self.results: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(s,)) for s in streams]

    @property
    def failures(self) -> list[str]:
        return [r for r in self.results if r != OK]

    def __enter__(self) -> RequestStream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def _client(self, stream: bool) -> None:
        body = {"model": "tiny", "prompt": "Alice", "max_tokens": 48, "stream": stream}
        while not self._stop.is_set():
            result = completion(self.url, body)
            self.results.append(result)
            if result != OK:
                time.sleep(self.RETRY_PAUSE_S)


class PodWatch:
    """Samples a role's pods (through the API, as often as it answers) while something runs:
    the fewest ready, the most not being deleted, and every pod name seen."""

    def __init__(self, cluster: Cluster, selector: str) -> None:
        self.cluster = cluster
        self.selector = selector
        first = self._sample()
        self.least_ready = sum(map(is_ready, first))
        self.most_pods = len(first)
        self.seen = {p["metadata"]["name"] for p in first}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _sample(self) -> list[Obj]:
        got = self.cluster.kube.get(
            f"/api/v1/namespaces/{self.cluster.namespace}/pods",
            params={"labelSelector": self.selector},
        ).ok()
        return [p for p in got["items"] if not p["metadata"].get("deletionTimestamp")]

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _watch(self) -> None:
        while not self._stop.is_set():
            live = self._sample()
            self.least_ready = min(self.least_ready, sum(map(is_ready, live)))
            self.most_pods = max(self.most_pods, len(live))
            self.seen |= {p["metadata"]["name"] for p in live}
            time.sleep(0.05)


def metric(url: str, name: str) -> float:
    """The value of one unlabelled-or-single sample ``name`` on ``url``/metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in {url}/metrics")


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:3000]
