"""Pod networking: the cluster's bridge, one network namespace and veth pair per pod, and IPAM.

What a CNI plugin (bridge + host-local IPAM) does for a kubelet, with ``ip``:

- the bridge ``layout.bridge`` holds ``layout.gateway``/24, the node's InternalIP and every pod's
  default route (created if missing, removed at stop only if this agent created it);
- a pod gets the netns ``<netns_prefix><hash>`` and the veth ``kv<tag>-<hash>`` (at most 15
  characters) whose peer is ``eth0`` in the netns, with the next free address of the pod CIDR,
  ``lo`` up and a default route via the gateway;
- addresses are handed out round-robin from .2 like host-local, recorded in
  ``<dir>/nodeagent/ips.json`` (uid -> address) so that a restarted agent neither gives a live
  pod's address to another nor changes the address of a pod it starts again.

No IP forwarding, NAT or iptables: pod addresses are reachable from this machine and from each
other over the bridge, nothing is routed off it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import subprocess
import threading

from localcluster.layout import Layout

logger = logging.getLogger(__name__)


class NetworkError(Exception):
    pass


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def links() -> list[str]:
    names = []
    for line in ip("-o", "link", "show").splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        names.append(name)
    return names


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", name, check=False).split()]


class Network:
    """The node's pod network (one per agent)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.state = layout.directory / "nodeagent" / "ips.json"
        self.created_bridge = False
        self._lock = threading.Lock()

    # --- names
    def hash_of(self, uid: str) -> str:
        length = 12 - len(self.layout.tag)  # "kv" + tag + "-" + hash <= 15 characters
        return hashlib.sha256(uid.encode()).hexdigest()[:length]

    def netns(self, uid: str) -> str:
        return self.layout.netns_prefix + self.hash_of(uid)

    def veth(self, uid: str) -> str:
        return f"kv{self.layout.tag}-{self.hash_of(uid)}"

    # --- the bridge
    def ensure_bridge(self) -> None:
        bridge, gateway = self.layout.bridge, self.layout.gateway
        if bridge not in links():
            ip("link", "add", bridge, "type", "bridge")
            self.created_bridge = True
        cidr = f"{gateway}/{self.layout.pod_cidr.prefixlen}"
        if cidr not in ip("-o", "addr", "show", "dev", bridge):
            ip("addr", "add", cidr, "dev", bridge)
        ip("link", "set", bridge, "up")

    def remove_bridge(self) -> None:
        if self.created_bridge:
            ip("link", "del", self.layout.bridge, check=False)
            self.created_bridge = False

    # --- pods
    def setup(self, uid: str) -> str:
        """The pod's netns, veth and address (returned); idempotent for one uid."""
        ns, veth = self.netns(uid), self.veth(uid)
        address = self.allocate(uid)
        if ns in namespaces():  # a half-made one from an earlier attempt
            self.teardown(uid, release=False)
        try:
            ip("netns", "add", ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.layout.bridge, "up")
            prefix = self.layout.pod_cidr.prefixlen
            ip("-n", ns, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "route", "add", "default", "via", str(self.layout.gateway))
        except NetworkError:
            self.teardown(uid, release=False)
            raise
        return address

    def teardown(self, uid: str, release: bool = True) -> None:
        """Removes the pod's veth and netns (its processes must be gone) and frees its address."""
        ns, veth = self.netns(uid), self.veth(uid)
        ip("link", "del", veth, check=False)
        if ns in namespaces():
            ip("netns", "del", ns, check=False)
        if release:
            self.release(uid)

    def leftovers(self) -> tuple[list[str], list[str]]:
        """Namespaces and veths with this cluster's prefixes (to remove at start and stop)."""
        veth_prefix = f"kv{self.layout.tag}-"
        nss = [n for n in namespaces() if n.startswith(self.layout.netns_prefix)]
        return nss, [link for link in links() if link.startswith(veth_prefix)]

    # --- IPAM
    def _load(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.state.read_text())
        return {"last": 1, "pods": {}}

    def _save(self, state: dict) -> None:
        self.state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state)

    def allocate(self, uid: str) -> str:
        with self._lock:
            state = self._load()
            if uid in state["pods"]:
                return state["pods"][uid]
            net = self.layout.pod_cidr
            used = set(state["pods"].values())
            hosts = net.num_addresses - 2  # .1 is the gateway, the last the broadcast
            for step in range(1, hosts):
                n = (state["last"] - 2 + step) % (hosts - 1) + 2
                address = str(net.network_address + n)
                if address not in used:
                    state["pods"][uid] = address
                    state["last"] = n
                    self._save(state)
                    return address
            raise NetworkError(f"no free address left in {net}")

    def release(self, uid: str) -> None:
        with self._lock:
            state = self._load()
            if state["pods"].pop(uid, None) is not None:
                self._save(state)

    def keep_only(self, uids: set[str]) -> None:
        """Forgets the addresses of pods not in ``uids`` (at start: pods that are gone)."""
        with self._lock:
            state = self._load()
            state["pods"] = {u: a for u, a in state["pods"].items() if u in uids}
            self._save(state)
