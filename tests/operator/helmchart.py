"""charts/ketch for the tests: the helm CLI (built by hack/build-control-plane.sh), rendering the
chart, and comparing what it renders with the kustomize overlays object by object.

The chart adds no Helm-only labels, so the two sides must be equal dict for dict. The one
Helm-only item it does add is listed in HELM_ONLY_ANNOTATIONS: `compare` removes exactly those
annotations from the chart's side (and fails if the kustomize side carries them), nothing else.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from localcluster import tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ketch"
RELEASE_NAMESPACE = "ketch-system"
# kind -> annotations only the chart carries (docs/helm.md, "helm template and kustomize").
HELM_ONLY_ANNOTATIONS = {"CustomResourceDefinition": ("helm.sh/resource-policy",)}

Obj = dict[str, Any]
Key = tuple[str, str, str, str]


def helm(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools.helm_binary()), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def template_result(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    """`helm template ketch CHART -n ketch-system --include-crds ARGS`."""
    return helm("template", "ketch", str(chart), "-n", RELEASE_NAMESPACE, "--include-crds", *args)


def render(*args: str, chart: Path = CHART) -> list[Obj]:
    result = template_result(*args, chart=chart)
    assert result.returncode == 0, f"helm template {' '.join(args)} failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def key(doc: Obj) -> Key:
    meta = doc["metadata"]
    return (doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"])


def by_key(docs: list[Obj]) -> dict[Key, Obj]:
    keyed: dict[Key, Obj] = {}
    for doc in docs:
        assert key(doc) not in keyed, f"{key(doc)} rendered twice"
        keyed[key(doc)] = doc
    return keyed


def without_helm_only(doc: Obj) -> Obj:
    """`doc` less the HELM_ONLY_ANNOTATIONS of its kind (a copy)."""
    names = HELM_ONLY_ANNOTATIONS.get(doc["kind"], ())
    annotations = doc["metadata"].get("annotations") or {}
    if not any(name in annotations for name in names):
        return doc
    kept = {k: v for k, v in annotations.items() if k not in names}
    metadata = {k: v for k, v in doc["metadata"].items() if k != "annotations"}
    if kept:
        metadata["annotations"] = kept
    return {**doc, "metadata": metadata}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` (the chart's) and `b` (kustomize's) differ, as 'path: a != b' lines."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a:
                out.append(f"{path}.{k}: only kustomize has it: {b[k]!r}")
            elif k not in b:
                out.append(f"{path}.{k}: only the chart has it: {a[k]!r}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ]
    if _number(a) and _number(b):  # JSON has one number type: kustomize writes 30.0 as 30
        return [] if a == b else [f"{path}: chart {a!r} != kustomize {b!r}"]
    if a != b or type(a) is not type(b):
        return [f"{path}: chart {a!r} != kustomize {b!r}"]
    return []


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def compare(chart: list[Obj], kustomize: list[Obj]) -> list[str]:
    """Every difference between the two object streams, keyed by apiVersion/kind/namespace/name."""
    ours, theirs = by_key(chart), by_key(kustomize)
    out = [f"{k}: only the chart renders it" for k in sorted(set(ours) - set(theirs))]
    out += [f"{k}: only kustomize renders it" for k in sorted(set(theirs) - set(ours))]
    for k in sorted(set(ours) & set(theirs)):
        for name in HELM_ONLY_ANNOTATIONS.get(k[1], ()):
            assert name not in (theirs[k]["metadata"].get("annotations") or {}), (k, name)
        out += [f"{k}: {d}" for d in differences(without_helm_only(ours[k]), theirs[k])]
    return out
