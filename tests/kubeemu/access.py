"""The gate in front of every API request, in kube-apiserver's order: who sends it
(authn.Tokens: 401 for a token it does not know), whether RBAC lets them (rbac.Authorizer: 403
with the apiserver's message), then the handler. Also answers the TokenRequest subresource
(`POST /api/v1/namespaces/NS/serviceaccounts/NAME/token`), which issues ServiceAccount tokens,
and SelfSubjectAccessReviews (`kubectl auth can-i`).

A server-side apply that would create its object is authorized for `create` as well as `patch`,
as the apiserver's patch handler does (a Role with `patch` but not `create` cannot create by
applying). The emulator's own endpoints (/_emulator/...) are not Kubernetes: no credentials.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kubeemu import protowire
from kubeemu.authn import Tokens, User
from kubeemu.errors import ApiError, bad_request
from kubeemu.patches import APPLY_PATCH
from kubeemu.rbac import Authorizer, RequestInfo, request_info

if TYPE_CHECKING:
    from kubeemu.store import Store

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("kubeemu.access")


class Gate:
    """Authentication and authorization for the emulator's aiohttp application."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.tokens = Tokens()
        self.authorizer = Authorizer(store)

    def middleware(self) -> Any:
        @web.middleware
        async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path == "/_emulator" or request.path.startswith("/_emulator/"):
                return await handler(request)
            try:
                answer = await self.admit(request)
            except ApiError as err:
                log.info("%s %s: %d %s", request.method, request.path_qs, err.code, err.message)
                return _respond(err.status(), err.code, err.headers)
            return answer if answer is not None else await handler(request)

        return gate

    async def admit(self, request: web.Request) -> web.StreamResponse | None:
        """Raise the 401/403 for this request, answer it if it is a TokenRequest, else None."""
        user = self.tokens.authenticate(
            self.store, request.headers.get("Authorization"), secure=request.secure
        )
        info = request_info(request.method, request.path, request.query)
        self.authorizer.check(user, info)
        if self._creates_by_apply(info, request.headers.get("Content-Type", "")):
            self.authorizer.check(user, info.but(verb="create"))
            info = info.but(verb="create")
        if log.isEnabledFor(logging.DEBUG) and user.uid:  # what ServiceAccounts use
            resource = "/".join(p for p in (info.resource, info.subresource) if p)
            log.debug("allowed %s %s %s.%s", user.name, info.verb, resource, info.api_group)
        if _is_token_request(info):
            body = await _token_request_body(request)
            issued = self.tokens.request(self.store, info.namespace, info.name, body)
            return _respond(issued, 201)
        if _is_self_review(info):
            return _respond(self._self_review(user, await _token_request_body(request)), 201)
        return None

    def _self_review(self, user: User, body: Any) -> dict[str, Any]:
        """A SelfSubjectAccessReview (`kubectl auth can-i`): may this user do that?"""
        spec = (body.get("spec") if isinstance(body, dict) else None) or {}
        resource = spec.get("resourceAttributes")
        if isinstance(resource, dict):
            asked = RequestInfo(
                path="",
                verb=str(resource.get("verb") or ""),
                resource_request=True,
                api_group=str(resource.get("group") or ""),
                api_version=str(resource.get("version") or ""),
                namespace=str(resource.get("namespace") or ""),
                resource=str(resource.get("resource") or ""),
                subresource=str(resource.get("subresource") or ""),
                name=str(resource.get("name") or ""),
            )
        else:
            other = spec.get("nonResourceAttributes") or {}
            asked = RequestInfo(str(other.get("path") or ""), str(other.get("verb") or ""))
        allowed, reason = self.authorizer.allowed(user, asked)
        status: dict[str, Any] = {"allowed": allowed}
        if reason:
            status["reason"] = reason
        return {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }

    def _creates_by_apply(self, info: RequestInfo, content_type: str) -> bool:
        if info.verb != "patch" or info.subresource or not info.name:
            return False
        if content_type.split(";")[0].strip() != APPLY_PATCH:
            return False
        rt = self.store.lookup(info.api_group, info.api_version, info.resource)
        if rt is None:
            return False
        namespace = info.namespace if rt.namespaced else None
        return self.store.peek(rt.key, namespace, info.name) is None


def _is_self_review(info: RequestInfo) -> bool:
    return (
        info.verb == "create"
        and info.api_group == "authorization.k8s.io"
        and info.resource == "selfsubjectaccessreviews"
        and not info.name
    )


def _is_token_request(info: RequestInfo) -> bool:
    return (
        info.resource_request
        and info.verb == "create"
        and info.api_group == ""
        and info.resource == "serviceaccounts"
        and info.subresource == "token"
        and bool(info.namespace and info.name)
    )


async def _token_request_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    if "protobuf" in request.headers.get("Content-Type", ""):
        try:  # kubectl may send protobuf; the spec's defaults do if it cannot be read
            return protowire.decode(raw)
        except protowire.ProtobufError:
            return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"error decoding request body: {exc}") from exc


def _respond(body: Any, status: int, headers: dict[str, str] | None = None) -> web.Response:
    data = json.dumps(body, separators=(",", ":")).encode()
    return web.Response(body=data, status=status, content_type="application/json", headers=headers)
