"""The kubelet's log endpoint, so ``kubectl logs`` works: the API server proxies
``pods/log`` to ``https://<node InternalIP>:10250/containerLogs/<ns>/<pod>/<container>``.

TLS with a serving certificate for the node's address (``pki/kubelet.crt``), and a client
certificate required: only the API server's kubelet client (``kube-apiserver-kubelet-client``,
signed by the cluster CA) is answered; a kubelet would ask the API server (SubjectAccessReview)
who else may, and nobody else needs to here. Query parameters as the kubelet takes them:
``previous``, ``tailLines``, ``limitBytes``, ``follow`` (until the container's process
ends), ``timestamps`` (ignored: the files hold what the process wrote).

A container's output is ``pods/<ns>_<pod>_<uid>/<container>/<restart count>.log``.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

logger = logging.getLogger(__name__)

PORT = 10250
CLIENT_NAME = "kube-apiserver-kubelet-client"
_PATH = re.compile(r"^/containerLogs/([a-z0-9.-]{1,253})/([a-z0-9.-]{1,253})/([a-z0-9-]{1,63})$")
_CHUNK = 64 * 1024
FOLLOW_POLL_S = 0.2


class LogServer:
    """Serves the container logs under ``pods_root`` on ``address``:``PORT``."""

    def __init__(self, pods_root: Path, address: str, pki: Path) -> None:
        self.pods_root = pods_root
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(pki / "kubelet.crt"), str(pki / "kubelet.key"))
        context.load_verify_locations(str(pki / "ca.crt"))
        context.verify_mode = ssl.CERT_REQUIRED
        server = self

        class Handler(_Handler):
            logs = server

        self.httpd = ThreadingHTTPServer((address, PORT), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self, namespace: str, pod: str, container: str) -> list[Path]:
        """The container's log files, oldest restart first (empty: no such container here)."""
        found = []
        for pod_dir in self.pods_root.glob(f"{namespace}_{pod}_*"):
            if pod_dir.name.count("_") == 2:
                found += (pod_dir / container).glob("*.log")
        numbered = [p for p in found if p.stem.isdigit()]
        return sorted(numbered, key=lambda p: int(p.stem))


class _Handler(BaseHTTPRequestHandler):
    logs: LogServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug("logs: " + fmt, *args)

    def do_GET(self) -> None:
        peer = self.connection.getpeercert() or {}
        names = [v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]
        if names != [CLIENT_NAME]:
            self._error(403, f"forbidden: only {CLIENT_NAME} may read logs")
            return
        url = urllib.parse.urlsplit(self.path)
        match = _PATH.match(url.path)
        if not match:
            self._error(404, "not found")
            return
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        try:
            tail = _non_negative(query.get("tailLines"))
            limit = _non_negative(query.get("limitBytes"))
        except ValueError as exc:
            self._error(400, str(exc))
            return
        files = self.logs.files(*match.groups())
        _, pod, container = match.groups()
        if query.get("previous") in ("true", "1"):
            if len(files) < 2:  # the kubelet's words
                self._error(
                    400, f'previous terminated container "{container}" in pod "{pod}" not found'
                )
                return
            files = files[:-1]
        if not files:
            self._error(404, f'container "{container}" in pod "{pod}" has no logs here')
            return
        self._send(files[-1], tail, limit, query.get("follow") in ("true", "1"))

    def _send(self, path: Path, tail: int | None, limit: int | None, follow: bool) -> None:
        data = path.read_bytes()
        if tail is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail:]) if tail else b""
        if limit is not None:
            data = data[:limit]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if not follow:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        offset = path.stat().st_size
        try:
            self._chunk(data)
            while path.exists() and not _newer(path) and _running(path.parent):
                with path.open("rb") as f:
                    f.seek(offset)
                    more = f.read(_CHUNK)
                if more:
                    offset += len(more)
                    self._chunk(more)
                else:
                    time.sleep(FOLLOW_POLL_S)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def _error(self, code: int, message: str) -> None:
        body = (message + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _non_negative(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or len(value) > 12:
        raise ValueError(f"expected a non-negative integer, got {value[:20]!r}")
    return int(value)


def _running(container_dir: Path) -> bool:
    """Whether the container's process (``<container>/pid``) is still there."""
    try:
        os.kill(int((container_dir / "pid").read_text().split()[0]), 0)
    except (OSError, ValueError):
        return False
    return True


def _newer(path: Path) -> bool:
    """Whether the container was restarted since ``path`` was its log."""
    return (path.parent / f"{int(path.stem) + 1}.log").exists()
