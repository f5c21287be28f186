"""The Node object and its heartbeats: registration, the Lease, status updates.

Registration creates the Node (or, if it exists, updates its labels) with this machine's
capacity (``os.cpu_count()`` CPUs, MemTotal, 110 pods, the cluster directory's disk; ``--capacity``
overrides or adds amounts: nothing is enforced, so a 2-CPU machine may announce 16), the
labels a kubelet sets (hostname, os, arch), the ``--taint``\\ s (NodeRestriction lets a node set
taints only when it creates itself), ``podCIDR`` (the layout's; dropped if the API refuses it),
and addresses InternalIP (the bridge's) and Hostname. Then, as a kubelet with leases does, it
renews ``kube-node-lease/<node>`` every ``LEASE_RENEW_S`` and patches the node's status
(conditions with heartbeat times, capacity, nodeInfo) every ``STATUS_INTERVAL_S``; the node
lifecycle controller marks a node whose Lease stops being renewed NotReady and evicts its pods.
A node deleted meanwhile is registered again. At stop the Ready condition turns False.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

from localcluster.layout import Layout
from localcluster.nodeagent.api import Api, ApiError, micro_now, now

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0
STATUS_INTERVAL_S = 30.0
KUBELET_VERSION = "v1.37.2"
RUNTIME_VERSION = "ketch-nodeagent://0.1.0"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le"}


def parse_taint(text: str) -> Obj:
    """``key[=value]:Effect`` as a taint."""
    left, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ValueError(f"taint {text!r} is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute")
    key, _, value = left.partition("=")
    taint = {"key": key, "effect": effect}
    if value:
        taint["value"] = value
    return taint


def capacity(directory: Path) -> dict[str, str]:
    memory_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            memory_kib = int(line.split()[1])
    disk = os.statvfs(directory)
    return {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{memory_kib}Ki",
        "pods": "110",
        "ephemeral-storage": f"{disk.f_blocks * disk.f_frsize // 1024}Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
    }


def _read(path: str, default: str = "") -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def node_info() -> Obj:
    os_image = "Linux"
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            os_image = line.split("=", 1)[1].strip('"')
    machine_id = _read("/etc/machine-id")
    return {
        "machineID": machine_id,
        "systemUUID": _read("/sys/class/dmi/id/product_uuid", machine_id),
        "bootID": _read("/proc/sys/kernel/random/boot_id"),
        "kernelVersion": platform.release(),
        "osImage": os_image,
        "containerRuntimeVersion": RUNTIME_VERSION,
        "kubeletVersion": KUBELET_VERSION,
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": arch(),
    }


def arch() -> str:
    return _ARCH.get(platform.machine(), platform.machine())


class NodeStatus:
    """Registers the node and keeps its Lease and status fresh from a thread of its own."""

    def __init__(
        self, api: Api, layout: Layout, taints: list[Obj], extra: dict[str, str] | None = None
    ) -> None:
        self.api, self.layout, self.taints = api, layout, taints
        self.name = layout.node_name
        self.capacity = capacity(layout.directory) | (extra or {})
        self.uid = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-status", daemon=True)

    def _node(self, with_cidr: bool) -> Obj:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": arch(),
            "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": arch(),
        }
        spec: Obj = {"taints": self.taints} if self.taints else {}
        if with_cidr:
            spec |= {"podCIDR": str(self.layout.pod_cidr), "podCIDRs": [str(self.layout.pod_cidr)]}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": spec,
        }

    def register(self) -> None:
        try:
            try:
                created = self.api.post("/api/v1/nodes", self._node(with_cidr=True))
            except ApiError as exc:
                if exc.status not in (403, 422):
                    raise
                logger.warning("node create with podCIDR refused (%s); without it", exc.message)
                created = self.api.post("/api/v1/nodes", self._node(with_cidr=False))
            self.uid = created["metadata"]["uid"]
            logger.info("registered node %s", self.name)
        except ApiError as exc:
            if exc.status != 409:
                raise
            existing = self.api.get(f"/api/v1/nodes/{self.name}")
            self.uid = existing["metadata"]["uid"]
            labels = self._node(False)["metadata"]["labels"]
            self.api.patch(f"/api/v1/nodes/{self.name}", {"metadata": {"labels": labels}})
            if (existing["spec"].get("taints") or []) != self.taints:
                logger.warning(
                    "node %s exists with taints %s, not %s (a node may not change its taints; "
                    "delete the Node to have it registered again)",
                    self.name, existing["spec"].get("taints"), self.taints,
                )  # fmt: skip
        self.update_status(ready=True)
        self.renew_lease()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.update_status(ready=False, message="node agent stopped")
        except (ApiError, OSError) as exc:
            logger.warning("could not mark node %s NotReady: %s", self.name, exc)

    def _loop(self) -> None:
        since_status = 0.0
        while not self._stop.wait(LEASE_RENEW_S):
            since_status += LEASE_RENEW_S
            try:
                self.renew_lease()
                if since_status >= STATUS_INTERVAL_S:
                    self.update_status(ready=True)
                    since_status = 0.0
            except ApiError as exc:
                if exc.status == 404 and "nodes" in exc.message:
                    logger.warning("node %s is gone: registering it again", self.name)
                    self._register_quietly()
                else:
                    logger.warning("node heartbeat failed: %s", exc)
            except OSError as exc:
                logger.warning("node heartbeat failed: %s", exc)

    def _register_quietly(self) -> None:
        try:
            self.register()
        except (ApiError, OSError) as exc:
            logger.warning("registering node %s again failed: %s", self.name, exc)

    def update_status(self, ready: bool, message: str = "") -> None:
        path = f"/api/v1/nodes/{self.name}"
        current = self.api.get(path)
        self.uid = current["metadata"]["uid"]
        old = {c["type"]: c for c in (current.get("status") or {}).get("conditions") or []}
        stamp = now()
        wanted = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory",
             "kubelet has sufficient memory available"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID",
             "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status")
            if ready
            else ("Ready", "False", "KubeletNotReady", message or "node agent is not ready"),
        ]  # fmt: skip
        conditions = []
        for kind, value, reason, text in wanted:
            before = old.get(kind, {})
            moved = before.get("status") != value
            conditions.append({
                "type": kind, "status": value, "reason": reason, "message": text,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp if moved else before.get("lastTransitionTime", stamp),
            })  # fmt: skip
        status = {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": str(self.layout.gateway)},
                {"type": "Hostname", "address": self.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": node_info(),
        }
        self.api.patch(f"{path}/status", {"status": status})

    def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        owner = [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}]
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": micro_now(),
        }
        try:
            lease = self.api.get(path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.name,
                    "namespace": "kube-node-lease",
                    "ownerReferences": owner,
                },
                "spec": spec,
            }
            self.api.post(path.rsplit("/", 1)[0], body)
            return
        lease["spec"] = {**lease.get("spec", {}), **spec}
        lease["metadata"]["ownerReferences"] = owner
        self.api.put(path, lease)
