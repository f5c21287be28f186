"""The floor of ``bench_operator.py``: the operator's writes with no operator logic.

For every InferenceService of the burst, the children are rendered *before* the clock starts
(``ketch-operator render``'s code, with a placeholder owner uid). Timed: create the
InferenceService, server-side apply its pre-serialised children (the uid substituted into the
text, all six at once), post one Event; one watch on the namespace's Deployments; when an
InferenceService's Deployment reports a ready replica, patch a fixed ``Ready=True`` status and
post a second Event. That is every request the real operator makes for one object (6 applies,
2 events, 1 status patch) and the least it must watch, so what the cluster's controllers, the
scheduler and KWOK add on top (ReplicaSets, pods, bindings, pod and Deployment status) is the
same as in the ketch run: ketch ÷ floor is the operator's own efficiency, floor ÷ no-op is what
the API side costs per object.

Its creates are paced by 16 workers, each waiting for its six applies. On kube-apiserver the
slowest of them is the Service with a ClusterIP (allocated one Service at a time, server-wide),
so the floor's objects/s is about the API server's rate of ClusterIP allocations: an operator
that lets pods start while its Services wait can come level with it, not far past it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import kopf

from ketch.operator import api_names
from ketch.operator.cli import PLACEHOLDER_UID, render_object
from ketch.operator.events import EventRecorder
from ketch.operator.kube import KubeClient, resource_path
from ketch.operator.labels import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGER


def prerender(bodies: list[dict[str, Any]]) -> dict[str, list[tuple[str, str, str]]]:
    """name -> [(kind, child name, JSON text with the placeholder uid)] for each body."""
    out = {}
    for body in bodies:
        children = render_object(body)
        out[body["metadata"]["name"]] = [
            (c["kind"], c["metadata"]["name"], json.dumps(c, separators=(",", ":")))
            for c in children
        ]
    return out


def ready_status(generation: int) -> dict[str, Any]:
    stamp = "2026-01-01T00:00:00Z"
    return {
        "observedGeneration": generation,
        "replicas": "1/1",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllReplicasReady",
                "message": "1/1 pods ready",
                "lastTransitionTime": stamp,
                "observedGeneration": generation,
            },
            {
                "type": "Progressing",
                "status": "False",
                "reason": "Complete",
                "message": "rollout complete",
                "lastTransitionTime": stamp,
                "observedGeneration": generation,
            },
        ],
    }


async def floor_burst(
    namespace: str,
    bodies: list[dict[str, Any]],
    rendered: dict[str, list[tuple[str, str, str]]],
    created: dict[str, float],
    concurrency: int = 16,
) -> None:
    """Runs the writes above until every InferenceService has its Ready status."""
    loop = asyncio.get_running_loop()
    client = KubeClient(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))
    events = EventRecorder(client)  # the operator's Event shape, posted the same way
    stored: dict[str, dict[str, Any]] = {}
    done: set[str] = set()
    patches: list[asyncio.Task[None]] = []
    finished = asyncio.Event()

    async def mark_ready(name: str) -> None:
        body = stored[name]
        await client.patch_status(
            api_names.KIND, namespace, name, ready_status(body["metadata"]["generation"])
        )
        await events.post(body, "Normal", "Ready", "1/1 pods ready")
        if len(done) == len(bodies):
            finished.set()

    async def watch_deployments() -> None:
        url = client.server + resource_path("Deployment", namespace)
        params = {
            "watch": "true",
            "labelSelector": f"{LABEL_MANAGED_BY}={MANAGER}",
            "timeoutSeconds": "300",
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        headers = client._authorization
        async with client._session.get(
            url, params=params, timeout=timeout, headers=headers
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"watch {url}: {response.status} {await response.text()}")
            async for line in response.content:
                obj = json.loads(line).get("object") or {}
                owner = (obj["metadata"].get("labels") or {}).get(LABEL_INSTANCE)
                ready = (obj.get("status") or {}).get("readyReplicas") or 0
                if owner in stored and owner not in done and ready >= 1:
                    done.add(owner)
                    patches.append(loop.create_task(mark_ready(owner)))

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)

    async def worker() -> None:
        while not queue.empty():
            body = queue.get_nowait()
            name = body["metadata"]["name"]
            created[name] = loop.time()
            obj = await client.post(api_names.KIND, namespace, body)
            stored[name] = obj
            uid = obj["metadata"]["uid"]
            await asyncio.gather(
                *(
                    client.request(
                        "PATCH",
                        resource_path(kind, namespace, child),
                        params={"fieldManager": "ketch-operator", "force": "true"},
                        body=json.loads(text.replace(PLACEHOLDER_UID, uid)),
                        content_type="application/apply-patch+yaml",
                    )
                    for kind, child, text in rendered[name]
                )
            )
            await events.post(obj, "Normal", "Reconciled", "applied 6 children")

    watcher = loop.create_task(watch_deployments())
    try:
        await asyncio.sleep(0.3)  # the watch is up
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await asyncio.wait_for(finished.wait(), timeout=300)
        await asyncio.gather(*patches)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await client.close()
