"""The command lines of the cluster's programs: how ``controlplane.start`` runs each one (its
flags are what a production cluster would set where Ketch depends on them; see the module
docstring there). Pure: no process is started here."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localcluster.layout import CLUSTER_DOMAIN, Layout

HACK = Path(__file__).resolve().parents[1]
NODE_TAINT = "ketch.dev/local-node=true:NoSchedule"
SERVICE_ACCOUNT_ISSUER = f"https://kubernetes.default.svc.{CLUSTER_DOMAIN}"


def apiserver_names(layout: Layout) -> tuple[str, ...]:
    """Every name and address the API server's certificate is valid for."""
    return (
        "127.0.0.1",
        str(layout.gateway),
        str(layout.service_cidr.network_address + 1),  # the `kubernetes` Service
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        f"kubernetes.default.svc.{CLUSTER_DOMAIN}",
    )


@dataclass(frozen=True)
class Etcd:
    """One member on loopback, plain HTTP (only this machine's programs reach it)."""

    client_port: int
    peer_port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self, binary: Path, layout: Layout) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            str(binary),
            "--name", "ketch",
            "--data-dir", str(layout.directory / "etcd"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"ketch={peer}",
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=4294967296",
            "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
            "--log-level", "warn",
        ]  # fmt: skip


def apiserver(binary: Path, layout: Layout, etcd_url: str, port: int) -> list[str]:
    p, host = layout.pki, str(layout.gateway)
    return [
        str(binary),
        "--etcd-servers", etcd_url,
        "--bind-address", host,
        "--advertise-address", host,
        "--secure-port", str(port),
        "--tls-cert-file", str(p / "apiserver.crt"),
        "--tls-private-key-file", str(p / "apiserver.key"),
        "--client-ca-file", str(p / "ca.crt"),
        "--authorization-mode", "Node,RBAC",
        "--enable-admission-plugins", "NodeRestriction,PodTolerationRestriction",
        "--admission-control-config-file", str(layout.directory / "admission.yaml"),
        "--service-cluster-ip-range", str(layout.service_cidr),
        "--service-account-issuer", SERVICE_ACCOUNT_ISSUER,
        "--service-account-key-file", str(p / "sa.pub"),
        "--service-account-signing-key-file", str(p / "sa.key"),
        "--api-audiences", SERVICE_ACCOUNT_ISSUER,
        "--allow-privileged=true",
        # the aggregation layer (prometheus-adapter's custom metrics API)
        "--requestheader-client-ca-file", str(p / "front-proxy-ca.crt"),
        "--requestheader-allowed-names", "front-proxy-client",
        "--requestheader-username-headers", "X-Remote-User",
        "--requestheader-group-headers", "X-Remote-Group",
        "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
        "--proxy-client-cert-file", str(p / "front-proxy-client.crt"),
        "--proxy-client-key-file", str(p / "front-proxy-client.key"),
        "--enable-aggregator-routing=true",
        # kubectl logs: the node agent's endpoint on the node's InternalIP
        "--kubelet-client-certificate", str(p / "apiserver-kubelet-client.crt"),
        "--kubelet-client-key", str(p / "apiserver-kubelet-client.key"),
        "--kubelet-certificate-authority", str(p / "ca.crt"),
        "--kubelet-preferred-address-types", "InternalIP",
        "--audit-policy-file", str(layout.directory / "audit-policy.yaml"),
        "--audit-log-path", str(layout.logs / "audit.log"),
        "--audit-log-format", "json",
        "--audit-log-mode", "blocking",
        "--profiling=false",
        "--v", "1",
    ]  # fmt: skip


def _component(binary: Path, kubeconfig: Path, port: int) -> list[str]:
    """What kube-controller-manager and kube-scheduler share: their identity (for the API and
    for delegated authn/authz of their own /healthz), loopback, no leader election."""
    cfg = str(kubeconfig)
    return [
        str(binary),
        "--kubeconfig", cfg,
        "--authentication-kubeconfig", cfg,
        "--authorization-kubeconfig", cfg,
        "--bind-address", "127.0.0.1",
        "--secure-port", str(port),
        "--leader-elect=false",
        "--v", "1",
    ]  # fmt: skip


def controller_manager(
    bins: dict[str, Path], layout: Layout, port: int, hpa_sync_period: str
) -> list[str]:
    p = layout.pki
    argv = _component(
        bins["kube-controller-manager"], layout.kubeconfig("controller-manager"), port
    )
    return [
        *argv,
        "--controllers", "*",
        "--use-service-account-credentials=true",
        "--service-account-private-key-file", str(p / "sa.key"),
        "--root-ca-file", str(p / "ca.crt"),
        "--cluster-signing-cert-file", str(p / "ca.crt"),
        "--cluster-signing-key-file", str(p / "ca.key"),
        "--horizontal-pod-autoscaler-sync-period", hpa_sync_period,
    ]  # fmt: skip


def scheduler(bins: dict[str, Path], layout: Layout, port: int) -> list[str]:
    return _component(bins["kube-scheduler"], layout.kubeconfig("scheduler"), port)


def python_env() -> dict[str, str]:
    """This environment with ``hack/`` on PYTHONPATH, for our own programs."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(HACK), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _ours(layout: Layout) -> list[str]:
    return [
        "--dir",
        str(layout.directory),
        "--tag",
        layout.tag,
        "--index",
        str(layout.index),
    ]


def service_proxy(layout: Layout) -> list[str]:
    kubeconfig = str(layout.kubeconfig("service-proxy"))
    return [
        sys.executable,
        "-m",
        "localcluster.proxy",
        "--kubeconfig",
        kubeconfig,
        *_ours(layout),
    ]


def node_agent(layout: Layout, images: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "localcluster.nodeagent",
        "--kubeconfig", str(layout.kubeconfig("node")),
        *_ours(layout),
        "--taint", NODE_TAINT,
        # Examples ask for 2 CPUs and several GiB (KV cache, swap space) a pod: the node
        # offers more than the machine has, and the pods' processes share its cores and
        # memory (a tiny-model engine pod uses ~1 GB).
        "--capacity", "cpu=16",
        "--capacity", "memory=96Gi",
        "--images", str(images),
        *extra,
    ]  # fmt: skip


def watchdog(layout: Layout, pid: int) -> list[str]:
    return [
        sys.executable, "-m", "localcluster", "watchdog",
        "--dir", str(layout.directory), "--pid", str(pid),
    ]  # fmt: skip


def kube_dns_service(layout: Layout) -> dict[str, Any]:
    """The ``kube-dns`` Service, reserving cluster DNS's address as a real cluster's does."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "kube-dns",
            "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns"},
        },
        "spec": {
            "clusterIP": str(layout.dns_ip),
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ],
        },
    }
