"""A rendered InferenceService's pods and Services, run on this machine.

``LocalCluster(isvc)`` renders the object with the operator's own code (``render_object``, what
``ketch-operator render`` prints), then for every Deployment starts ``replicas`` pods (see
``pod.py``) and for every ClusterIP Service a local proxy (see ``proxy.py``).

What a pod gets, translated from its manifest:
- pod IP 127.0.0.1; every declared ``containerPort`` remapped to a free loopback port, the same
  way everywhere in the pod: ``*port`` keys of its mounted YAML/JSON config files, ``--*-port``
  flags, probes, and the Services that select it;
- ConfigMap and Secret volumes written under the pod's directory; ``emptyDir`` volumes are
  directories there too, except ``/dev/shm``, which is the machine's (shared by the pod's
  containers, as the memory-backed volume is in the pod); paths under a mount are rewritten;
- ``env`` values, ``configMapKeyRef``/``secretKeyRef``, and downward-API fields
  (``status.podIP`` = 127.0.0.1, ``metadata.name``, ``metadata.namespace``);
- Service names, as cluster DNS would resolve them: a ClusterIP Service's name is its proxy on
  127.0.0.1; a headless Service's name is the list of its pods' addresses
  (``127.0.0.1:<port>,...``), taken when the naming pod starts.
``apply(new)`` re-renders and rolls every Deployment whose pod template changed, one pod at a
time: a new pod must be ready before an old one is terminated (maxSurge 1, maxUnavailable 0).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ketch.engine.lifecycle import ENV_WATCH_PID
from ketch.operator.cli import render_object
from localpods.pod import Container, LocalPod, _Probe
from localpods.proxy import ServiceProxies
from localpods.translate import local_path, localize_args, localize_file
from procs import free_ports, processes_with_env, wait_for

Obj = dict[str, Any]
_KETCH_BIN = Path(sys.executable).parent
# Set on every container: the processes of one cluster (and all they start) can be found, and
# killed, however they were left.
CLUSTER_ENV = "KETCH_LOCALPODS_DIR"


class LocalCluster:
    """Pods of one rendered InferenceService as processes; Services as proxies."""

    def __init__(
        self,
        isvc: Obj,
        namespace: str = "default",
        secrets: dict[str, dict[str, str]] | None = None,
        time_scale: float = 1.0,
        workdir: Path | None = None,
    ) -> None:
        """``secrets``: Secret name -> data (what ``kubectl create secret`` would hold).
        ``time_scale`` shortens startup/readiness probe periods, preStop sleeps and restart
        back-off (tests); liveness probes keep their periods."""
        self.namespace = namespace
        self.secrets = secrets or {}
        self.time_scale = time_scale
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="localpods-"))
        self.children = render_object(isvc, namespace=namespace)
        self.pods: dict[str, list[LocalPod]] = {}  # Deployment name -> pods
        self._every_pod: list[LocalPod] = []  # retired ones too, for stop()
        self.proxy_ports: dict[tuple[str, int | str], int] = {}  # (Service, port) -> local port
        self._ports: dict[str, dict[int, int]] = {}  # pod name -> containerPort -> local port
        self._names: dict[str, dict[str, int]] = {}  # pod name -> port name -> containerPort
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
        number = self._names[pod.name][port] if isinstance(port, str) else port
        return self._ports[pod.name][number]

    def describe(self) -> str:
        lines = []
        for deployment, pods in self.pods.items():
            for pod in pods:
                state = ", ".join(
                    f"{c.name}: {'running' if c.running else 'down'} ready={c.ready} "
                    f"restarts={c.restarts}"
                    for c in pod.containers
                )
                lines.append(f"{deployment}/{pod.name} ready={pod.ready}: {state}")
                for c in pod.containers:
                    if not c.ready:
                        lines.append(f"  --- {c.name} log:\n{c.log()}")
        return "\n".join(lines)

    # ---- updates ----

    def apply(self, isvc: Obj, timeout: float = 180.0) -> None:
        """Re-renders and rolls each Deployment whose pod template changed, one pod at a time."""
        old_children, self.children = self.children, render_object(isvc, namespace=self.namespace)
        old = {d["metadata"]["name"]: d for d in _of_kind(old_children, "Deployment")}
        for deployment in self._objects("Deployment"):
            name = deployment["metadata"]["name"]
            previous = old.get(name)
            if previous and previous["spec"]["template"] == deployment["spec"]["template"]:
                continue
            self._roll(deployment, timeout)

    def _roll(self, deployment: Obj, timeout: float) -> None:
        name = deployment["metadata"]["name"]
        outgoing = list(self.pods.get(name, []))
        for i in range(deployment["spec"].get("replicas", 1)):
            pod = self._new_pod(deployment)
            with self._lock:
                self.pods.setdefault(name, []).append(pod)
            pod.start()
            deadline = time.monotonic() + timeout
            while not pod.ready:
                if time.monotonic() > deadline:
                    raise AssertionError(f"new pod {pod.name} not ready:\n{self.describe()}")
                time.sleep(0.05)
            if i < len(outgoing):  # maxUnavailable 0: an old pod goes once a new one is ready
                self._retire(name, outgoing[i])
        for pod in outgoing[deployment["spec"].get("replicas", 1) :]:
            self._retire(name, pod)

    def _retire(self, deployment: str, pod: LocalPod) -> None:
        pod.terminate(wait=False)

        def forget() -> None:
            pod.terminated.wait()
            with self._lock:
                self.pods[deployment].remove(pod)

        threading.Thread(target=forget, daemon=True).start()

    # ---- building pods ----

    def _objects(self, kind: str) -> list[Obj]:
        return _of_kind(self.children, kind)

    def _new_pod(self, deployment: Obj) -> LocalPod:
        template = deployment["spec"]["template"]
        spec = template["spec"]
        with self._lock:
            self._counter += 1
            name = f"{deployment['metadata']['name']}-{self._counter}"
        pod_dir = self.dir / name
        pod_dir.mkdir(parents=True)
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        names = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
        ports = dict(zip(names.values(), free_ports(len(names)), strict=True))
        self._names[name], self._ports[name] = names, ports
        volumes = {v["name"]: self._volume_dir(v, pod_dir) for v in spec.get("volumes", [])}
        # Paths under any mount, as the pod's containers see them (config files name them too).
        mounts = sorted(
            {
                (m["mountPath"], volumes[m["name"]])
                for c in containers
                for m in c.get("volumeMounts", [])
            },
            key=lambda m: -len(m[0]),
        )
        for volume in spec.get("volumes", []):
            self._fill_volume(volume, volumes[volume["name"]], ports, mounts)

        def build(c: Obj) -> Container:
            return self._container(c, name, pod_dir, volumes, ports)

        pod = LocalPod(
            name,
            template["metadata"].get("labels", {}),
            [build(c) for c in spec.get("initContainers", [])],
            [build(c) for c in spec["containers"]],
            probe_port=lambda c, probe: self._probe_port(name, probe),
            grace_s=spec.get("terminationGracePeriodSeconds", 30),
            time_scale=self.time_scale,
        )
        with self._lock:
            self._every_pod.append(pod)
        return pod

    def _volume_dir(self, volume: Obj, pod_dir: Path) -> Path:
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            return Path("/dev/shm")  # shared by the pod's containers, as in the pod
        if not {"configMap", "secret", "emptyDir"} & set(volume):
            raise ValueError(f"volume {volume['name']!r} ({sorted(volume)}) can't run locally")
        path = pod_dir / "volumes" / volume["name"]
        path.mkdir(parents=True)
        return path

    def _fill_volume(
        self, volume: Obj, path: Path, ports: dict[int, int], mounts: list[tuple[str, Path]]
    ) -> None:
        if "configMap" in volume:
            data = self._config_map(volume["configMap"]["name"])
            for key, text in data.items():
                (path / key).write_text(localize_file(key, text, ports, mounts, self._resolve_name))
        elif "secret" in volume:
            secret = volume["secret"]["secretName"]
            if secret not in self.secrets:
                raise ValueError(f"the pods mount Secret {secret!r}: pass it in secrets=")
            data = self.secrets[secret]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (path / item["path"]).write_text(data[item["key"]])

    def _config_map(self, name: str) -> dict[str, str]:
        for config_map in self._objects("ConfigMap"):
            if config_map["metadata"]["name"] == name:
                return config_map.get("data", {})
        raise ValueError(f"ConfigMap {name!r} is not among the rendered objects")

    def _container(
        self, c: Obj, pod: str, pod_dir: Path, volumes: dict[str, Path], ports: dict[int, int]
    ) -> Container:
        mounts = sorted(
            ((m["mountPath"], volumes[m["name"]]) for m in c.get("volumeMounts", [])),
            key=lambda m: -len(m[0]),
        )

        def local(value: str) -> str:
            return self._resolve_name(local_path(value, mounts))

        argv = localize_args([local(a) for a in [*c.get("command", []), *c.get("args", [])]], ports)
        if argv and argv[0] == "ketch":  # the image's ketch is this checkout's (after the
            argv[0] = str(_KETCH_BIN / "ketch")  # rewriting: it may live under a mount path)
        env = {"PATH": f"{_KETCH_BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        # This harness plays the kubelet: if it dies, its pods stop by themselves.
        env |= {ENV_WATCH_PID: str(os.getpid()), CLUSTER_ENV: str(self.dir)}
        for item in c.get("env", []):
            env[item["name"]] = local(self._env_value(item, pod))
        # time_scale speeds up what only delays a test (startup/readiness polling); liveness
        # keeps its real period, so a slow start on a busy machine is not killed for it.
        probes = {
            kind: _Probe(c[f"{kind}Probe"], 1.0 if kind == "liveness" else self.time_scale)
            for kind in ("startup", "liveness", "readiness")
            if f"{kind}Probe" in c
        }
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        return Container(
            name=c["name"],
            argv=argv,
            env=env,
            log_path=pod_dir / f"{c['name']}.log",
            cwd=pod_dir,
            probes=probes,
            pre_stop_s=pre_stop,
        )

    def _env_value(self, item: Obj, pod: str) -> str:
        if "value" in item:
            return str(item["value"])
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            values = {
                "status.podIP": "127.0.0.1",
                "status.hostIP": "127.0.0.1",
                "metadata.name": pod,
                "metadata.namespace": self.namespace,
                "spec.nodeName": "localhost",
            }
            if field not in values:
                raise ValueError(f"env {item['name']}: fieldRef {field} is not supported locally")
            return values[field]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self._config_map(ref["name"])[ref["key"]]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = self.secrets.get(ref["name"], {}).get(ref["key"])
            if value is None:
                raise ValueError(
                    f"env {item['name']} reads key {ref['key']!r} of Secret {ref['name']!r}: "
                    "pass it in secrets= (run.py: --secret NAME=KEY=VALUE)"
                )
            return value
        raise ValueError(f"env {item['name']}: {sorted(source)} is not supported locally")

    def _probe_port(self, pod: str, probe: Obj) -> int:
        port = probe["httpGet"]["port"]
        number = self._names[pod][port] if isinstance(port, str) else port
        return self._ports[pod].get(number, number)

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
        selector = service["spec"].get("selector", {})
        target = port.get("targetPort", port["port"])
        out = []
        with self._lock:
            pods = [p for pods in self.pods.values() for p in pods]
        for pod in pods:
            if any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            if not any_state and not pod.ready:
                continue
            number = self._names[pod.name].get(target) if isinstance(target, str) else target
            if number in self._ports[pod.name]:
                out.append(f"127.0.0.1:{self._ports[pod.name][number]}")
        return out


def _of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind]


def _is_router(deployment: Obj) -> bool:
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    return labels.get("app.kubernetes.io/component") == "router"
