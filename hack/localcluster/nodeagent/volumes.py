"""A pod's files: its directory, volumes, resolv.conf and hosts, and each container's mounts.

``PodFiles`` keeps ``<dir>/pods/<ns>_<name>_<uid>/``:

- ``.volumes/<name>``: emptyDir (mode 0777 as the kubelet makes it; ``medium: Memory`` a tmpfs
  mounted there, ``sizeLimit`` its size), configMap, secret, downwardAPI and projected volumes
  (files written once from the API objects, ``items``/``defaultMode``/``optional`` honoured;
  service account tokens from the TokenRequest API, renewed at 80% of their lifetime);
  hostPath volumes are the host's path, and so is a persistentVolumeClaim bound to a hostPath
  or local PersistentVolume;
- ``.etc/``: the pod's ``resolv.conf`` (cluster DNS, the pod's search domains, ndots:5),
  ``hosts`` (localhost and the pod's own name) and ``hostname``;
- ``.shm/``: /dev/shm of containers that mount nothing there; ``<container>/tmp``: a
  container's own /tmp; ``<container>/<restart>.log``: its output (container names are DNS
  labels, so they never clash with the dotted directories).

With ``fsGroup`` the volume files get that group (group-writable for emptyDir, setgid
directories), as the kubelet's ownership management does.

``container_mounts`` gives the bind mounts of a container in mount order. A mount target missing
on the host is created there (``MountPoints`` records what it created and removes it, when empty,
at agent stop) unless it lies inside an earlier mount of the container (then it is created in
that volume) or inside a masked directory. A masked directory is the top-most directory of an
image's ``expose`` path that other users cannot traverse (``/root`` for a venv made from a pyenv
Python): the container gets an empty tmpfs there, with only the exposed paths inside, so a
non-root container can run the image's Python and sees nothing else of the host's ``/root``.
A kubelet's runtime instead has an image filesystem per container (overlayfs), where every
mount point is created.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from localcluster.nodeagent.envs import (
    ConfigError,
    expand,
    field_value,
    parse_quantity,
    resource_value,
)
from localcluster.nodeagent.images import Image

Obj = dict[str, Any]
Lookup = Callable[[str, str], "dict[str, str | bytes] | None"]
# (audience, expirationSeconds) -> (token, lifetime in seconds)
TokenSource = Callable[[str | None, int], "tuple[str, float]"]


@dataclass(frozen=True)
class Sources:
    """Where volumes come from: ConfigMap/Secret data, service account tokens, the host path of
    a bound PersistentVolumeClaim (ConfigError if none), the node's allocatable resources."""

    lookup: Lookup
    token: TokenSource
    claim: Callable[[str], Path]
    allocatable: dict[str, str]


READ_ONLY_KINDS = ("configMap", "secret", "downwardAPI", "projected")
DEFAULT_MODE = 0o644


class VolumeError(Exception):
    """A volume cannot be set up (reported as FailedMount; the pod stays ContainerCreating)."""


@dataclass(frozen=True)
class Mount:
    """A bind mount (``source`` on the host) or, with ``source`` None, a tmpfs."""

    target: str
    source: str | None
    read_only: bool = False
    create: str = ""  # "" (exists), "host", "inside" (in a mask or an earlier mount)

    def as_json(self) -> Obj:
        return {"target": self.target, "source": self.source, "readOnly": self.read_only}


def pod_dir_name(pod: Obj) -> str:
    m = pod["metadata"]
    return f"{m['namespace']}_{m['name']}_{m['uid']}"


class PodFiles:
    """The files of one pod (see the module docstring)."""

    def __init__(self, root: Path, pod: Obj) -> None:
        self.dir = root / pod_dir_name(pod)
        self.volumes: dict[str, Path] = {}
        self.kinds: dict[str, str] = {}
        self.tmpfs: list[Path] = []
        self._tokens: list[tuple[Path, str | None, int, float, float]] = []

    # --- set-up
    def prepare(self, pod: Obj, sources: Sources) -> None:
        """Writes every volume and the etc files (VolumeError on a missing source)."""
        spec = pod["spec"]
        (self.dir / ".volumes").mkdir(parents=True, exist_ok=True)
        (self.dir / ".etc").mkdir(exist_ok=True)
        shm = self.dir / ".shm"
        shm.mkdir(exist_ok=True)
        shm.chmod(0o1777)
        group = (spec.get("securityContext") or {}).get("fsGroup")
        for volume in spec.get("volumes", []):
            name = volume["name"]
            if name in self.volumes:
                continue
            kind = next((k for k in volume if k != "name"), "")
            path = self.dir / ".volumes" / name
            try:
                self.volumes[name] = self._volume(pod, volume, kind, path, sources)
            except ConfigError as exc:
                raise VolumeError(f'MountVolume.SetUp failed for volume "{name}": {exc}') from exc
            self.kinds[name] = kind
            if (volume.get(kind) or {}).get("readOnly"):
                self.kinds[name] = "readOnly"
            if group is not None and kind in ("emptyDir", *READ_ONLY_KINDS):
                set_ownership(self.volumes[name], int(group), kind not in READ_ONLY_KINDS)

    def _volume(self, pod: Obj, volume: Obj, kind: str, path: Path, sources: Sources) -> Path:
        src = volume.get(kind) or {}
        if kind == "hostPath":
            return host_path(src)
        if kind == "persistentVolumeClaim":
            return sources.claim(src["claimName"])
        if kind not in ("emptyDir", *READ_ONLY_KINDS):
            raise VolumeError(f'volume "{volume["name"]}": {kind} volumes are not supported here')
        path.mkdir(exist_ok=True)
        if kind == "emptyDir":
            path.chmod(0o777)
            if src.get("medium") == "Memory" and not os.path.ismount(path):
                options = "mode=1777"
                if src.get("sizeLimit"):
                    options += f",size={int(parse_quantity(src['sizeLimit']))}"
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip
                self.tmpfs.append(path)
            return path
        files: dict[str, tuple[bytes, int]] = {}
        mode = src.get("defaultMode", DEFAULT_MODE)
        parts = src.get("sources", []) if kind == "projected" else [{kind: src}]
        for source in parts:
            files |= self._source(pod, source, mode, sources, path)
        for rel, (data, file_mode) in files.items():
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file(target, data, file_mode)
        return path

    def _source(
        self, pod: Obj, source: Obj, mode: int, sources: Sources, path: Path
    ) -> dict[str, tuple[bytes, int]]:
        if "configMap" in source or "secret" in source:
            kind = "configMap" if "configMap" in source else "secret"
            src = source[kind]
            name = src.get("name") or src.get("secretName", "")
            data = sources.lookup(kind.lower(), name)
            label = "configmap" if kind == "configMap" else "secret"
            if data is None:
                if src.get("optional"):
                    return {}
                raise ConfigError(f'{label} "{name}" not found')
            mode = src.get("defaultMode", mode)
            items = src.get("items") or [{"key": k, "path": k} for k in data]
            out = {}
            for item in items:
                if item["key"] not in data:
                    if src.get("optional"):
                        continue
                    raise ConfigError(f"{label} references non-existent config key: {item['key']}")
                value = data[item["key"]]
                raw = value if isinstance(value, bytes) else value.encode()
                out[item["path"]] = (raw, item.get("mode", mode))
            return out
        if "downwardAPI" in source:
            out = {}
            for item in source["downwardAPI"].get("items", []):
                if "fieldRef" in item:
                    value = field_value(pod, item["fieldRef"]["fieldPath"])
                else:
                    ref = item["resourceFieldRef"]
                    containers = pod["spec"]["containers"]
                    c = next((c for c in containers if c["name"] == ref.get("containerName")), {})
                    value = resource_value(c, ref, sources.allocatable)
                out[item["path"]] = (value.encode(), item.get("mode", mode))
            return out
        if "serviceAccountToken" in source:
            src = source["serviceAccountToken"]
            expiry = int(src.get("expirationSeconds", 3600))
            value, lifetime = sources.token(src.get("audience"), expiry)
            file = path / src["path"]
            self._tokens.append((file, src.get("audience"), expiry, time.monotonic(), lifetime))
            return {src["path"]: (value.encode(), mode)}
        if "clusterTrustBundle" in source or "podCertificate" in source:
            raise ConfigError(f"projected source {sorted(source)} is not supported here")
        return {}

    def refresh_tokens(self, token: TokenSource) -> None:
        """Renews each service account token past 80% of its lifetime (as the kubelet does)."""
        now = time.monotonic()
        for i, (file, audience, expiry, fetched, lifetime) in enumerate(self._tokens):
            if now - fetched >= 0.8 * lifetime:
                value, lifetime = token(audience, expiry)
                write_file(file, value.encode(), stat.S_IMODE(file.stat().st_mode))
                self._tokens[i] = (file, audience, expiry, now, lifetime)

    def write_etc(self, pod: Obj, pod_ip: str, dns_ip: str, domain: str) -> None:
        spec, meta = pod["spec"], pod["metadata"]
        hostname = spec.get("hostname") or meta["name"]
        etc = self.dir / ".etc"
        write_file(etc / "hostname", f"{hostname}\n".encode(), DEFAULT_MODE)
        fqdn = ""
        if spec.get("subdomain"):
            fqdn = f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc.{domain}"
        lines = [
            "# Kubernetes-managed hosts file.",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            "fe00::0\tip6-localnet",
            "fe00::0\tip6-mcastprefix",
            "fe00::1\tip6-allnodes",
            "fe00::2\tip6-allrouters",
            f"{pod_ip}\t{fqdn}\t{hostname}" if fqdn else f"{pod_ip}\t{hostname}",
        ]
        for alias in spec.get("hostAliases", []):
            lines.append(f"{alias['ip']}\t" + "\t".join(alias.get("hostnames", [])))
        write_file(etc / "hosts", ("\n".join(lines) + "\n").encode(), DEFAULT_MODE)
        resolv = resolv_conf(pod, dns_ip, domain)
        if resolv is not None:
            write_file(etc / "resolv.conf", resolv.encode(), DEFAULT_MODE)

    # --- per container
    def container_dir(self, name: str) -> Path:
        path = self.dir / name
        (path / "tmp").mkdir(parents=True, exist_ok=True)
        (path / "tmp").chmod(0o1777)
        return path

    def container_mounts(
        self, pod: Obj, container: Obj, image: Image, env: dict[str, str]
    ) -> tuple[list[Mount], list[str]]:
        """The container's mounts in mount order, and the directories to mask (see the module
        docstring). VolumeError for a mount of an unknown volume or a bad subPath."""
        spec = pod["spec"]
        read_only_root = (container.get("securityContext") or {}).get("readOnlyRootFilesystem")
        wanted: list[Mount] = []
        for m in container.get("volumeMounts", []):
            if m["name"] not in self.volumes:
                raise VolumeError(f'volume "{m["name"]}" of mount {m["mountPath"]} is not defined')
            source = self.volumes[m["name"]]
            sub = m.get("subPath") or expand(m.get("subPathExpr", ""), env)
            if sub:
                rel = PurePosixPath(sub)
                if rel.is_absolute() or ".." in rel.parts:
                    raise VolumeError(f"subPath {sub!r} must be a relative path without '..'")
                source = source / rel
                if not source.exists():  # the kubelet creates a missing subPath directory
                    source.mkdir(parents=True, mode=0o777)
            ro = bool(m.get("readOnly")) or self.kinds.get(m["name"]) in (
                *READ_ONLY_KINDS,
                "readOnly",
            )
            wanted.append(Mount(str(PurePosixPath(m["mountPath"])), str(source), ro))
        targets = {m.target for m in wanted}
        implicit = [
            ("/dev/shm", self.dir / ".shm", False),
            ("/tmp", self.container_dir(container["name"]) / "tmp", bool(read_only_root)),
        ]
        if not spec.get("hostNetwork"):
            implicit.append(("/etc/hosts", self.dir / ".etc" / "hosts", False))
            implicit.append(("/etc/hostname", self.dir / ".etc" / "hostname", False))
        if (self.dir / ".etc" / "resolv.conf").exists():
            implicit.append(("/etc/resolv.conf", self.dir / ".etc" / "resolv.conf", False))
        base = [Mount(t, str(s), ro) for t, s, ro in implicit if t not in targets]
        present = [p for p in image.expose if os.path.isdir(p)]
        exposed = [p for p in present if not any(_under(p, q) for q in present if q != p)]
        masks = sorted({m for p in exposed if (m := mask_of(p))})
        mounts = [Mount(p, p, True) for p in exposed] + base + wanted
        mounts.sort(key=lambda m: len(PurePosixPath(m.target).parts))
        placed: list[Mount] = []
        for m in mounts:
            create = ""
            if any(_under(m.target, mask) for mask in masks) or any(
                _under(m.target, p.target) and p.target != m.target for p in placed
            ):
                create = "inside"
            elif not os.path.lexists(m.target):
                create = "host"
            placed.append(Mount(m.target, m.source, m.read_only, create))
        return placed, masks

    # --- teardown
    def remove(self, keep_logs: bool) -> None:
        """Unmounts the pod's tmpfs volumes and removes its directory (logs kept if asked)."""
        for path in self.tmpfs:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
        self.tmpfs.clear()
        if not self.dir.exists():
            return
        if not keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        for child in self.dir.iterdir():
            if child.name.startswith("."):
                _remove(child)
            elif child.is_dir():
                for item in child.iterdir():
                    if not item.name.endswith(".log"):
                        _remove(item)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def mask_of(path: str) -> str | None:
    """The top-most directory on the way to ``path`` that others cannot traverse, if any."""
    current = PurePosixPath("/")
    for part in PurePosixPath(path).parts[1:]:
        current = current / part
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return str(current)
    return None


def host_path(src: Obj) -> Path:
    path, kind = Path(src["path"]), src.get("type", "")
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True, mode=0o755)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o644)
    checks = {
        "Directory": path.is_dir, "File": path.is_file, "Socket": path.is_socket,
        "CharDevice": path.is_char_device, "BlockDevice": path.is_block_device,
    }  # fmt: skip
    if kind in checks and not checks[kind]():
        raise VolumeError(f"hostPath type check failed: {path} is not a {kind}")
    return path


def write_file(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
    tmp.chmod(mode)
    tmp.replace(path)


def set_ownership(root: Path, gid: int, writable: bool) -> None:
    """fsGroup: the volume's files belong to ``gid``; group rw (writable volumes, with setgid
    directories) or r (configMap, secret and the like)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    continue
                os.chown(path, -1, gid)
                if stat.S_ISDIR(st.st_mode):
                    extra = 0o2070 if writable else 0o050
                else:
                    extra = 0o060 if writable else 0o040
                os.chmod(path, stat.S_IMODE(st.st_mode) | extra)


def resolv_conf(pod: Obj, dns_ip: str, domain: str) -> str | None:
    """The pod's resolv.conf by dnsPolicy (None: the host's, for Default and hostNetwork)."""
    spec = pod["spec"]
    policy = spec.get("dnsPolicy", "ClusterFirst")
    if policy == "ClusterFirst" and spec.get("hostNetwork"):
        policy = "Default"
    config = spec.get("dnsConfig") or {}
    ns = pod["metadata"]["namespace"]
    if policy in ("ClusterFirst", "ClusterFirstWithHostNet"):
        servers, searches = [dns_ip], [f"{ns}.svc.{domain}", f"svc.{domain}", domain]
        options = {"ndots": "5"}
    elif policy == "None":
        servers, searches, options = [], [], {}
    else:
        return None
    servers += config.get("nameservers", [])
    searches += [s for s in config.get("searches", []) if s not in searches]
    for option in config.get("options", []):
        options[option["name"]] = option.get("value")
    lines = [f"nameserver {s}" for s in servers[:3]]
    if searches:
        lines.append("search " + " ".join(searches))
    if options:
        lines.append(
            "options " + " ".join(k if v is None else f"{k}:{v}" for k, v in options.items())
        )
    return "\n".join(lines) + "\n"


class MountPoints:
    """Mount targets this agent created on the host (``<dir>/nodeagent/mountpoints.json``)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self._lock = threading.Lock()

    def _load(self) -> list[str]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.state.read_text())
        return []

    def ensure(self, target: str, directory: bool) -> None:
        """Creates ``target`` (and missing parents), recording each path it creates."""
        with self._lock:
            created = self._load()
            current = PurePosixPath("/")
            parts = PurePosixPath(target).parts[1:]
            for i, part in enumerate(parts):
                current = current / part
                if os.path.lexists(current):
                    continue
                if i < len(parts) - 1 or directory:
                    os.mkdir(current, 0o755)
                else:
                    Path(current).touch(0o644)
                created.append(str(current))
            self.state.parent.mkdir(parents=True, exist_ok=True)
            self.state.write_text(json.dumps(created))

    def cleanup(self) -> None:
        """Removes the recorded paths that are empty (deepest first) and that no process on the
        machine has a mount on (another cluster's containers may use the same mount point)."""
        with self._lock:
            remaining = []
            busy = mounted_anywhere()
            for path in sorted(self._load(), key=lambda p: -len(PurePosixPath(p).parts)):
                if os.path.realpath(path) in busy:
                    remaining.append(path)
                    continue
                try:
                    if os.path.isdir(path) and not os.path.islink(path):
                        os.rmdir(path)
                    elif os.path.getsize(path) == 0:
                        os.unlink(path)
                    else:
                        remaining.append(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    remaining.append(path)
            self.state.parent.mkdir(parents=True, exist_ok=True)
            self.state.write_text(json.dumps(remaining))


def mounted_anywhere() -> set[str]:
    """Every mount point of every process's mount namespace."""
    points: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{entry}/mountinfo").read_text().splitlines():
                    points.add(line.split()[4].encode().decode("unicode_escape"))
    return points


def object_data(kind: str, obj: Obj) -> dict[str, str | bytes]:
    """A ConfigMap's data and binaryData, or a Secret's data decoded."""
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    binary = {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    return {**(obj.get("data") or {}), **binary}
