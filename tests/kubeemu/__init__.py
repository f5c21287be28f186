"""Test-side helpers for the Kubernetes API-server emulator (tests/kubeemu/server.py).

    emu = start_emulator()          # a subprocess; emu.url, emu.kubeconfig
    emu.set_fault("ns", "deploy", "crashloop")
    emu.set_pod_behaviour(image="repo/model:v2", ready_delay=3)   # or pod=, deployment=
    emu.applied(manager="ketch")    # every server-side apply request, as received
    emu.hold(verb="apply", resource="deployments")  # matching requests wait: emu.release()
    emu.expire_watches()            # compact the watch history: open watches get a 410
    kubectl(emu, "get", "pods", "-n", "ns")
    emu.stop()

`RealCluster` offers the same surface for a real cluster (KETCH_TEST_KUBECONFIG); emulator-only
features raise pytest.skip there. The HTTP client `Emulator` extends, `ApiResponse` and
`write_kubeconfig` are in `kubeemu.client`. This module stays import-light (no aiohttp).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kubeemu.client import ADMIN_TOKEN, ApiResponse, _Client, write_kubeconfig

SERVER_SCRIPT = Path(__file__).resolve().parent / "server.py"

__all__ = [
    "ADMIN_TOKEN",
    "ApiResponse",
    "Emulator",
    "RealCluster",
    "kubectl",
    "start_emulator",
    "write_kubeconfig",
]


class Emulator(_Client):
    """A running emulator subprocess."""

    is_emulator = True

    def __init__(
        self,
        proc: subprocess.Popen[str],
        url: str,
        workdir: Path,
        log_path: Path,
        secure_url: str | None = None,
    ):
        self.proc = proc
        self.url = url  # plain HTTP: the tests' helpers (no credentials = the admin)
        self.secure_url = secure_url or url  # TLS: what kubeconfigs name (kubectl sends tokens)
        self.workdir = workdir
        self.log_path = log_path
        self.kubeconfig = str(write_kubeconfig(workdir / "kubeconfig", self.secure_url))
        self.cache_dir = str(workdir / "kubectl-cache")

    def set_fault(self, namespace: str, deployment: str, mode: str, ready_delay: float = 0) -> None:
        """Make the pods of a Deployment behave so (see set_pod_behaviour)."""
        self.set_pod_behaviour(namespace, deployment=deployment, mode=mode, ready_delay=ready_delay)

    def set_pod_behaviour(
        self,
        namespace: str = "",
        *,
        pod: str | None = None,
        deployment: str | None = None,
        image: str | None = None,
        mode: str = "ready",
        ready_delay: float = 0,
        init_container: str = "",
    ) -> None:
        """How the containers of one pod, a Deployment's pods or every pod of an image behave
        from now on (the most specific wins): mode ready (after `ready_delay` seconds),
        never-ready, crashloop, imagepull, unschedulable, pending, init-error or init-crashloop
        (`init_container` fails; default the first)."""
        body: dict[str, Any] = {
            "namespace": namespace,
            "mode": mode,
            "readyDelaySeconds": ready_delay,
            "initContainer": init_container,
        }
        for scope, name in (("pod", pod), ("deployment", deployment), ("image", image)):
            if name:
                body[scope] = name
        self.post("/_emulator/faults", body).ok()

    def applied(self, manager: str | None = None, **filters: str) -> list[dict[str, Any]]:
        """Server-side apply requests received (oldest first), optionally for one manager."""
        params = {k: v for k, v in {"manager": manager, **filters}.items() if v is not None}
        return self.get("/_emulator/applied", params=params).ok()["items"]

    def stats(self) -> dict[str, Any]:
        return self.get("/_emulator/stats").ok()

    def reset_stats(self) -> None:
        self.post("/_emulator/reset", {}).ok()

    def expire_watches(self, *resources: str) -> int:
        """Compact the watch history (of ``plural[.group]`` types; none: all) as etcd would:
        open watches get a 410 Expired ERROR event and end. Returns how many ended."""
        body = {"resources": list(resources)} if resources else {}
        return int(self.post("/_emulator/expire-watches", body).ok()["ended"])

    def hold(self, **match: str) -> None:
        """Make matching requests (verb, resource plural, namespace, name) wait until
        ``release()`` or until their client goes away (holds.py)."""
        self.post("/_emulator/holds", match).ok()

    def holds(self) -> list[dict[str, Any]]:
        """Each hold with ``caught`` (requests it stopped) and ``waiting`` (stopped now)."""
        return self.get("/_emulator/holds").ok()["holds"]

    def release(self) -> None:
        self.delete("/_emulator/holds").ok()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_emulator(
    port: int = 0,
    *,
    timeout: float = 30,
    log_level: str = "WARNING",
    watch_history: int | None = None,
    pod_ip_prefix: str | None = None,
) -> Emulator:
    """Start tests/kubeemu/server.py in a subprocess and wait until it answers.

    watch_history: watch events kept per resource type (default 10000); a watch from an older
    resourceVersion gets a 410 Gone ERROR event. pod_ip_prefix: first two octets of pod IPs
    (default 10.244; "127.3" makes them loopback addresses a test can serve fake metrics on).
    """
    extra = ["--watch-history", str(watch_history)] if watch_history else []
    if pod_ip_prefix:
        extra += ["--pod-ip-prefix", pod_ip_prefix]
    workdir = Path(tempfile.mkdtemp(prefix="kubeemu-"))
    log_path = workdir / "server.log"
    log_file = open(log_path, "w")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "--port", str(port), "--log-level", log_level, *extra],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        cwd=str(workdir),
    )
    log_file.close()
    found: list[str] = []

    def read_first_line() -> None:
        assert proc.stdout is not None
        found.append(proc.stdout.readline())

    reader = threading.Thread(target=read_first_line, daemon=True)
    reader.start()
    reader.join(timeout)
    line = found[0].strip() if found else ""
    if not line.startswith("KUBEEMU_LISTENING "):
        proc.kill()
        raise RuntimeError(f"emulator did not start: {line!r}\n{log_path.read_text()}")
    urls = line.split()[1:]
    emu = Emulator(proc, urls[0], workdir, log_path, urls[1] if len(urls) > 1 else None)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if emu.get("/version", timeout=2).status == 200:
                return emu
        except OSError:
            pass
        if time.monotonic() > deadline:
            emu.stop()
            raise RuntimeError("emulator did not answer /version")
        time.sleep(0.05)


class RealCluster:
    """A real cluster from a kubeconfig: same surface as Emulator, minus the emulator extras."""

    is_emulator = False

    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig
        self.cache_dir: str | None = None
        self.url = self._server_url()

    def _server_url(self) -> str:
        out = subprocess.run(
            [
                "kubectl",
                "--kubeconfig",
                self.kubeconfig,
                "config",
                "view",
                "--minify",
                "-o",
                "jsonpath={.clusters[0].cluster.server}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        return out.stdout.strip()

    @staticmethod
    def _skip(what: str) -> None:
        import pytest

        pytest.skip(f"{what} needs the emulator (KETCH_TEST_KUBECONFIG points at a real cluster)")

    def set_fault(self, *args: Any, **kwargs: Any) -> None:
        self._skip("fault injection")

    def set_pod_behaviour(self, *args: Any, **kwargs: Any) -> None:
        self._skip("pod behaviours")

    def applied(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        self._skip("the apply log")
        return []

    def stats(self) -> dict[str, Any]:
        self._skip("API statistics")
        return {}

    def expire_watches(self, *resources: str) -> int:
        self._skip("watch expiry")
        return 0

    def hold(self, **match: str) -> None:
        self._skip("held requests")

    def stop(self) -> None:
        pass


def kubectl(
    kube: Emulator | RealCluster,
    *args: str,
    input: str | None = None,
    check: bool = False,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run the real kubectl against `kube` (text mode; stdout/stderr captured)."""
    cmd = ["kubectl", "--kubeconfig", kube.kubeconfig]
    if getattr(kube, "cache_dir", None):
        cmd += ["--cache-dir", str(kube.cache_dir)]
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    return subprocess.run(
        [*cmd, *args],
        input=input,
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        env=env,
    )
