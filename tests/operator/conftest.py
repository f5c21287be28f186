"""Fixtures for operator tests: a real Kubernetes control plane and a fresh namespace per test.

`kube` is one cluster per test run (tests/kubecluster.py: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler built from Go modules, the node agent and the
service proxy of hack/localcluster), started the first time a test asks for it; or the cluster
KETCH_TEST_KUBECONFIG names (then the audit-log helpers skip). Run kubectl with
`kubecluster.kubectl(kube, ...)`.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubecluster import KubeCluster, kubectl, start_cluster

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "inferenceservices.serving.ketch.dev.yaml"

__all__ = ["kubectl"]


@pytest.fixture(scope="session")
def kube() -> Iterator[KubeCluster]:
    kubeconfig = os.environ.get("KETCH_TEST_KUBECONFIG")
    if kubeconfig:
        yield KubeCluster(kubeconfig)
        return
    if os.geteuid() != 0:
        pytest.fail(
            "the operator tests start a local cluster: run them as root (network namespaces)"
        )
    directory = Path(tempfile.mkdtemp(prefix="ketch-test-cluster-"))
    try:
        # KETCH_TEST_NODE_AGENT=0: no node, no service proxy (pods stay Pending); only for
        # working on tests that need none.
        with_node = os.environ.get("KETCH_TEST_NODE_AGENT", "1") != "0"
        cluster = start_cluster(
            directory, watch_pid=os.getpid(), node_agent=with_node, service_proxy=with_node
        )
    except RuntimeError as exc:
        pytest.fail(f"the test cluster did not start: {exc}")
    try:
        # The CRD first: the garbage collector learns new resource types by discovery every
        # 30 s, and until it has, deleting an InferenceService leaves its children (tests wait
        # for the garbage collector; this gets the wait out of their way).
        kubectl(cluster, "apply", "--server-side", "-f", str(CRD_FILE), check=True)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def namespace(kube: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace made for this test (named after it) and deleted afterwards."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:6]}"
    kubectl(kube, "create", "namespace", name, check=True)
    yield name
    kubectl(kube, "delete", "namespace", name, "--wait=false")
