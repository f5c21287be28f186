"""Every panel of the Grafana dashboards (charts/ketch/dashboards) against a real Prometheus.

A disaggregated InferenceService of the tiny model (router, prefill and decode pods with their
cache-manager sidecars) runs on the test cluster, under load through the OpenAI client, beside
the operator serving its own /metrics. Prometheus (a pod: hack/localcluster/metrics.py, the
v3.16 binary hack/build-control-plane.sh builds) scrapes the engines by their annotations, the
sidecars' and routers' ports and the operator. Then each dashboard's variables are resolved as
Grafana would (label_values and the variable's regex) and each panel target, variables filled
in, is evaluated by Prometheus' HTTP API: every one must return data, and every metric name in
it (found by Prometheus' own parser, /api/v1/parse_query) must be a series Prometheus has.
The service has a gateway section (the GAIE CRDs installed first), so its router is also the
endpoint picker and serves the EPP's series the router dashboard queries.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import dashboards as dash
import openai
import operator_rbac
import pytest
from test_e2e import (  # noqa: F401 (fixtures)
    Cluster,
    _delete_what_the_test_made,
    cluster,
    running_operator,
    wait_for,
)
from test_gateway_e2e import install_gaie

from localcluster import metrics as monitoring
from localcluster.controlplane import free_port

NAME = "dash"
OPERATOR_JOB = "ketch-operator"
# The cache-manager sidecars and the routers: pods' container ports by (container, port) name.
COMPONENTS_JOB = {
    "job_name": "ketch-components",
    "fallback_scrape_protocol": "PrometheusText0.0.4",
    "kubernetes_sd_configs": [{"role": "pod"}],
    "relabel_configs": [
        {
            "source_labels": [
                "__meta_kubernetes_pod_container_name",
                "__meta_kubernetes_pod_container_port_name",
            ],
            "regex": "cache-manager;cm-http|router;http",
            "action": "keep",
        },
        {
            "source_labels": ["__meta_kubernetes_pod_phase"],
            "regex": "Pending|Succeeded|Failed|Unknown",
            "action": "drop",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
    ],
}


def service(peer_key: str) -> dict[str, Any]:
    role = {"replicas": 1, "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi"}}
    return {
        "apiVersion": "serving.ketch.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "tiny"},
            "engine": {"maxNumSeqs": 4, "kvCacheMemory": "128MiB"},
            "roles": {"prefill": role, "decode": role},
            "cacheManager": {"enabled": True, "hostSwapSpace": "256Mi", "cpu": "250m"},
            "router": {"replicas": 1, "policy": "prefix-hash"},
            # the router is also the GAIE endpoint picker: the EPP row's series
            "gateway": {"inferencePool": {}},
            "auth": {"peerKeySecretRef": {"name": peer_key}},
        },
    }


# --------------------------------------------------------------------------- fixtures


def node_address(c: Cluster) -> str:
    """The node's InternalIP: the host's address on the pod bridge, which pods reach."""
    nodes = json.loads(c.run("get", "nodes", "-o", "json", ns=False).stdout)["items"]
    for address in nodes[0]["status"]["addresses"]:
        if address["type"] == "InternalIP":
            return address["address"]
    raise AssertionError("the node has no InternalIP")


@pytest.fixture(scope="module")
def operator_endpoint(cluster: Cluster) -> tuple[str, int]:  # noqa: F811
    host = node_address(cluster)
    return host, free_port(host)


@pytest.fixture(scope="module")
def operator(cluster, operator_endpoint, tmp_path_factory):  # noqa: F811
    """The operator as test_e2e runs it (its ServiceAccount's RBAC), serving /metrics on the
    node's address so that the Prometheus pod reaches it."""
    install_gaie(cluster.kube)  # before the operator starts: it renders the InferencePool
    kubeconfig = operator_rbac.install(
        cluster.kube, cluster.namespace, tmp_path_factory.mktemp("operator")
    )
    with running_operator(cluster, kubeconfig, metrics=operator_endpoint) as controller:
        yield controller


@pytest.fixture(scope="module")
def prometheus(cluster, operator_endpoint) -> Iterator[str]:  # noqa: F811
    """The monitoring stack with two more jobs (sidecars and routers, the operator); yields
    Prometheus' base URL (its Service's ClusterIP) and removes the stack afterwards."""
    host, port = operator_endpoint
    operator_job = {"job_name": OPERATOR_JOB, "static_configs": [{"targets": [f"{host}:{port}"]}]}
    settings = monitoring.MonitoringSettings(extra_scrape_configs=(COMPONENTS_JOB, operator_job))
    kubeconfig = cluster.kube.kubeconfig
    try:
        try:
            monitoring.deploy_monitoring(kubeconfig, settings=settings)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"the monitoring stack did not come up: {exc}")
        svc = json.loads(
            monitoring.kubectl(
                kubeconfig, "-n", monitoring.NAMESPACE, "get", "svc", "prometheus", "-o", "json"
            ).stdout
        )
        yield f"http://{svc['spec']['clusterIP']}:9090"
    finally:
        monitoring.delete_monitoring(kubeconfig)


# --------------------------------------------------------------------------- Prometheus


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"GET {url}: {exc.code} {exc.read().decode()[:500]}") from exc
    assert body["status"] == "success", body
    return body["data"]


def targets_up(base: str) -> dict[str, int]:
    """Scrape jobs -> targets up."""
    up: dict[str, int] = {}
    for target in api(base, "targets", state="active")["activeTargets"]:
        job = target["labels"]["job"]
        up[job] = up.get(job, 0) + (target["health"] == "up")
    return up


def resolve_variables(base: str, board: dict[str, Any], wanted: dict[str, str]) -> dict[str, str]:
    """Each query variable as Grafana resolves it (label_values, then its regex), in order, so
    later ones see earlier values; the value used is the one ``wanted`` names, which must be
    among the offered ones."""
    values: dict[str, str] = {}
    for variable in dash.variables(board):
        if variable["type"] != "query":
            continue
        selector, label = dash.label_values_query(variable)
        offered = api(
            base, f"label/{label}/values", **{"match[]": dash.substitute(selector, values)}
        )
        offered = dash.apply_regex(variable, offered)
        value = wanted[variable["name"]]
        assert value in offered, (variable["name"], value, offered)
        values[variable["name"]] = value
    return values


# --------------------------------------------------------------------------- load


class Load:
    """Completions from a few threads through the router until stopped; prompts share
    prefixes (prefix-hash affinity, prefix-cache hits), half of them streamed."""

    def __init__(self, url: str, concurrency: int = 3):
        self.url, self.done, self.errors = url, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(concurrency)]

    def _run(self, worker: int) -> None:
        client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)
        n = 0
        with client:
            while not self._stop.is_set():
                prompt = f"Once upon a time, in a land far away, story {n % 3}, part {worker}"
                try:
                    if n % 2:
                        stream = client.completions.create(
                            model="tiny", prompt=prompt, max_tokens=16, stream=True
                        )
                        for _ in stream:
                            pass
                    else:
                        client.completions.create(model="tiny", prompt=prompt, max_tokens=16)
                    self.done += 1
                except openai.OpenAIError as exc:
                    self.errors.append(repr(exc))
                    time.sleep(0.5)
                n += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)


# --------------------------------------------------------------------------- the test


def test_every_panel_query_returns_data_from_real_pods(cluster, operator, prometheus):  # noqa: F811
    c: Cluster = cluster
    peer_key = base64.b64encode(b"dash-peer-key-0123456789abcdef").decode()
    c.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{NAME}-peer-key"},
            "data": {"peer-key": peer_key},
        }
    )
    c.apply(service(f"{NAME}-peer-key"))
    # A spec the engine refuses (kvCacheMemory 0MiB passes the schema, not the engine's own
    # check): the operator counts a reconcile error, so the errors panel has a series.
    bad = service(f"{NAME}-peer-key")
    bad["metadata"]["name"] = f"{NAME}-bad"
    bad["spec"]["engine"]["kvCacheMemory"] = "0MiB"
    c.apply(bad)

    wait_for(
        lambda: all(c.ready_pods(NAME, r) for r in ("prefill", "decode", "router")),
        "one ready pod per role",
        timeout=300,
    )
    # A child deleted by hand: the operator restores it (children_restored has a series).
    c.run("delete", "poddisruptionbudget", f"{NAME}-decode")
    wait_for(lambda: c.get("poddisruptionbudget", f"{NAME}-decode"), "the PDB restored")

    wanted_jobs = {"kubernetes-pods": 2, "ketch-components": 3, OPERATOR_JOB: 1}
    wait_for(
        lambda: all(targets_up(prometheus).get(j, 0) >= n for j, n in wanted_jobs.items()),
        f"Prometheus scraping {wanted_jobs}",
        timeout=120,
    )
    boards = dash.load()
    wanted = {"namespace": c.namespace, "service": NAME, "job": OPERATOR_JOB}
    router_ip = c.get("services", f"{NAME}-router")["spec"]["clusterIP"]
    with Load(f"http://{router_ip}:8000/v1") as load:
        wait_for(lambda: load.done >= 12, "requests served through the router", timeout=180)
        values = {
            name: wait_for(
                lambda b=board: _try(resolve_variables, prometheus, b, wanted),
                f"{name}'s variables",
                timeout=60,
            )
            for name, board in boards.items()
        }
        checked, failures = _evaluate_all(prometheus, boards, values)
    assert not load.errors, load.errors[:3]
    assert not failures, "\n".join(failures)
    assert checked >= 40, checked
    assert checked == len(dash.targets(boards))


def _try(fn, *args):
    """fn(*args), or None while it fails (the caller's wait_for retries)."""
    try:
        return fn(*args)
    except AssertionError:
        return None


def _evaluate_all(
    base: str, boards: dict[str, dict[str, Any]], values: dict[str, dict[str, str]]
) -> tuple[int, list[str]]:
    """Each target evaluated (retried for a while: a rate needs two scrapes of a series)."""
    checked, failures = 0, []
    for target in dash.targets(boards):
        expr = dash.substitute(target.expr, values[target.dashboard])
        names = dash.ast_names(api(base, "parse_query", query=expr))
        assert names == dash.metric_names(target.expr), (target, names)  # the tokenizer agrees

        def answered(expr: str = expr, names: set[str] = names) -> bool:
            known = set(api(base, "label/__name__/values"))
            return names <= known and bool(api(base, "query", query=expr)["result"])

        try:
            wait_for(answered, str(target), timeout=60)
            checked += 1
        except (TimeoutError, AssertionError) as exc:
            known = set(api(base, "label/__name__/values"))
            failures.append(f"{target}\n  -> {expr}\n  missing names: {names - known}: {exc}")
    return checked, failures
