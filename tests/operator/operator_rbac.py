"""The operator's own identity for the end-to-end tests: the ServiceAccount, Role and RoleBinding
of manifests/ (the single-namespace overlay, built by kustomize for the test's namespace as the
overlay documents: only watched-namespace.yaml changes), and a kubeconfig holding a token of
that ServiceAccount. An operator started with it has exactly the rights an installed one has:
a call outside them gets kube-apiserver's 403 (its RBAC authorizer decides).

`without=("apps", "deployments", "create")` drops one verb from the Role first, to show what
the operator does when the manifests lack it. `Refusals` collects the 403s the operator (or
kopf under it) logs, so a test can fail naming them. `own_cluster()` starts a cluster for one
test, for what must not touch the session's (a ClusterRoleBinding for the operator's
ServiceAccount would widen what every other test's operator may do).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubecluster import KubeCluster, start_cluster

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
    """Remove `verb` on `group`/`resource` from a Role's rules (it must be granted there); a rule
    left without verbs goes, as the API server refuses it."""
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
            if fewer:
                role["rules"].append({**rule, "resources": [resource], "verbs": fewer})
        elif fewer:
            rule["verbs"] = fewer
        else:  # a rule without verbs is invalid (rules[i].verbs: Required value)
            role["rules"].remove(rule)
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
    ClusterRole instead (on a cluster of the test's own, `own_cluster()`: it grants in every
    namespace)."""
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
    config["users"] = [{"name": OPERATOR, "user": {"token": token}}]
    context = config["contexts"][0]["context"]
    context["user"], context["namespace"] = OPERATOR, namespace
    path.write_text(json.dumps(config, indent=2))
    return path


def with_node() -> bool:
    """Whether the test clusters run a node (KETCH_TEST_NODE_AGENT=0: none, pods stay Pending)."""
    return os.environ.get("KETCH_TEST_NODE_AGENT", "1") != "0"


@contextlib.contextmanager
def own_cluster(why: str) -> Iterator[KubeCluster]:
    """A cluster of the calling test's own (tests/kubecluster.py, ~10 s to start), with a node
    unless KETCH_TEST_NODE_AGENT=0; stopped when the test ends."""
    if os.environ.get("KETCH_TEST_KUBECONFIG"):
        pytest.skip(f"{why}: runs on a local cluster of its own, not KETCH_TEST_KUBECONFIG's")
    if os.geteuid() != 0:
        pytest.fail("the operator tests start local clusters: run them as root")
    directory = Path(tempfile.mkdtemp(prefix="ketch-test-own-"))
    node = with_node()
    try:
        cluster = start_cluster(
            directory, watch_pid=os.getpid(), node_agent=node, service_proxy=node
        )
    except RuntimeError as exc:
        pytest.fail(f"the test's own cluster did not start: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


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
