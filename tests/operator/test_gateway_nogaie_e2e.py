"""spec.gateway without the GAIE CRDs: on a cluster of this test's own that never had them
(they are cluster-scoped, and the session's cluster may have them from other modules). The
operator serves everything else and says what is missing; it applies the pool once the CRDs
are installed, and says so again when they are deleted.

A module of its own: the operator of test_gateway_e2e.py collects every 403 the operators of
this process log, and the transient one here (a create while the deleted CRD terminates,
retried) is not its business.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_e2e import CRD_FILE, Cluster, running_operator, wait_for
from test_gateway_e2e import POOLS, ROUTES, gateway_ready, gateway_service, install_gaie

from kubecluster import kubectl, start_cluster


@contextlib.contextmanager
def cluster_without_gaie() -> Iterator[Cluster]:
    """A cluster of this test's own (no node: pods stay Pending), which never had the GAIE
    CRDs, with the InferenceService CRD and one namespace."""
    if os.environ.get("KETCH_TEST_KUBECONFIG"):
        pytest.skip("runs on a local cluster of its own, not KETCH_TEST_KUBECONFIG's")
    directory = Path(tempfile.mkdtemp(prefix="ketch-test-gaie-"))
    kube = start_cluster(directory, watch_pid=os.getpid(), node_agent=False, service_proxy=False)
    try:
        kubectl(kube, "apply", "--server-side", "-f", str(CRD_FILE), check=True)
        kubectl(kube, "create", "namespace", "nogaie", check=True)
        yield Cluster(kube, "nogaie")
    finally:
        kube.stop()


def test_without_the_gaie_crds_the_condition_says_so_and_the_rest_is_served():
    with cluster_without_gaie() as cluster:
        assert kubectl(cluster.kube, "get", POOLS, "-A").returncode != 0
        with running_operator(cluster, cluster.kube.kubeconfig) as controller:
            controller.pools.retry_seconds = 1.0  # the test needs no 10 s waits
            cluster.apply(gateway_service("nogw"))
            cond = wait_for(
                lambda: (
                    gateway_ready(cluster, "nogw").get("reason") == "InferencePoolCRDMissing"
                    and gateway_ready(cluster, "nogw")
                ),
                "GatewayReady InferencePoolCRDMissing",
            )
            assert cond["status"] == "False"
            assert "install the Gateway API Inference Extension CRDs" in cond["message"]
            for name in ("nogw-mixed", "nogw-router"):  # everything else is applied
                assert wait_for(lambda n=name: cluster.get("deployment", n), name)
            assert wait_for(lambda: cluster.get("service", "nogw-router"), "router Service")
            events = json.loads(cluster.run("get", "events", "-o", "json").stdout)["items"]
            assert "GatewayAPIUnavailable" in {e["reason"] for e in events}

            # The CRDs installed later: the operator notices and applies the pool and route.
            install_gaie(cluster.kube)
            wait_for(lambda: cluster.get(POOLS, "nogw"), "the InferencePool, once served")
            wait_for(lambda: cluster.get(ROUTES, "nogw"), "the HTTPRoute, once served")
            wait_for(
                lambda: gateway_ready(cluster, "nogw").get("reason") == "NotAccepted",
                "GatewayReady NotAccepted once the CRDs are there",
            )

            # The GAIE CRD deleted again (with the pool): the condition says so once more.
            kubectl(cluster.kube, "delete", "crd", POOLS, check=True)
            wait_for(
                lambda: gateway_ready(cluster, "nogw").get("reason") == "InferencePoolCRDMissing",
                "GatewayReady InferencePoolCRDMissing after the CRD was deleted",
            )
            assert cluster.get("deployment", "nogw-router") is not None
