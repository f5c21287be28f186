"""spec.gateway end to end: the operator (kopf's KopfRunner, signed in with the manifests' RBAC)
against the real control plane with the Gateway API and GAIE CRDs installed
(``localcluster.tools.gaie_crds()``). No gateway implementation runs here: the tests
write the InferencePool's ``status.parents`` as a gateway controller would, through the status
subresource, and check what the InferenceService reports.

The GAIE CRDs are cluster-scoped: the module installs them once (and removes what it
installed). The case without them runs on a cluster of its own that never had them.
"""

from __future__ import annotations

import base64
import collections
import json
import random
from collections.abc import Iterator
from typing import Any

import extproc_client
import operator_rbac
import pytest
from test_e2e import (
    Cluster,
    condition,
    cpu_example,
    fresh_namespace,
    ready,
    running_operator,
    wait_for,
)

from ketch.operator import api_names
from ketch.operator.controller import Controller
from kubecluster import kubectl, wait_established
from localcluster.tools import gaie_crds

POOLS = "inferencepools.inference.networking.k8s.io"
ROUTES = "httproutes.gateway.networking.k8s.io"
GATEWAY = {"gatewayRef": {"name": "inference-gateway"}, "hostnames": ["llm.example.com"]}


def install_gaie(kube: Any) -> list[str]:
    """Applies the Gateway API + GAIE CRDs; the names of those that were not there before."""
    names = []
    for path in gaie_crds():
        name = path.name.removesuffix(".yaml").split("_", 1)[1] + "." + path.name.split("_")[0]
        names.append(name)
    present = {n for n in names if kubectl(kube, "get", "crd", n, "-o", "name").returncode == 0}
    for path in gaie_crds():
        kubectl(kube, "apply", "--server-side", "--force-conflicts", "-f", str(path), check=True)
    wait_established(kube, *(f"crd/{name}" for name in names))
    wait_for(lambda: kubectl(kube, "get", POOLS, "-A").returncode == 0, "inferencepools served")
    return [n for n in names if n not in present]


@pytest.fixture(scope="module")
def gaie(kube) -> Iterator[Any]:
    added = install_gaie(kube)
    yield kube
    for name in added:
        kubectl(kube, "delete", "crd", name, "--wait=false")


@pytest.fixture(scope="module")
def cluster(gaie) -> Iterator[Cluster]:
    with fresh_namespace(gaie, "gw") as c:
        yield c


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[Controller]:
    """Signed in as its ServiceAccount with the single-namespace overlay's Role: a verb the
    gateway children need and the manifests lack shows as a 403."""
    kubeconfig = operator_rbac.install(
        cluster.kube, cluster.namespace, tmp_path_factory.mktemp("gw-operator")
    )
    refusals = operator_rbac.Refusals()
    with refusals.watching(), running_operator(cluster, kubeconfig) as controller:
        yield controller
    assert not refusals.messages, "\n".join(refusals.messages)


@pytest.fixture(autouse=True)
def _delete_what_the_test_made(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        c.run("delete", api_names.PLURAL, "--all", "--wait=false", check=False)


def gateway_service(name: str, section: dict[str, Any] | None = None) -> dict[str, Any]:
    body = cpu_example(name)
    body["spec"]["gateway"] = section if section is not None else dict(GATEWAY)
    return body


def owned_pods(cluster: Cluster, deployment: str) -> set[str]:
    """The live pods of a Deployment, found by ownership (ReplicaSet -> Deployment), not by
    labels: what the pool's selector is compared with."""
    sets = {
        rs["metadata"]["name"]
        for rs in json.loads(cluster.run("get", "replicasets", "-o", "json").stdout)["items"]
        if any(o["name"] == deployment for o in rs["metadata"].get("ownerReferences") or [])
    }
    pods = json.loads(cluster.run("get", "pods", "-o", "json").stdout)["items"]
    return {
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(o["name"] in sets for o in p["metadata"].get("ownerReferences") or [])
    }


def selected_pods(cluster: Cluster, pool: dict[str, Any]) -> set[str]:
    labels = pool["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return {
        p["metadata"]["name"]
        for p in cluster.items("pods", selector)
        if not p["metadata"].get("deletionTimestamp")
    }


def write_pool_status(cluster: Cluster, name: str, **conditions: tuple[str, str]) -> None:
    """What a gateway controller writes: one parent (the Gateway) with its conditions."""
    stamp = "2026-01-01T00:00:00Z"
    parent = {
        "parentRef": {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference-gateway",
            "namespace": cluster.namespace,
        },
        "controllerName": "example.net/gateway-controller",
        "conditions": [
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": f"{kind}: {reason}",
                "lastTransitionTime": stamp,
            }
            for kind, (status, reason) in conditions.items()
        ],
    }
    patch = json.dumps({"status": {"parents": [parent]}})
    cluster.run("patch", POOLS, name, "--subresource=status", "--type=merge", "-p", patch)


def gateway_ready(cluster: Cluster, name: str) -> dict[str, Any]:
    return condition(cluster.get(api_names.PLURAL, name), "GatewayReady")


# --------------------------------------------------------------------------- tests


def test_pool_route_and_condition_follow_the_spec_and_the_gateway(cluster, operator):
    cluster.apply(gateway_service("gw"))
    pool = wait_for(lambda: cluster.get(POOLS, "gw"), "the InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["kind"], picker["name"], picker["port"], picker["failureMode"]) == (
        "Service",
        "gw-router",
        {"number": 9002},
        "FailClose",
    )
    service = wait_for(lambda: cluster.get("service", "gw-router"), "the router Service")
    assert {"name": "grpc-epp", "port": 9002, "appProtocol": "kubernetes.io/h2c"}.items() <= next(
        p for p in service["spec"]["ports"] if p["name"] == "grpc-epp"
    ).items()
    route = wait_for(lambda: cluster.get(ROUTES, "gw"), "the HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "gw"

    # The pool selects exactly the serving (mixed) pods: not the router's.
    wait_for(lambda: len(owned_pods(cluster, "gw-mixed")) == 2, "two mixed pods")
    wait_for(lambda: owned_pods(cluster, "gw-router"), "the router pod")
    serving = owned_pods(cluster, "gw-mixed")
    assert selected_pods(cluster, pool) == serving
    assert not selected_pods(cluster, pool) & owned_pods(cluster, "gw-router")

    # No gateway has taken the pool yet; then the gateway writes its status.
    cond = wait_for(lambda: gateway_ready(cluster, "gw") or None, "GatewayReady")
    assert (cond["status"], cond["reason"]) == ("False", "NotAccepted")
    write_pool_status(cluster, "gw", Accepted=("True", "Accepted"), ResolvedRefs=("True", "Ok"))
    cond = wait_for(
        lambda: (c := gateway_ready(cluster, "gw")).get("status") == "True" and c,
        "GatewayReady True",
    )
    assert cond["reason"] == "Accepted" and "inference-gateway" in cond["message"]
    write_pool_status(
        cluster, "gw", Accepted=("True", "Accepted"), ResolvedRefs=("False", "InvalidExtensionRef")
    )
    cond = wait_for(
        lambda: (c := gateway_ready(cluster, "gw")).get("status") == "False" and c,
        "GatewayReady False again",
    )
    assert cond["reason"] == "InvalidExtensionRef"
    assert "ResolvedRefs: InvalidExtensionRef" in cond["message"]

    # A pool deleted by hand is put back (the operator watches its pools).
    cluster.run("delete", POOLS, "gw")
    wait_for(lambda: cluster.get(POOLS, "gw"), "the InferencePool put back")

    # The section removed: pool, route and router pruned, the condition gone.
    cluster.apply(cpu_example("gw"))
    wait_for(
        lambda: (
            cluster.get(POOLS, "gw") is None
            and cluster.get(ROUTES, "gw") is None
            and cluster.get("deployment", "gw-router") is None
            and cluster.get("service", "gw-router") is None
        ),
        "the gateway children pruned",
    )
    wait_for(lambda: not gateway_ready(cluster, "gw"), "GatewayReady gone")
    assert cluster.get("deployment", "gw-mixed") is not None


def test_disaggregated_pool_selects_exactly_the_decode_pods(cluster, operator):
    key = base64.b64encode(b"gwpd-peer-key-0123456789abcdef").decode()
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "gwpd-peer-key"},
            "data": {"peer-key": key},
        }
    )
    body = gateway_service("gwpd", {"inferencePool": {"failureMode": "FailOpen"}})
    role = {"replicas": 1, "resources": {"gpus": 0, "cpu": "2", "memory": "2Gi"}}
    body["spec"]["roles"] = {"prefill": role, "decode": role}
    body["spec"]["auth"] = {"peerKeySecretRef": {"name": "gwpd-peer-key"}}
    cluster.apply(body)
    pool = wait_for(lambda: cluster.get(POOLS, "gwpd"), "the InferencePool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert cluster.get(ROUTES, "gwpd") is None  # no gatewayRef
    for deployment in ("gwpd-prefill", "gwpd-decode", "gwpd-router"):
        wait_for(lambda d=deployment: owned_pods(cluster, d), f"a {deployment} pod")
    decode = owned_pods(cluster, "gwpd-decode")
    assert selected_pods(cluster, pool) == decode
    assert not decode & (owned_pods(cluster, "gwpd-prefill") | owned_pods(cluster, "gwpd-router"))


def ready_endpoints(cluster: Cluster, deployment: str, port: int) -> set[str]:
    """``ip:port`` of the Deployment's ready pods."""
    names = owned_pods(cluster, deployment)
    pods = json.loads(cluster.run("get", "pods", "-o", "json").stdout)["items"]
    return {
        f"{p['status']['podIP']}:{port}"
        for p in pods
        if p["metadata"]["name"] in names
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    }


def test_the_routers_endpoint_picker_sends_each_request_to_a_ready_serving_pod(cluster, operator):
    """A gateway's side of ext_proc (tests/extproc_client.py, Envoy's protos) against the
    router's endpoint picker, through the router Service the InferencePool names: every pick
    is a ready pod of the pool, and a shared long prompt prefix keeps to one pod."""
    body = gateway_service("epp", {})
    body["spec"]["router"] = {"policy": "prefix-hash"}
    cluster.apply(body)
    wait_for(lambda: ready(cluster, "epp"), "epp Ready (engines and router)", timeout=240)
    pool = cluster.get(POOLS, "epp")
    picker = pool["spec"]["endpointPickerRef"]
    service = cluster.get("service", picker["name"])
    target = f"{service['spec']['clusterIP']}:{picker['port']['number']}"
    router_pod = next(iter(ready_endpoints(cluster, "epp-router", picker["port"]["number"])))
    for where in (target, router_pod):  # the Service, and the pod itself
        wait_for(
            lambda w=where: extproc_client.health(w, "readiness") == "SERVING",
            f"the picker at {where} SERVING",
        )
    pool_pods = selected_pods(cluster, pool)
    assert pool_pods == owned_pods(cluster, "epp-mixed")
    serving = ready_endpoints(cluster, "epp-mixed", pool["spec"]["targetPorts"][0]["number"])
    assert len(serving) == 2

    rng = random.Random(11)
    words = ["tea", "queen", "dodo", "hare", "gryphon", "turtle"]
    prefixes = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(8)]
    order = [g for g in range(len(prefixes)) for _ in range(4)]
    rng.shuffle(order)
    chosen: dict[int, list[str]] = collections.defaultdict(list)
    for g in order:
        prompt = f"{prefixes[g]} question {rng.random()}"
        request = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
        pick = extproc_client.pick(target, request)
        assert pick.status is None, (pick.status, pick.immediate_body)
        assert pick.primary in serving, (pick.primary, serving)
        assert pick.metadata == pick.header  # the header and envoy.lb metadata agree
        chosen[g].append(pick.primary)
    same = sum(collections.Counter(seen).most_common(1)[0][1] for seen in chosen.values())
    assert same / len(order) >= 0.9, dict(chosen)  # each prefix keeps to its pod
