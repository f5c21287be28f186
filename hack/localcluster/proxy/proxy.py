"""The service proxy: kube-proxy's old ``userspace`` mode, with the ClusterIPs owned locally.

Every ClusterIP (and the cluster DNS address) is a /32 on a dummy interface in the host's
network namespace, so a packet to it, from a test client on the host or from a pod (whose
default route is the bridge, i.e. the host), is delivered locally: no forwarding, no NAT, no
iptables. For each TCP port of a Service the proxy listens on ``clusterIP:port`` and splices
each accepted connection to one endpoint, chosen round-robin (or by client IP while a
``ClientIP`` session-affinity entry lasts); a failed dial tries the next endpoint, as the
userspace proxier did. A port is listened on only while it has endpoints, so with none a
client's SYN meets a reset ("connection refused"), as kube-proxy's REJECT rule gives. The
rest of the Service range is routed into the interface, which drops it: an address no Service
holds times out (on the host it would otherwise leave by the default route). Where the kernel
has no ``dummy`` driver the interface is an ``ifb`` device, which behaves the same here.

Different from kube-proxy (iptables/nftables/ipvs): endpoints see the connection coming from
the host (the bridge address for pods), not from the client; UDP and SCTP ports are not
proxied (logged once); NodePort and LoadBalancer Services are served on their ClusterIP only
(no node ports, no load-balancer IPs, no externalIPs); an open connection whose Service is
deleted dies with its address (there is no conntrack to keep it); changes of endpoints never
touch open connections, as with kube-proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

CHUNK = 64 << 10
DIAL_TIMEOUT_S = 3.0
MAX_DIALS = 3


def ip_cmd(*args: str, check: bool = True) -> bool:
    """Runs ``ip args``; False (logged unless check is False) when it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode and check:
        logger.warning("ip %s: %s", " ".join(args), result.stderr.strip())
    return result.returncode == 0


class Interface:
    """The dummy interface holding the Service addresses (and the Service range's route);
    deleting it removes them all."""

    def __init__(self, name: str, cidr: str) -> None:
        self.name, self.cidr = name, cidr
        self.addresses: set[str] = set()

    def create(self) -> None:
        if ip_cmd("link", "show", self.name, check=False):
            logger.info("deleting leftover interface %s", self.name)
            ip_cmd("link", "del", self.name)
        # A kernel without the dummy driver (some VM kernels) may have ifb: a device with no
        # wire either, whose addresses are just as local.
        for kind in ("dummy", "ifb"):
            if ip_cmd("link", "add", self.name, "type", kind, check=False):
                break
        else:
            raise RuntimeError(f"cannot create interface {self.name} (type dummy or ifb)")
        ip_cmd("link", "set", self.name, "addrgenmode", "none")  # no IPv6 link-local address
        ip_cmd("link", "set", self.name, "up")
        # The rest of the Service range goes nowhere (the device drops it) instead of out of
        # the default route: a ClusterIP no Service holds is unreachable, as in a cluster.
        ip_cmd("route", "add", self.cidr, "dev", self.name)
        logger.info("created %s (type %s), routing %s to it", self.name, kind, self.cidr)

    def add(self, ip: str) -> bool:
        if ip not in self.addresses and ip_cmd("addr", "add", f"{ip}/32", "dev", self.name):
            self.addresses.add(ip)
        return ip in self.addresses

    def remove(self, ip: str) -> None:
        if ip in self.addresses:
            self.addresses.discard(ip)
            ip_cmd("addr", "del", f"{ip}/32", "dev", self.name)

    def delete(self) -> None:
        ip_cmd("link", "del", self.name, check=False)
        self.addresses.clear()


@dataclass
class Target:
    """Where one Service port's connections go."""

    label: str  # "ns/name:port" for logs
    backends: list[tuple[str, int]]
    affinity_timeout: int | None = None
    next: int = 0
    affinity: dict[str, tuple[tuple[str, int], float]] = field(default_factory=dict)

    def order(self, client: str) -> list[tuple[str, int]]:
        """Backends to try, the chosen one first."""
        n = len(self.backends)
        if not n:
            return []
        if self.affinity_timeout is not None:
            pinned, expires = self.affinity.get(client, (None, 0.0))
            if pinned in self.backends and expires > time.monotonic():
                i = self.backends.index(pinned)
                return self.backends[i:] + self.backends[:i]
        i, self.next = self.next % n, self.next + 1
        return self.backends[i:] + self.backends[:i]

    def used(self, client: str, backend: tuple[str, int]) -> None:
        if self.affinity_timeout is not None:
            if len(self.affinity) > 10000:
                self.affinity.clear()
            self.affinity[client] = (backend, time.monotonic() + self.affinity_timeout)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with a TCP reset (SO_LINGER 0), what a rejected connection gets."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(CHUNK):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()  # half-close: the other direction goes on


class Proxy:
    """Listeners keyed by (clusterIP, port), each with its Target; connections in flight."""

    def __init__(self) -> None:
        self.listeners: dict[tuple[str, int], tuple[asyncio.Server, Target]] = {}
        self.targets: dict[tuple[str, int], Target] = {}
        self.connections: set[asyncio.Task] = set()

    async def apply(self, wanted: dict[tuple[str, int], Target]) -> None:
        """Makes the listeners match ``wanted`` (addresses must already be on the interface)."""
        for key in list(self.targets):
            if key not in wanted:
                self._close(key)
                del self.targets[key]
        for key, new in wanted.items():
            target = self.targets.setdefault(key, new)
            if target is not new:  # update in place: the listener's handler holds it
                target.label, target.backends = new.label, new.backends
                if target.affinity_timeout != new.affinity_timeout:
                    target.affinity_timeout, target.affinity = new.affinity_timeout, {}
            if not target.backends:
                self._close(key)  # no endpoints: connections are refused
            elif key not in self.listeners:
                await self._open(key, target)

    async def _open(self, key: tuple[str, int], target: Target) -> None:
        ip, port = key

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            self.connections.add(task)
            try:
                await self._forward(target, reader, writer)
            finally:
                self.connections.discard(task)

        try:
            server = await asyncio.start_server(
                accepted, ip, port, reuse_address=True, limit=CHUNK, backlog=256
            )
        except OSError as e:
            logger.warning("service %s: cannot listen on %s:%d: %s", target.label, ip, port, e)
            return
        self.listeners[key] = (server, target)

    def _close(self, key: tuple[str, int]) -> None:
        entry = self.listeners.pop(key, None)
        if entry is not None:
            entry[0].close()  # accepted connections stay open

    async def _forward(
        self, target: Target, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = (writer.get_extra_info("peername") or ("?",))[0]
        upstream = None
        for backend in target.order(client)[:MAX_DIALS]:
            try:
                async with asyncio.timeout(DIAL_TIMEOUT_S):
                    upstream = await asyncio.open_connection(*backend, limit=CHUNK)
            except (OSError, TimeoutError) as e:
                logger.info("service %s: endpoint %s:%d: %s", target.label, *backend, e)
                continue
            target.used(client, backend)
            break
        if upstream is None:
            _reset(writer)
            return
        up_reader, up_writer = upstream
        pipes = [
            asyncio.create_task(_pipe(reader, up_writer)),
            asyncio.create_task(_pipe(up_reader, writer)),
        ]
        failed = True
        try:
            # A failing direction (a reset, an error) ends both; a clean EOF waits for the other.
            pending: set[asyncio.Task] = set(pipes)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.cancelled() or t.exception() for t in done):
                    break
            else:
                failed = False
        finally:
            for t in pipes:
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved, so asyncio does not log it
                t.cancel()
            for w in (writer, up_writer):
                if failed:
                    w.transport.abort()
                else:
                    w.close()

    async def close(self) -> None:
        for key in list(self.listeners):
            self._close(key)
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=2)
