"""The instance's private run directory: where its loopback channels live.

Every channel between the processes of one instance that never leaves the machine (API server
<-> engine, engine <-> worker, engine <-> cache manager) is a Unix socket in a directory only
this user can enter (mode 0700). A TCP port on 127.0.0.1 would be open to every local user: one
could connect first, pose as the worker and read every prompt, or as the engine and copy KV
blocks around. File permissions decide who reaches a Unix socket, so nothing else is needed:
no token to hand around, no per-message cost.

The directory is ``$KETCH_RUN_DIR`` when set, else ``<tempdir>/ketch-<uid>``. In a pod the engine
and the cache-manager sidecar share ``/tmp`` (an ``emptyDir``) and run as the same user, so
both find the same directory. A directory that exists but is not ours, or that others can
enter, is refused rather than used: in a world-writable ``/tmp`` another user could have made it
first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
from pathlib import Path

ENV = "KETCH_RUN_DIR"
# sun_path holds 108 bytes with the terminating NUL.
_MAX_SOCKET_PATH = 107


class RunDirError(RuntimeError):
    """The run directory cannot be used safely; the message says why and how to fix it."""


def run_dir() -> Path:
    """The private run directory, created (0700) if missing; raises RunDirError if unsafe."""
    configured = os.environ.get(ENV)
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"ketch-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=bool(configured))
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """Raises RunDirError unless ``path`` is a real directory owned by us that only we can use."""
    where = f"run directory {path} (set {ENV} to choose another)"
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise RunDirError(f"{where}: {exc.strerror}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RunDirError(f"{where} is not a directory (a symlink is refused too)")
    if info.st_uid != os.getuid():
        raise RunDirError(f"{where} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        raise RunDirError(f"{where} has mode {mode:o}; other users could reach its sockets (0700)")


def socket_address(name: str, directory: Path | None = None) -> str:
    """``ipc://`` address of the socket ``name`` in the run directory."""
    path = (directory or run_dir()) / name
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise RunDirError(
            f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes; "
            f"set {ENV} to a shorter directory"
        )
    return f"ipc://{path}"


def claim(address: str, what: str) -> None:
    """Before binding ``address``: removes a socket file a dead process left behind, and raises
    ValueError (naming ``what``) if a live process still listens on it."""
    path = address.removeprefix("ipc://")
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ValueError(f"{what}: cannot check {path}: {exc.strerror}") from exc
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # nobody listens: a killed run's leftover
        return
    finally:
        probe.close()
    raise ValueError(f"{what} is in use by another running instance ({path})")


def release(address: str) -> None:
    """Removes a bound socket's file (closing a ZMQ socket leaves it behind)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address.removeprefix("ipc://"))


# What lives in the run directory; the numbers are the instance's configured "ports", which
# keep two instances on one host apart (and name their shared-memory segments).
def api_addresses(port: int, directory: Path | None = None) -> tuple[str, str]:
    """API server -> engine requests, engine -> API server outputs."""
    return (
        socket_address(f"api-{port}-requests.sock", directory),
        socket_address(f"api-{port}-outputs.sock", directory),
    )


def worker_address(engine_worker_queue_port: int, rank: int = 0) -> str:
    """Engine <-> worker (``--engine-worker-queue-port``); tensor-parallel rank ``rank``."""
    suffix = f"-rank{rank}" if rank else ""
    return socket_address(f"worker-{engine_worker_queue_port}{suffix}.sock")


def cache_queue_address(cache_queue_port: int) -> str:
    """Engine <-> cache manager (``--cache-queue-port``)."""
    return socket_address(f"cache-{cache_queue_port}.sock")


class SocketFile:
    """A bound socket's file, removed by ``close`` (for lists of things to close)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def close(self) -> None:
        release(self.address)
