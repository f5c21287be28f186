"""A stateful Kubernetes API-server emulator (aiohttp) for operator tests.

Run: `python tests/kubeemu/server.py --port 0` prints `KUBEEMU_LISTENING http://127.0.0.1:PORT`
on stdout once it serves. See tests/kubeemu/__init__.py for the test-side helpers.

Known differences from kube-apiserver (deliberate simplifications):
- one storage per group/resource; CRD versions share it without conversion (apiVersion is
  rewritten); core/v1 and events.k8s.io/v1 Events are separate stores.
- authentication and RBAC (access.py, authn.py, rbac.py): bearer tokens only (the admin token,
  ServiceAccount tokens from TokenRequest), no impersonation, no aggregated ClusterRoles; Pod
  Security admission (podsecurity.py); no admission webhooks, quotas, limit ranges.
- controllers (controllers.py): Deployments roll ReplicaSets by their strategy, ReplicaSets run
  pods, a kubelet gives pods the status a test set (POST /_emulator/pods); no scheduler, no
  graceful termination (a deleted pod goes at once), no proportional scaling mid-rollout.
- SSA: container ports are keyed by containerPort, service ports by port (the real keys add
  protocol); custom resources use x-kubernetes-list-type from their schema (atomic otherwise).
- GC runs synchronously on delete; Foreground propagation behaves like Background.
- list `resourceVersion`/`resourceVersionMatch` are ignored (lists are always current);
  protobuf request bodies only for Namespace/ConfigMap/Secret/ServiceAccount (kubectl create).
- no /openapi/v2; /openapi/v3 tells kubectl which endpoints accept fieldValidation and serves
  custom resources' schemas (for `kubectl explain`), not the built-in kinds'.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script: import the package, not sibling modules
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from aiohttp import web

from kubeemu import controllers, tls
from kubeemu.access import Gate
from kubeemu.controllers import ControllerManager, PodBehaviour, describe_faults
from kubeemu.discovery import VERSION_INFO, group_info, group_list, openapi_v3, resource_list
from kubeemu.holds import Holds
from kubeemu.http_wire import generic_not_found, json_response, read_body, status_response
from kubeemu.labelsel import SelectorError
from kubeemu.resource_requests import ResourceRequests
from kubeemu.store import HISTORY_PER_TYPE, ApiError, Store, bad_request, load_validator_factory
from kubeemu.watch import expire

log = logging.getLogger("kubeemu")


class EmulatorApp:
    """The aiohttp application: routing (discovery in ``discovery``, resources in
    ``resource_requests``, watches in ``watch_stream``) and the admin endpoints."""

    def __init__(
        self, history: int = HISTORY_PER_TYPE, pod_ip_prefix: str = controllers.POD_IP_PREFIX
    ) -> None:
        self.store = Store(load_validator_factory(), history=history)
        self.controller = ControllerManager(self.store, pod_ip_prefix)
        self.holds = Holds()  # requests a test makes wait (holds.py)
        self.resources = ResourceRequests(self.store, self.holds)
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.gate = Gate(self.store)  # authentication and RBAC before every handler
        self.app.middlewares.append(self.gate.middleware())
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)
        self.host = "127.0.0.1:0"

    async def _on_startup(self, app: web.Application) -> None:
        self.store.loop = asyncio.get_running_loop()
        self.controller.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        self.holds.release()
        self.store.close_all_watchers()
        await self.controller.stop()

    # ------------------------------------------------------------------------------------------
    # dispatch

    async def handle(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        try:
            if not parts:
                return json_response(
                    {"paths": ["/api", "/api/v1", "/apis", "/version", "/_emulator"]}
                )
            head = parts[0]
            if head == "_emulator":
                return await self.admin(request, parts[1:])
            if head in ("healthz", "readyz", "livez"):
                return web.Response(text="ok")
            if head == "version" and len(parts) == 1:
                return json_response(VERSION_INFO)
            if head == "openapi" and len(parts) >= 2 and parts[1] == "v3":
                return openapi_v3(self.store, parts[2:])
            if head == "api":
                if len(parts) == 1:
                    return json_response(
                        {
                            "kind": "APIVersions",
                            "versions": ["v1"],
                            "serverAddressByClientCIDRs": [
                                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.host}
                            ],
                        }
                    )
                if len(parts) == 2:
                    return resource_list(self.store, "", parts[1])
                return await self.resources.resource(request, "", parts[1], parts[2:])
            if head == "apis":
                if len(parts) == 1:
                    return json_response(group_list(self.store))
                if len(parts) == 2:
                    group = group_info(self.store, parts[1])
                    if group is None:
                        raise generic_not_found()
                    return json_response({"kind": "APIGroup", "apiVersion": "v1", **group})
                if len(parts) == 3:
                    return resource_list(self.store, parts[1], parts[2])
                return await self.resources.resource(request, parts[1], parts[2], parts[3:])
            raise generic_not_found()
        except ApiError as err:
            return status_response(err)
        except SelectorError as err:
            return status_response(bad_request(str(err)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not look like a healthy API to the client
            log.exception("%s %s failed", request.method, request.path_qs)
            return status_response(ApiError(500, "InternalError", f"emulator error: {exc!r}"))

    # ------------------------------------------------------------------------------------------
    # admin endpoints (not Kubernetes)

    async def admin(self, request: web.Request, parts: list[str]) -> web.Response:
        what = parts[0] if parts else ""
        store = self.store
        if what == "faults":  # how pods behave: {scope: name, mode, readyDelaySeconds, ...}
            if request.method == "POST":
                self._set_pod_behaviour(await read_body(request) or {})
            return json_response({"faults": describe_faults(self.controller)})
        if what == "applied":
            q = request.query
            items = [
                e
                for e in store.apply_log
                if all(
                    q.get(k) in (None, e.get(k)) for k in ("manager", "namespace", "name", "kind")
                )
            ]
            return json_response({"items": items})
        if what == "stats":
            out = store.stats.to_json(store.commits)
            out["resourceVersion"] = store.rv
            out["objects"] = {
                (f"{k[1]}.{k[0]}" if k[0] else k[1]): len(v)
                for k, v in sorted(store.objects.items())
                if v
            }
            out["watchers"] = sum(len(ws) for ws in store.watchers.values())
            return json_response(out)
        if what == "holds":
            if request.method == "POST":
                self.holds.add(await read_body(request))
            elif request.method == "DELETE":
                self.holds.release()
            return json_response(self.holds.to_json())
        if what == "expire-watches" and request.method == "POST":
            # {"resources": ["deployments.apps", "pods"]} (plural[.group]); none: every type
            wanted = (await read_body(request) or {}).get("resources")
            keys = [
                k
                for k in store.types
                if wanted is None or (f"{k[1]}.{k[0]}" if k[0] else k[1]) in wanted
            ]
            return json_response({"ended": expire(store, keys), "resourceVersion": str(store.rv)})
        if what == "reset" and request.method == "POST":
            store.apply_log.clear()
            store.stats = type(store.stats)()
            self.controller.reset()
            return json_response({"ok": True})
        raise generic_not_found()

    def _set_pod_behaviour(self, body: Any) -> None:
        try:
            scopes = [s for s in ("pod", "deployment", "image") if body.get(s)]
            if len(scopes) != 1:
                raise ValueError("name exactly one of pod, deployment, image")
            behaviour = PodBehaviour(
                body.get("mode", "ready"),
                float(body.get("readyDelaySeconds", 0) or 0),
                str(body.get("initContainer") or ""),
            )
            namespace = "" if scopes[0] == "image" else body["namespace"]
            self.controller.set_behaviour(scopes[0], namespace, body[scopes[0]], behaviour)
        except (AttributeError, KeyError, ValueError, TypeError) as exc:
            raise bad_request(f"bad fault request: {exc}") from exc


async def serve(
    host: str,
    port: int,
    ready_line: bool = True,
    history: int = HISTORY_PER_TYPE,
    pod_ip_prefix: str = controllers.POD_IP_PREFIX,
) -> None:
    emu = EmulatorApp(history, pod_ip_prefix)
    runner = web.AppRunner(emu.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    actual = sockets[0].getsockname()[1] if sockets else port
    emu.host = f"{host}:{actual}"
    secure = await tls.start_site(runner, host, Path.cwd())  # credentials need TLS (kubectl)
    if ready_line:
        print(f"KUBEEMU_LISTENING http://{host}:{actual} {secure or ''}".rstrip(), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()

    async def watch_parent() -> None:
        while not stop.is_set():  # an orphaned emulator would outlive its test run
            if os.getppid() != parent:
                stop.set()
            await asyncio.sleep(1.0)

    parent_task = loop.create_task(watch_parent())
    await stop.wait()
    parent_task.cancel()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument(
        "--watch-history",
        type=int,
        default=HISTORY_PER_TYPE,
        help="watch events kept per resource type (older resourceVersions get 410)",
    )
    ap.add_argument(
        "--pod-ip-prefix",
        default=controllers.POD_IP_PREFIX,
        help="first two octets of pod IPs (127.x makes them loopback addresses, for fake metrics)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(
        serve(args.host, args.port, history=args.watch_history, pod_ip_prefix=args.pod_ip_prefix)
    )


if __name__ == "__main__":
    main()
