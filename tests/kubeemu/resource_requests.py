"""Requests on resources (``/api/v1/...``, ``/apis/<group>/<version>/...``): the path parsed
into type, namespace, name and subresource, the verb, request statistics and holds, then the
store's get, list, create, update, patch and delete (watches go to ``watch_stream``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kubeemu.holds import Holds
from kubeemu.http_wire import (
    agent_of,
    generic_not_found,
    json_response,
    read_body,
    wants_table,
    with_warnings,
)
from kubeemu.kinds import ResourceType
from kubeemu.labelsel import parse_fields, parse_labels
from kubeemu.store import APPLY_PATCH, ApiError, Store, bad_request
from kubeemu.tables import to_table
from kubeemu.watch_stream import stream_watch


class ResourceRequests:
    """Serves requests on resources from a store, making them wait on the tests' holds."""

    def __init__(self, store: Store, holds: Holds) -> None:
        self.store = store
        self.holds = holds

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
            raise generic_not_found()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (rt.namespaced and ns is None and name is not None) or (not rt.namespaced and ns):
            raise generic_not_found()
        if sub is not None and not (
            (sub == "status" and rt.status) or (sub == "scale" and rt.scale is not None)
        ):
            raise generic_not_found()

        q = request.query
        method = request.method
        verb = self._verb(method, name, q, request.headers.get("Content-Type", ""))
        store.stats.requests[verb] += 1
        agent = agent_of(request)
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
        default_manager = manager or agent_of(request)
        if verb == "watch":
            return await stream_watch(store, request, rt, ns)
        if verb == "list":
            return self.list(request, rt, ns)
        if verb == "get":
            assert name is not None
            if sub == "scale":
                return json_response(store.get_scale(rt, ns, name))
            obj = store.get(rt, ns, name)
            if wants_table(request):
                return json_response(
                    to_table(
                        rt,
                        [obj],
                        resource_version=obj["metadata"]["resourceVersion"],
                        include_object=q.get("includeObject", "Metadata"),
                    )
                )
            return json_response(obj)
        if verb == "create":
            if name is not None:
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            if ns is None and rt.namespaced:
                raise generic_not_found()
            body = await read_body(request)
            obj, warnings = store.create(
                rt,
                ns,
                body,
                manager=default_manager,
                dry_run=dry_run,
                field_validation=field_validation,
            )
            return with_warnings(json_response(obj, 201), warnings)
        assert name is not None or verb == "deletecollection"
        if verb == "update":
            assert name is not None
            body = await read_body(request)
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
            return with_warnings(json_response(obj), warnings)
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
            return with_warnings(json_response(obj, 201 if created else 200), warnings)
        if verb in ("delete", "deletecollection"):
            body = await read_body(request) or {}
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
                return json_response(
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
                return json_response(obj)
            details: dict[str, Any] = {
                "name": name,
                "kind": rt.plural,
                "uid": obj["metadata"].get("uid"),
            }
            if rt.group:
                details["group"] = rt.group
            return json_response(
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
        if wants_table(request):
            return json_response(
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
        return json_response(
            {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": items}
        )
