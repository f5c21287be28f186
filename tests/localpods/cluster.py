"""A rendered InferenceService's pods and Services, run on this machine.

``LocalCluster(isvc)`` renders the object with the operator's own code (``render_object``, what
``ketch-operator render`` prints), then for every Deployment starts ``replicas`` pods (see
``pod.py``) and for every ClusterIP Service a local proxy (see ``proxy.py``).

What a pod gets, translated from its manifest (``podtemplate.py``):
- pod IP 127.0.0.1; every declared ``containerPort`` remapped to a free loopback port, the same
  way everywhere in the pod: ``*port`` keys of its mounted YAML/JSON config files, ``--*-port``
  flags, probes, and the Services that select it;
- ConfigMap and Secret volumes written under the pod's directory; ``emptyDir`` volumes are
  directories there too, except ``/dev/shm``, which is the machine's (shared by the pod's
  containers, as the memory-backed volume is in the pod); paths under a mount are rewritten;
- ``env`` values, ``configMapKeyRef``/``secretKeyRef``, and downward-API fields
  (``status.podIP`` = 127.0.0.1, ``metadata.name``, ``metadata.namespace``), see
  ``sources.py``;
- the engine's loopback numbers (``translate.LOOPBACK_PORTS``: they name its Unix sockets and
  ``/dev/shm`` segments) remapped too, and a private run directory (``$KETCH_RUN_DIR``, 0700)
  per pod: two pods of one Deployment never share a socket or a segment name, as two pods on
  a node would not; when a pod is gone, any ``/dev/shm/ketch-*-<its number>`` segment left goes
  with it, as its memory-backed volume would (``leftover_segments`` names them);
- Service names, as cluster DNS would resolve them: a ClusterIP Service's name is its proxy on
  127.0.0.1; a headless Service's name is the list of its pods' addresses
  (``127.0.0.1:<port>,...``), taken when the naming pod starts.

A Service proxy sends connections to a pod while it is ready and for ``endpoint_lag_s`` after it
stopped being ready or was deleted: on a cluster the endpoint controllers and kube-proxy see a
deletion that late, while the kubelet starts the pod's ``preStop`` (or sends SIGTERM) at once.
A pod that exits as soon as it gets SIGTERM is still sent requests, which fail; the rendered
``preStop`` sleep, then the engine's drain, are what keep them.

``apply(new)`` re-renders and rolls out every Deployment as its rendered ``strategy`` says, with
the Deployment controller's decisions (``rollout.py``): RollingUpdate starts new pods up to
``maxSurge`` and deletes old ones only while ``replicas - maxUnavailable`` pods stay available
(ready, by their real readiness probe, for ``minReadySeconds``); Recreate deletes every old pod,
waits until all are gone, then starts the new ones. Pods carry a ``pod-template-hash`` label
that tells the template they were made from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ketch.operator.cli import render_object
from localpods.pod import LocalPod
from localpods.podtemplate import CLUSTER_ENV, Placement, PodPorts, make_pod
from localpods.proxy import ServiceProxies
from localpods.rollout import PodView, Strategy, complete, next_step
from localpods.sources import PodSources
from procs import processes_with_env, wait_for

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
Patch = Callable[[list[Obj]], None]
"""Edits rendered objects in place before they run (tests: what the operator would not render)."""
TEMPLATE_HASH = "pod-template-hash"  # the label a ReplicaSet gives its pods
_SYNC_S = 0.05  # how often a rollout looks again
_SHM = Path("/dev/shm")


class LocalCluster:
    """Pods of one rendered InferenceService as processes; Services as proxies."""

    def __init__(
        self,
        isvc: Obj,
        namespace: str = "default",
        secrets: dict[str, dict[str, str]] | None = None,
        time_scale: float = 1.0,
        workdir: Path | None = None,
        endpoint_lag_s: float = 2.0,
    ) -> None:
        """``secrets``: Secret name -> data (what ``kubectl create secret`` would hold).
        ``time_scale`` shortens startup/readiness probe periods, preStop sleeps, restart
        back-off, ``minReadySeconds`` and ``endpoint_lag_s`` (how long a Service keeps sending
        to a pod that was deleted or stopped being ready; it stays in proportion to the
        preStop sleep meant to cover it; a later change of the attribute holds for the
        deletions after it); liveness probes keep their periods."""
        self.namespace = namespace
        self.secrets = secrets or {}
        self.time_scale = time_scale
        self.endpoint_lag_s = endpoint_lag_s * time_scale
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="localpods-"))
        self.children = render_object(isvc, namespace=namespace)
        self._sources = PodSources(self.children, self.secrets, namespace)
        self.pods: dict[str, list[LocalPod]] = {}  # Deployment name -> pods
        self._every_pod: list[LocalPod] = []  # retired ones too, for stop()
        self.proxy_ports: dict[tuple[str, int | str], int] = {}  # (Service, port) -> local port
        self._ports: dict[str, PodPorts] = {}  # pod name -> its ports
        self._leaves: dict[str, float] = {}  # deleted pod -> when its Services stop sending
        self.leftover_segments: list[str] = []  # /dev/shm names removed with their pod
        self._counter = 0
        self._lock = threading.Lock()
        self._proxies = ServiceProxies()

    # ---- life cycle ----

    def start(self) -> LocalCluster:
        for service in self._objects("Service"):
            if service["spec"].get("clusterIP") != "None":
                for port in service["spec"]["ports"]:
                    self._add_proxy(service, port)
        deployments = sorted(self._objects("Deployment"), key=lambda d: _is_router(d))
        for deployment in deployments:  # engines first: the router names their Services
            name = deployment["metadata"]["name"]
            replicas = deployment["spec"].get("replicas", 1)
            self.pods[name] = [self._new_pod(deployment) for _ in range(replicas)]
        for pods in self.pods.values():
            for pod in pods:
                pod.start()
        return self

    def wait_ready(self, timeout: float = 180.0) -> LocalCluster:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p.ready for pods in self.pods.values() for p in pods):
                return self
            time.sleep(0.1)
        raise AssertionError(f"pods not ready after {timeout:.0f} s:\n{self.describe()}")

    def stop(self) -> None:
        """Terminates every pod (SIGTERM, grace period), kills any process of the cluster still
        there (whatever started it), then removes the working directory."""
        pods = list(self._every_pod)
        for pod in pods:
            pod.terminate(wait=False)
        for pod in pods:
            if not pod.terminated.wait(pod.grace_s + 10):
                pod.kill()
        for pod in pods:
            pod.join(10)  # its supervisor starts nothing more
        self._proxies.close()
        self._kill_leftovers()
        for pod in pods:
            self._remove_segments(pod)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        for pid in processes_with_env(CLUSTER_ENV, str(self.dir)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not processes_with_env(CLUSTER_ENV, str(self.dir)), 10, "pods gone")

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # ---- what tests and people look at ----

    def service_url(self, service: str, port: int | str = "http") -> str:
        """``http://127.0.0.1:<proxy>`` of a ClusterIP Service's port (by name or number)."""
        return f"http://127.0.0.1:{self.proxy_ports[(service, port)]}"

    def pod_port(self, pod: LocalPod, port: int | str) -> int:
        """The local port of one of a pod's container ports (by name or number)."""
        ports = self._ports[pod.name]
        return ports.local[ports.names[port] if isinstance(port, str) else port]

    def endpoints(self, service: str, port: int | str = "http") -> list[str]:
        """Names of the pods a ClusterIP Service's proxy sends new connections to, now."""
        svc = next(s for s in self._objects("Service") if s["metadata"]["name"] == service)
        spec = next(p for p in svc["spec"]["ports"] if port in (p["port"], p.get("name")))
        addresses = set(self._endpoints(svc, spec, False))
        with self._lock:
            pods = list(self._every_pod)
        return [p.name for p in pods if self._address(p, spec) in addresses]

    def delete_pod(self, pod: LocalPod) -> None:
        """``kubectl delete pod``: terminates it; the next ``apply`` replaces it."""
        deployment = next(name for name, pods in self.pods.items() if pod in pods)
        self._retire(deployment, pod)

    def describe(self) -> str:
        lines = []
        for deployment, pods in self.pods.items():
            for pod in pods:
                state = ", ".join(
                    f"{c.name}: {'running' if c.running else 'down'} ready={c.ready} "
                    f"restarts={c.restarts}"
                    for c in pod.containers
                )
                deleted = " (deleted)" if pod.terminating else ""
                lines.append(f"{deployment}/{pod.name}{deleted} ready={pod.ready}: {state}")
                for c in pod.containers:
                    if not c.ready:
                        lines.append(f"  --- {c.name} log:\n{c.log()}")
        return "\n".join(lines)

    # ---- updates ----

    def apply(self, isvc: Obj, patch: Patch | None = None, timeout: float = 180.0) -> None:
        """Re-renders (``patch`` then edits the rendered objects) and rolls out every Deployment
        whose pods differ from it, each as its strategy says, all at once as the controller
        would; returns when every rollout is complete (old pods may still be terminating)."""
        children = render_object(isvc, namespace=self.namespace)
        if patch is not None:
            patch(children)
        self.children = children
        self._sources = PodSources(children, self.secrets, self.namespace)
        deadline = time.monotonic() + timeout
        pending = self._objects("Deployment")
        while pending:
            pending = [d for d in pending if not self._sync(d)]
            if pending and time.monotonic() > deadline:
                names = [d["metadata"]["name"] for d in pending]
                raise AssertionError(f"rollout of {names} not complete:\n{self.describe()}")
            time.sleep(_SYNC_S)

    def _sync(self, deployment: Obj) -> bool:
        """One sync of the Deployment controller for ``deployment``; True once it is complete."""
        name = deployment["metadata"]["name"]
        desired = deployment["spec"].get("replicas", 1)
        strategy = Strategy.of(deployment)
        template = _template_hash(deployment)
        now = time.monotonic()
        with self._lock:
            pods = list(self.pods.get(name, []))
        by_name = {p.name: p for p in pods}
        views: dict[bool, list[PodView]] = {True: [], False: []}  # is it of the template?
        for pod in pods:
            if not pod.terminating:
                view = PodView(pod.name, pod.ready, pod.available(strategy.min_ready_s, now))
                views[pod.labels.get(TEMPLATE_HASH) == template].append(view)
        new, old = views[True], views[False]
        if complete(desired, new, old):
            return True
        old_running = any(
            p.labels.get(TEMPLATE_HASH) != template and not p.terminated.is_set() for p in pods
        )
        step = next_step(strategy, desired, new, old, old_running)
        for _ in range(step.create):
            pod = self._new_pod(deployment)
            with self._lock:
                self.pods.setdefault(name, []).append(pod)
            pod.start()
        for pod_name in step.delete:
            self._retire(name, by_name[pod_name])
        return False

    def _retire(self, deployment: str, pod: LocalPod) -> None:
        now = time.monotonic()
        # The Service sees the deletion endpoint_lag_s from now (as the lag is now).
        leaves = now + self.endpoint_lag_s if pod.routed(self.endpoint_lag_s, now) else now
        with self._lock:
            self._leaves[pod.name] = leaves
        pod.terminate(wait=False)

        def forget() -> None:
            pod.terminated.wait()
            with self._lock:
                self.pods[deployment].remove(pod)
            self._remove_segments(pod)

        threading.Thread(target=forget, daemon=True).start()

    # ---- building pods ----

    def _objects(self, kind: str) -> list[Obj]:
        return _of_kind(self.children, kind)

    def _new_pod(self, deployment: Obj) -> LocalPod:
        with self._lock:
            self._counter += 1
            name = f"{deployment['metadata']['name']}-{self._counter}"
        where = Placement(
            name, self.dir / name, self.dir, self.time_scale, self._sources, self._resolve_name
        )
        template = deployment["spec"]["template"]
        labels = {
            **template["metadata"].get("labels", {}),
            TEMPLATE_HASH: _template_hash(deployment),
        }
        pod, ports = make_pod(template, labels, where)
        with self._lock:
            self._ports[name] = ports
            self._every_pod.append(pod)
        return pod

    # ---- names and ports ----

    def _resolve_name(self, value: str) -> str:
        """A Service's DNS name as cluster DNS would answer it, mapped to local addresses."""
        host, _, port = value.partition(":")
        for service in self._objects("Service"):
            meta = service["metadata"]
            base = meta["name"]
            forms = {base, f"{base}.{meta['namespace']}", f"{base}.{meta['namespace']}.svc"}
            forms.add(f"{base}.{meta['namespace']}.svc.cluster.local")
            if host not in forms:
                continue
            if service["spec"].get("clusterIP") == "None":  # the pods' ports: the named one
                ports = service["spec"]["ports"]
                chosen = next((p for p in ports if str(p["port"]) == port), ports[0])
                return ",".join(self._endpoints(service, chosen, True))
            if port.isdigit():
                return f"127.0.0.1:{self.proxy_ports[(base, int(port))]}"
            return "127.0.0.1"
        return value

    def _add_proxy(self, service: Obj, port: Obj) -> None:
        local = self._proxies.add(
            lambda: [int(a.rsplit(":", 1)[1]) for a in self._endpoints(service, port, False)]
        )
        name = service["metadata"]["name"]
        self.proxy_ports[(name, port["port"])] = local
        if "name" in port:
            self.proxy_ports[(name, port["name"])] = local

    def _endpoints(self, service: Obj, port: Obj, any_state: bool) -> list[str]:
        """The addresses of the pods ``service`` selects: every pod there is (``any_state``,
        as a headless name lists them), or those its proxy still sends to (``routed``)."""
        selector = service["spec"].get("selector", {})
        out = []
        now = time.monotonic()
        with self._lock:
            if any_state:
                pods = [p for pods in self.pods.values() for p in pods]
            else:  # a deleted pod too, while the Service has not caught up
                pods = [p for p in self._every_pod if self._routed(p, now)]
        for pod in pods:
            if any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            address = self._address(pod, port)
            if address is not None:
                out.append(address)
        return out

    def _routed(self, pod: LocalPod, now: float) -> bool:
        """Whether a Service's proxy still sends ``pod`` new connections (lock held)."""
        if pod.name in self._leaves:  # deleted
            return now < self._leaves[pod.name]
        return pod.routed(self.endpoint_lag_s, now)

    def _address(self, pod: LocalPod, port: Obj) -> str | None:
        """``127.0.0.1:<local port>`` of a Service port's target on ``pod`` (None: not there)."""
        target = port.get("targetPort", port["port"])
        ports = self._ports[pod.name]
        number = ports.names.get(target) if isinstance(target, str) else target
        if number in ports.local:
            return f"127.0.0.1:{ports.local[number]}"
        return None

    def _remove_segments(self, pod: LocalPod) -> None:
        """Removes what the pod left in ``/dev/shm`` (``ketch-*-<one of its numbers>``), as
        the kubelet drops a pod's memory-backed volume; ``leftover_segments`` names them."""
        for number in self._ports[pod.name].local.values():
            for path in _SHM.glob(f"ketch-*-{number}"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    logger.warning("pod %s left %s behind; removed", pod.name, path)
                    with self._lock:
                        self.leftover_segments.append(path.name)


def _template_hash(deployment: Obj) -> str:
    text = json.dumps(deployment["spec"]["template"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind]


def _is_router(deployment: Obj) -> bool:
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    return labels.get("app.kubernetes.io/component") == "router"
