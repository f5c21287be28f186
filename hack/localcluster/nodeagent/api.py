"""A minimal Kubernetes API client over ``http.client``: kubeconfig, JSON requests, watches.

The agent authenticates with the client certificate of its kubeconfig (user
``system:node:<node>``), like a kubelet. One keep-alive connection per thread; a watch gets a
connection of its own. A real kubelet uses client-go: informers with shared caches, protobuf,
client-side rate limits and certificate rotation, none of which this needs.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from localcluster.kubeconfig import Kubeconfig

Obj = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """A non-2xx answer: ``status`` (HTTP code), ``reason`` (the Status reason) and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def now() -> str:
    """metav1.Time: RFC 3339 in UTC, whole seconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """metav1.MicroTime (Lease renewTime, Event eventTime)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Api:
    """JSON requests to the API server: ``get``, ``post``, ``patch``, ``put``, ``delete``,
    ``watch``. Raises ApiError for non-2xx answers, OSError when the server is unreachable."""

    def __init__(self, config: Kubeconfig, user_agent: str = "ketch-nodeagent") -> None:
        self.config = config
        url = urllib.parse.urlsplit(config.server)
        self.host = url.hostname or "localhost"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.https = url.scheme == "https"
        self.user_agent = user_agent
        self._local = threading.local()

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout, context=self.config.ssl
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = self.config.headers(self.user_agent)
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Obj:
        if query:
            path += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(2):  # a kept-alive connection the server closed: once more
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._connect(timeout)
            conn.timeout = timeout
            try:
                conn.request(method, path, data, self._headers(content_type if data else None))
                response = conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
                continue
            break
        answer = json.loads(raw) if raw else {}
        if response.status >= 300:
            if not isinstance(answer, dict):
                answer = {}
            raise ApiError(
                response.status,
                answer.get("reason", response.reason),
                answer.get("message", raw[:300].decode(errors="replace")),
            )
        return answer

    def get(self, path: str, **query: Any) -> Obj:
        return self.request("GET", path, query=query)

    def post(self, path: str, body: Obj, **query: Any) -> Obj:
        return self.request("POST", path, body, query=query)

    def put(self, path: str, body: Obj) -> Obj:
        return self.request("PUT", path, body)

    def patch(self, path: str, body: Obj, content_type: str = MERGE_PATCH) -> Obj:
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str, body: Obj | None = None) -> Obj:
        return self.request("DELETE", path, body)

    def watch(self, path: str, query: dict[str, Any], timeout_s: int = 300) -> Iterator[Obj]:
        """The events of one watch request (``{"type", "object"}``) until the server ends it.
        An ERROR event (e.g. 410 Gone: the resourceVersion is too old) is yielded as is."""
        query = {**query, "watch": "1", "timeoutSeconds": timeout_s, "allowWatchBookmarks": "true"}
        conn = self._connect(timeout_s + 30)
        try:
            conn.request(
                "GET", path + "?" + urllib.parse.urlencode(query), headers=self._headers(None)
            )
            response = conn.getresponse()
            if response.status >= 300:
                raw = response.read()
                raise ApiError(response.status, response.reason, raw[:300].decode(errors="replace"))
            while True:
                line = response.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def pod_path(namespace: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}" + (f"/{sub}" if sub else "")
