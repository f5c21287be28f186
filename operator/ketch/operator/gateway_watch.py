"""The operator's own watch of its InferencePools: the gateway writes their status, and the
InferenceService's ``GatewayReady`` condition follows it.

kopf watches the core children (``handlers``), but a kopf watch of a resource that is not
served fails for ever, and GAIE's CRDs are optional. So InferencePools are watched here: one
list-then-watch loop per namespace that has an InferenceService with ``spec.gateway`` (a
namespaced watch: the single-namespace Role suffices), only objects labelled as the
operator's. Its events go to ``Controller.on_child_event`` like kopf's (cache, drift repair,
status). While the kind is not served (404) the loop asks again every ``retry_seconds``; once
it is served, ``on_served(namespace, True)`` lets the controller apply what it could not
(``on_served(namespace, False)`` when it stops being served: the CRD was deleted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ketch.operator.cache import Obj
from ketch.operator.children import inferencepool
from ketch.operator.kube import ApiError, KubeClient, resource_path
from ketch.operator.labels import LABEL_MANAGED_BY, MANAGER

logger = logging.getLogger("ketch.operator")

KIND = inferencepool.KIND.kind
API_VERSION = inferencepool.KIND.api_version
# The server ends each watch after this long, before the client's 75 s read timeout.
WATCH_SECONDS = 55


class PoolWatch:
    """One list-then-watch loop of InferencePools per namespace in ``sync``'s set."""

    def __init__(
        self,
        client: KubeClient,
        on_event: Callable[[str, Obj], None],
        on_served: Callable[[str, bool], None],
        *,
        retry_seconds: float = 10.0,
    ):
        self.client = client
        self.on_event = on_event
        self.on_served = on_served
        self.retry_seconds = retry_seconds
        self.unserved: set[str] = set()  # namespaces whose last list answered 404
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def sync(self, namespaces: set[str]) -> None:
        """Watches exactly ``namespaces`` (started and stopped as needed)."""
        for namespace in set(self._tasks) - namespaces:
            self._tasks.pop(namespace).cancel()
            self.unserved.discard(namespace)
        for namespace in namespaces - set(self._tasks):
            self._tasks[namespace] = asyncio.get_running_loop().create_task(self._run(namespace))

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks.values())

    def stop_all(self) -> list[asyncio.Task[None]]:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        self._tasks.clear()
        return tasks

    async def _run(self, namespace: str) -> None:
        seen: dict[str, Obj] = {}
        selector = f"{LABEL_MANAGED_BY}={MANAGER}"
        while True:
            try:
                listing = await self.client.request(
                    "GET", resource_path(KIND, namespace), params={"labelSelector": selector}
                )
                if namespace in self.unserved:
                    self.unserved.discard(namespace)
                    self.on_served(namespace, True)
                current = {}
                for item in listing.get("items") or []:
                    item = {**item, "kind": KIND, "apiVersion": API_VERSION}
                    current[item["metadata"]["name"]] = item
                    self.on_event("MODIFIED", item)
                for name in set(seen) - set(current):
                    self.on_event("DELETED", seen[name])
                seen = current
                version = (listing.get("metadata") or {}).get("resourceVersion") or ""
                while version:
                    version = await self._watch(namespace, selector, version, seen)
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 404:
                    for item in seen.values():  # the CRD is gone, and its objects with it
                        self.on_event("DELETED", item)
                    seen = {}
                    if namespace not in self.unserved:
                        logger.warning(
                            "%s: %s is not served: is the GAIE CRD installed? (asking again "
                            "every %.0f s)",
                            namespace,
                            API_VERSION,
                            self.retry_seconds,
                        )
                        self.unserved.add(namespace)
                        self.on_served(namespace, False)
                else:
                    logger.warning("%s: InferencePool watch: %s", namespace, exc)
                await asyncio.sleep(self.retry_seconds)
            except Exception as exc:  # a dropped connection, a timeout: list again
                logger.warning("%s: InferencePool watch: %s", namespace, exc)
                await asyncio.sleep(min(self.retry_seconds, 2.0))

    async def _watch(
        self, namespace: str, selector: str, version: str, seen: dict[str, Obj]
    ) -> str:
        """Watches from ``version``; the version to go on from, or "" to list again."""
        params = {
            "labelSelector": selector,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        async for event in self.client.watch(KIND, namespace, params):
            kind, item = event.get("type"), event.get("object") or {}
            if kind == "ERROR":  # 410 Gone: the version is too old
                return ""
            version = (item.get("metadata") or {}).get("resourceVersion") or version
            if kind == "BOOKMARK":
                continue
            item = {**item, "kind": KIND, "apiVersion": API_VERSION}
            name = item["metadata"]["name"]
            if kind == "DELETED":
                seen.pop(name, None)
            else:
                seen[name] = item
            self.on_event(str(kind), item)
        return version
