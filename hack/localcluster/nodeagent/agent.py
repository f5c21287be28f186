"""The agent: sweeps what an earlier run left, registers the node, watches its pods, stops cleanly.

Pods come from a list and watch of ``/api/v1/pods?fieldSelector=spec.nodeName=<node>`` (the
only pods the Node authorizer lets a node see), resumed from the last resourceVersion and
listed again after a 410 Gone or any error; a pod no longer listed counts as deleted. Each pod
gets a ``PodWorker`` keyed by uid, dropped once the pod is gone and its worker finished.

Start and stop both sweep: processes recorded by container pid files or left in this cluster's
network namespaces, mounts under ``<dir>/pods``, network namespaces and veths with this
cluster's prefixes, and mount points the agent created. At stop (SIGTERM/SIGINT, or the process
in KETCH_WATCH_PID gone) every pod is stopped as on deletion, but with the grace period capped by
``--shutdown-grace-period`` (like a kubelet's graceful node shutdown), the pods are not deleted,
the containers show as terminated (the pods keep their phase and, for when the agent runs again,
their addresses: it then restarts their containers, restart counts carrying on) and the node
turns NotReady. A second signal, a second or more after the first, kills what still runs.

Events are posted from a thread of their own, so a slow API server never holds up a pod. (A
kubelet uses informers for pods, Services, ConfigMaps and Secrets, and aggregates its Events.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localcluster.layout import Layout
from localcluster.nodeagent import runtime
from localcluster.nodeagent.api import Api, ApiError, now
from localcluster.nodeagent.images import ImageTable
from localcluster.nodeagent.logs import LogServer
from localcluster.nodeagent.network import Network, netns_pids
from localcluster.nodeagent.node import NodeStatus
from localcluster.nodeagent.pod import PodWorker
from localcluster.nodeagent.volumes import MountPoints

logger = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Config:
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    shutdown_grace_s: float = 30.0
    keep_logs: bool = False
    capacity: tuple[tuple[str, str], ...] = ()


class Agent:
    def __init__(
        self, api: Api, layout: Layout, images: ImageTable, taints: list[Obj], config: Config
    ) -> None:
        self.api, self.layout, self.images, self.config = api, layout, images, config
        self.pods_root = layout.directory / "pods"
        self.network = Network(layout)
        self.mountpoints = MountPoints(layout.directory / "nodeagent" / "mountpoints.json")
        self.node = NodeStatus(api, layout, taints, dict(config.capacity))
        self.allocatable = self.node.capacity
        self.kubernetes_ip = layout.service_cidr.network_address + 1
        self.workers: dict[str, PodWorker] = {}
        self.log_server: LogServer | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._events: queue.Queue[Obj | None] = queue.Queue(maxsize=1000)
        self._event_thread = threading.Thread(target=self._post_events, name="events", daemon=True)
        self._watch_thread = threading.Thread(target=self._watch, name="pod-watch", daemon=True)

    # ------------------------------------------------------------------ start and stop
    def start(self) -> None:
        self.pods_root.mkdir(parents=True, exist_ok=True)
        self.pods_root.chmod(0o700)
        self.sweep(at_start=True)
        self.network.ensure_bridge()
        try:
            self.log_server = LogServer(self.pods_root, str(self.layout.gateway), self.layout.pki)
            self.log_server.start()
        except (OSError, ssl.SSLError) as exc:  # pods run without it; kubectl logs does not
            logger.warning("the log endpoint (kubectl logs) did not start: %s", exc)
        for attempt in range(12):  # an API server that is (re)starting: a minute
            try:
                self.node.register()
                break
            except (ApiError, OSError) as exc:
                if attempt == 11 or (isinstance(exc, ApiError) and exc.status < 500):
                    raise
                logger.warning("registering the node failed (%s); again in 5 s", exc)
                time.sleep(5)
        self.node.start()
        self._event_thread.start()
        self._watch_thread.start()
        logger.info("node agent for %s running", self.layout.node_name)

    def stop(self, fast: threading.Event) -> None:
        """Stops every pod (see the module docstring), then sweeps and marks the node NotReady."""
        self._stopping.set()
        with self._lock:
            workers = list(self.workers.values())
        cap = self.config.shutdown_grace_s
        for worker in workers:
            worker.stop_for_shutdown(cap)
        deadline = time.monotonic() + cap + 20
        for worker in workers:
            while not worker.finished.wait(0.2):
                if fast.is_set() or time.monotonic() > deadline:
                    for w in workers:
                        w.kill()
                    worker.finished.wait(15)
                    break
        self.node.stop()
        if self.log_server is not None:
            self.log_server.stop()
        self.sweep(at_start=False)
        self.network.remove_bridge()
        self._events.put(None)
        self._event_thread.join(5)
        logger.info("node agent stopped")

    def sweep(self, at_start: bool) -> None:
        """Kills and removes whatever pods of this cluster left behind (see module docstring)."""
        killed = runtime.kill_recorded(self.pods_root)
        namespaces, veths = self.network.leftovers()
        for ns in namespaces:
            for pid in netns_pids(ns):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        if killed:
            logger.warning("killed %d leftover container processes", killed)
            time.sleep(0.2)
        for mount in _mounts_under(self.pods_root):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        for veth in veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if namespaces or veths:
            logger.warning("removed %d leftover netns and %d veths", len(namespaces), len(veths))
        if (at_start or not self.config.keep_logs) and self.pods_root.exists():
            for child in self.pods_root.iterdir():
                shutil.rmtree(child, ignore_errors=True)
        self.mountpoints.cleanup()

    # ------------------------------------------------------------------ the pod watch
    def _watch(self) -> None:
        selector = {"fieldSelector": f"spec.nodeName={self.layout.node_name}"}
        first = True
        while not self._stopping.is_set():
            try:
                listed = self.api.get("/api/v1/pods", **selector)
                version = listed["metadata"]["resourceVersion"]
                pods = {p["metadata"]["uid"]: p for p in listed["items"]}
                if first:
                    self.network.keep_only(set(pods))
                    first = False
                self._resync(pods)
                for event in self.api.watch(
                    "/api/v1/pods", {**selector, "resourceVersion": version}
                ):
                    if self._stopping.is_set():
                        return
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        logger.info("pod watch: %s; listing again", obj.get("message"))
                        break
                    if kind == "BOOKMARK":
                        continue
                    if kind in ("ADDED", "MODIFIED"):
                        self._upsert(obj)
                    elif kind == "DELETED":
                        self._deleted(obj["metadata"]["uid"])
                    self._forget_finished()
            except (ApiError, OSError, ValueError) as exc:
                if not self._stopping.is_set():
                    logger.warning("pod watch failed: %s; listing again", exc)
                    time.sleep(1.0)
            except Exception:
                logger.exception("pod watch crashed; listing again")
                time.sleep(1.0)

    def _resync(self, pods: dict[str, Obj]) -> None:
        with self._lock:
            gone = [uid for uid in self.workers if uid not in pods]
        for uid in gone:
            self._deleted(uid)
        for pod in pods.values():
            self._upsert(pod)
        self._forget_finished()

    def _upsert(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if worker is None:
                if self._stopping.is_set():
                    return
                worker = self.workers[uid] = PodWorker(self, pod)
                logger.info("pod %s/%s (%s) bound here: starting", *_key(pod), uid)
                worker.start()
                return
        worker.update(pod)

    def _deleted(self, uid: str) -> None:
        with self._lock:
            worker = self.workers.get(uid)
        if worker is not None:
            worker.removed_from_api()

    def _forget_finished(self) -> None:
        with self._lock:
            for uid, worker in list(self.workers.items()):
                if worker.finished.is_set() and worker.removed:
                    del self.workers[uid]

    # ------------------------------------------------------------------ events
    def post_event(self, pod: Obj, kind: str, reason: str, message: str, field_path: str) -> None:
        meta = pod["metadata"]
        involved = {
            "apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"],
            "name": meta["name"], "uid": meta["uid"],
            "resourceVersion": meta.get("resourceVersion", ""),
        }  # fmt: skip
        if field_path:
            involved["fieldPath"] = field_path
        stamp = now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{time.time_ns():x}",
                "namespace": meta["namespace"],
            },
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": self.layout.node_name},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": "kubelet",
            "reportingInstance": self.layout.node_name,
        }
        log = logger.warning if kind == "Warning" else logger.info
        log("pod %s/%s: %s: %s", meta["namespace"], meta["name"], reason, message)
        with contextlib.suppress(queue.Full):
            self._events.put_nowait(event)

    def _post_events(self) -> None:
        while True:
            event = self._events.get()
            if event is None:
                return
            ns = event["metadata"]["namespace"]
            try:
                self.api.post(f"/api/v1/namespaces/{ns}/events", event)
            except (ApiError, OSError) as exc:
                logger.debug("event not posted: %s", exc)


def _key(pod: Obj) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root.resolve()).rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                found.append(point)
    return sorted(found, key=lambda p: -p.count("/"))
