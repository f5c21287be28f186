"""``python -m localcluster.proxy``: the local cluster's service proxy and cluster DNS.

    PYTHONPATH=hack python -m localcluster.proxy --kubeconfig D/proxy.kubeconfig \\
        --dir D --tag T --index N

Runs as root in the host's network namespace. Creates the dummy interface
``layout.service_interface`` (deleting a leftover one of the same cluster), puts
``layout.dns_ip`` on it and serves DNS there, then watches Services and EndpointSlices and
keeps one /32 per ClusterIP and one listener per TCP Service port in step with them (see
``proxy`` and ``dns``). Logs "ready" once both resources are listed and applied. SIGTERM or
SIGINT, or the end of the process named by ``KETCH_WATCH_PID``, stops it: listeners and open
connections are closed and the interface (with every address on it) deleted. ``D/proxy.lock``
keeps a second proxy of the same cluster from starting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path

import aiohttp

from ..layout import CLUSTER_DOMAIN, Layout
from . import dns, model
from .kubeapi import Informer, load_kubeconfig
from .proxy import Interface, Proxy, Target

logger = logging.getLogger("localcluster.proxy")

ENV_WATCH_PID = "KETCH_WATCH_PID"  # as ketch.engine.lifecycle


class App:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.interface = Interface(layout.service_interface, str(layout.service_cidr))
        self.proxy = Proxy()
        self.zone = dns.Zone(CLUSTER_DOMAIN)
        self.dirty = asyncio.Event()
        self.reported: dict[tuple[str, str, int], str] = {}
        self.warned: set[str] = set()

    def changed(self) -> None:
        self.dirty.set()

    def _warn_once(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self.warned:
            self.warned.add(message)
            logger.log(level, "%s", message)

    async def sync_loop(self, services: Informer, slices: Informer) -> None:
        await services.synced.wait()
        await slices.synced.wait()
        first = True
        while True:
            await self.dirty.wait()
            await asyncio.sleep(0.05)  # gathers a burst of events into one pass
            self.dirty.clear()
            try:
                await self.sync(list(services.store.values()), slices.store.values())
            except Exception:
                logger.exception("applying services failed; retrying in 1 s")
                await asyncio.sleep(1)
                self.dirty.set()
                continue
            if first:
                first = False
                logger.info(
                    "ready: %d services, DNS on %s:53", len(services.store), self.layout.dns_ip
                )

    async def sync(self, services: list[model.Service], all_slices) -> None:
        slices = model.group_slices(all_slices)
        self.zone.update(model.dns_records(services, slices))
        dns_ip = str(self.layout.dns_ip)
        addresses = {dns_ip}
        wanted: dict[tuple[str, int], Target] = {}
        report: dict[tuple[str, str, int], str] = {}
        for svc in services:
            name = f"{svc.namespace}/{svc.name}"
            if svc.cluster_ip is None:
                if svc.external_name is None:
                    n = len(self.zone.services[(svc.namespace, svc.name)].endpoints)
                    report[(svc.namespace, svc.name, 0)] = f"headless -> {n} endpoints (DNS)"
                continue
            if ipaddress.IPv4Address(svc.cluster_ip) not in self.layout.service_cidr:
                self._warn_once(f"service {name}: {svc.cluster_ip} is outside the service range")
                continue
            if svc.cluster_ip == dns_ip:
                self._warn_once(f"service {name}: {dns_ip} is the built-in DNS", logging.INFO)
                continue
            addresses.add(svc.cluster_ip)
            for port in svc.ports:
                if port.protocol != "TCP":
                    self._warn_once(f"service {name}: {port.protocol} port {port.port} not proxied")
                    continue
                backends = model.backends(port, slices.get((svc.namespace, svc.name), ()))
                label = f"{name}:{port.name or port.port}"
                wanted[(svc.cluster_ip, port.port)] = Target(label, backends, svc.affinity_timeout)
                report[(svc.namespace, svc.name, port.port)] = (
                    f"{svc.cluster_ip}:{port.port} -> {len(backends)} endpoints"
                    + ("" if backends else " (refusing)")
                )
        for ip in sorted(addresses - self.interface.addresses):
            self.interface.add(ip)
        await self.proxy.apply(
            {k: t for k, t in wanted.items() if k[0] in self.interface.addresses}
        )
        for ip in sorted(self.interface.addresses - addresses):
            self.interface.remove(ip)
        for key, text in sorted(report.items()):
            if self.reported.get(key) != text:
                logger.info("service %s/%s %s", key[0], key[1], text)
        for key in sorted(self.reported.keys() - report.keys()):
            logger.info("service %s/%s %s gone", key[0], key[1], self.reported[key].split(" ")[0])
        self.reported = report


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


async def _watch_pid(pid: int, stop: asyncio.Event) -> None:
    """Sets ``stop`` when ``pid`` is gone (what ketch.engine.lifecycle.watch_supervisor does)."""
    started = _start_time(pid)
    while started is not None and _start_time(pid) == started:
        await asyncio.sleep(0.25)
    logger.warning("process %d (%s) is gone: stopping", pid, ENV_WATCH_PID)
    stop.set()


async def run(layout: Layout, kubeconfig: Path) -> int:
    """Serves until stopped; the exit status (1 if a part of it failed)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = App(layout)
    server, tls, headers = load_kubeconfig(kubeconfig)
    tasks: list[asyncio.Task] = []
    if os.environ.get(ENV_WATCH_PID):
        tasks.append(asyncio.create_task(_watch_pid(int(os.environ[ENV_WATCH_PID]), stop)))
    closers: list = []
    status = 0
    app.interface.create()
    try:
        if not app.interface.add(str(layout.dns_ip)):
            raise RuntimeError(f"cannot add {layout.dns_ip} to {app.interface.name}")
        closers = await dns.serve(app.zone, str(layout.dns_ip))
        async with aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=tls, limit=4)
        ) as session:
            services = Informer(
                session, server, "/api/v1/services", model.parse_service, app.changed
            )
            slices = Informer(
                session,
                server,
                "/apis/discovery.k8s.io/v1/endpointslices",
                model.parse_slice,
                app.changed,
            )
            tasks += [asyncio.create_task(c) for c in (services.run(), slices.run())]
            tasks.append(asyncio.create_task(app.sync_loop(services, slices)))
            stopping = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopping}:  # these run until cancelled: an end is a bug
                if task.exception() is not None:
                    logger.error("%s failed: %r", task.get_coro().__name__, task.exception())
                    status = 1
            logger.info("stopping")
            for task in [stopping, *tasks]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await app.proxy.close()
        for closer in closers:
            closer.close()
        app.interface.delete()
        logger.info("deleted %s", app.interface.name)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localcluster.proxy", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--kubeconfig", type=Path, required=True, help="list/watch services, endpointslices"
    )
    parser.add_argument("--dir", type=Path, required=True, help="the cluster's directory")
    parser.add_argument("--tag", default="k0", help="the cluster's tag (names its interface)")
    parser.add_argument(
        "--index", type=int, default=0, help="the cluster's index (its address ranges)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s proxy %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    layout = Layout(args.dir, args.tag, args.index)
    args.dir.mkdir(parents=True, exist_ok=True)
    lock = open(args.dir / "proxy.lock", "w")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        logger.error("another proxy holds %s", args.dir / "proxy.lock")
        return 1
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run(layout, args.kubeconfig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
