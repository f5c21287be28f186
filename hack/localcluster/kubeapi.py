"""A minimal client for the cluster's API server: TLS with a client certificate from a kubeconfig.

Only what starting and checking a cluster needs (readiness, a few objects); the operator under
test uses kopf and the tests use kubectl, both real clients.
"""

from __future__ import annotations

import base64
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from localcluster.kubeconfig import Kubeconfig


class ApiError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class KubeApi:
    """Requests to the server a kubeconfig names, as the identity it holds (client cert or
    token)."""

    def __init__(self, kubeconfig: Path | str):
        config = Kubeconfig(Path(kubeconfig))
        self.server = config.server
        self._ctx = config.ssl
        self._token = config.token

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 10,
    ) -> Any:
        try:
            with self._open(method, path, body, content_type, timeout) as resp:
                raw = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    @contextlib.contextmanager
    def stream(self, method: str, path: str, timeout: float = 10) -> Iterator[Iterator[bytes]]:
        """The response's lines as they come (a watch: one event per line); ``timeout`` bounds
        each wait for data."""
        try:
            resp = self._open(method, path, None, "application/json", timeout)
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        with resp:
            yield (line for line in resp if line.strip())

    def _open(self, method: str, path: str, body: Any, content_type: str, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        req.add_header("Accept", "application/json")
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        return urllib.request.urlopen(req, context=self._ctx, timeout=timeout)

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def apply(self, path: str, obj: dict[str, Any], manager: str = "ketch-localcluster") -> Any:
        """Server-side apply of one object at its own path (``.../<plural>/<name>``)."""
        return self.request(
            "PATCH",
            f"{path}?fieldManager={manager}&force=true",
            obj,
            content_type="application/apply-patch+yaml",
        )

    def close(self) -> None:
        """Nothing to release (each request has its own connection); kept for callers."""


def write_kubeconfig(
    path: Path,
    server: str,
    ca_crt: Path,
    *,
    user: str,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    namespace: str | None = None,
) -> Path:
    """A self-contained kubeconfig (certificates embedded) with one cluster, user and context."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    creds: dict[str, Any] = {}
    if cert and key:
        creds = {"client-certificate-data": b64(cert), "client-key-data": b64(key)}
    if token:
        creds["token"] = token
    context: dict[str, Any] = {"cluster": "ketch-local", "user": user}
    if namespace:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "ketch-local",
                "cluster": {"server": server, "certificate-authority-data": b64(ca_crt)},
            }
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "ketch-local", "context": context}],
        "current-context": "ketch-local",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
