"""Engine pods as local processes: ``ketch serve`` in a role with its ``ketch cache-manager``
sidecar (the way the operator renders a pod), plus helpers to read their state.

Every process listens on free loopback ports; ``Pod.stop`` stops both, ``Pod.kill`` kills the
engine's processes at once (a crash), leaving the sidecar running as Kubernetes would.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import httpx
from cm_harness import CacheManagerProcess
from serve_harness import Server, metric, scrape, wait_for

BLOCK_SIZE = 16  # serve_harness's --block-size


class Pod:
    """One engine instance: ``ketch serve --role ROLE`` and its cache manager."""

    def __init__(
        self,
        role: str,
        *serve_args: str,
        swap_space: str = "0.05",
        peer_key_file: str = "",
        cm_args: tuple[str, ...] = (),
    ) -> None:
        """``peer_key_file``: both processes get it as --peer-key-file (as the operator does);
        ``cm_args``: more flags of the cache manager (overriding the defaults here)."""
        self.role = role
        key_args = ("--peer-key-file", peer_key_file) if peer_key_file else ()
        self.cm = CacheManagerProcess(
            "--swap-space", swap_space, "--transfer-timeout", "5", "--role", role, *key_args,
            *cm_args,
        )  # fmt: skip
        self.server = Server(
            *key_args,
            "--role",
            role,
            "--cache-queue-port",
            str(self.cm.queue_port),
            "--kv-transfer-port",
            str(self.cm.kv_port),
            "--cache-manager-port",
            str(self.cm.http_port),
            *serve_args,
        )
        self.url = self.server.url
        self._pd_address: str | None = None

    def wait_ready(self) -> Pod:
        self.cm.wait_ready()
        self.server.wait_ready()
        wait_for(self.ready, 60, f"{self.role} instance ready (cache manager attached)", 0.2)
        if self.role != "mixed":
            assert self.pd_address
        return self

    def ready(self) -> dict | None:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{self.url}/ready", timeout=5)
            if response.status_code == 200:
                return response.json()
        return None

    @property
    def pd_address(self) -> str:
        """The pd-comm "host:port" (read from /ready once, so it is known after a kill)."""
        if self._pd_address is None:
            info = self.ready()
            assert info is not None, f"{self.role} instance not ready"
            self._pd_address = f"127.0.0.1:{info['pd_comm_port']}"
        return self._pd_address

    def engine_metric(self, name: str) -> float:
        return metric(scrape(self.url), name)

    def cm_metric(self, name: str, **labels: str) -> float:
        return self.cm.metrics()[("ketch:" + name, tuple(sorted(labels.items())))]

    def kill(self) -> None:
        """SIGKILL the server, its engine and worker at once: a crash of the engine container."""
        pids = [self.server.proc.pid, *self.server.descendants()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.server.proc.wait(10)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop()
        self.cm.stop()


@contextlib.contextmanager
def running_pods(*specs: tuple[str, ...], peer_key_file: str = "") -> Iterator[list[Pod]]:
    """Pods started together (each takes seconds to load), stopped at the end."""
    pods: list[Pod] = []
    try:
        for role, *args in specs:
            pods.append(Pod(role, *args, peer_key_file=peer_key_file))
        for pod in pods:
            pod.wait_ready()
        yield pods
    finally:
        for pod in pods:
            pod.stop()


def all_blocks_free(pod: Pod) -> bool:
    samples = scrape(pod.url)
    return metric(samples, "free_kv_block_num") == metric(samples, "max_kv_block_num")
