"""A static check that rendered children are wired to what their ``ketch`` processes do.

``check_wiring(children)`` reads every pod template's ``ketch`` containers the way the process
would: their command and args through the real ``ketch`` argument parser, their ``--config``
file from the rendered ConfigMap mounted at that path (the same parsing and unknown-key checks
as ``ketch``), then the real config dataclasses, via each subcommand's ``listening_ports``. It
compares what the process listens on with the containers' declared ports, probes, Services and
the router's settings. No paddle: only ``ketch`` config and argparse-level modules are imported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Any

from ketch.engine.cache_manager.config import CacheManagerConfig
from ketch.engine.cli import build_parser, config_file_classes, listening_ports
from ketch.engine.cli_args import config_from_args, parse_config_text
from ketch.engine.ports import Listener
from ketch.engine.router.config import RouterConfig
from ketch.engine.serving.config import ServerConfig

Obj = dict[str, Any]
POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


class WiringError(ValueError):
    """A container's ``--config`` cannot be found in the rendered objects."""


@dataclass
class Process:
    """One ``ketch`` container of a pod template, parsed and configured as the process would be."""

    where: str
    container: Obj
    args: argparse.Namespace
    values: dict[str, Any]
    source: str
    listeners: dict[int, Listener]
    init: bool = False

    @property
    def command(self) -> str:
        return self.args.command

    def config(self, cls: type) -> Any:
        return config_from_args(cls, self.args, self.values)


@dataclass
class Pod:
    where: str
    namespace: str
    labels: dict[str, str]
    spec: Obj
    processes: list[Process] = field(default_factory=list)
    broken: bool = False  # a ketch container of it was reported already and is not checked


def check_wiring(children: list[Obj]) -> list[str]:
    """Problems with how ``children`` (one InferenceService's, rendered) are wired; [] when fine."""
    problems: list[str] = []
    config_maps = {(_ns(o), o["metadata"]["name"]): o for o in children if o["kind"] == "ConfigMap"}
    services = [o for o in children if o["kind"] == "Service"]
    pods = []
    for obj in children:
        template = (obj.get("spec") or {}).get("template")
        if obj["kind"] not in POD_KINDS or not template:
            continue
        pod = Pod(
            f"{obj['kind'].lower()} {obj['metadata']['name']}",
            _ns(obj),
            (template.get("metadata") or {}).get("labels") or {},
            template.get("spec") or {},
        )
        for init, key in ((True, "initContainers"), (False, "containers")):
            for container in pod.spec.get(key) or []:
                proc = _process(pod, container, init, config_maps, problems)
                if proc is not None:
                    pod.processes.append(proc)
                pod.broken |= proc is None and _is_ketch(container)
        pods.append(pod)
    for pod in pods:
        for proc in pod.processes:
            problems += _check_ports(proc)
        problems += _check_pod(pod)
    for svc in services:
        problems += _check_service(svc, pods)
    for pod in pods:
        for proc in pod.processes:
            if proc.command == "router":
                problems += _check_router(proc, pod, pods, services)
    return problems


def _ns(obj: Obj) -> str:
    return obj["metadata"].get("namespace") or "default"


def _is_ketch(container: Obj) -> bool:
    command = container.get("command") or []
    return bool(command) and posixpath.basename(str(command[0])) == "ketch"


def _process(
    pod: Pod, container: Obj, init: bool, config_maps: dict, problems: list[str]
) -> Process | None:
    if not _is_ketch(container):
        return None
    command = [str(c) for c in container["command"]]
    argv = command[1:] + [str(a) for a in container.get("args") or []]
    where = f"{pod.where}, container {container.get('name')}"
    exits = f"`ketch {shlex.join(argv)}` would exit at startup"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit:
        errors = [line for line in err.getvalue().splitlines() if ": error: " in line]
        problems.append(f"{where}: {exits}: {errors[-1] if errors else 'it asks for --help'}")
        return None
    values: dict[str, Any] = {}
    source = "flags only"
    path = getattr(args, "config", None)
    try:
        if path:
            text, source = _config_text(path, pod, container, config_maps)
            values = parse_config_text(text, path, *config_file_classes(args))
        listeners = listening_ports(args, values)
    except WiringError as exc:
        problems.append(f"{where}: {exc}")
        return None
    except (ValueError, TypeError) as exc:
        problems.append(f"{where}: {exits}: {exc} (settings from {source})")
        return None
    return Process(where, container, args, values, source, listeners, init)


def _config_text(path: str, pod: Pod, container: Obj, config_maps: dict) -> tuple[str, str]:
    """The text at ``path`` in ``container``: a key of a rendered ConfigMap mounted there."""
    path = posixpath.normpath(path)
    mounts = sorted(container.get("volumeMounts") or [], key=lambda m: -len(m["mountPath"]))
    for mount in mounts:
        root = posixpath.normpath(mount["mountPath"])
        if path == root or path.startswith(root.rstrip("/") + "/"):
            break
    else:
        listed = ", ".join(m["mountPath"] for m in mounts) or "none"
        raise WiringError(
            f"--config {path} is inside none of the container's volume mounts ({listed}); the "
            f"process would exit with 'config file {path} does not exist': mount the ConfigMap "
            f"holding it at {posixpath.dirname(path)}"
        )
    rel = "" if path == root else posixpath.relpath(path, root)
    if mount.get("subPath"):
        rel = posixpath.join(mount["subPath"], rel) if rel else mount["subPath"]
    volumes = {v.get("name"): v for v in pod.spec.get("volumes") or []}
    volume = volumes.get(mount["name"])
    if volume is None:
        raise WiringError(
            f"--config {path}: its mount {mount['mountPath']} uses volume {mount['name']!r}, "
            f"which the pod does not define (volumes: {sorted(volumes)})"
        )
    ref = volume.get("configMap")
    if ref is None:
        kind = next((k for k in volume if k != "name"), "unknown")
        raise WiringError(
            f"--config {path} comes from volume {mount['name']!r} ({kind}), not from a "
            "ConfigMap: it cannot be checked"
        )
    key = rel
    if ref.get("items"):
        key = next((i["key"] for i in ref["items"] if i.get("path") == rel), None)
        if key is None:
            paths = [i.get("path") for i in ref["items"]]
            raise WiringError(
                f"--config {path}: volume {mount['name']!r} projects only {paths} of "
                f"ConfigMap {ref.get('name')}, not {rel!r}"
            )
    cm = config_maps.get((pod.namespace, ref.get("name")))
    if cm is None:
        raise WiringError(
            f"--config {path} comes from ConfigMap {ref.get('name')}, which is not among the "
            "rendered objects: it cannot be checked"
        )
    data = cm.get("data") or {}
    if key not in data:
        raise WiringError(
            f"--config {path}: ConfigMap {ref.get('name')} has no key {key!r} (keys: "
            f"{sorted(data)}); the process would exit with 'config file {path} does not exist'"
        )
    return data[key], f"ConfigMap {ref.get('name')} key {key}"


def _listing(listeners: dict[int, Listener]) -> str:
    return ", ".join(
        f"{n} ({flag}{', 127.0.0.1 only' if flag.loopback else ''})"
        for n, flag in sorted(listeners.items())
    )


def _setting(proc: Process, flag: Listener, value: int) -> str:
    """How to make the process use ``value`` for ``flag``: the flag, or the config-file key."""
    key = f"{flag.config_key}: {value} in {proc.source}" if proc.values else None
    return f"{flag.flag} {value}" + (f" (or {key})" if key else "")


def _check_ports(proc: Process) -> list[str]:
    """Declared containerPorts vs what the process binds, and the container's probes."""
    problems = []
    listeners = proc.listeners
    declared = {
        int(p["containerPort"]): p.get("name", "") for p in proc.container.get("ports") or []
    }
    by_name = {name: number for number, name in declared.items() if name}
    explained = set()
    for number, name in sorted(declared.items()):
        if number in listeners:
            continue
        compact = name.replace("-", "")
        guesses = [n for n, f in listeners.items() if compact and compact in f.replace("-", "")]
        if len(guesses) != 1:
            guesses = [n for n in listeners if n not in declared]
        label = f"{name or '(unnamed)'} {number}"
        text = f"{proc.where}: declares port {label}, but `ketch {proc.command}`"
        if len(guesses) == 1 and guesses[0] not in declared:
            flag = listeners[guesses[0]]
            explained.add(guesses[0])
            problems.append(
                f"{text} listens on {guesses[0]} ({flag}), not {number}: set "
                f"{_setting(proc, flag, number)}, or containerPort {guesses[0]}"
            )
        else:
            listing = _listing(listeners) or "nothing"
            problems.append(f"{text} does not listen on {number} (it listens on {listing})")
    for number, flag in sorted(listeners.items()):
        if number in declared or number in explained or flag.loopback:
            continue
        problems.append(
            f"{proc.where}: `ketch {proc.command}` listens on {number} ({flag.describe()}), but "
            f"the container declares no port {number}: add containerPort {number} (Services, "
            f"probes and NetworkPolicies reach only declared ports) or change {flag}"
        )
    for kind in PROBES:
        probe = proc.container.get(kind) or {}
        handler = next((h for h in ("httpGet", "tcpSocket", "grpc") if h in probe), None)
        if handler is None:
            continue
        port = probe[handler].get("port")
        path = str(probe[handler].get("path") or "/").split("?", 1)[0]
        target = f"{path} port {port}" if handler == "httpGet" else f"port {port}"
        text = f"{proc.where}: {kind} ({handler} {target})"
        named = isinstance(port, str) and not port.isdigit()
        number = by_name.get(port) if named else None if port is None else int(port)
        if number is None:
            names = sorted(by_name) or "none"
            problems.append(f"{text} names a port the container does not declare (names: {names})")
        elif number not in declared:
            problems.append(f"{text}: {number} is not a declared port of the container")
        elif number not in listeners:
            problems.append(f"{text}: nothing listens on {number}, the probe would fail")
        elif listeners[number].loopback:
            problems.append(
                f"{text}: {number} ({listeners[number]}) is bound on 127.0.0.1 only; the kubelet "
                "probes the pod IP"
            )
        elif handler == "httpGet" and path not in listeners[number].http_paths:
            flag = listeners[number]
            http = {n: f.http_paths for n, f in listeners.items() if f.http}
            serves = f"serves only {list(flag.http_paths)}" if flag.http else "is not HTTP"
            problems.append(f"{text}: {number} ({flag}) {serves}; HTTP paths by port: {http}")
    return problems


def _check_pod(pod: Pod) -> list[str]:
    """Containers of one pod share its network: no port twice; engine and sidecar agree."""
    problems = []
    running = [p for p in pod.processes if not p.init]
    seen: dict[int, tuple[Process, Listener]] = {}
    for proc in running:
        for number, flag in proc.listeners.items():
            if number in seen:
                other, other_flag = seen[number]
                problems.append(
                    f"{pod.where}: {other.where.split(', ')[-1]} ({other_flag}) and "
                    f"{proc.where.split(', ')[-1]} ({flag}) both listen on {number}; containers "
                    f"share the pod's network, so one would exit with '{flag} {number} ... is "
                    "not free'"
                )
            seen[number] = (proc, flag)
    engines = [p for p in running if p.command == "serve"]
    sidecars = [p for p in running if p.command == "cache-manager"]
    for engine in engines:
        server = engine.config(ServerConfig)
        for sidecar in sidecars:
            cm = sidecar.config(CacheManagerConfig)
            keys = ["cache_queue_port"] + (["kv_transfer_port"] if server.role != "mixed" else [])
            for key in keys:
                if getattr(server, key) != getattr(cm, key):
                    flag = Listener("--" + key.replace("_", "-"), cm.host)
                    fix = _setting(sidecar, flag, getattr(server, key))
                    problems.append(
                        f"{pod.where}: {engine.where.split(', ')[-1]} uses {key} "
                        f"{getattr(server, key)} (its args over {engine.source}), but "
                        f"{sidecar.where.split(', ')[-1]} listens on {getattr(cm, key)} ({flag}): "
                        f"give both the same value, e.g. {fix} for the sidecar"
                    )
    return problems


def _matches(selector: dict[str, str], pod: Pod) -> bool:
    return all(pod.labels.get(k) == v for k, v in selector.items())


def _check_service(svc: Obj, pods: list[Pod]) -> list[str]:
    """The selector picks pods; every targetPort is declared there and not loopback-only."""
    selector = (svc.get("spec") or {}).get("selector")
    if not selector:
        return []
    name = f"service {svc['metadata']['name']}"
    matching = [p for p in pods if p.namespace == _ns(svc) and _matches(selector, p)]
    if not matching:
        return [f"{name}: selector {selector} matches no rendered pod template: no endpoints"]
    problems = []
    for port in svc["spec"].get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        text = f"{name}, port {port.get('name') or port.get('port')}: targetPort {target!r}"
        named = isinstance(target, str) and not target.isdigit()
        for pod in matching:
            declared = [
                (c, p) for c in pod.spec.get("containers") or [] for p in c.get("ports") or []
            ]
            hits = [
                (c, int(p["containerPort"]))
                for c, p in declared
                if (p.get("name") == target if named else int(p["containerPort"]) == int(target))
            ]
            if not hits:
                listed = ", ".join(
                    f"{c.get('name')}/{p.get('name', '')} {p['containerPort']}" for c, p in declared
                )
                problems.append(
                    f"{text} is declared by no container of {pod.where} (declared: "
                    f"{listed or 'none'}): traffic to it reaches no listener"
                )
            for proc in pod.processes:
                for container, number in hits:
                    flag = proc.listeners.get(number) if container is proc.container else None
                    if flag is not None and flag.loopback:
                        problems.append(
                            f"{text} is {number} of {proc.where} ({flag}), bound on "
                            f"{flag.host} only: other pods cannot reach it"
                        )
    return problems


def _service_for(dns: str, namespace: str, services: list[Obj]) -> Obj | None:
    parts = dns.rstrip(".").split(".")
    if len(parts) > 2 and parts[2] != "svc":
        return None
    ns = parts[1] if len(parts) > 1 else namespace
    return next((s for s in services if s["metadata"]["name"] == parts[0] and _ns(s) == ns), None)


def _check_router(proc: Process, pod: Pod, pods: list[Pod], services: list[Obj]) -> list[str]:
    """The router's instance DNS names, engine_port and pd_comm_port vs the engines."""
    problems = []
    config = proc.config(RouterConfig)
    headless = [
        f"{s['metadata']['name']}.{_ns(s)}.svc"
        for s in services
        if (s.get("spec") or {}).get("clusterIP") == "None"
    ]
    for entry in config.entries():
        if entry.dns_name is None:
            continue
        text = f"{proc.where}: {entry.role} instances {entry.dns_name!r} ({proc.source})"
        svc = _service_for(entry.dns_name, pod.namespace, services)
        if svc is None or (svc.get("spec") or {}).get("clusterIP") != "None":
            what = (
                "names no rendered Service"
                if svc is None
                else "names a Service that is not headless"
            )
            problems.append(f"{text} {what}: the router would find no pods; headless: {headless}")
            continue
        selector = svc["spec"].get("selector") or {}
        engines = [
            (p, e)
            for p in pods
            if p.namespace == _ns(svc) and selector and _matches(selector, p)
            for e in p.processes
            if e.command == "serve"
        ]
        if not engines and not any(p.broken for p in pods):
            problems.append(f"{text}: Service {svc['metadata']['name']} selects no `ketch serve`")
        for _, engine in engines:
            server = engine.config(ServerConfig)
            if server.role != entry.role:
                problems.append(f"{text} selects {engine.where}, whose role is {server.role}")
            wanted = [("engine_port", server.port, "--port")]
            if server.role != "mixed":
                wanted.append(("pd_comm_port", server.pd_comm_port, "--pd-comm-port"))
            for key, value, flag in wanted:
                if getattr(config, key) != value:
                    problems.append(
                        f"{proc.where}: router {key} is {getattr(config, key)} "
                        f"({proc.source}), but {engine.where} listens on {value} ({flag}): set "
                        f"{key}: {value} (or --{key.replace('_', '-')} {value})"
                    )
    return problems
