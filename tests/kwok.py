"""KWOK (sigs.k8s.io/kwok) beside a cluster of ``kubecluster.start_cluster``: fake Nodes whose
pods KWOK marks Running and Ready without running anything, for bursts of hundreds of pods.

    kube = start_cluster(tmp_dir, node_agent=False, service_proxy=False)
    fake = start_kwok(kube, nodes=1)      # the kwok controller, and Nodes it keeps Ready
    pod_spec["tolerations"] = TOLERATIONS  # pods that tolerate the fake nodes' taint (and
    pod_spec["nodeSelector"] = NODE_SELECTOR  # select them) are scheduled there, then Ready
    fake.stop()                           # before kube.stop()

The controller is upstream's ``kwok`` (``hack/build-control-plane.sh kwok``: the wrapper module
hack/kwok, the binary in ``<cache>/kwok/<version>/bin``), run with upstream's default stages (the
ones ``kwokctl`` writes into its config: node-initialize, node-heartbeat-with-lease, pod-ready,
pod-complete, pod-delete; the build copies them beside the binary), managing only the Nodes
annotated ``kwok.x-k8s.io/node=fake``. Its identity is its own (user ``ketch:kwok``, a client
certificate of the cluster's CA) with upstream's ClusterRole less the KWOK CRDs, and, as
upstream's manifests do, an exempt FlowSchema. The scheduler, the controllers and the API
server stay the real ones: only the kubelet is faked. Each pod gets an address from the node's
``spec.podCIDR``; nothing answers there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parents[1] / "hack"
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

from localcluster import controlplane, pki  # noqa: E402
from localcluster.kubeapi import ApiError, KubeApi, write_kubeconfig  # noqa: E402

__all__ = ["NODE_SELECTOR", "TAINT", "TOLERATIONS", "Kwok", "kwok_binary", "start_kwok"]

ANNOTATION = "kwok.x-k8s.io/node"
TAINT = {"key": ANNOTATION, "value": "fake", "effect": "NoSchedule"}
TOLERATIONS = [{"key": ANNOTATION, "operator": "Exists", "effect": "NoSchedule"}]
NODE_SELECTOR = {"type": "kwok"}
USER = "ketch:kwok"
STAGES = ("node-initialize", "node-heartbeat-with-lease", "pod-ready", "pod-complete", "pod-delete")

_RBAC = [
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/ketch:kwok",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "ketch:kwok"},
            "rules": [  # upstream's kustomize/rbac/role.yaml, without the kwok.x-k8s.io CRDs
                {
                    "apiGroups": [""],
                    "resources": ["events"],
                    "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                },
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                {
                    "apiGroups": [""],
                    "resources": ["nodes/status", "pods/status"],
                    "verbs": ["patch", "update"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["delete", "get", "list", "patch", "update", "watch"],
                },
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "verbs": ["create", "get", "list", "patch", "update", "watch"],
                },
            ],
        },
    ),
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/ketch:kwok",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "ketch:kwok"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "ketch:kwok",
            },
            "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": USER}],
        },
    ),
    # As upstream's kustomize/rbac/flow_schema.yaml: the kubelet stand-in is not queued
    # behind the workloads it serves (the kubelets' own requests are system ones too).
    (
        "/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas/ketch-kwok",
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": "ketch-kwok"},
            "spec": {
                "priorityLevelConfiguration": {"name": "exempt"},
                "matchingPrecedence": 1000,
                "rules": [
                    {
                        "subjects": [{"kind": "User", "user": {"name": USER}}],
                        "resourceRules": [
                            {
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "verbs": ["*"],
                                "clusterScope": True,
                                "namespaces": ["*"],
                            }
                        ],
                        "nonResourceRules": [{"nonResourceURLs": ["*"], "verbs": ["*"]}],
                    }
                ],
            },
        },
    ),
]


def kwok_version() -> str:
    return controlplane.module_version("kwok", "sigs.k8s.io/kwok")


def kwok_binary() -> Path:
    """The built controller; says how to build it when it is missing."""
    binary = controlplane.bin_cache() / "kwok" / kwok_version() / "bin" / "kwok"
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"not built: {binary}; run hack/build-control-plane.sh kwok (needs Go)")
    return binary


def _stages(stages: Path) -> str:
    """Upstream's default stages, one multi-document config (the options are flags: a
    KwokConfiguration document here would replace the defaults of every option it omits)."""
    docs = []
    for name in STAGES:
        path = stages / f"{name}.yaml"
        if not path.exists():
            raise RuntimeError(f"{path} missing: run hack/build-control-plane.sh kwok")
        docs.append(path.read_text())
    return "---\n".join(docs)


def fake_node(
    name: str, pod_cidr: str, *, cpu: str = "1000", memory: str = "4Ti", pods: str = "1000"
) -> dict[str, Any]:
    """A Node KWOK manages: its annotation, its taint, the label NODE_SELECTOR names."""
    resources = {"cpu": cpu, "memory": memory, "pods": pods}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                **NODE_SELECTOR,
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
            },
        },
        "spec": {"taints": [TAINT], "podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"capacity": resources, "allocatable": resources},
    }


@dataclass
class Kwok:
    """The running controller and the fake Nodes it manages."""

    process: subprocess.Popen[bytes]
    nodes: list[str]
    kubeconfig: Path
    log: Path

    def stop(self) -> None:
        """Ends the controller (the Nodes stay: they go with the cluster)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def __enter__(self) -> Kwok:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_kwok(
    kube: Any, *, nodes: int = 1, directory: Path | None = None, timeout: float = 60
) -> Kwok:
    """Start the kwok controller against ``kube`` (a ``KubeCluster`` of this machine) and make
    ``nodes`` fake Nodes (``kwok-0``...; each /20 of pod addresses in 10.250.0.0/16 and room
    for 1000 pods); returns once every one is Ready and schedulable. The controller dies with
    this process."""
    binary = kwok_binary()
    directory = Path(directory or Path(kube.kubeconfig).parent)
    layout = kube.layout
    if layout is None:
        raise RuntimeError("start_kwok needs a cluster of start_cluster (its CA signs kwok's cert)")
    admin = KubeApi(kube.kubeconfig)
    try:
        if not (layout.pki / "kwok.crt").exists():
            pki.make_cert(layout.pki, "kwok", "ca", USER)
        kubeconfig = write_kubeconfig(
            directory / "kwok.kubeconfig",
            admin.server,
            layout.pki / "ca.crt",
            user=USER,
            cert=layout.pki / "kwok.crt",
            key=layout.pki / "kwok.key",
        )
        for path, obj in _RBAC:
            admin.apply(path, obj)
        config = directory / "kwok.yaml"
        stages = binary.parent.parent / "stages"
        config.write_text(_stages(stages))
        log = (layout.logs if layout.logs.exists() else directory) / "kwok.log"
        with open(log, "ab") as out:
            # setpriv (util-linux): the controller gets SIGTERM when this process (the thread
            # that starts it) ends, so a killed benchmark or test run leaves no kwok behind.
            guard = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
            process = subprocess.Popen(
                [
                    *guard,
                    str(binary),
                    "--kubeconfig",
                    str(kubeconfig),
                    "--config",
                    str(config),
                    f"--manage-nodes-with-annotation-selector={ANNOTATION}=fake",
                    "--cidr=10.250.0.0/16",
                    "--node-lease-duration-seconds=40",
                    "--v=WARN",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(directory),
            )
        names = [f"kwok-{i}" for i in range(nodes)]
        kwok = Kwok(process, names, kubeconfig, log)
        try:
            for i, name in enumerate(names):
                body = fake_node(name, f"10.250.{16 * i}.0/20")
                try:
                    admin.request("POST", "/api/v1/nodes", body)
                except ApiError as exc:
                    if exc.status != 409:
                        raise
            deadline = time.monotonic() + timeout
            while not all(_ready(admin, n) for n in names):
                if process.poll() is not None:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"kwok exited ({process.returncode}); its log ends:\n{tail}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake nodes {names} not Ready after {timeout:.0f}s")
                time.sleep(0.2)
        except BaseException:
            kwok.stop()
            raise
        return kwok
    finally:
        admin.close()


def _ready(api: KubeApi, node: str) -> bool:
    try:
        body = api.get(f"/api/v1/nodes/{node}")
    except ApiError:
        return False
    conditions = body.get("status", {}).get("conditions", [])
    taints = [t.get("key") for t in body.get("spec", {}).get("taints") or []]
    # Schedulable too: the node lifecycle controller lifts its not-ready taint a moment later.
    return "node.kubernetes.io/not-ready" not in taints and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )
