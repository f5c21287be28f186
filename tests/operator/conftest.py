"""Fixtures for operator tests: a Kubernetes API and a fresh namespace per test.

`kube` is the API-server emulator (tests/kubeemu) started once per session, or a real cluster
when KETCH_TEST_KUBECONFIG names a kubeconfig (then `kube.is_emulator` is False and fault
injection / the apply log skip the test). Run kubectl with `kubeemu.kubectl(kube, ...)`.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator

import pytest

from kubeemu import Emulator, RealCluster, kubectl, start_emulator

__all__ = ["kubectl"]


@pytest.fixture(scope="session")
def kube() -> Iterator[Emulator | RealCluster]:
    kubeconfig = os.environ.get("KETCH_TEST_KUBECONFIG")
    if kubeconfig:
        yield RealCluster(kubeconfig)
        return
    emu = start_emulator()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def namespace(kube: Emulator | RealCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace made for this test (named after it) and deleted afterwards."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:6]}"
    if isinstance(kube, Emulator):
        kube.post("/api/v1/namespaces", {"metadata": {"name": name}}).ok()
    else:
        kubectl(kube, "create", "namespace", name, check=True)
    yield name
    if isinstance(kube, Emulator):
        kube.delete(f"/api/v1/namespaces/{name}")
    else:
        kubectl(kube, "delete", "namespace", name, "--wait=false")
