"""Authentication: who a request comes from, decided from its bearer token as kube-apiserver does.

- ADMIN_TOKEN (the token of the kubeconfig `start_emulator` writes): user `kubeemu-admin` in
  `system:masters`, the group the authorizer lets do anything;
- ServiceAccount tokens, issued by the TokenRequest subresource
  (`POST /api/v1/namespaces/NS/serviceaccounts/NAME/token`, what `kubectl create token` sends):
  user `system:serviceaccount:NS:NAME` in `system:serviceaccounts`,
  `system:serviceaccounts:NS` and `system:authenticated`. A token is bound to the
  ServiceAccount's uid and expires (1 h by default), so deleting the ServiceAccount or waiting
  revokes it;
- no Authorization header on the TLS port: `system:anonymous` in `system:unauthenticated`
  (kube-apiserver's default --anonymous-auth=true), who may only read /version and health; on
  the plain HTTP port, the admin (the tests' helpers; see tls.py);
- any other token: 401 Unauthorized.

Tokens are opaque random strings here, not signed JWTs: nothing in the tests reads inside one.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kubeemu import ADMIN_TOKEN
from kubeemu.errors import ApiError, bad_request, invalid, not_found

if TYPE_CHECKING:
    from kubeemu.store import Store

MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
SERVICE_ACCOUNTS = "system:serviceaccounts"
SERVICE_ACCOUNTS_PREFIX = "system:serviceaccount:"

DEFAULT_EXPIRATION = 3600
MIN_EXPIRATION = 600  # kube-apiserver refuses shorter TokenRequests
MAX_EXPIRATION = 48 * 3600


@dataclass(frozen=True)
class User:
    """An authenticated identity: what RBAC subjects are matched against."""

    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""


ADMIN = User("kubeemu-admin", (MASTERS, AUTHENTICATED))
ANONYMOUS = User("system:anonymous", (UNAUTHENTICATED,))


def service_account_user(namespace: str, name: str, uid: str = "") -> User:
    return User(
        f"{SERVICE_ACCOUNTS_PREFIX}{namespace}:{name}",
        (SERVICE_ACCOUNTS, f"{SERVICE_ACCOUNTS}:{namespace}", AUTHENTICATED),
        uid,
    )


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


@dataclass
class _Bound:
    namespace: str
    name: str
    uid: str
    expires: float


@dataclass
class Tokens:
    """The tokens the emulator accepts: the admin token and the ServiceAccount tokens it issued."""

    issued: dict[str, _Bound] = field(default_factory=dict)

    def authenticate(self, store: Store, authorization: str | None, *, secure: bool) -> User:
        """The request's user; ApiError 401 for a token the emulator does not know (or revoked).
        Without credentials: anonymous over TLS, the admin on the plain port (tls.py)."""
        if not authorization:
            return ANONYMOUS if secure else ADMIN
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized()
        if token == ADMIN_TOKEN:
            return ADMIN
        bound = self.issued.get(token)
        if bound is None:
            raise unauthorized()
        account = store.peek(("", "serviceaccounts"), bound.namespace, bound.name)
        live = account is not None and not account["metadata"].get("deletionTimestamp")
        if not live or account["metadata"]["uid"] != bound.uid or time.time() >= bound.expires:
            self.issued.pop(token, None)
            raise unauthorized()
        return service_account_user(bound.namespace, bound.name, bound.uid)

    def request(self, store: Store, namespace: str, name: str, body: Any) -> dict[str, Any]:
        """Answer a TokenRequest for ServiceAccount `namespace/name` (the 201 body)."""
        account = store.peek(("", "serviceaccounts"), namespace, name)
        if account is None:
            raise not_found(store.rt("", "serviceaccounts"), name)
        spec = (body.get("spec") if isinstance(body, dict) else None) or {}
        if not isinstance(spec, dict):
            raise bad_request("spec must be an object")
        seconds = spec.get("expirationSeconds", DEFAULT_EXPIRATION)
        if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < MIN_EXPIRATION:
            raise invalid(
                store.rt("", "serviceaccounts"),
                name,
                [
                    {
                        "reason": "FieldValueInvalid",
                        "field": "spec.expirationSeconds",
                        "message": f"Invalid value: {seconds}: may not specify a duration less "
                        "than 10 minutes",
                    }
                ],
            )
        seconds = min(seconds, MAX_EXPIRATION)
        token = "kubeemu-sa." + secrets.token_urlsafe(24)
        expires = time.time() + seconds
        self.issued[token] = _Bound(namespace, name, account["metadata"]["uid"], expires)
        return {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None},
            "spec": {
                "audiences": list(spec.get("audiences") or ["https://kubernetes.default.svc"]),
                "expirationSeconds": seconds,
                "boundObjectRef": spec.get("boundObjectRef"),
            },
            "status": {
                "token": token,
                "expirationTimestamp": datetime.fromtimestamp(expires, UTC).strftime(
                    "%Y-%m-%dT%H:%M:%SZ"
                ),
            },
        }
