"""The informer against a fake API server on loopback: paging, watch events, 410, bad objects."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from localcluster.proxy import model
from localcluster.proxy.kubeapi import Informer


def svc(name: str, ip: str, version: str) -> dict:
    return {
        "metadata": {"namespace": "default", "name": name, "resourceVersion": version},
        "spec": {"clusterIP": ip, "ports": [{"port": 80}]},
    }


def test_list_watch_relist():
    requests: list[dict] = []
    lists = [
        # first list, two pages; "bad" has no usable clusterIP and is left out
        [
            {"items": [svc("a", "10.96.0.2", "1")], "metadata": {"continue": "x"}},
            {"items": [svc("bad", "banana", "2")], "metadata": {"resourceVersion": "5"}},
        ],
        # after the 410
        [{"items": [svc("z", "10.96.0.9", "20")], "metadata": {"resourceVersion": "20"}}],
    ]
    watches = [
        [
            {"type": "ADDED", "object": svc("b", "10.96.0.3", "6")},
            {"type": "MODIFIED", "object": svc("bad", "10.96.0.4", "7")},
            {"type": "DELETED", "object": svc("a", "10.96.0.2", "8")},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
        ],  # ends: the informer watches again from 9
        [{"type": "ERROR", "object": {"code": 410, "message": "too old"}}],
        [],
    ]
    done, stop = asyncio.Event(), asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        requests.append(dict(request.query))
        if "watch" not in request.query:
            pages = lists[0]
            page = pages[1] if request.query.get("continue") else pages[0]
            if page is pages[-1]:
                lists.pop(0)
            return web.json_response(page)
        response = web.StreamResponse()
        await response.prepare(request)
        events = watches.pop(0) if watches else []
        for event in events:
            await response.write(json.dumps(event).encode() + b"\n")
        if not watches:
            done.set()
            await stop.wait()
        return response

    async def main():
        app = web.Application()
        app.router.add_get("/api/v1/services", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        changes = []
        async with aiohttp.ClientSession() as session:
            informer = Informer(
                session,
                f"http://127.0.0.1:{port}",
                "/api/v1/services",
                model.parse_service,
                lambda: changes.append(sorted(informer.store)),
            )
            task = asyncio.create_task(informer.run())
            await asyncio.wait_for(done.wait(), 10)
            await asyncio.sleep(0.1)
            task.cancel()
        stop.set()
        await runner.cleanup()
        return informer, changes

    informer, changes = asyncio.run(main())
    assert changes[0] == [("default", "a")]  # after the first list
    assert [("default", "a"), ("default", "b"), ("default", "bad")] in changes
    assert list(informer.store) == [("default", "z")]  # re-listed after the 410
    assert informer.store[("default", "z")].cluster_ip == "10.96.0.9"
    watch_versions = [r["resourceVersion"] for r in requests if "watch" in r]
    assert watch_versions == ["5", "9", "20"]
