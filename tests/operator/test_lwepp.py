"""A third-party GAIE endpoint picker on Ketch pods: the Gateway API Inference Extension's own
lightweight reference picker (``cmd/lwepp`` of GAIE v1.6.2, wrapper module hack/lwepp, built by
``hack/build-control-plane.sh``, which `make test` runs).

An InferencePool (the GAIE CRD, as the apiserver validates it) selects a mixed InferenceService's
two engine pods; lwepp watches the pool and its pods and answers ext_proc streams, which
tests/extproc_client.py plays as Envoy would (FULL_DUPLEX_STREAMED: lwepp holds the headers until
the body). Each pick names a ready Ketch pod's ``ip:port`` in the header and in ``envoy.lb``
metadata, and that endpoint serves the request. lwepp picks round robin: it reads no model-server
metrics (GAIE v1.6.2 moved metric-scoring pickers to llm-d), so this checks the pool and the
ext_proc plumbing, not the vLLM-named gauges (docs/observability.md).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import extproc_client
import httpx
from test_e2e import (  # noqa: F401 (fixtures)
    Cluster,
    _delete_what_the_test_made,
    cluster,
    operator,
    ready,
    wait_for,
)
from test_gateway_e2e import install_gaie

from localcluster.controlplane import free_port
from localcluster.tools import lwepp_binary

NAME = "lw"
POOL = f"{NAME}-pool"


def service() -> dict[str, Any]:
    return {
        "apiVersion": "serving.ketch.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "tiny"},
            "engine": {"maxNumSeqs": 4, "kvCacheMemory": "128MiB"},
            "roles": {
                "mixed": {
                    "replicas": 2,
                    "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi"},
                }
            },
            "cacheManager": {"enabled": False},
        },
    }


@contextlib.contextmanager
def running_lwepp(cluster: Cluster, tmp_path: Path) -> Iterator[str]:  # noqa: F811
    """lwepp on the pool (plaintext gRPC, as behind a mesh); yields its ext_proc address once
    its gRPC health service answers (it reports its pool's sync in readiness)."""
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    log = (tmp_path / "lwepp.log").open("w")
    proc = subprocess.Popen(
        [
            str(lwepp_binary()),
            f"--kubeconfig={cluster.kube.kubeconfig}",
            f"--pool-name={POOL}",
            f"--pool-namespace={cluster.namespace}",
            "--secure-serving=false",
            f"--grpc-port={grpc_port}",
            f"--grpc-health-port={health_port}",
            f"--metrics-port={metrics_port}",
            "--zap-devel=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: _health(f"127.0.0.1:{health_port}") is not None,
            "lwepp healthy",
            timeout=60,
        )
        yield f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _health(target: str) -> str | None:
    try:
        return extproc_client.health(target, timeout=2)
    except Exception:  # not listening yet
        return None


def test_lwepp_picks_ketch_pods_from_an_inference_pool(cluster, operator, tmp_path):  # noqa: F811
    c: Cluster = cluster
    install_gaie(c.kube)
    c.apply(service())
    wait_for(lambda: ready(c, NAME), f"{NAME} Ready", timeout=300)
    pods = c.items("pods", f"app.kubernetes.io/instance={NAME}")
    endpoints = {f"{p['status']['podIP']}:8000" for p in pods}
    assert len(endpoints) == 2
    labels = pods[0]["metadata"]["labels"]
    selector = {k: labels[k] for k in ("app.kubernetes.io/instance", "serving.ketch.dev/role")}
    c.apply(
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": POOL},
            "spec": {
                "selector": {"matchLabels": selector},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": f"{NAME}-epp", "port": {"number": 9002}},
            },
        }
    )
    with running_lwepp(c, tmp_path) as lwepp:
        picks = _picks(lwepp, 6)
    for got in picks:
        assert got.status is None, got.status  # no immediate response
        assert got.primary in endpoints, (got.primary, endpoints)
        assert got.header == got.metadata == got.primary
    primaries = [got.primary for got in picks]
    assert set(primaries) == endpoints  # both pods picked
    assert all(a != b for a, b in itertools.pairwise(primaries))  # round robin
    # The picked endpoint is a Ketch server that answers the request.
    answer = httpx.post(f"http://{primaries[0]}/v1/completions", content=BODY, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]


BODY = json.dumps({"model": "tiny", "prompt": "Alice was", "max_tokens": 4}).encode()


def _picks(lwepp: str, n: int) -> list[extproc_client.Pick]:

    def one_pick() -> extproc_client.Pick | None:
        try:
            got = extproc_client.pick(
                lwepp, BODY, {"content-type": "application/json"}, streamed=True, timeout=10
            )
        except Exception:  # the pool or its pods not in lwepp's store yet
            return None
        return got if got.primary else None

    first = wait_for(one_pick, "lwepp's first pick (its store has the pool and pods)", timeout=60)
    return [first] + [wait_for(one_pick, "a pick", timeout=30) for _ in range(n - 1)]
