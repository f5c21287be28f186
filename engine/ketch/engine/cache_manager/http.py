"""The cache manager's HTTP endpoint: ``GET /health`` (JSON) and ``GET /metrics`` (Prometheus).

Runs in a daemon thread (``ThreadingHTTPServer``); ``health`` is a callable of the main loop
returning ``(healthy, body)`` so this module knows nothing of the loop's internals.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ketch.engine.cache_manager.metrics import CacheManagerMetrics

logger = logging.getLogger("ketch.cache_manager.http")

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


class HttpEndpoint:
    """/health and /metrics on ``host:port``; ``start()`` binds, ``close()`` stops the thread."""

    def __init__(self, host: str, port: int, health: HealthFn, metrics: CacheManagerMetrics):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("%s " + format, self.address_string(), *args)

        self._health = health
        self._metrics = metrics
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="cache-manager-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever: only when it runs
            self._server.shutdown()
        self._server.server_close()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/health":
            healthy, body = self._health()
            payload = json.dumps(body).encode()
            self._reply(request, 200 if healthy else 503, payload, "application/json")
        elif path == "/metrics":
            payload, content_type = self._metrics.render()
            self._reply(request, 200, payload, content_type)
        else:
            message = json.dumps({"error": f"no such path {path}; try /health or /metrics"})
            self._reply(request, 404, message.encode(), "application/json")

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
        request.send_response(code)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
