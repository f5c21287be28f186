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
import hashlib
import json
import logging
import re
import signal
from pathlib import Path
from typing import Any

from aiohttp import web

from kubeemu import controllers, protowire, tls
from kubeemu.access import Gate
from kubeemu.controllers import ControllerManager, PodBehaviour, describe_faults
from kubeemu.holds import Holds
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import SelectorError, parse_fields, parse_labels
from kubeemu.store import (
    APPLY_PATCH,
    HISTORY_PER_TYPE,
    ApiError,
    Store,
    bad_request,
    decode_yaml_or_json,
    load_validator_factory,
)
from kubeemu.tables import to_table
from kubeemu.watch import expire

log = logging.getLogger("kubeemu")

BOOKMARK_INTERVAL = 30.0
VERSION_INFO = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-kubeemu",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _json(data: Any, status: int = 200, headers: Any = None) -> web.Response:
    body = json.dumps(data, separators=(",", ":")).encode()
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def _status_response(err: ApiError) -> web.Response:
    headers = dict(err.headers)
    return _json(err.status(), err.code, headers)


def _generic_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def _version_key(v: str) -> tuple[int, int, int, str]:
    """Kubernetes version priority: GA before beta before alpha, higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", v)
    if not m:
        return (3, 0, 0, v)
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (stage, -int(m.group(1)), -int(m.group(3) or 0), v)


def _agent(request: web.Request) -> str:
    ua = request.headers.get("User-Agent", "")
    return ua.split("/", 1)[0][:128] or "unknown"


class EmulatorApp:
    """The aiohttp application: routing, discovery, watch streaming, admin endpoints."""

    def __init__(
        self, history: int = HISTORY_PER_TYPE, pod_ip_prefix: str = controllers.POD_IP_PREFIX
    ) -> None:
        self.store = Store(load_validator_factory(), history=history)
        self.controller = ControllerManager(self.store, pod_ip_prefix)
        self.holds = Holds()  # requests a test makes wait (holds.py)
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
                return _json({"paths": ["/api", "/api/v1", "/apis", "/version", "/_emulator"]})
            head = parts[0]
            if head == "_emulator":
                return await self.admin(request, parts[1:])
            if head in ("healthz", "readyz", "livez"):
                return web.Response(text="ok")
            if head == "version" and len(parts) == 1:
                return _json(VERSION_INFO)
            if head == "openapi" and len(parts) >= 2 and parts[1] == "v3":
                return self.openapi_v3(parts[2:])
            if head == "api":
                if len(parts) == 1:
                    return _json(
                        {
                            "kind": "APIVersions",
                            "versions": ["v1"],
                            "serverAddressByClientCIDRs": [
                                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.host}
                            ],
                        }
                    )
                if len(parts) == 2:
                    return self.resource_list("", parts[1])
                return await self.resource(request, "", parts[1], parts[2:])
            if head == "apis":
                if len(parts) == 1:
                    return _json(self.group_list())
                if len(parts) == 2:
                    group = self.group_info(parts[1])
                    if group is None:
                        raise _generic_not_found()
                    return _json({"kind": "APIGroup", "apiVersion": "v1", **group})
                if len(parts) == 3:
                    return self.resource_list(parts[1], parts[2])
                return await self.resource(request, parts[1], parts[2], parts[3:])
            raise _generic_not_found()
        except ApiError as err:
            return _status_response(err)
        except SelectorError as err:
            return _status_response(bad_request(str(err)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not look like a healthy API to the client
            log.exception("%s %s failed", request.method, request.path_qs)
            return _status_response(ApiError(500, "InternalError", f"emulator error: {exc!r}"))

    # ------------------------------------------------------------------------------------------
    # discovery

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, set[str]] = {}
        for rt in self.store.served():
            if rt.group:
                groups.setdefault(rt.group, set()).add(rt.version)
        return {g: sorted(vs, key=_version_key) for g, vs in sorted(groups.items())}

    def group_info(self, name: str) -> dict[str, Any] | None:
        versions = self._groups().get(name)
        if not versions:
            return None
        entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
        return {"name": name, "versions": entries, "preferredVersion": entries[0]}

    def group_list(self) -> dict[str, Any]:
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [self.group_info(g) for g in self._groups()],
        }

    def resource_list(self, group: str, version: str) -> web.Response:
        types = sorted(
            (rt for rt in self.store.served() if rt.group == group and rt.version == version),
            key=lambda r: r.plural,
        )
        if not types:
            raise _generic_not_found()
        resources: list[dict[str, Any]] = []
        for rt in types:
            entry: dict[str, Any] = {
                "name": rt.plural,
                "singularName": rt.singular,
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": list(rt.verbs),
            }
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            if rt.categories:
                entry["categories"] = list(rt.categories)
            resources.append(entry)
            if rt.status:
                resources.append(
                    {
                        "name": f"{rt.plural}/status",
                        "singularName": "",
                        "namespaced": rt.namespaced,
                        "kind": rt.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
            if rt.scale is not None:
                resources.append(
                    {
                        "name": f"{rt.plural}/scale",
                        "singularName": "",
                        "namespaced": rt.namespaced,
                        "group": "autoscaling",
                        "version": "v1",
                        "kind": "Scale",
                        "verbs": ["get", "patch", "update"],
                    }
                )
        gv = f"{group}/{version}" if group else version
        return _json(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": gv,
                "resources": resources,
            }
        )

    def openapi_v3(self, gv_parts: list[str]) -> web.Response:
        """Just enough OpenAPI v3 for kubectl: which PATCH endpoints take `fieldValidation`.

        kubectl (>= 1.27) asks this before choosing server-side field validation; without it
        kubectl falls back to client-side validation that needs full schemas.
        """
        gvs: dict[str, list[ResourceType]] = {}
        for rt in self.store.served():
            gv = f"apis/{rt.group}/{rt.version}" if rt.group else f"api/{rt.version}"
            gvs.setdefault(gv, []).append(rt)
        if not gv_parts:
            paths = {}
            for gv, types in sorted(gvs.items()):
                digest = (
                    hashlib.sha256(
                        json.dumps(sorted((t.plural, t.kind, t.namespaced) for t in types)).encode()
                    )
                    .hexdigest()[:16]
                    .upper()
                )
                paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
            return _json({"paths": paths})
        gv = "/".join(gv_parts)
        if gv not in gvs:
            raise _generic_not_found()
        params = [
            {"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
            for n in ("dryRun", "fieldManager", "fieldValidation", "force")
        ]
        out_paths: dict[str, Any] = {}
        schemas: dict[str, Any] = {}
        for rt in sorted(gvs[gv], key=lambda r: r.plural):
            if rt.schema:  # custom resources: their schema, so that `kubectl explain` works
                dotted = ".".join(reversed(rt.group.split(".")))
                schemas[f"{dotted}.{rt.version}.{rt.kind}"] = {
                    **rt.schema,
                    "x-kubernetes-group-version-kind": [
                        {"group": rt.group, "version": rt.version, "kind": rt.kind}
                    ],
                }
            base = f"/{gv}/namespaces/{{namespace}}" if rt.namespaced else f"/{gv}"
            gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
            for verb in ("patch", "put", "post"):
                path = f"{base}/{rt.plural}" + ("" if verb == "post" else "/{name}")
                out_paths.setdefault(path, {})[verb] = {
                    "operationId": f"{verb}{rt.kind}",
                    "x-kubernetes-action": {"put": "put", "post": "post"}.get(verb, "patch"),
                    "x-kubernetes-group-version-kind": gvk,
                    "parameters": params,
                    "responses": {"200": {"description": "OK"}},
                }
        return _json(
            {
                "openapi": "3.0.0",
                "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
                "paths": out_paths,
                "components": {"schemas": schemas},
            }
        )

    # ------------------------------------------------------------------------------------------
    # resources

    async def resource(
        self, request: web.Request, group: str, version: str, rest: list[str]
    ) -> web.StreamResponse:
        store = self.store
        ns: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            candidate = store.lookup(group, version, rest[2])
            if candidate is not None and candidate.namespaced:
                ns, rest = rest[1], rest[2:]
        rt = store.lookup(group, version, rest[0])
        if rt is None or len(rest) > 3:
            raise _generic_not_found()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (rt.namespaced and ns is None and name is not None) or (not rt.namespaced and ns):
            raise _generic_not_found()
        if sub is not None and not (
            (sub == "status" and rt.status) or (sub == "scale" and rt.scale is not None)
        ):
            raise _generic_not_found()

        q = request.query
        method = request.method
        verb = self._verb(method, name, q, request.headers.get("Content-Type", ""))
        store.stats.requests[verb] += 1
        agent = _agent(request)
        store.stats.by_agent[agent][verb] += 1
        store.stats.by_resource[f"{agent} {verb} {rt.plural}" + (f"/{sub}" if sub else "")] += 1
        await self.holds.wait(verb, rt, ns, name)
        dry_run = self._dry_run(q)
        field_validation = q.get("fieldValidation", "Warn")
        if field_validation not in ("Strict", "Warn", "Ignore"):
            raise bad_request(
                f'fieldValidation must be one of "Ignore", "Warn", or "Strict", got '
                f'"{field_validation}"'
            )
        manager = q.get("fieldManager") or None
        before = store.commits
        try:
            response = await self._dispatch(
                request, rt, ns, name, sub, verb, dry_run, field_validation, manager
            )
        finally:
            committed = store.commits - before
            store.stats.api_commits += committed
        if verb not in ("get", "list", "watch"):
            if committed and not dry_run:
                store.stats.writes[verb] += 1
            else:
                store.stats.noop_writes[verb] += 1
        return response

    @staticmethod
    def _verb(method: str, name: str | None, q: Any, ctype: str) -> str:
        if method == "GET":
            if name is not None:
                return "get"
            return "watch" if q.get("watch") in ("true", "1") else "list"
        if method == "POST":
            return "create"
        if method == "PUT":
            return "update"
        if method == "PATCH":
            return "apply" if ctype.split(";")[0].strip() == APPLY_PATCH else "patch"
        if method == "DELETE":
            return "delete" if name is not None else "deletecollection"
        return method.lower()

    @staticmethod
    def _dry_run(q: Any) -> bool:
        values = q.getall("dryRun", [])
        for v in values:
            if v != "All":
                raise bad_request(f'unsupported dry run value "{v}"; only "All" is supported')
        return bool(values)

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        ctype = request.headers.get("Content-Type", "")
        if "protobuf" in ctype:
            try:
                return protowire.decode(raw)
            except protowire.ProtobufError as exc:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the emulator cannot decode this protobuf body ({exc}); send JSON or YAML",
                ) from exc
        if "cbor" in ctype:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media "
                "types include: application/json, application/yaml",
            )
        if "yaml" in ctype:
            return decode_yaml_or_json(raw)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"error decoding request body: {exc}") from exc

    async def _dispatch(
        self,
        request: web.Request,
        rt: ResourceType,
        ns: str | None,
        name: str | None,
        sub: str | None,
        verb: str,
        dry_run: bool,
        field_validation: str,
        manager: str | None,
    ) -> web.StreamResponse:
        store = self.store
        q = request.query
        default_manager = manager or _agent(request)
        if verb == "watch":
            return await self.watch(request, rt, ns)
        if verb == "list":
            return self.list(request, rt, ns)
        if verb == "get":
            assert name is not None
            if sub == "scale":
                return _json(store.get_scale(rt, ns, name))
            obj = store.get(rt, ns, name)
            if self._wants_table(request):
                return _json(
                    to_table(
                        rt,
                        [obj],
                        resource_version=obj["metadata"]["resourceVersion"],
                        include_object=q.get("includeObject", "Metadata"),
                    )
                )
            return _json(obj)
        if verb == "create":
            if name is not None:
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            if ns is None and rt.namespaced:
                raise _generic_not_found()
            body = await self._body(request)
            obj, warnings = store.create(
                rt,
                ns,
                body,
                manager=default_manager,
                dry_run=dry_run,
                field_validation=field_validation,
            )
            return self._with_warnings(_json(obj, 201), warnings)
        assert name is not None or verb == "deletecollection"
        if verb == "update":
            assert name is not None
            body = await self._body(request)
            obj, warnings = store.update(
                rt,
                ns,
                name,
                body,
                manager=default_manager,
                subresource=sub,
                dry_run=dry_run,
                field_validation=field_validation,
            )
            return self._with_warnings(_json(obj), warnings)
        if verb in ("patch", "apply"):
            assert name is not None
            raw = await request.read()
            force = q.get("force") in ("true", "1")
            obj, warnings, created = store.patch(
                rt,
                ns,
                name,
                raw,
                request.headers.get("Content-Type", ""),
                manager=manager if verb == "apply" else default_manager,
                subresource=sub,
                force=force,
                dry_run=dry_run,
                field_validation=field_validation,
            )
            return self._with_warnings(_json(obj, 201 if created else 200), warnings)
        if verb in ("delete", "deletecollection"):
            body = await self._body(request) or {}
            if not isinstance(body, dict):
                raise bad_request("the body of a delete request must be DeleteOptions")
            policy = q.get("propagationPolicy") or body.get("propagationPolicy")
            if policy not in (None, "Orphan", "Background", "Foreground"):
                raise bad_request(f'unsupported propagationPolicy "{policy}"')
            if body.get("dryRun"):
                dry_run = dry_run or "All" in body["dryRun"]
            if verb == "deletecollection":
                items = store.delete_collection(
                    rt,
                    ns,
                    parse_labels(q.get("labelSelector")),
                    parse_fields(q.get("fieldSelector")),
                    propagation=policy,
                    dry_run=dry_run,
                )
                return _json(
                    {
                        "kind": rt.list_kind,
                        "apiVersion": rt.api_version,
                        "metadata": {"resourceVersion": str(store.rv)},
                        "items": items,
                    }
                )
            assert name is not None
            obj = store.delete(
                rt,
                ns,
                name,
                propagation=policy,
                preconditions=body.get("preconditions"),
                dry_run=dry_run,
            )
            still_there = store.peek(rt.key, ns, name) is not None
            if still_there or rt.is_crd or rt.key in (("", "pods"), ("", "services")):
                return _json(obj)
            details: dict[str, Any] = {
                "name": name,
                "kind": rt.plural,
                "uid": obj["metadata"].get("uid"),
            }
            if rt.group:
                details["group"] = rt.group
            return _json(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": details,
                }
            )
        raise ApiError(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )

    @staticmethod
    def _with_warnings(resp: web.Response, warnings: list[str]) -> web.Response:
        for w in warnings:
            resp.headers.add("Warning", f'299 - "{w.replace(chr(34), chr(92) + chr(34))}"')
        return resp

    @staticmethod
    def _wants_table(request: web.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    def list(self, request: web.Request, rt: ResourceType, ns: str | None) -> web.Response:
        q = request.query
        try:
            limit = int(q.get("limit") or 0)
        except ValueError as exc:
            raise bad_request(f"invalid limit: {q.get('limit')}") from exc
        items, rv, cont, remaining = self.store.list(
            rt,
            ns,
            parse_labels(q.get("labelSelector")),
            parse_fields(q.get("fieldSelector")),
            limit=limit,
            cont=q.get("continue"),
        )
        if self._wants_table(request):
            return _json(
                to_table(
                    rt,
                    items,
                    resource_version=rv,
                    include_object=q.get("includeObject", "Metadata"),
                    cont=cont,
                )
            )
        meta: dict[str, Any] = {"resourceVersion": rv}
        if cont:
            meta["continue"] = cont
            meta["remainingItemCount"] = remaining
        return _json(
            {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": items}
        )

    # ------------------------------------------------------------------------------------------
    # watch

    async def watch(
        self, request: web.Request, rt: ResourceType, ns: str | None
    ) -> web.StreamResponse:
        q = request.query
        store = self.store
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

        as_table = self._wants_table(request)  # `kubectl get -w` prints server-side rows
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
            return line(
                "BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}
            )

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

    # ------------------------------------------------------------------------------------------
    # admin endpoints (not Kubernetes)

    async def admin(self, request: web.Request, parts: list[str]) -> web.Response:
        what = parts[0] if parts else ""
        store = self.store
        if what == "faults":  # how pods behave: {scope: name, mode, readyDelaySeconds, ...}
            if request.method == "POST":
                self._set_pod_behaviour(await self._body(request) or {})
            return _json({"faults": describe_faults(self.controller)})
        if what == "applied":
            q = request.query
            items = [
                e
                for e in store.apply_log
                if all(
                    q.get(k) in (None, e.get(k)) for k in ("manager", "namespace", "name", "kind")
                )
            ]
            return _json({"items": items})
        if what == "stats":
            out = store.stats.to_json(store.commits)
            out["resourceVersion"] = store.rv
            out["objects"] = {
                (f"{k[1]}.{k[0]}" if k[0] else k[1]): len(v)
                for k, v in sorted(store.objects.items())
                if v
            }
            out["watchers"] = sum(len(ws) for ws in store.watchers.values())
            return _json(out)
        if what == "holds":
            if request.method == "POST":
                self.holds.add(await self._body(request))
            elif request.method == "DELETE":
                self.holds.release()
            return _json(self.holds.to_json())
        if what == "expire-watches" and request.method == "POST":
            # {"resources": ["deployments.apps", "pods"]} (plural[.group]); none: every type
            wanted = (await self._body(request) or {}).get("resources")
            keys = [
                k
                for k in store.types
                if wanted is None or (f"{k[1]}.{k[0]}" if k[0] else k[1]) in wanted
            ]
            return _json({"ended": expire(store, keys), "resourceVersion": str(store.rv)})
        if what == "reset" and request.method == "POST":
            store.apply_log.clear()
            store.stats = type(store.stats)()
            self.controller.reset()
            return _json({"ok": True})
        raise _generic_not_found()

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
