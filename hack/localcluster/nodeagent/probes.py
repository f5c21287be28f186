"""Probes and lifecycle hook handlers, and a worker thread per (container, probe) as in the kubelet.

A handler is ``httpGet`` (to the pod IP, or ``host``, at ``port`` by number or by the name of a
container port; ``path``, ``scheme``, ``httpHeaders``; 200-399 is a success), ``tcpSocket`` (a
connection), ``exec`` (the command in the container's namespaces as its user; exit 0), or, for
hooks only, ``sleep``. ``grpc`` probes always fail here, with a message saying so.

``ProbeWorker`` waits ``initialDelaySeconds`` after the container started, then probes every
``periodSeconds`` with ``timeoutSeconds``; its result changes after ``successThreshold``
successes or ``failureThreshold`` failures in a row. A readiness result starts as failure, a
liveness one as success; a startup probe stops once it succeeded. The pod worker reads
``result`` and is woken on each change. The kubelet's probes are the same; its HTTP probes also
follow redirects to the same host, and its exec probes go through the runtime (CRI ExecSync).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
# argv, timeout -> (exit code or None on timeout, output)
Exec = Callable[[list[str], float], "tuple[int | None, str]"]
USER_AGENT = "kube-probe/1.37"


def resolve_port(port: int | str, container: Obj) -> int:
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for item in container.get("ports", []):
        if item.get("name") == port:
            return int(item["containerPort"])
    raise ValueError(f"couldn't find port {port!r} in container {container['name']}")


def run_handler(
    handler: Obj, container: Obj, pod_ip: str, run: Exec, timeout: float
) -> tuple[bool, str]:
    """Runs one probe or hook handler; (success, message on failure)."""
    try:
        if "httpGet" in handler:
            get = handler["httpGet"]
            port = resolve_port(get["port"], container)
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
            return http_get(
                get.get("host") or pod_ip, port, get.get("path", "/"),
                get.get("scheme", "HTTP"), headers, timeout,
            )  # fmt: skip
        if "tcpSocket" in handler:
            tcp = handler["tcpSocket"]
            port = resolve_port(tcp["port"], container)
            host = tcp.get("host") or pod_ip
            try:
                with socket.create_connection((host, port), timeout=timeout):
                    return True, ""
            except OSError as exc:
                return False, f"dial tcp {host}:{port}: {exc}"
        if "exec" in handler:
            code, out = run(handler["exec"].get("command", []), timeout)
            if code == 0:
                return True, ""
            if code is None:
                return False, out
            return False, f"command {handler['exec'].get('command')} exited {code}: {out.strip()}"
        if "sleep" in handler:
            time.sleep(min(float(handler["sleep"]["seconds"]), timeout))
            return True, ""
        if "grpc" in handler:
            return False, "grpc probes are not supported by the ketch node agent"
    except ValueError as exc:
        return False, str(exc)
    return False, f"unsupported handler {sorted(handler)}"


def http_get(
    host: str, port: int, path: str, scheme: str, headers: dict[str, str], timeout: float
) -> tuple[bool, str]:
    url = f"{scheme.lower()}://{host}:{port}{path}"
    headers = {"User-Agent": USER_AGENT, "Accept": "*/*", **headers}
    if scheme.upper() == "HTTPS":
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the kubelet does not verify probe certificates
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=context
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read(10240)
    except (OSError, http.client.HTTPException) as exc:
        return False, f'Get "{url}": {exc}'
    finally:
        conn.close()
    if 200 <= response.status < 400:
        return True, ""
    text = body.decode(errors="replace").strip()
    return False, f"HTTP probe failed with statuscode: {response.status}" + (
        f" ({text[:200]})" if text else ""
    )


class ProbeWorker(threading.Thread):
    """Probes one container periodically (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        spec: Obj,
        container: Obj,
        pod_ip: str,
        run: Exec,
        started_at: float,
        on_change: Callable[[], None],
        on_failure: Callable[[str, str], None],
    ) -> None:
        super().__init__(name=f"probe-{kind}-{container['name']}", daemon=True)
        self.kind, self.spec, self.container, self.pod_ip = kind, spec, container, pod_ip
        self.run_exec, self.started_at = run, started_at
        self.on_change, self.on_failure = on_change, on_failure
        self.result: bool | None = {"readiness": False, "liveness": True}.get(kind)
        self.message = ""
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        spec = self.spec
        period = max(1, int(spec.get("periodSeconds", 10)))
        timeout = max(1, int(spec.get("timeoutSeconds", 1)))
        needed = {
            True: int(spec.get("successThreshold", 1)),
            False: int(spec.get("failureThreshold", 3)),
        }
        delay = self.started_at + int(spec.get("initialDelaySeconds", 0)) - time.time()
        if self._stop.wait(max(0.0, delay)):
            return
        streak: tuple[bool | None, int] = (None, 0)
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                ok, message = run_handler(spec, self.container, self.pod_ip, self.run_exec, timeout)
            except Exception as exc:  # a probe must never kill its worker
                ok, message = False, f"probe error: {exc}"
            if self._stop.is_set():
                return
            streak = (ok, streak[1] + 1 if streak[0] == ok else 1)
            if not ok:
                self.message = message
                with contextlib.suppress(Exception):
                    self.on_failure(self.kind, message)
            if streak[1] >= needed[ok] and self.result != ok:
                self.result = ok
                self.on_change()
            if self.kind == "startup" and self.result:
                return
            self._stop.wait(max(0.0, period - (time.monotonic() - began)))
