"""Services and EndpointSlices reduced to what the proxy and DNS use, and the rules that join them.

Parsing keeps only a few fields of each object, so the store stays small and a malformed
object fails here (the caller logs and ignores it) instead of somewhere in the proxy.

Endpoint selection follows kube-proxy: an endpoint serves a Service port when its slice
(labelled ``kubernetes.io/service-name``) has a port of the same name and protocol; the
endpoints used are the ready ones (``conditions.ready`` unset counts as ready), or, when none
is ready, the serving ones that are terminating (graceful termination). kube-proxy also
honours topology hints, ``internalTrafficPolicy`` and ``trafficDistribution``; one node makes
them moot. Only the first address of an endpoint is used, as kube-proxy does.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .dns import DnsService

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class Port:
    name: str
    protocol: str
    port: int


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    type: str
    cluster_ip: str | None  # None: headless or none assigned
    ports: tuple[Port, ...]
    affinity_timeout: int | None  # seconds, when sessionAffinity is ClientIP
    external_name: str | None
    publish_not_ready: bool


@dataclass(frozen=True)
class Endpoint:
    ip: str
    hostname: str | None
    ready: bool
    serving: bool
    terminating: bool


@dataclass(frozen=True)
class Slice:
    namespace: str
    service: str
    ports: tuple[Port, ...]
    endpoints: tuple[Endpoint, ...]


def _key(obj: Mapping) -> tuple[str, str]:
    meta = obj["metadata"]
    return str(meta.get("namespace") or ""), str(meta["name"])


def _port(p: Mapping, field: str = "port") -> Port:
    number = int(p[field])
    if not 0 < number < 65536:
        raise ValueError(f"port {number} out of range")
    return Port(str(p.get("name") or ""), str(p.get("protocol") or "TCP").upper(), number)


def parse_service(obj: Mapping) -> Service:
    """Raises (KeyError, TypeError, ValueError) on an object this cannot use."""
    namespace, name = _key(obj)
    spec = obj.get("spec") or {}
    ip = spec.get("clusterIP")
    cluster_ip = None
    if ip and ip != "None":
        cluster_ip = str(ipaddress.IPv4Address(ip))
    affinity = None
    if spec.get("sessionAffinity") == "ClientIP":
        config = ((spec.get("sessionAffinityConfig") or {}).get("clientIP")) or {}
        affinity = int(config.get("timeoutSeconds") or 10800)
    return Service(
        namespace=namespace,
        name=name,
        type=str(spec.get("type") or "ClusterIP"),
        cluster_ip=cluster_ip,
        ports=tuple(_port(p) for p in spec.get("ports") or ()),
        affinity_timeout=affinity,
        external_name=spec.get("externalName") if spec.get("type") == "ExternalName" else None,
        publish_not_ready=bool(spec.get("publishNotReadyAddresses")),
    )


def parse_slice(obj: Mapping) -> Slice | None:
    """None for a slice the proxy ignores (not IPv4, no Service label)."""
    namespace, _ = _key(obj)
    service = (obj["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
    if not service or obj.get("addressType") != "IPv4":
        return None
    ports = tuple(_port(p) for p in obj.get("ports") or () if p.get("port") is not None)
    endpoints = []
    for ep in obj.get("endpoints") or ():
        addresses = ep.get("addresses") or ()
        if not addresses:
            continue
        cond = ep.get("conditions") or {}
        ready = cond.get("ready") is not False
        endpoints.append(
            Endpoint(
                ip=str(ipaddress.IPv4Address(addresses[0])),
                hostname=ep.get("hostname") or None,
                ready=ready,
                serving=ready if cond.get("serving") is None else bool(cond["serving"]),
                terminating=bool(cond.get("terminating")),
            )
        )
    return Slice(namespace, str(service), ports, tuple(endpoints))


def group_slices(slices: Iterable[Slice]) -> dict[tuple[str, str], list[Slice]]:
    by_service: dict[tuple[str, str], list[Slice]] = {}
    for s in slices:
        by_service.setdefault((s.namespace, s.service), []).append(s)
    return by_service


def backends(port: Port, slices: Iterable[Slice]) -> list[tuple[str, int]]:
    """The (ip, targetPort) pairs that serve one Service port, sorted."""
    ready: set[tuple[str, int]] = set()
    terminating: set[tuple[str, int]] = set()
    for s in slices:
        target = next(
            (p for p in s.ports if (p.name, p.protocol) == (port.name, port.protocol)), None
        )
        if target is None:
            continue
        for ep in s.endpoints:
            if ep.ready:
                ready.add((ep.ip, target.port))
            elif ep.serving and ep.terminating:
                terminating.add((ep.ip, target.port))
    return sorted(ready or terminating)


def dns_records(
    services: Iterable[Service], slices: Mapping[tuple[str, str], list[Slice]]
) -> dict[tuple[str, str], DnsService]:
    """What DNS serves: every Service, with the endpoints DNS publishes for it."""
    records = {}
    for svc in services:
        group = slices.get((svc.namespace, svc.name), ())
        endpoints = {
            (ep.ip, ep.hostname)
            for s in group
            for ep in s.endpoints
            if ep.ready or svc.publish_not_ready
        }
        ports = [(p.name, p.protocol, p.port) for p in svc.ports]
        if svc.cluster_ip is None:  # headless: SRV records name the endpoints' own ports
            own = {(p.name, p.protocol): p.port for s in group for p in s.ports}
            ports = [(name, proto, own.get((name, proto), port)) for name, proto, port in ports]
        records[(svc.namespace, svc.name)] = DnsService(
            cluster_ip=svc.cluster_ip,
            ports=tuple(ports),
            endpoints=tuple(sorted(endpoints, key=lambda e: (e[0], e[1] or ""))),
            external_name=svc.external_name,
        )
    return records
