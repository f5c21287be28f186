"""The router's view of its engine instances: where they come from and whether they can serve.

Three sources feed one registry keyed by URL: static list entries, DNS names (a headless
Service, re-resolved every ``dns_interval``; a failed lookup keeps the last good set), and
registration (``POST /v1/ketch/register``; an instance not heard from for ``registration_ttl``
is dropped). A health loop polls every instance's ``/ready`` (and ``/metrics`` for its load)
every ``health_interval``: a non-200, a connection error or a role that disagrees with the
instance's list takes it out of rotation at once; the next success puts it back. Besides the
polls only a refused connection takes an instance out (``mark_down``); a slow or failed answer
to one request does not, since the instance may be healthy and busy with a long request.

Bounds: at most ``MAX_REGISTERED`` registered instances (each costs two GETs per health round);
no request of the router follows a redirect; a ``/ready`` body is read up to
``MAX_READY_BYTES`` and a ``/metrics`` body up to ``MAX_METRICS_BYTES`` (more: not scraped).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ketch.engine.router.config import ROLES, RouterConfig, normalise_url

logger = logging.getLogger("ketch.router")

_LOAD_METRICS = ("ketch:num_requests_running", "ketch:num_requests_waiting")
MAX_REGISTERED = 256  # registered instances at once; more registrations are refused (503)
MAX_READY_BYTES = 64 * 1024
MAX_METRICS_BYTES = 4 << 20  # an engine's /metrics is tens of KB


class RegistryFull(ValueError):
    """No room for another registered instance."""


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None when it is longer than ``limit`` bytes (nothing more is read)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        return None
    body = await resp.content.read(limit + 1)
    while len(body) <= limit and not resp.content.at_eof():
        more = await resp.content.read(limit + 1 - len(body))
        if not more:
            break
        body += more
    return None if len(body) > limit else body


@dataclass
class Instance:
    """One engine instance and what the router last learnt about it."""

    url: str
    role: str
    source: str  # "static", "dns:<name>" or "registered"
    pd_comm_port: int
    healthy: bool = False
    checked: bool = False
    engine_load: int = 0  # running + waiting at the last /metrics scrape
    sent_since_scrape: int = 0  # requests the router sent since that scrape
    in_flight: int = 0  # requests the router has open to it now
    last_error: str | None = None
    model: str | None = None  # the model its /ready names (None: not said)
    last_seen: float = field(default_factory=time.monotonic)  # registration heartbeat

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def load(self) -> int:
        return self.engine_load + self.sent_since_scrape

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "source": self.source,
            "healthy": self.healthy,
            "load": self.load,
            "engine_load": self.engine_load,
            "in_flight": self.in_flight,
            "pd_comm_port": self.pd_comm_port,
            "last_error": self.last_error,
        }


class Registry:
    """All known instances, plus the loops that discover them and check their health."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.instances: dict[str, Instance] = {}
        self.dns_names = [(e.dns_name, e.role) for e in config.entries() if e.dns_name]
        for entry in config.entries():
            if entry.url:
                self._add(entry.url, entry.role, "static")
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ membership

    def _add(self, url: str, role: str, source: str) -> Instance:
        inst = self.instances.get(url)
        if inst is None:
            inst = Instance(url, role, source, self.config.pd_comm_port)
            self.instances[url] = inst
            logger.info("instance %s (%s) added from %s", url, role, source)
        return inst

    def _remove(self, url: str, why: str) -> None:
        if self.instances.pop(url, None) is not None:
            logger.info("instance %s removed: %s", url, why)

    def register(self, url: str, role: str) -> Instance:
        """A registration or heartbeat; a new instance is probed at once."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
        url = normalise_url(url, "url")
        inst = self.instances.get(url)
        if inst is not None and inst.source != "registered":
            return inst  # also listed statically or by DNS: that source owns it
        if inst is not None and inst.role != role:
            self._remove(url, f"re-registered as {role}")
            inst = None
        if inst is None:
            registered = sum(1 for i in self.instances.values() if i.source == "registered")
            if registered >= MAX_REGISTERED:
                raise RegistryFull(f"this router already has {MAX_REGISTERED} registered instances")
            inst = self._add(url, role, "registered")
            if self.session is not None:
                self._tasks = [t for t in self._tasks if not t.done()]
                self._tasks.append(asyncio.create_task(self.check(inst)))
        inst.last_seen = time.monotonic()
        return inst

    def unregister(self, url: str) -> bool:
        url = normalise_url(url, "url")
        inst = self.instances.get(url)
        if inst is None or inst.source != "registered":
            return False
        self._remove(url, "unregistered")
        return True

    def expire(self) -> None:
        cutoff = time.monotonic() - self.config.registration_ttl
        for inst in list(self.instances.values()):
            if inst.source == "registered" and inst.last_seen < cutoff:
                self._remove(inst.url, f"no heartbeat for {self.config.registration_ttl:g} s")

    async def resolve_dns(self) -> None:
        """Re-resolves each DNS name; a failure keeps that name's last good set."""
        loop = asyncio.get_running_loop()
        port = self.config.engine_port
        for name, role in self.dns_names:
            source = f"dns:{name}"
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("DNS lookup of %s failed (%s); keeping the last good set", name, exc)
                continue
            urls = set()
            for family, *_, sockaddr in infos:
                host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
                urls.add(f"http://{host}:{port}")
            for url in sorted(urls):
                self._add(url, role, source)
            for inst in list(self.instances.values()):
                if inst.source == source and inst.url not in urls:
                    self._remove(inst.url, f"{name} no longer resolves to it")

    # ------------------------------------------------------------ health

    def mark_down(self, inst: Instance, error: str) -> None:
        if inst.healthy:
            logger.warning("instance %s out of rotation: %s", inst.url, error)
        inst.healthy = False
        inst.last_error = error

    async def check(self, inst: Instance) -> None:
        """One /ready (+ /metrics) poll of ``inst``."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        try:
            async with self.session.get(
                f"{inst.url}/ready", timeout=timeout, allow_redirects=False
            ) as resp:
                status = resp.status
                raw = await read_bounded(resp, MAX_READY_BYTES)
                try:
                    body = json.loads(raw) if raw else {}
                except (ValueError, RecursionError):
                    body = {}
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            inst.checked = True
            self.mark_down(inst, f"/ready failed: {type(exc).__name__}: {exc}".rstrip(": "))
            return
        inst.checked = True
        body = body if isinstance(body, dict) else {}
        if status != 200:
            problems = body.get("problems") or body.get("detail") or ""
            self.mark_down(inst, f"/ready answered {status} {problems}".rstrip())
            return
        said = body.get("role")
        if said is not None and said != inst.role:
            if inst.healthy or inst.last_error is None or "role" not in inst.last_error:
                logger.warning(
                    "instance %s is listed as %s but its /ready says role %r; kept out",
                    inst.url,
                    inst.role,
                    said,
                )
            inst.healthy = False
            inst.last_error = f"role mismatch: listed as {inst.role}, /ready says {said}"
            return
        model = body.get("model")
        if isinstance(model, str) and 0 < len(model) <= 256:
            inst.model = model
        port = body.get("pd_comm_port")
        if isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535:
            inst.pd_comm_port = port
        await self._scrape(inst, timeout)
        if not inst.healthy:
            logger.info("instance %s (%s) in rotation", inst.url, inst.role)
        inst.healthy = True
        inst.last_error = None

    async def _scrape(self, inst: Instance, timeout: aiohttp.ClientTimeout) -> None:
        assert self.session is not None
        try:
            async with self.session.get(
                f"{inst.url}/metrics", timeout=timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return
                raw = await read_bounded(resp, MAX_METRICS_BYTES)
                if raw is None:
                    logger.warning(
                        "instance %s: /metrics is over %d bytes; not scraped", inst.url,
                        MAX_METRICS_BYTES,
                    )  # fmt: skip
                    return
                text = raw.decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return  # load stays as last known; /ready decides health
        try:
            load = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name in _LOAD_METRICS
            )
            inst.engine_load = max(0, int(load))
        except (ValueError, TypeError, OverflowError) as exc:  # not Prometheus text; NaN, inf
            logger.warning("instance %s: unreadable /metrics (%s); load kept", inst.url, exc)
            return
        inst.sent_since_scrape = 0

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in list(self.instances.values())))

    # ------------------------------------------------------------ loops

    async def start(self) -> None:
        """Opens the HTTP session, resolves names and checks every instance once."""
        # Idle connections go before uvicorn's own 5 s keep-alive closes them: a POST sent on a
        # connection the instance is closing fails, and is never retried (it might have run).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        self.session = aiohttp.ClientSession(connector=connector)
        await self.resolve_dns()
        await self.check_all()
        self._tasks += [
            asyncio.create_task(self._every(self.config.health_interval, self._health_round)),
            asyncio.create_task(self._every(self.config.dns_interval, self.resolve_dns)),
        ]

    async def _health_round(self) -> None:
        self.expire()
        await self.check_all()

    async def _every(self, interval: float, action) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await action()
            except Exception:  # a loop must never die quietly
                logger.exception("router background task failed; continuing")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ queries

    def healthy(self, role: str) -> list[Instance]:
        return sorted(
            (i for i in self.instances.values() if i.healthy and i.role == role),
            key=lambda i: i.url,
        )

    def can_serve(self) -> bool:
        return bool(self.healthy("mixed")) or (
            bool(self.healthy("prefill")) and bool(self.healthy("decode"))
        )
