"""The DNS codec and the cluster.local zone (no network)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from localcluster.proxy import dns, model

A, AAAA, SRV, CNAME = dns.A, dns.AAAA, dns.SRV, dns.CNAME


def query(name: str, qtype: int = A, qid: int = 7, edns: int | None = None, flags=0x0100) -> bytes:
    labels = tuple(p.encode() for p in name.rstrip(".").split("."))
    msg = struct.pack("!6H", qid, flags, 1, 0, 0, 1 if edns else 0)
    msg += dns.encode_name(labels) + struct.pack("!HH", qtype, 1)
    if edns:
        msg += b"\0" + struct.pack("!HHIH", dns.OPT, edns, 0, 0)
    return msg


def decode(msg: bytes) -> tuple[int, int, list[tuple[int, bytes]], int]:
    """(flags, rcode, [(type, rdata)], id) of a response."""
    qid, flags, qd, an, _, _ = struct.unpack_from("!6H", msg)
    off = 12
    for _ in range(qd):
        _, off = dns.read_name(msg, off)
        off += 4
    records = []
    for _ in range(an):
        _, off = dns.read_name(msg, off)
        rtype, _, ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
        assert ttl == dns.TTL
        records.append((rtype, msg[off + 10 : off + 10 + rdlen]))
        off += 10 + rdlen
    return flags, flags & 0xF, records, qid


def ips(records) -> list[str]:
    return [socket.inet_ntoa(rdata) for rtype, rdata in records if rtype == A]


def zone() -> dns.Zone:
    services = [
        model.parse_service(
            {
                "metadata": {"namespace": "default", "name": "web"},
                "spec": {
                    "clusterIP": "10.96.0.23",
                    "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
                },
            }
        ),
        model.parse_service(
            {
                "metadata": {"namespace": "ml", "name": "workers"},
                "spec": {"clusterIP": "None", "ports": [{"name": "zmq", "port": 5555}]},
            }
        ),
        model.parse_service(
            {
                "metadata": {"namespace": "ml", "name": "ext"},
                "spec": {"type": "ExternalName", "externalName": "web.default.svc.cluster.local"},
            }
        ),
    ]
    endpoints = [
        {"addresses": ["10.244.0.5"], "hostname": "w-0", "conditions": {"ready": True}},
        {"addresses": ["10.244.0.6"], "hostname": "w-1"},  # ready unset: ready
        {"addresses": ["10.244.0.7"], "hostname": "w-2", "conditions": {"ready": False}},
    ]
    slices = [
        model.parse_slice(
            {
                "metadata": {
                    "namespace": "ml",
                    "name": "workers-abc",
                    "labels": {model.SERVICE_NAME_LABEL: "workers"},
                },
                "addressType": "IPv4",
                "ports": [{"name": "zmq", "port": 5556, "protocol": "TCP"}],
                "endpoints": endpoints,
            }
        )
    ]
    z = dns.Zone()
    z.update(model.dns_records(services, model.group_slices(slices)))
    return z


def ask(name: str, qtype: int = A, limit: int | None = 512, **kw):
    reply = dns.answer(zone(), query(name, qtype, **kw), limit)
    assert reply is not None
    return decode(reply)


def test_cluster_ip_service():
    flags, rcode, records, qid = ask("web.default.svc.cluster.local")
    assert (rcode, ips(records), qid) == (dns.NOERROR, ["10.96.0.23"], 7)
    assert flags & 0x8000 and flags & 0x0400 and flags & 0x0100  # QR, AA, RD echoed
    # case-insensitive, trailing dot
    assert ips(ask("WEB.Default.SVC.cluster.local.")[2]) == ["10.96.0.23"]


def test_headless_service_lists_ready_endpoints():
    _, rcode, records, _ = ask("workers.ml.svc.cluster.local")
    assert (rcode, sorted(ips(records))) == (dns.NOERROR, ["10.244.0.5", "10.244.0.6"])
    assert ips(ask("w-1.workers.ml.svc.cluster.local")[2]) == ["10.244.0.6"]
    assert ips(ask("10-244-0-5.workers.ml.svc.cluster.local")[2]) == ["10.244.0.5"]
    assert ask("w-2.workers.ml.svc.cluster.local")[1] == dns.NXDOMAIN  # not ready


def test_srv():
    _, rcode, records, _ = ask("_http._tcp.web.default.svc.cluster.local", SRV)
    assert rcode == dns.NOERROR and len(records) == 1
    _, _, port = struct.unpack_from("!HHH", records[0][1])
    target, _ = dns.read_name(records[0][1], 6)
    assert (port, b".".join(target)) == (8000, b"web.default.svc.cluster.local")
    _, _, records, _ = ask("_zmq._tcp.workers.ml.svc.cluster.local", SRV)
    targets = sorted(b".".join(dns.read_name(r, 6)[0]) for _, r in records)
    assert targets == [b"w-0.workers.ml.svc.cluster.local", b"w-1.workers.ml.svc.cluster.local"]
    assert {struct.unpack_from("!HHH", r)[2] for _, r in records} == {5556}  # the pods' port
    assert ask("_grpc._tcp.web.default.svc.cluster.local", SRV)[1] == dns.NXDOMAIN


def test_other_names():
    assert ips(ask("10-244-0-9.ml.pod.cluster.local")[2]) == ["10.244.0.9"]
    assert ask("web.default.svc.cluster.local", AAAA)[1:3] == (dns.NOERROR, [])
    assert ask("nope.default.svc.cluster.local")[1] == dns.NXDOMAIN
    assert ask("web.default.svc.cluster.local.svc.cluster.local")[1] == dns.NXDOMAIN
    assert ask("web.default.svc.cluster.local.default.svc.cluster.local")[1] == dns.NXDOMAIN
    assert ask("default.svc.cluster.local")[1:3] == (dns.NOERROR, [])
    assert ask("nons.svc.cluster.local")[1] == dns.NXDOMAIN
    for outside in ("huggingface.co", "cluster.local.example.com", "local"):
        flags, rcode, _, _ = ask(outside)
        assert rcode == dns.NXDOMAIN and not flags & 0x0400  # not authoritative
    _, rcode, records, _ = ask("ext.ml.svc.cluster.local")
    assert rcode == dns.NOERROR and records[0][0] == CNAME


def test_truncation_and_edns():
    big = dns.Zone()
    endpoints = tuple((f"10.244.0.{i}", None) for i in range(1, 61))
    big.update({("ns", "many"): dns.DnsService(None, (), endpoints)})
    msg = query("many.ns.svc.cluster.local")
    flags, _, records, _ = decode(dns.answer(big, msg, 512))
    assert flags & 0x0200 and records == []  # TC: retry over TCP
    flags, _, records, _ = decode(dns.answer(big, msg, None))
    assert not flags & 0x0200 and len(records) == 60
    edns = query("many.ns.svc.cluster.local", edns=4096)
    flags, _, records, _ = decode(dns.answer(big, edns, 512))
    assert not flags & 0x0200 and len(records) == 60  # 60 x 16 bytes fit 1232


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"\0" * 11,
        query("web.default.svc.cluster.local")[:-3],  # truncated question
        query("x", flags=0x8000),  # a response
        struct.pack("!6H", 1, 0, 2, 0, 0, 0) + b"\0\0\1\0\1" * 2,  # two questions
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c\0\1\0\1",  # pointer loop
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + b"\x3f" + b"a" * 10,  # label past the end
        struct.pack("!6H", 1, 0, 1, 0, 0, 0) + (b"\x3f" + b"a" * 63) * 5 + b"\0\0\1\0\1",
        query("web.default.svc.cluster.local") + b"\0" * 5000,  # too big
    ],
)
def test_malformed_is_dropped(msg):
    assert dns.answer(zone(), msg, 512) is None


def test_opcode_and_class():
    assert decode(dns.answer(zone(), query("x", flags=0x2800), 512))[1] == dns.NOTIMP
    chaos = query("version.bind")[:-2] + b"\0\3"
    assert decode(dns.answer(zone(), chaos, 512))[1] == dns.REFUSED


def test_servers_udp_and_tcp():
    async def main():
        z = zone()
        closers = await dns.serve(z, "127.0.0.1", 0)
        port = closers[1].sockets[0].getsockname()[1]  # TCP's ephemeral port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        msg = query("web.default.svc.cluster.local")
        writer.write(struct.pack("!H", len(msg)) + msg + struct.pack("!H", len(msg)) + msg)
        for _ in range(2):
            (n,) = struct.unpack("!H", await reader.readexactly(2))
            assert ips(decode(await reader.readexactly(n))[2]) == ["10.96.0.23"]
        writer.close()
        for c in closers:
            c.close()

    asyncio.run(main())


def test_servfail_until_synced_and_probe():
    assert dns.Zone().resolve(("web", "default", "svc", "cluster", "local"), A)[0] == dns.SERVFAIL

    async def main():
        closers = await dns.serve(zone(), "127.0.0.1", 0)
        port = closers[0].get_extra_info("sockname")[1]
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(
            None, dns.probe, "127.0.0.1", "web.default.svc.cluster.local", 1.0, port
        )
        for c in closers:
            c.close()
        return found

    assert asyncio.run(main()) == ["10.96.0.23"]
