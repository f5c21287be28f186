"""Watch streaming: one chunked JSON-lines response per watch request (initial events, then
events as the store publishes them, bookmarks, tables for `kubectl get -w`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from kubeemu.http_wire import wants_table
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import parse_fields, parse_labels
from kubeemu.store import Store, bad_request
from kubeemu.tables import to_table

BOOKMARK_INTERVAL = 30.0


async def stream_watch(
    store: Store, request: web.Request, rt: ResourceType, ns: str | None
) -> web.StreamResponse:
    """Serve a watch: the initial events, then the store's events as they come, with bookmarks
    if asked for, until timeoutSeconds, the end of the watcher or the client's disconnect."""
    q = request.query
    send_initial = q.get("sendInitialEvents") == "true"
    bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
    since = None if send_initial else q.get("resourceVersion")
    timeout: float | None = None
    if q.get("timeoutSeconds"):
        try:
            timeout = float(q["timeoutSeconds"])
        except ValueError as exc:
            raise bad_request(f"invalid timeoutSeconds: {q['timeoutSeconds']}") from exc
    watcher, initial = store.watch(
        rt,
        ns,
        parse_labels(q.get("labelSelector")),
        parse_fields(q.get("fieldSelector")),
        since,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None

    as_table = wants_table(request)  # `kubectl get -w` prints server-side rows
    include = q.get("includeObject", "Metadata")

    def line(etype: str, obj: dict[str, Any]) -> str:
        if etype != "ERROR":
            obj = store.view(rt, obj)
        if as_table and etype in ("ADDED", "MODIFIED", "DELETED"):
            obj = to_table(
                rt,
                [obj],
                resource_version=obj["metadata"]["resourceVersion"],
                include_object=include,
            )
        return json.dumps({"type": etype, "object": obj}, separators=(",", ":")) + "\n"

    def bookmark(initial_end: bool = False) -> str:
        meta: dict[str, Any] = {"resourceVersion": str(store.rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return line("BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta})

    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.enable_chunked_encoding()
    try:
        await resp.prepare(request)
        chunk = "".join(line(t, o) for t, o in initial)
        if send_initial and bookmarks:
            chunk += bookmark(initial_end=True)
        if chunk:
            await resp.write(chunk.encode())
        if initial and initial[0][0] == "ERROR":
            return resp
        next_bookmark = loop.time() + BOOKMARK_INTERVAL
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                break
            wait = 5.0
            if deadline is not None:
                wait = min(wait, deadline - now)
            if bookmarks:
                wait = min(wait, max(next_bookmark - now, 0.0))
            try:
                item = await asyncio.wait_for(watcher.queue.get(), timeout=max(wait, 0.001))
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    break
                if bookmarks and loop.time() >= next_bookmark:
                    await resp.write(bookmark().encode())
                    next_bookmark = loop.time() + BOOKMARK_INTERVAL
                continue
            items = [item]
            while not watcher.queue.empty() and len(items) < 1000:
                items.append(watcher.queue.get_nowait())
            done = None in items
            text = "".join(line(*it) for it in items if it is not None)
            if text:
                await resp.write(text.encode())
            if done:
                break
    except (ConnectionError, RuntimeError):
        pass
    finally:
        store.unwatch(watcher)
    return resp
