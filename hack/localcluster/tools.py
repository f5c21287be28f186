"""What the tests use beside the cluster, built or copied by hack/build-control-plane.sh into
the binary cache: the helm CLI (hack/helm), GAIE's reference endpoint picker lwepp
(hack/lwepp) and the Gateway API / GAIE CRD manifests (hack/gaie). Each says how to build it
when it is missing."""

from __future__ import annotations

import os
from pathlib import Path

from localcluster.controlplane import bin_cache, module_version

GAIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"


def _built(component: str, module_dir: str, module: str, name: str) -> Path:
    binary = bin_cache() / component / module_version(module_dir, module) / "bin" / name
    if not os.access(binary, os.X_OK):
        raise RuntimeError(
            f"not built: {binary}; run hack/build-control-plane.sh {component} (needs Go)"
        )
    return binary


def helm_binary() -> Path:
    """The helm CLI (v4, hack/helm)."""
    return _built("helm", "helm", "helm.sh/helm/v4", "helm")


def lwepp_binary() -> Path:
    """GAIE's lightweight reference endpoint picker (cmd/lwepp, hack/lwepp)."""
    return _built("lwepp", "lwepp", GAIE_MODULE, "lwepp")


def gaie_crds() -> list[Path]:
    """The Gateway API (standard channel: GatewayClass, Gateway, HTTPRoute, ReferenceGrant) and
    Gateway API Inference Extension (InferencePool...) CRD manifests, as their modules ship them."""
    directory = bin_cache() / "gaie" / module_version("gaie", GAIE_MODULE) / "crds"
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise RuntimeError(f"no CRDs in {directory}; run hack/build-control-plane.sh gaie")
    return files
