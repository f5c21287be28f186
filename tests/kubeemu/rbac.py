"""Authorization as kube-apiserver's RBAC authorizer decides it.

A request is described as the apiserver's RequestInfoFactory describes it (verb, API group,
resource, subresource, namespace, name; or a non-resource path) and allowed when a rule reaches
the user through
- a ClusterRoleBinding (its ClusterRole applies in every namespace and cluster-wide), or
- a RoleBinding in the request's namespace (its Role, or a ClusterRole, applies in that
  namespace only; never to non-resource URLs or cluster-scoped objects),
from the Roles, ClusterRoles and bindings stored in the emulator, plus the default policy every
cluster bootstraps (DEFAULT_CLUSTER_ROLES): discovery and /version for everyone signed in,
/version and health for anonymous users too. `system:masters` may do anything (the apiserver's
privileged-group authorizer runs before RBAC).

Not modelled: aggregated ClusterRoles (aggregationRule), the escalate/bind checks on writing
roles and bindings, impersonation, the other default roles (admin, edit, view, system:node...).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kubeemu.authn import AUTHENTICATED, MASTERS, SERVICE_ACCOUNTS, UNAUTHENTICATED, User
from kubeemu.errors import ApiError

if TYPE_CHECKING:
    from kubeemu.store import Store

RBAC = "rbac.authorization.k8s.io"
Rule = Mapping[str, Any]

_SPECIAL_VERBS = ("proxy", "watch")  # /api/v1/watch/... : the verb from the path
_NAMESPACE_SUBRESOURCES = ("status", "finalize")

# The default ClusterRoles (kube-apiserver's bootstrap policy) and the groups bound to them.
DEFAULT_CLUSTER_ROLES: dict[str, tuple[tuple[str, ...], tuple[Rule, ...]]] = {
    "cluster-admin": (
        (MASTERS,),
        (
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            {"nonResourceURLs": ["*"], "verbs": ["*"]},
        ),
    ),
    "system:discovery": (
        (AUTHENTICATED,),
        (
            {
                "nonResourceURLs": [
                    "/api",
                    "/api/*",
                    "/apis",
                    "/apis/*",
                    "/healthz",
                    "/livez",
                    "/openapi",
                    "/openapi/*",
                    "/readyz",
                    "/version",
                    "/version/",
                ],
                "verbs": ["get"],
            },
        ),
    ),
    "system:public-info-viewer": (
        (AUTHENTICATED, UNAUTHENTICATED),
        (
            {
                "nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"],
                "verbs": ["get"],
            },
        ),
    ),
    "system:basic-user": (
        (AUTHENTICATED,),
        (
            {
                "apiGroups": ["authorization.k8s.io"],
                "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                "verbs": ["create"],
            },
            {
                "apiGroups": ["authentication.k8s.io"],
                "resources": ["selfsubjectreviews"],
                "verbs": ["create"],
            },
        ),
    ),
    "system:service-account-issuer-discovery": (
        (SERVICE_ACCOUNTS,),
        (
            {
                "nonResourceURLs": [
                    "/.well-known/openid-configuration",
                    "/.well-known/openid-configuration/",
                    "/openid/v1/jwks",
                    "/openid/v1/jwks/",
                ],
                "verbs": ["get"],
            },
        ),
    ),
}


@dataclass(frozen=True)
class RequestInfo:
    """What the authorizer is asked about one request (kube-apiserver's RequestInfo)."""

    path: str
    verb: str
    resource_request: bool = False
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""

    def but(self, **changes: Any) -> RequestInfo:
        return replace(self, **changes)


def request_info(method: str, path: str, query: Mapping[str, str]) -> RequestInfo:
    """Describe a request as RequestInfoFactory.NewRequestInfo does."""
    info = RequestInfo(path=path, verb=method.lower())
    parts = [p for p in path.strip("/").split("/") if p] if path.strip("/") else []
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return info
    prefix, parts = parts[0], parts[1:]
    group = ""
    if prefix == "apis":
        if len(parts) < 3:
            return info
        group, parts = parts[0], parts[1:]
    version, parts = parts[0], parts[1:]
    info = info.but(resource_request=True, api_group=group, api_version=version)
    via_path = parts[0] in _SPECIAL_VERBS
    if via_path:
        verb, parts = parts[0], parts[1:]
        if not parts:
            return info.but(verb=verb)
    else:
        verb = {
            "POST": "create",
            "GET": "get",
            "HEAD": "get",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete",
        }.get(method.upper(), "")
    namespace = ""
    if parts[0] == "namespaces" and len(parts) > 1:
        namespace = parts[1]
        if len(parts) > 2 and parts[2] not in _NAMESPACE_SUBRESOURCES:
            parts = parts[2:]
    name = parts[1] if len(parts) >= 2 else ""
    sub = parts[2] if len(parts) >= 3 and verb != "proxy" else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch", "false").lower() not in ("false", "0") else "list"
        name = _exact_name(query.get("fieldSelector", ""))
    if not name and verb == "delete":
        verb = "deletecollection"
    return info.but(verb=verb, namespace=namespace, resource=parts[0], subresource=sub, name=name)


def _exact_name(selector: str) -> str:
    """metadata.name=X in a field selector names the object (RBAC resourceNames then apply)."""
    for term in selector.split(","):
        for op in ("==", "="):
            field_name, sep, value = term.partition(op)
            if sep and field_name.strip() == "metadata.name" and not value.startswith("="):
                value = value.strip()
                if value and value not in (".", "..") and "/" not in value and "%" not in value:
                    return value
                return ""
    return ""


# ---------------------------------------------------------------------------------- rules


def rule_allows(info: RequestInfo, rule: Rule) -> bool:
    verbs = rule.get("verbs") or ()
    if "*" not in verbs and info.verb not in verbs:
        return False
    if not info.resource_request:
        return any(
            url == "*"
            or url == info.path
            or (url.endswith("*") and info.path.startswith(url.rstrip("*")))
            for url in rule.get("nonResourceURLs") or ()
        )
    groups = rule.get("apiGroups") or ()
    if "*" not in groups and info.api_group not in groups:
        return False
    combined = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
    if not any(
        r == "*" or r == combined or (info.subresource and r == f"*/{info.subresource}")
        for r in rule.get("resources") or ()
    ):
        return False
    names = rule.get("resourceNames") or ()
    return not names or info.name in names


def _applies(user: User, subjects: Any, binding_namespace: str) -> bool:
    for subject in subjects or ():
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and user.name == name:
            return True
        if kind == "Group" and name in user.groups:
            return True
        if kind == "ServiceAccount":
            namespace = subject.get("namespace") or binding_namespace
            if namespace and user.name == f"system:serviceaccount:{namespace}:{name}":
                return True
    return False


class Authorizer:
    """RBAC over the store's roles and bindings plus the default cluster roles."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def allowed(self, user: User, info: RequestInfo) -> tuple[bool, str]:
        """(allowed, reason): the reason lists role references that could not be resolved."""
        if MASTERS in user.groups:
            return True, ""
        errors: list[str] = []
        for rules in self._rules_for(user, info.namespace, errors):
            if any(rule_allows(info, rule) for rule in rules):
                return True, ""
        if not errors:
            return False, ""
        joined = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
        return False, f"RBAC: {joined}"

    def check(self, user: User, info: RequestInfo) -> None:
        allowed, reason = self.allowed(user, info)
        if not allowed:
            raise forbidden(user, info, reason)

    def _rules_for(self, user: User, namespace: str, errors: list[str]) -> Iterator[Any]:
        for groups, rules in DEFAULT_CLUSTER_ROLES.values():
            if any(g in user.groups for g in groups):
                yield rules
        for binding in self._objects("clusterrolebindings", ""):
            if _applies(user, binding.get("subjects"), ""):
                rules = self._role_rules(binding.get("roleRef") or {}, "", errors)
                if rules is not None:
                    yield rules
        if not namespace:
            return
        for binding in self._objects("rolebindings", namespace):
            if _applies(user, binding.get("subjects"), namespace):
                rules = self._role_rules(binding.get("roleRef") or {}, namespace, errors)
                if rules is not None:
                    yield rules

    def _objects(self, plural: str, namespace: str) -> list[dict[str, Any]]:
        objects = self.store.objects.get((RBAC, plural), {})
        return [obj for (ns, _), obj in sorted(objects.items()) if ns == namespace]

    def _role_rules(self, ref: Mapping[str, Any], namespace: str, errors: list[str]) -> Any:
        kind, name = ref.get("kind"), ref.get("name") or ""
        if kind == "Role":
            role = self.store.peek((RBAC, "roles"), namespace, name) if namespace else None
            if role is None:
                errors.append(f'role.{RBAC} "{name}" not found')
                return None
            return role.get("rules") or ()
        if kind == "ClusterRole":
            role = self.store.peek((RBAC, "clusterroles"), None, name)
            if role is not None:
                return role.get("rules") or ()
            if name in DEFAULT_CLUSTER_ROLES:
                return DEFAULT_CLUSTER_ROLES[name][1]
            errors.append(f'clusterrole.{RBAC} "{name}" not found')
            return None
        errors.append(f"unsupported role reference kind: {json.dumps(kind or '')}")
        return None


def forbidden(user: User, info: RequestInfo, reason: str = "") -> ApiError:
    """The 403 kube-apiserver answers (responsewriters.ForbiddenStatusError)."""
    if info.resource_request:
        resource = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
        scope = (
            f"in the namespace {_q(info.namespace)}" if info.namespace else "at the cluster scope"
        )
        what = (
            f"User {_q(user.name)} cannot {info.verb} resource {_q(resource)} in API group "
            f"{_q(info.api_group)} {scope}"
        )
    else:
        what = f"User {_q(user.name)} cannot {info.verb} path {_q(info.path)}"
    what = what.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if reason:
        what = f"{what}: {reason}"
    details: dict[str, Any] = {}
    if info.name:
        details["name"] = info.name
    if info.api_group:
        details["group"] = info.api_group
    if info.resource:
        details["kind"] = info.resource
    qualified = f"{info.resource}.{info.api_group}" if info.api_group else info.resource
    if not qualified:
        message = f"forbidden: {what}"
    elif not info.name:
        message = f"{qualified} is forbidden: {what}"
    else:
        message = f"{qualified} {_q(info.name)} is forbidden: {what}"
    return ApiError(403, "Forbidden", message, details)


def _q(text: str) -> str:
    """Go's %q for the strings that occur here."""
    return json.dumps(text, ensure_ascii=False)
