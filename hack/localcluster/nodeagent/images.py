"""Images without an image store: a table maps image references to what their containers run.

Each entry (``--images FILE``: a JSON list; default ``default_table()``) has

- ``image``: an fnmatch pattern, or a list of them, matched against the reference as written and
  as normalised (``python:3.11`` is also ``docker.io/library/python:3.11``);
- ``path``: directories of this machine put first on the container's PATH (the image's PATH);
- ``env``: the image's ENV (the container's own ``env`` wins over it); ``workingDir``;
  ``entrypoint`` and ``cmd`` (what ``command``/``args`` replace); ``user`` (``"uid[:gid]"``, the
  image's USER; root if absent);
- ``expose``: directories of this machine the image contains at the same path, mounted read-only
  in its containers: an image built from this checkout contains its venv, the Python the venv
  was made from, the checkout itself (an editable install) and the prebuilt C++ kernels;
- ``pull``: a command run once (as root, on the host) before the first container of the image
  starts, as a kubelet pulls an image; the engine image builds Ketch's C++ kernels with it if
  they are not built yet, so no pod compiles them.

A reference no entry matches fails as an image pull does (ErrImagePull, then ImagePullBackOff).
Strings in a table may name ``{venv}``, ``{python_home}``, ``{repo}`` and ``{extensions}``
(where this checkout's venv, its base Python, the checkout and the kernel build live).
Variables of the agent's own environment named ``KETCH_*`` are part of every image's ENV, so a
test run's ``KETCH_WATCH_PID`` and ``KETCH_CACHE_DIR`` reach the processes in its pods.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
PULL_TIMEOUT_S = 900
# What python:3.11-slim and Ketch's Dockerfiles set.
_PYTHON_ENV = {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def places() -> dict[str, str]:
    """The values of the ``{...}`` placeholders of an image table."""
    venv = REPO / ".venv"
    if not venv.exists() and sys.prefix != sys.base_prefix:
        # a git worktree of the checkout has no venv of its own: the one the agent runs in
        venv = Path(sys.prefix)
    home = Path("/usr")
    cfg = venv / "pyvenv.cfg"
    if cfg.exists():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                home = Path(value.strip()).parent
    extensions = os.environ.get("KETCH_EXTENSION_DIR") or str(
        Path.home() / ".cache" / "ketch" / "extensions"
    )
    return {
        "venv": str(venv),
        "python_home": str(home),
        "repo": str(REPO),
        "extensions": extensions,
    }


def default_table() -> list[dict[str, Any]]:
    """Ketch's two images (this checkout), python and busybox."""
    # The checkout's sources first on the path: what its pods run is this checkout (a worktree's
    # too), whichever checkout the venv's editable install points at.
    sources = {"PYTHONPATH": "{repo}/engine:{repo}/operator:{repo}/kernels"}
    ketch = {
        "path": ["{venv}/bin"],
        "user": "1000:1000",
        "expose": ["{venv}", "{python_home}", "{repo}"],
    }
    return [
        {
            "image": ["ghcr.io/ketch-dev/ketch-engine:*", "ghcr.io/ketch-dev/ketch-engine@*"],
            **ketch,
            "env": {**_PYTHON_ENV, **sources, "KETCH_EXTENSION_DIR": "{extensions}"},
            "expose": [*ketch["expose"], "{extensions}"],
            "cmd": ["ketch", "--help"],
            "pull": ["{venv}/bin/python", "-m", "ketch.kernels.cpp_ops"],
        },
        {
            "image": ["ghcr.io/ketch-dev/ketch-operator:*", "ghcr.io/ketch-dev/ketch-operator@*"],
            **ketch,
            "env": {**_PYTHON_ENV, **sources},
            "cmd": ["ketch-operator", "run"],
        },
        {
            "image": "docker.io/library/python:*",
            "path": ["{python_home}/bin"],
            "env": dict(_PYTHON_ENV),
            "expose": ["{python_home}"],
            "cmd": ["python3"],
        },
        {"image": ["docker.io/library/busybox:*", "docker.io/library/busybox@*"], "cmd": ["sh"]},
    ]


def normalise(reference: str) -> str:
    """docker's reference normalisation: default registry docker.io, ``library/`` for official
    images, tag ``latest`` when neither tag nor digest is given."""
    first, _, rest = reference.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        reference = "docker.io/" + reference
        if not rest:
            reference = "docker.io/library/" + reference.split("/", 1)[1]
    last = reference.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        reference += ":latest"
    return reference


class PullError(Exception):
    """The image is not in the table, or its pull command failed."""


@dataclass
class Image:
    """One resolved table entry."""

    reference: str
    entry: dict[str, Any]
    path: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    uid: int | None = None
    gid: int | None = None
    expose: list[str] = field(default_factory=list)
    pull: list[str] = field(default_factory=list)

    @property
    def image_id(self) -> str:
        digest = hashlib.sha256(json.dumps(self.entry, sort_keys=True).encode()).hexdigest()
        return f"{normalise(self.reference).rsplit(':', 1)[0]}@sha256:{digest}"

    def base_env(self) -> dict[str, str]:
        """The image's ENV: PATH, the agent's own KETCH_* variables, then the entry's env."""
        env = {"PATH": ":".join([*self.path, STANDARD_PATH])}
        env |= {k: v for k, v in os.environ.items() if k.startswith("KETCH_")}
        return env | self.env


class ImageTable:
    """The table of ``path`` (re-read when the file changes) or the default one; ``pulled``
    runs each entry's pull command once."""

    def __init__(self, path: Path | None) -> None:
        self.file = path
        self._mtime = -1.0
        self._entries: list[dict[str, Any]] = default_table()
        self._places = places()
        self._lock = threading.Lock()
        self._pulled: dict[str, threading.Lock] = {}
        self._done: set[str] = set()
        self._reload()

    def _reload(self) -> None:
        if self.file is None:
            return
        try:
            mtime = self.file.stat().st_mtime
            if mtime != self._mtime:
                entries = json.loads(self.file.read_text())
                if not isinstance(entries, list):
                    raise ValueError("an image table is a JSON list")
                self._entries, self._mtime = entries, mtime
        except (OSError, ValueError) as exc:
            logger.error("image table %s: %s (keeping the previous one)", self.file, exc)

    def resolve(self, reference: str) -> Image:
        """The image ``reference`` runs as; PullError if no entry matches."""
        with self._lock:
            self._reload()
            entries = list(self._entries)
        names = {reference, normalise(reference)}
        for entry in entries:
            patterns = entry.get("image", [])
            patterns = [patterns] if isinstance(patterns, str) else patterns
            if any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns):
                return self._image(reference, entry)
        raise PullError(
            f'failed to pull and unpack image "{reference}": not found in the node agent\'s '
            "image table"
        )

    def _image(self, reference: str, entry: dict[str, Any]) -> Image:
        def sub(value: Any) -> Any:
            if isinstance(value, str):
                return value.format(**self._places)
            if isinstance(value, list):
                return [sub(v) for v in value]
            if isinstance(value, dict):
                return {k: sub(v) for k, v in value.items()}
            return value

        e = sub(entry)
        uid = gid = None
        if e.get("user") not in (None, ""):
            user, _, group = str(e["user"]).partition(":")
            uid, gid = int(user), int(group) if group else None
        return Image(
            reference=reference,
            entry=entry,
            path=e.get("path", []),
            env=e.get("env", {}),
            working_dir=e.get("workingDir") or "/",
            entrypoint=e.get("entrypoint", []),
            cmd=e.get("cmd", []),
            uid=uid,
            gid=gid,
            expose=[str(Path(p)) for p in e.get("expose", [])],
            pull=e.get("pull", []),
        )

    def pulled(self, image: Image) -> float | None:
        """Runs the image's pull command unless it already succeeded; returns the seconds it
        took (None if there was nothing to do). PullError if it fails."""
        if not image.pull:
            return None
        key = json.dumps(image.entry, sort_keys=True)
        with self._lock:
            lock = self._pulled.setdefault(key, threading.Lock())
        with lock:
            if key in self._done:
                return None
            started = time.monotonic()
            env = {**os.environ, **image.base_env()}
            try:
                result = subprocess.run(
                    image.pull, env=env, capture_output=True, text=True, timeout=PULL_TIMEOUT_S,
                    stdin=subprocess.DEVNULL,
                )  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PullError(f'failed to pull image "{image.reference}": {exc}') from exc
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip()[-400:]
                raise PullError(f'failed to pull image "{image.reference}": {tail}')
            self._done.add(key)
            return time.monotonic() - started
