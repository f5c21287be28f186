"""List and watch one resource cluster-wide: a minimal informer over aiohttp.

What client-go's reflector does, reduced: list (in pages) to get a consistent snapshot and its
resourceVersion, then watch from there (with bookmarks, so a quiet watch still advances it),
re-watch when the server ends a watch, and re-list after a 410 Gone, an ERROR event or any
failure (with backoff). Each object goes through ``parse`` at once; the store keeps only what
it returns, and an object it fails on is logged and left out (the old version is dropped too).
No shared informer, no resync period, no field/label selectors: the proxy is the only user.

Needs only ``list`` and ``watch`` on the resource (the kubeconfig's user may have no more).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from localcluster.kubeconfig import Kubeconfig

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300
MAX_EVENT_BYTES = 16 << 20
PAGE = 500


class Gone(Exception):
    """The resourceVersion is too old (410): list again."""


def load_kubeconfig(path: Path) -> tuple[str, ssl.SSLContext, dict[str, str]]:
    """The current context's server URL, TLS context (CA, client certificate) and headers."""
    config = Kubeconfig(path)
    return config.server, config.ssl, config.headers("ketch-localcluster-proxy")


class Informer:
    """Keeps ``store`` (key -> parsed object) in step with one resource; calls ``changed()``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        server: str,
        path: str,
        parse: Callable[[dict], Any],
        changed: Callable[[], None],
    ) -> None:
        self.session, self.url, self.parse, self.changed = session, server + path, parse, changed
        self.kind = path.rsplit("/", 1)[-1]
        self.store: dict[tuple[str, str], Any] = {}
        self.synced = asyncio.Event()

    def _put(self, obj: dict, deleted: bool = False) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        self.store.pop(key, None)
        if deleted:
            return
        try:
            parsed = self.parse(obj)
        except Exception as e:  # a bad object must not stop the proxy
            logger.warning("ignoring %s %s/%s: %r", self.kind, *key, e)
            return
        if parsed is not None:
            self.store[key] = parsed

    async def run(self) -> None:
        backoff = 1.0
        while True:
            try:
                version = await self._list()
                backoff = 1.0
                while True:
                    version = await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Gone:
                logger.info("%s: resourceVersion expired, listing again", self.kind)
            except Exception as e:
                logger.warning("%s: %r; listing again in %.0f s", self.kind, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 15.0)

    async def _list(self) -> str:
        objects: list[dict] = []
        params = {"limit": str(PAGE)}
        timeout = aiohttp.ClientTimeout(total=60)
        while True:
            async with self.session.get(self.url, params=params, timeout=timeout) as resp:
                if resp.status == 410:
                    raise Gone()
                resp.raise_for_status()
                body = await resp.json()
            objects += body.get("items") or []
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        self.store.clear()
        for obj in objects:
            self._put(obj)
        self.synced.set()
        self.changed()
        return meta["resourceVersion"]

    async def _watch(self, version: str) -> str:
        params = {
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30)
        async with self.session.get(self.url, params=params, timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            resp.raise_for_status()
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                if len(buffer) > MAX_EVENT_BYTES:
                    raise ValueError("watch event too large")
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        version = self._event(json.loads(line), version)
        return version

    def _event(self, event: dict, version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch error: {obj.get('message')}")
        new_version = (obj.get("metadata") or {}).get("resourceVersion") or version
        if kind == "BOOKMARK":
            return new_version
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise RuntimeError(f"unknown watch event {kind!r}")
        self._put(obj, deleted=kind == "DELETED")
        self.changed()
        return new_version
