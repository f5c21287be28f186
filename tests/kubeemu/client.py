"""The tests' HTTP side of the emulator: a small synchronous JSON client (``_Client``, which
``Emulator`` extends), the ``ApiResponse`` it returns, and ``write_kubeconfig`` for kubectl and
other clients. Import-light like the package (no aiohttp).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The kubeconfig's token: a member of system:masters (authn.py); other identities get tokens from
# the TokenRequest subresource (`service_account_token`) and are held to RBAC (rbac.py).
ADMIN_TOKEN = "kubeemu-token"


@dataclass
class ApiResponse:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def ok(self) -> Any:
        """The body, or AssertionError with the Status message when the call failed."""
        if self.status >= 400:
            raise AssertionError(f"HTTP {self.status}: {self.body}")
        return self.body


def write_kubeconfig(
    path: Path, url: str, namespace: str = "default", token: str = ADMIN_TOKEN
) -> Path:
    """A kubeconfig with one context: the server `url`, TLS checks off, a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "kubeemu", "cluster": {"server": url, "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "kubeemu", "user": {"token": token}}],
        "contexts": [
            {
                "name": "kubeemu",
                "context": {"cluster": "kubeemu", "user": "kubeemu", "namespace": namespace},
            }
        ],
        "current-context": "kubeemu",
        "preferences": {},
    }
    path.write_text(json.dumps(config, indent=2))
    return path


class _Client:
    """A tiny synchronous JSON client for the emulator (tests use it to set up and assert).
    It sends `token` (the admin's unless a test sets another)."""

    url: str
    token: str | None = ADMIN_TOKEN

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        content_type: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> ApiResponse:
        url = self.url.rstrip("/") + path
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        data = None
        hdrs = {"Accept": "application/json", "User-Agent": "kubeemu-tests/1.0"}
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            if isinstance(body, bytes | str):
                data = body.encode() if isinstance(body, str) else body
            else:
                data = json.dumps(body).encode()
            hdrs["Content-Type"] = content_type or "application/json"
        hdrs.update(headers or {})
        req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw, status, rh = resp.read(), resp.status, resp.headers
        except urllib.error.HTTPError as err:
            raw, status, rh = err.read(), err.code, err.headers
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return ApiResponse(status, parsed, dict(rh.items()), rh.get_all("Warning") or [])

    def get(self, path: str, **kw: Any) -> ApiResponse:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> ApiResponse:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body: Any, **kw: Any) -> ApiResponse:
        return self.request("PUT", path, body, **kw)

    def patch(self, path: str, body: Any, kind: str = "merge", **kw: Any) -> ApiResponse:
        ctype = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
            "strategic": "application/strategic-merge-patch+json",
        }[kind]
        return self.request("PATCH", path, body, content_type=ctype, **kw)

    def apply(
        self, path: str, body: Any, *, manager: str, force: bool = False, **kw: Any
    ) -> ApiResponse:
        params = {"fieldManager": manager, **(kw.pop("params", None) or {})}
        if force:
            params["force"] = "true"
        return self.request(
            "PATCH", path, body, content_type="application/apply-patch+yaml", params=params, **kw
        )

    def delete(self, path: str, **kw: Any) -> ApiResponse:
        return self.request("DELETE", path, **kw)

    def watch(
        self, path: str, params: dict[str, Any] | None = None, timeout: float = 30
    ) -> Iterator[dict[str, Any]]:
        """Yield watch events until the server closes the stream (use timeoutSeconds)."""
        parsed = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
        query = urllib.parse.urlencode({"watch": "true", **(params or {})})
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        conn.request("GET", f"{path}?{query}", headers=headers)
        resp = conn.getresponse()
        try:
            if resp.status != 200:
                raise AssertionError(f"watch failed: HTTP {resp.status}: {resp.read()!r}")
            while True:
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()
