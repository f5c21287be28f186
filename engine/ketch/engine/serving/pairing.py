"""Decode role: which prefill instance a request is paired with, and whether that is allowed.

The router pairs each request with a prefill instance and says so in the header
``x-ketch-prefill`` (the prefill engine's pd-comm ``host:port``). The decode engine then
connects to that prefill host, so the header must not let just anyone point it anywhere:
``--pd-prefill-peers`` (the operator sets it to the prefill pods' headless Service) limits the
prefill hosts to the addresses that name resolves to. Unset, any host is taken: then only the
router may be able to reach this instance. Where the prefill side pushes the KV is this
instance's own ``--kv-transfer-host``, never a header (it once was: a client could send the
KV, and the prefill side's time, anywhere).
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

from fastapi import Request

from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.protocol import ProtocolError

PREFILL_HEADER = "x-ketch-prefill"
# On a 503 that ``ketch serve`` answered before taking the request (draining, paused, engine
# gone): the router may send the request to another instance.
NOT_ACCEPTED_HEADER = "x-ketch-not-accepted"
_HOST = re.compile(r"^[A-Za-z0-9._-]+$|^\[[0-9A-Fa-f:.]+\]$")
_RESOLVE_EVERY_S = 5.0
_MIN_GAP_S = 1.0  # between two resolutions, however many unknown peers ask


class PrefillPeers:
    """The prefill peers a decode instance accepts: entries of ``--pd-prefill-peers`` (DNS names
    or addresses, each with its pd-comm ``:port``, or this instance's own ``--pd-comm-port``
    when it has none: every pod of one service shares the port). A peer must match an entry's
    host and port, or one of the addresses the names resolved to.

    Names are resolved again every ``_RESOLVE_EVERY_S`` seconds, and when a peer is not among
    the addresses (a new prefill pod) — but never more than once per ``_MIN_GAP_S``: requests
    naming unknown peers wait for the next resolution and share it, so a flood of forged
    headers costs at most one DNS lookup a second, not one each."""

    def __init__(self, spec: str | None, default_port: int = 0) -> None:
        self.entries: list[tuple[str, int]] = []
        for raw in (e.strip() for e in (spec or "").split(",")):
            host, colon, port = raw.rpartition(":")
            if not colon or "]" in port or not port.isdigit():  # no port (or a bare IPv6)
                host, port = raw, str(default_port)
            if host:
                self.entries.append((host.strip("[]"), int(port)))
        self._addresses: set[tuple[str, int]] = set()
        self._resolved_at = -_RESOLVE_EVERY_S
        self._pending: asyncio.Future[None] | None = None  # the next resolution, when due

    @property
    def restricted(self) -> bool:
        return bool(self.entries)

    def describe(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port in self.entries)

    async def allows(self, host: str, port: int) -> bool:
        peer = (host.strip("[]"), port)
        if not self.restricted or peer in self.entries:
            return True
        if time.monotonic() - self._resolved_at >= _RESOLVE_EVERY_S or peer not in self._addresses:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._pending)
        return peer in self._addresses

    async def _refresh(self) -> None:
        try:
            wait = self._resolved_at + _MIN_GAP_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._addresses = await asyncio.to_thread(self._resolve)
            self._resolved_at = time.monotonic()
        finally:
            self._pending = None

    def _resolve(self) -> set[tuple[str, int]]:
        found: set[tuple[str, int]] = set()
        for host, port in self.entries:
            try:
                found |= {(info[4][0], port) for info in socket.getaddrinfo(host, None)}
            except OSError:
                continue  # not resolvable now (no prefill pod yet): allows nothing from it
        return found


async def pairing(config: ServerConfig, peers: PrefillPeers, request: Request) -> str | None:
    """Decode role: the prefill peer's "host:port" from the router's header."""
    if config.role != "decode":
        return None
    prefill = request.headers.get(PREFILL_HEADER)
    if not prefill:
        raise ProtocolError(
            400,
            "this is a decode instance: send requests through `ketch router`, which pairs each "
            f"one with a prefill instance (header {PREFILL_HEADER}: host:pd-comm-port)",
        )
    host, _, port = prefill.strip().rpartition(":")
    if not _HOST.match(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ProtocolError(400, f"{PREFILL_HEADER} must be host:port, got {prefill!r}")
    if not await peers.allows(host, int(port)):
        raise ProtocolError(
            403,
            f"{PREFILL_HEADER} names {host}:{port}, which is not one of this decode instance's "
            f"prefill peers ({peers.describe()}; --pd-prefill-peers)",
        )
    return f"{host}:{port}"
