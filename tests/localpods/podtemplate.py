"""A Deployment's pod template made into a ``LocalPod`` on this machine.

``make_pod`` gives the pod its own directory (volumes, logs, ``$KETCH_RUN_DIR``), its own local
port for every declared container port and for the engine's loopback numbers, writes its
ConfigMap and Secret volumes, and turns each container into a process to run: argv and config
files with ports, mount paths and Service names translated, ``env`` resolved, probes and the
``preStop`` sleep as rendered. ``cluster.py`` says what is translated and why.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ketch.engine import rundir
from ketch.engine.lifecycle import ENV_WATCH_PID
from ketch.kernels import cpp_ops
from localpods.pod import Container, LocalPod, _Probe
from localpods.sources import PodSources
from localpods.translate import Resolve, local_path, localize_args, loopback_ports
from procs import free_ports

Obj = dict[str, Any]
Mounts = list[tuple[str, Path]]  # (mount path, local directory), longest mount path first
_KETCH_BIN = Path(sys.executable).parent
# Set on every container: the processes of one cluster (and all they start) can be found, and
# killed, however they were left.
CLUSTER_ENV = "KETCH_LOCALPODS_DIR"


@dataclass(frozen=True)
class Placement:
    """Where and with what a new pod runs: its name and directory, the cluster's."""

    name: str
    pod_dir: Path
    cluster_dir: Path
    time_scale: float
    sources: PodSources
    resolve: Resolve  # a Service's DNS name -> its local address(es)


@dataclass(frozen=True)
class PodPorts:
    """A pod's port numbers: ``names`` (port name -> containerPort) and ``local`` (each
    containerPort or loopback number -> the local port this pod uses instead)."""

    names: dict[str, int]
    local: dict[int, int]

    def of(self, port: int | str) -> int:
        """The local port of a container port given by name or number (others unchanged)."""
        number = self.names[port] if isinstance(port, str) else port
        return self.local.get(number, number)


def make_pod(template: Obj, labels: dict[str, str], where: Placement) -> tuple[LocalPod, PodPorts]:
    """The pod of ``template`` (not started) and its ports."""
    spec = template["spec"]
    where.pod_dir.mkdir(parents=True)
    (where.pod_dir / "run").mkdir(mode=0o700)  # its $KETCH_RUN_DIR, the pod's /tmp/ketch-<uid>
    ports = _ports(spec, where.sources)
    volumes = {v["name"]: PodSources.volume_dir(v, where.pod_dir) for v in spec.get("volumes", [])}
    # Paths under any mount, as the pod's containers see them (config files name them too).
    every_mount = {
        (m["mountPath"], volumes[m["name"]])
        for c in _containers(spec)
        for m in c.get("volumeMounts", [])
    }
    mounts = sorted(every_mount, key=lambda m: -len(m[0]))
    for volume in spec.get("volumes", []):
        path = volumes[volume["name"]]
        where.sources.fill_volume(volume, path, ports.local, mounts, where.resolve)

    def build(c: Obj) -> Container:
        own = sorted(
            ((m["mountPath"], volumes[m["name"]]) for m in c.get("volumeMounts", [])),
            key=lambda m: -len(m[0]),
        )
        return _container(c, where, own, ports)

    pod = LocalPod(
        where.name,
        labels,
        [build(c) for c in spec.get("initContainers", [])],
        [build(c) for c in spec["containers"]],
        probe_port=lambda c, probe: ports.of(probe["httpGet"]["port"]),
        grace_s=spec.get("terminationGracePeriodSeconds", 30),
        time_scale=where.time_scale,
    )
    return pod, ports


def _containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _ports(spec: Obj, sources: PodSources) -> PodPorts:
    containers = _containers(spec)
    names = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
    argvs = [[*c.get("command", []), *c.get("args", [])] for c in containers]
    numbers = sorted(set(names.values()) | loopback_ports(sources.config_files(spec), argvs))
    return PodPorts(names, dict(zip(numbers, free_ports(len(numbers)), strict=True)))


def _container(c: Obj, where: Placement, mounts: Mounts, ports: PodPorts) -> Container:
    def local(value: str) -> str:
        return where.resolve(local_path(value, mounts))

    argv = [local(a) for a in [*c.get("command", []), *c.get("args", [])]]
    argv = localize_args(argv, ports.local)
    if argv and argv[0] == "ketch":  # the image's ketch is this checkout's (after the
        argv[0] = str(_KETCH_BIN / "ketch")  # rewriting: it may live under a mount path)
    env = {"PATH": f"{_KETCH_BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    # This harness plays the kubelet: if it dies, its pods stop by themselves.
    env |= {ENV_WATCH_PID: str(os.getpid()), CLUSTER_ENV: str(where.cluster_dir)}
    env[rundir.ENV] = str(where.pod_dir / "run")
    # The image's prebuilt C++ kernels (docker/engine.Dockerfile sets KETCH_EXTENSION_DIR): this
    # checkout's build directory plays them. Without it every pod, its HOME on a fresh emptyDir,
    # would compile them at start-up.
    env[cpp_ops.ENV_DIR] = str(cpp_ops.build_dir())
    for item in c.get("env", []):
        env[item["name"]] = local(where.sources.env_value(item, where.name))
    # time_scale speeds up what only delays a test (startup/readiness polling); liveness
    # keeps its real period, so a slow start on a busy machine is not killed for it.
    probes = {
        kind: _Probe(c[f"{kind}Probe"], 1.0 if kind == "liveness" else where.time_scale)
        for kind in ("startup", "liveness", "readiness")
        if f"{kind}Probe" in c
    }
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    return Container(
        name=c["name"],
        argv=argv,
        env=env,
        log_path=where.pod_dir / f"{c['name']}.log",
        cwd=where.pod_dir,
        probes=probes,
        pre_stop_s=pre_stop,
    )
