"""Names and addresses one local cluster uses: shared by the control plane, node agent and proxy.

A cluster is named by a short ``tag`` (``[a-z0-9]{1,6}``) so that two clusters (a developer's
``make cluster-up`` and a test run's) can run side by side on one machine: every interface,
network namespace and address range below is derived from it and from ``index`` (0-99).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

TAG_RE = re.compile(r"^[a-z0-9]{1,6}$")
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class Layout:
    """Where one cluster lives: its directory (state, PKI, kubeconfigs, logs) and its networks.

    index picks the address ranges: pods 10.244.<index>.0/24 (the bridge is .1, the node's
    InternalIP), Services 10.96.<index>.0/24 (the ``kubernetes`` Service is .1, cluster DNS
    .10). Every address is on this machine: pod addresses live only in network namespaces the
    node agent creates, Service addresses on the cluster's dummy interface; nothing is routed
    off the machine (IP forwarding is left as it is).
    """

    directory: Path
    tag: str = "k0"
    index: int = 0

    def __post_init__(self) -> None:
        if not TAG_RE.match(self.tag):
            raise ValueError(f"cluster tag {self.tag!r} must match {TAG_RE.pattern}")
        if not 0 <= self.index <= 99:
            raise ValueError("cluster index must be 0..99")

    # --- files
    @property
    def pki(self) -> Path:
        return self.directory / "pki"

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.directory / "admin.kubeconfig"

    def kubeconfig(self, component: str) -> Path:
        return self.directory / f"{component}.kubeconfig"

    # --- names
    @property
    def node_name(self) -> str:
        return f"ketch-node-{self.tag}"

    @property
    def bridge(self) -> str:  # interface names are at most 15 characters
        return f"kbr-{self.tag}"

    @property
    def service_interface(self) -> str:
        return f"ksvc-{self.tag}"

    @property
    def netns_prefix(self) -> str:
        return f"kp-{self.tag}-"

    # --- addresses
    @property
    def pod_cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.244.{self.index}.0/24")

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        """The bridge's address: the node's InternalIP and the pods' default route."""
        return self.pod_cidr.network_address + 1

    @property
    def service_cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.96.{self.index}.0/24")

    @property
    def dns_ip(self) -> ipaddress.IPv4Address:
        return self.service_cidr.network_address + 10
