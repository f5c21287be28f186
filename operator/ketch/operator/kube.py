"""A small asyncio Kubernetes client: what the operator needs and nothing else.

kopf watches and handles; this client does the operator's own writes (server-side apply with one
field manager, status, events, deletes of children no longer wanted). It logs in with the same
``kopf.ConnectionInfo`` that kopf uses, so both talk to one cluster with one identity.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp

from ketch.operator import api_names, children
from ketch.operator.managers import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER

# kind -> (apiVersion, plural): the children's (``children.KINDS``), and what else is read or
# written: the InferenceServices, their pods, Events, Secrets.
RESOURCES: dict[str, tuple[str, str]] = {
    **{k.kind: (k.api_version, k.plural) for k in children.KINDS},
    "Pod": ("v1", "pods"),
    "Event": ("v1", "events"),
    "Secret": ("v1", "secrets"),
    api_names.KIND: (api_names.API_VERSION, api_names.PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(kind: str, namespace: str | None, name: str | None = None) -> str:
    api_version, plural = RESOURCES[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{quote(namespace)}"
    base += f"/{plural}"
    if name:
        base += f"/{quote(name)}"
    return base


def _write_temp(data: str | bytes, suffix: str) -> str:
    raw = data if isinstance(data, bytes) else data.encode()
    try:  # kubeconfig *-data fields are base64 of PEM
        decoded = base64.b64decode(raw, validate=True)
        raw = decoded if b"-----BEGIN" in decoded else raw
    except ValueError:
        pass
    fd, path = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def ssl_context(info: Any) -> ssl.SSLContext | bool:
    if not str(info.server).startswith("https"):
        return False
    if info.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        ca_path = info.ca_path or (_write_temp(info.ca_data, ".crt") if info.ca_data else None)
        context = ssl.create_default_context(cafile=ca_path)
    cert = info.certificate_path or (
        _write_temp(info.certificate_data, ".crt") if info.certificate_data else None
    )
    key = info.private_key_path or (
        _write_temp(info.private_key_data, ".key") if info.private_key_data else None
    )
    if cert:
        context.load_cert_chain(cert, key)
    return context


class KubeClient:
    def __init__(self, info: Any, *, connections: int = 32, relogin: Any = None):
        """``relogin()`` returns fresh credentials (a ConnectionInfo); it is called once on a 401,
        because service-account tokens are rotated under a long-running operator."""
        self.server = str(info.server).rstrip("/")
        self._relogin = relogin
        self._authorization = self._bearer(info)
        headers = {"Accept": "application/json", "User-Agent": "ketch-operator"}
        auth = (
            aiohttp.BasicAuth(info.username, info.password or "")
            if info.username and not info.token
            else None
        )
        self._session = aiohttp.ClientSession(
            headers=headers,
            auth=auth,
            connector=aiohttp.TCPConnector(limit=connections, ssl=ssl_context(info)),
            # Not ``total``: that clock runs while a request waits for one of the pool's
            # connections, and in a burst of reconciles that wait alone can pass it (the
            # request is then cancelled unsent, or mid-way: the API server answers 504, the
            # reconcile backs off and redoes it). A sent request must connect in 10 s and be
            # answered in 75 (the API server answers 504 itself at 60).
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=75),
        )

    @staticmethod
    def _bearer(info: Any) -> dict[str, str]:
        return {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"} if info.token else {}

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        for attempt in (1, 2):
            headers = dict(self._authorization)
            if data is not None:
                headers["Content-Type"] = content_type
            async with self._session.request(
                method, self.server + path, params=params, data=data, headers=headers
            ) as response:
                status = response.status
                text = await response.text()
            if status == 401 and attempt == 1 and self._relogin is not None:
                self._authorization = self._bearer(self._relogin())
                continue
            break
        return self._decode(status, text)

    @staticmethod
    def _decode(status: int, text: str) -> Any:
        try:
            payload = json.loads(text) if text else {}
        except ValueError:
            payload = text
        if status >= 400:
            if isinstance(payload, dict):
                raise ApiError(
                    status,
                    str(payload.get("reason") or status),
                    str(payload.get("message") or text),
                )
            raise ApiError(status, str(status), text)
        return payload

    async def apply(
        self, obj: dict[str, Any], *, force: bool = True, manager: str = FIELD_MANAGER
    ) -> dict[str, Any]:
        """Server-side apply: ``manager`` owns exactly the fields ``obj`` sets."""
        meta = obj["metadata"]
        return await self.request(
            "PATCH",
            resource_path(obj["kind"], meta.get("namespace"), meta["name"]),
            params={"fieldManager": manager, "force": "true" if force else "false"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        payload = await self.request(
            "GET", resource_path(kind, namespace), params={"labelSelector": label_selector}
        )
        return payload.get("items") or []

    async def watch(
        self, kind: str, namespace: str, params: dict[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch (``?watch=1``), one JSON object a line, until the server ends
        it; an ``ApiError`` when it is refused (404: the kind is not served)."""
        query = {**params, "watch": "1"}
        headers = dict(self._authorization)
        async with self._session.get(
            self.server + resource_path(kind, namespace), params=query, headers=headers
        ) as response:
            if response.status >= 400:
                self._decode(response.status, await response.text())
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Deletes the object; with ``uid``, only if it is still that object (a precondition:
        one made again under the name since it was read is left). False when nothing was
        deleted (gone already, or another object)."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", resource_path(kind, namespace, name), body=body)
        except ApiError as exc:
            if exc.status == 404 or (exc.status == 409 and uid):
                return False
            raise
        return True

    async def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        return await self.request(
            "PATCH",
            resource_path(kind, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Sets replicas through the scale subresource, as an HPA does (coordinated autoscaling)."""
        return await self.request(
            "PATCH",
            resource_path(kind, namespace, name) + "/scale",
            params={"fieldManager": AUTOSCALER_FIELD_MANAGER},
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    async def post(self, kind: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", resource_path(kind, namespace), body=obj)
