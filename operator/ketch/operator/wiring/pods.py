"""Pod templates read the way their ``ketch`` processes would read them.

``read_pods`` turns each pod template among the rendered objects into a ``Pod`` whose ``ketch``
containers are ``Process``es: their command and args through the real ``ketch`` argument parser,
their ``--config`` file from the rendered ConfigMap mounted at that path (the same parsing and
unknown-key checks as ``ketch``), then the real config dataclasses via each subcommand's
``listening_ports``. A container that ``ketch`` would refuse is reported, not returned.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Any

from ketch.engine.cli import build_parser, config_file_classes, listening_ports
from ketch.engine.cli_args import config_from_args, parse_config_text
from ketch.engine.ports import Listener

Obj = dict[str, Any]
POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


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
    """One rendered pod template and its ``ketch`` processes."""

    where: str
    namespace: str
    labels: dict[str, str]
    spec: Obj
    processes: list[Process] = field(default_factory=list)
    broken: bool = False  # a ketch container of it was reported already and is not checked

    def selected_by(self, selector: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in selector.items())


def read_pods(children: list[Obj], problems: list[str]) -> list[Pod]:
    """Every pod template of ``children``, its ``ketch`` containers parsed; what ``ketch`` would
    refuse to start is appended to ``problems``."""
    config_maps = {(ns(o), o["metadata"]["name"]): o for o in children if o["kind"] == "ConfigMap"}
    pods = []
    for obj in children:
        template = (obj.get("spec") or {}).get("template")
        if obj["kind"] not in POD_KINDS or not template:
            continue
        pod = Pod(
            f"{obj['kind'].lower()} {obj['metadata']['name']}",
            ns(obj),
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
    return pods


def ns(obj: Obj) -> str:
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
