"""Review M10: the cache manager's HTTP endpoint (/health, /metrics) is bounded.

Before, ``ThreadingHTTPServer`` started a thread for every connection and waited for its request
forever: 10 000 idle connections meant 10 000 threads (the pod's pids or memory limit), and the
sidecar's own liveness probe, served by the same server, failed. Now connections over a cap (in
all, and per client address) are closed at once, an idle one is closed after a timeout, and a
probe from another address is still answered.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from ketch.engine.cache_manager.http import HttpEndpoint
from ketch.engine.cache_manager.metrics import CacheManagerMetrics
from procs import free_ports

pytestmark = pytest.mark.timeout(60)

IDLE = 40


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_are_capped_and_time_out() -> None:
    (port,) = free_ports(1)
    endpoint = HttpEndpoint(
        "127.0.0.1", port, lambda: (True, {"status": "ok"}), CacheManagerMetrics()
    )
    endpoint.start()
    threads_before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):  # one client opens connections and sends nothing
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        closed_at_once = sum(_closed_by_server(s, 0.05) for s in idle)
        assert closed_at_once >= IDLE - 8, f"only {closed_at_once} of {IDLE} were refused"
        assert threading.active_count() - threads_before <= 8  # one thread per served connection
        # Another address (the kubelet's probe) is still served meanwhile.
        with socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) as c:
            c.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            c.settimeout(5)
            assert c.recv(64).startswith(b"HTTP/1.0 200")
        # The connections it kept are closed once they have sent nothing for the timeout.
        open_ones = [s for s in idle if not _closed_by_server(s, 0.01)]
        assert all(_closed_by_server(s, 8.0) for s in open_ones)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()
        endpoint.close()
