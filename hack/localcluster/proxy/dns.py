"""Cluster DNS: the answers CoreDNS's ``kubernetes`` plugin gives, for ``cluster.local`` only.

Served on ``layout.dns_ip`` port 53, UDP and TCP. Records (TTL 5 s):

- ``<svc>.<ns>.svc.cluster.local``: A of the ClusterIP; for a headless Service the A records of
  its ready endpoints (all endpoints with ``publishNotReadyAddresses``); CNAME for ExternalName;
- ``<host>.<svc>.<ns>.svc.cluster.local``: A of the endpoint whose ``hostname`` (or dashed IP)
  is ``<host>`` (what a StatefulSet's pods get through their headless Service);
- ``_<port>._<proto>.<svc>.<ns>.svc.cluster.local`` SRV (and SRV on the Service name: all ports);
- ``<a-b-c-d>.<ns>.pod.cluster.local``: A ``a.b.c.d`` (CoreDNS's ``pods insecure``).

Names in the zone that match nothing (which is what a resolver's search path makes of most
names, e.g. ``foo.ns.svc.cluster.local.svc.cluster.local``) get NXDOMAIN; existing names
without records of the asked type (AAAA always) an empty NOERROR; names outside the zone
NXDOMAIN at once, not authoritative (CoreDNS would forward them upstream; nothing leaves this
machine here, and NXDOMAIN gives a client the usual "name not known", where REFUSED or
SERVFAIL would give glibc's retriable "temporary failure").

Different from CoreDNS: no SOA/NS records (negative answers carry no SOA, so resolvers do not
cache them), no PTR (reverse) zone, no additional-section A records for SRV targets, no
IPv6, no DNSSEC, EDNS only as far as honouring the client's UDP size; a response too big for
UDP is sent empty with TC set (the client retries over TCP) rather than cut to size.
Malformed queries are dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TTL = 5
A, CNAME, AAAA, SRV, OPT, ANY = 1, 5, 28, 33, 41, 255
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
MAX_QUERY = 4096  # bytes: a query is one name; anything bigger is dropped
MAX_UDP_ANSWER = 1232  # the EDNS size we offer (the DNS flag day 2020 value)
TCP_IDLE_S = 10.0
MAX_TCP_CLIENTS = 64

RR = tuple[tuple[bytes, ...] | None, int, bytes]  # (owner: None = the question's name, type, rdata)


class Malformed(ValueError):
    pass


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    labels: tuple[bytes, ...]  # as sent (case kept: the answer echoes it)
    qtype: int
    qclass: int
    udp_size: int | None  # from an EDNS OPT record, None without EDNS

    @property
    def name(self) -> tuple[str, ...]:
        return tuple(label.decode("latin-1").lower() for label in self.labels)


def read_name(msg: bytes, off: int) -> tuple[tuple[bytes, ...], int]:
    """Decodes a (possibly compressed) name at ``off``: its labels and the offset after it."""
    labels: list[bytes] = []
    end = None
    total = 0
    for _ in range(128):  # bounds pointer chains (a loop is malformed)
        if off >= len(msg):
            raise Malformed("name runs past the message")
        length = msg[off]
        if length == 0:
            return tuple(labels), (off + 1 if end is None else end)
        if length & 0xC0 == 0xC0:
            if off + 1 >= len(msg):
                raise Malformed("truncated pointer")
            if end is None:
                end = off + 2
            off = ((length & 0x3F) << 8) | msg[off + 1]
            continue
        if length & 0xC0:
            raise Malformed("unknown label type")
        label = msg[off + 1 : off + 1 + length]
        if len(label) != length:
            raise Malformed("truncated label")
        total += length + 1
        if total > 254:
            raise Malformed("name too long")
        labels.append(label)
        off += 1 + length
    raise Malformed("pointer loop")


def encode_name(labels: tuple[bytes, ...]) -> bytes:
    out = b"".join(bytes([len(label)]) + label for label in labels) + b"\0"
    if len(out) > 255 or any(not 0 < len(label) < 64 for label in labels):
        raise ValueError(f"not a DNS name: {labels!r}")
    return out


def _skip_rr(msg: bytes, off: int) -> tuple[int, int, int]:
    """Skips one resource record: its type, class and the offset after it."""
    _, off = read_name(msg, off)
    if off + 10 > len(msg):
        raise Malformed("truncated record")
    rtype, rclass, _ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
    off += 10 + rdlen
    if off > len(msg):
        raise Malformed("truncated rdata")
    return rtype, rclass, off


def parse_query(msg: bytes) -> Query:
    """A query with one question; raises Malformed for anything else."""
    if not 12 <= len(msg) <= MAX_QUERY:
        raise Malformed("bad size")
    qid, flags, qdcount, ancount, nscount, arcount = struct.unpack_from("!6H", msg)
    if flags & 0x8000 or qdcount != 1:
        raise Malformed("not a query with one question")
    labels, off = read_name(msg, 12)
    if off + 4 > len(msg):
        raise Malformed("truncated question")
    qtype, qclass = struct.unpack_from("!HH", msg, off)
    off += 4
    udp_size = None
    for i in range(ancount + nscount + arcount):
        rtype, rclass, off = _skip_rr(msg, off)
        if rtype == OPT and i >= ancount + nscount:
            udp_size = max(512, rclass)
    return Query(qid, flags, labels, qtype, qclass, udp_size)


def build_response(
    query: Query, rcode: int, answers: list[RR], limit: int = 65535, authoritative: bool = True
) -> bytes:
    """The response to ``query``; sent empty with TC set if the answers exceed ``limit``."""
    flags = 0x8000 | (query.flags & 0x7900) | rcode  # QR, opcode and RD kept
    flags |= 0x0400 if authoritative else 0
    question = encode_name(query.labels) + struct.pack("!HH", query.qtype, query.qclass)
    opt = b"\0" + struct.pack("!HHIH", OPT, MAX_UDP_ANSWER, 0, 0) if query.udp_size else b""
    records = [
        (b"\xc0\x0c" if owner is None else encode_name(owner))
        + struct.pack("!HHIH", rtype, CLASS_IN, TTL, len(rdata))
        + rdata
        for owner, rtype, rdata in answers
    ]
    size = 12 + len(question) + len(opt) + sum(map(len, records))
    if size > limit:
        flags |= 0x0200
        records = []
    header = struct.pack("!6H", query.id, flags, 1, len(records), 0, 1 if opt else 0)
    return header + question + b"".join(records) + opt


# --- the zone


@dataclass(frozen=True)
class DnsService:
    """What DNS needs of a Service; endpoints are (ip, hostname or None), already filtered."""

    cluster_ip: str | None  # None: headless (or ExternalName)
    ports: tuple[tuple[str, str, int], ...] = ()  # (name, protocol, port)
    endpoints: tuple[tuple[str, str | None], ...] = ()
    external_name: str | None = None


def _name(*parts: str) -> tuple[bytes, ...]:
    return tuple(p.encode() for part in parts for p in part.split(".") if p)


def _dashed(ip: str) -> str:
    return ip.replace(".", "-")


def _srv(port: int, target: tuple[bytes, ...]) -> bytes:
    return struct.pack("!HHH", 0, 100, port) + encode_name(target)


class Zone:
    """The ``cluster.local`` zone over a snapshot of Services, replaced on every change."""

    def __init__(self, domain: str = "cluster.local") -> None:
        self.domain = domain
        self.suffix = tuple(domain.split("."))
        self.services: Mapping[tuple[str, str], DnsService] = {}
        self.namespaces: frozenset[str] = frozenset()
        self.synced = False  # until the first update, names in the zone get SERVFAIL

    def update(self, services: Mapping[tuple[str, str], DnsService]) -> None:
        self.services = services
        self.namespaces = frozenset(ns for ns, _ in services)
        self.synced = True

    def contains(self, name: tuple[str, ...]) -> bool:
        return name[len(name) - len(self.suffix) :] == self.suffix

    def resolve(self, name: tuple[str, ...], qtype: int) -> tuple[int, list[RR]]:
        """(rcode, answers) for a lower-cased name split into labels."""
        n = len(self.suffix)
        if not self.contains(name):
            return NXDOMAIN, []
        if not self.synced:
            return SERVFAIL, []
        rest = name[:-n]
        if len(rest) <= 1:
            return (NOERROR, []) if rest in ((), ("svc",), ("pod",)) else (NXDOMAIN, [])
        if rest[-1] == "pod":
            if len(rest) == 2:
                return NOERROR, []
            if len(rest) == 3:
                try:
                    ip = ipaddress.IPv4Address(rest[0].replace("-", "."))
                except ValueError:
                    return NXDOMAIN, []
                return NOERROR, ([(None, A, ip.packed)] if qtype in (A, ANY) else [])
            return NXDOMAIN, []
        if rest[-1] != "svc":
            return NXDOMAIN, []
        if len(rest) == 2:
            return (NOERROR if rest[0] in self.namespaces else NXDOMAIN), []
        svc = self.services.get((rest[-2], rest[-3]))
        if svc is None:
            return NXDOMAIN, []
        if len(rest) == 3:
            return NOERROR, self._service(svc, rest[-3], rest[-2], qtype)
        if len(rest) == 4:
            ips = [ip for ip, host in svc.endpoints if rest[0] in (host, _dashed(ip))]
            if not ips:
                return NXDOMAIN, []
            return NOERROR, ([(None, A, _a(ip)) for ip in ips] if qtype in (A, ANY) else [])
        if len(rest) == 5 and rest[0][:1] == "_" and rest[1][:1] == "_":
            ports = [p for p in svc.ports if p[0] and (f"_{p[0]}", f"_{p[1].lower()}") == rest[:2]]
            if not ports:
                return NXDOMAIN, []
            answers = self._srv(svc, rest[-3], rest[-2], ports) if qtype in (SRV, ANY) else []
            return NOERROR, answers
        return NXDOMAIN, []

    def _service(self, svc: DnsService, name: str, ns: str, qtype: int) -> list[RR]:
        if svc.external_name:
            with contextlib.suppress(ValueError):
                return [(None, CNAME, encode_name(_name(svc.external_name)))]
            return []
        if qtype == SRV:
            return self._srv(svc, name, ns, list(svc.ports))
        if qtype not in (A, ANY):
            return []
        ips = [svc.cluster_ip] if svc.cluster_ip else sorted({ip for ip, _ in svc.endpoints})
        return [(None, A, _a(ip)) for ip in ips]

    def _srv(self, svc: DnsService, name: str, ns: str, ports: list) -> list[RR]:
        base = (name, ns, "svc", self.domain)
        if svc.cluster_ip:
            targets = [_name(*base)]
        else:
            targets = [_name(host or _dashed(ip), *base) for ip, host in svc.endpoints]
        answers: list[RR] = []
        for _, _, port in ports:
            for target in targets:
                with contextlib.suppress(ValueError):  # a hostname that is no DNS label
                    answers.append((None, SRV, _srv(port, target)))
        return answers


def _a(ip: str) -> bytes:
    return ipaddress.IPv4Address(ip).packed


def answer(zone: Zone, msg: bytes, limit: int | None) -> bytes | None:
    """The response to one query message (``limit`` None: over TCP), None to drop it."""
    try:
        query = parse_query(msg)
    except Malformed:
        return None
    if query.flags & 0x7800:  # opcode other than QUERY
        return build_response(query, NOTIMP, [])
    if query.qclass != CLASS_IN:
        return build_response(query, REFUSED, [])
    try:
        rcode, answers = zone.resolve(query.name, query.qtype)
    except Exception:  # a bug or odd data must not stop the server
        logger.exception("resolving %s", ".".join(query.name))
        return None
    if limit is None:
        limit = 65535
    elif query.udp_size:
        limit = min(query.udp_size, MAX_UDP_ANSWER)
    return build_response(query, rcode, answers, limit, zone.contains(query.name))


# --- servers


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, zone: Zone) -> None:
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        reply = answer(self.zone, data, 512)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("udp: %s", exc)


async def serve(zone: Zone, host: str, port: int = 53) -> list:
    """Starts the UDP and TCP servers; returns what to close when stopping."""
    loop = asyncio.get_running_loop()
    clients = asyncio.Semaphore(MAX_TCP_CLIENTS)

    async def tcp_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if clients.locked():
            writer.close()
            return
        async with clients:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                while True:
                    async with asyncio.timeout(TCP_IDLE_S):
                        (length,) = struct.unpack("!H", await reader.readexactly(2))
                        if length > MAX_QUERY:
                            break
                        msg = await reader.readexactly(length)
                    reply = answer(zone, msg, None)
                    if reply is None:
                        break
                    writer.write(struct.pack("!H", len(reply)) + reply)
                    await writer.drain()
            writer.close()

    udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(zone), local_addr=(host, port))
    tcp = await asyncio.start_server(tcp_client, host, port, reuse_address=True)
    return [udp, tcp]


def probe(
    server: str, name: str = "kubernetes.default.svc.cluster.local", timeout=1.0, port=53
) -> list[str]:
    """The A records ``server`` gives for ``name`` over UDP ([] on no answer): a readiness check
    for whoever starts the proxy (an answer means the Services have been listed)."""
    labels = tuple(label.encode() for label in name.split("."))
    msg = struct.pack("!6H", 0x6B74, 0x0100, 1, 0, 0, 0) + encode_name(labels) + b"\0\1\0\1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(msg, (server, port))
            reply = sock.recv(4096)
            qid, _, _, ancount, _, _ = struct.unpack_from("!6H", reply)
            if qid != 0x6B74:
                return []
            off = len(msg)
            ips = []
            for _ in range(ancount):
                rtype, _, end = _skip_rr(reply, off)
                if rtype == A:
                    ips.append(socket.inet_ntoa(reply[end - 4 : end]))
                off = end
        except (OSError, struct.error, Malformed):
            return []
    return ips
