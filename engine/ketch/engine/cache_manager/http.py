"""The cache manager's HTTP endpoint: ``GET /health`` (JSON) and ``GET /metrics`` (Prometheus).

Runs in a daemon thread (``ThreadingHTTPServer``); ``health`` is a callable of the main loop
returning ``(healthy, body)`` so this module knows nothing of the loop's internals.

Bounded, because the port is open to whoever may scrape it: at most ``MAX_CONNECTIONS``
connections are served at once (one thread each), at most ``MAX_PER_CLIENT`` from one address (so
one client cannot crowd out the kubelet's probes), and a connection that sends nothing for
``TIMEOUT_S`` seconds is closed. A connection over a cap is closed at once, before any thread
starts; one request per connection (HTTP/1.0).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ketch.engine.cache_manager.metrics import CacheManagerMetrics

logger = logging.getLogger("ketch.cache_manager.http")

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]

MAX_CONNECTIONS = 32
MAX_PER_CLIENT = 8
TIMEOUT_S = 5.0


class _BoundedServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` that refuses connections over its caps before starting a thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, total: int, per_client: int):
        self.max_total, self.max_per_client = total, per_client
        self.open: Counter[str] = Counter()
        self.refused = 0
        self._count_lock = threading.Lock()
        super().__init__(address, handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        client = client_address[0]
        with self._count_lock:
            if self.open.total() >= self.max_total or self.open[client] >= self.max_per_client:
                self.refused += 1
                return False  # socketserver closes it
            self.open[client] += 1
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self.open[client_address[0]] -= 1
                if self.open[client_address[0]] <= 0:
                    del self.open[client_address[0]]


class HttpEndpoint:
    """/health and /metrics on ``host:port``; ``start()`` binds, ``close()`` stops the thread."""

    def __init__(
        self,
        host: str,
        port: int,
        health: HealthFn,
        metrics: CacheManagerMetrics,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = MAX_PER_CLIENT,
        timeout: float = TIMEOUT_S,
    ):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("%s " + format, self.address_string(), *args)

        Handler.timeout = timeout  # every read and write of the connection's socket

        self._health = health
        self._metrics = metrics
        self._server = _BoundedServer((host, port), Handler, max_connections, max_per_client)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="cache-manager-http", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

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
