"""The operator's own identity for the end-to-end tests: the ServiceAccount, Role and RoleBinding
of manifests/ (the single-namespace overlay, built by kustomize for the test's namespace as the
overlay documents: only watched-namespace.yaml changes), and a kubeconfig holding a token of
that ServiceAccount. An operator started with it has exactly the rights an installed one has:
a call outside them gets the apiserver's 403 (the emulator enforces RBAC, as a cluster does).

`without=("apps", "deployments", "create")` drops one verb from the Role first, to show what
the operator does when the manifests lack it. `Refusals` collects the 403s the operator (or
kopf under it) logs, so a test can fail naming them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_NAMESPACE = "ketch-system"
OPERATOR = "ketch-operator"
USER = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{OPERATOR}"
INSTALLED_KINDS = ("Namespace", "ServiceAccount", "Role", "RoleBinding")
CLUSTER_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding")


def kubectl(kubeconfig: str, *args: str, input: str | None = None) -> str:
    result = subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result.stdout


def overlay_for(namespace: str | None, workdir: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize manifests/overlays/single-namespace`, serving `namespace`; or
    manifests/overlays/cluster-wide (namespace None)."""
    shutil.copytree(ROOT / "manifests", workdir / "manifests")
    shutil.copytree(ROOT / "crds", workdir / "crds")
    name = "cluster-wide" if namespace is None else "single-namespace"
    overlay = workdir / "manifests" / "overlays" / name
    if namespace is not None:
        setting = overlay / "watched-namespace.yaml"
        text = setting.read_text()
        assert "namespace: llm\n" in text, "watched-namespace.yaml changed: update this helper"
        setting.write_text(text.replace("namespace: llm\n", f"namespace: {namespace}\n"))
    built = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    return [d for d in yaml.safe_load_all(built.stdout) if d]


def drop_verb(role: dict[str, Any], group: str, resource: str, verb: str) -> None:
    """Remove `verb` on `group`/`resource` from a Role's rules (it must be granted there)."""
    found = False
    for rule in list(role["rules"]):
        groups, resources = rule.get("apiGroups", ()), rule.get("resources", ())
        if group not in groups or resource not in resources or verb not in rule["verbs"]:
            continue
        found = True
        fewer = [v for v in rule["verbs"] if v != verb]
        others = [r for r in resources if r != resource]
        if others:  # the rule's other resources keep the verb
            rule["resources"] = others
            role["rules"].append({**rule, "resources": [resource], "verbs": fewer})
        else:
            rule["verbs"] = fewer
    assert found, f"the Role does not grant {verb} on {resource}.{group}"


def install(
    kube: Any,
    namespace: str,
    workdir: Path,
    *,
    without: tuple[str, str, str] | None = None,
    cluster_wide: bool = False,
) -> Path:
    """Install the operator's RBAC for `namespace` (as the admin) and return a kubeconfig that
    signs in as the operator's ServiceAccount. `cluster_wide`: the cluster-wide overlay's
    ClusterRole instead (on an emulator of the test's own: it grants in every namespace)."""
    workdir.mkdir(parents=True, exist_ok=True)
    kinds = CLUSTER_KINDS if cluster_wide else INSTALLED_KINDS
    built = overlay_for(None if cluster_wide else namespace, workdir)
    docs = [d for d in built if d["kind"] in kinds]
    role = next(d for d in docs if d["kind"] in ("Role", "ClusterRole"))
    assert cluster_wide or role["metadata"]["namespace"] == namespace
    if without is not None:
        drop_verb(role, *without)
    admin = str(kube.kubeconfig)
    kubectl(admin, "apply", "-f", "-", input=yaml.safe_dump_all(docs))
    token = kubectl(
        admin, "create", "token", OPERATOR, "-n", SYSTEM_NAMESPACE, "--duration", "2h"
    ).strip()
    return write_kubeconfig(kube, workdir / "operator-kubeconfig", namespace, token)


def write_kubeconfig(kube: Any, path: Path, namespace: str, token: str) -> Path:
    """The admin's kubeconfig (server, CA), signed in with `token` instead."""
    config = json.loads(
        kubectl(str(kube.kubeconfig), "config", "view", "--minify", "--raw", "-o", "json")
    )
    if getattr(kube, "is_emulator", False):
        config["clusters"][0]["cluster"]["server"] = kube.secure_url
    config["users"] = [{"name": OPERATOR, "user": {"token": token}}]
    context = config["contexts"][0]["context"]
    context["user"], context["namespace"] = OPERATOR, namespace
    path.write_text(json.dumps(config, indent=2))
    return path


class Refusals(logging.Handler):
    """Warnings the operator and kopf log about calls the API refused (403). kopf replaces the
    root logger's handlers when it starts, so pytest's caplog would miss them."""

    LOGGERS = ("ketch.operator", "kopf")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "forbidden" in text.lower() and ("403" in text or "is forbidden:" in text):
            self.messages.append(text)

    @contextlib.contextmanager
    def watching(self) -> Iterator[Refusals]:
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeHandler(self)
