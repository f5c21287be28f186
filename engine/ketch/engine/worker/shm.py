"""Names and lifetime of the worker's shared-memory segments (no paddle here).

The KV cache and the worker's status block are named after the engine-worker queue port, so a
restarted instance, or the server cleaning up after a killed engine, can find them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import time
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


# The status block: ready flag, steps done, worker heartbeat, engine heartbeat (CLOCK_MONOTONIC
# seconds, the same in every PID namespace of the machine), the engine's PID namespace.
STATUS_SLOTS = 5
STATUS_BYTES = 8 * STATUS_SLOTS
ENGINE_HEARTBEAT = 3
PID_NAMESPACE = 4
# A segment pair made in another PID namespace (whose processes this one cannot see) is a dead
# instance's only once its engine has not beaten for this long.
STALE_AFTER_S = 30.0


def pid_namespace() -> float:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where unknown)."""
    try:
        return float(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return 0.0


def shm_names(port: int) -> tuple[str, str]:
    return f"ketch-kv-{port}", f"ketch-status-{port}"


def group_segment_name(port: int) -> str:
    """The tensor-parallel ranks' collectives segment (``ketch.kernels.collective.ShmGroup``)."""
    return f"ketch-tp-{port}"


def attach_segment(name: str) -> SharedMemory:
    """Attaches to a segment another process owns and will unlink.

    Python before 3.13 registers an attach with the resource tracker as if it were a create,
    and a spawned worker shares its engine's tracker: an ``unregister`` here removed the
    engine's own entry, so the engine's ``unlink`` later made the tracker print a KeyError
    traceback. Not registering at all leaves the owner's entry the only one."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def fresh_segment(name: str, size: int) -> SharedMemory:
    """Creates a segment, replacing one left behind by a killed run."""
    remove_segment(name)
    return SharedMemory(name=name, create=True, size=max(size, 1))


def remove_segment(name: str, shm_dir: Path | None = None) -> None:
    """Removes our segment ``name`` if it exists. One that is not a plain file of this user (a
    link, or another user's file in the sticky ``/dev/shm``, which we could not unlink) is a
    ValueError naming it: a local user who made it first would otherwise fail every start with
    a PermissionError (review L5)."""
    path = (shm_dir or SHM_DIR) / name
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError:  # no /dev/shm to look at (not Linux): let SharedMemory decide
        info = None
    if info is not None and (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else f"owned by uid {info.st_uid}"
        raise ValueError(
            f"shared-memory segment {path} exists and is {kind}, not this user's "
            f"(uid {os.getuid()}): remove it, or run on other ports"
        )
    with contextlib.suppress(FileNotFoundError):
        stale = SharedMemory(name=name)
        stale.close()
        stale.unlink()


def remove_segments(port: int) -> None:
    """Removes the segments of the instance on ``port`` (idempotent)."""
    for name in (*shm_names(port), group_segment_name(port)):
        remove_segment(name)


SHM_DIR = Path("/dev/shm")
_PREFIX = "ketch-"


def reclaim_stale_segments(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[str]:
    """Removes this user's ``ketch-*`` segments that no live process has open or mapped: what
    a killed instance left behind, on whatever port. Returns the names removed."""
    try:
        found = list(shm_dir.glob(f"{_PREFIX}*"))
    except OSError:  # no /dev/shm (not Linux)
        return []
    candidates = {p.name: p for p in found if _ours(p)}  # never a link, never another user's
    if not candidates or not proc.is_dir():
        return []
    stale = set(candidates) - segments_in_use(shm_dir, proc)
    stale = {name for name in stale if not _beating(shm_dir, name)}
    for name in sorted(stale):
        try:
            candidates[name].unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. gone read-only: not a reason to refuse to start
            logger.warning("cannot remove stale shared-memory segment %s: %s", name, exc)
    if stale:
        logger.warning(
            "removed %d shared-memory segment(s) that no live process uses: %s",
            len(stale),
            " ".join(sorted(stale)),
        )
    return sorted(stale)


def _beating(shm_dir: Path, name: str) -> bool:
    """Whether the instance ``name`` belongs to (ketch-kv-P or ketch-status-P) may be alive
    where this process cannot see it: made in another PID namespace, and still beating."""
    status = shm_dir / f"ketch-status-{name.rsplit('-', 1)[-1]}"
    try:
        with status.open("rb") as f:
            raw = f.read(STATUS_BYTES)
    except OSError:
        return False
    if len(raw) != STATUS_BYTES:
        return False
    slots = np.frombuffer(raw, dtype=np.float64)
    ours = pid_namespace()
    if ours and slots[PID_NAMESPACE] == ours:
        return False  # its processes would be visible here: none holds it, so it is dead
    return 0 <= time.monotonic() - float(slots[ENGINE_HEARTBEAT]) < STALE_AFTER_S


def segments_in_use(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> set[str]:
    """Names of ``ketch-*`` segments that some process has open (fd) or mapped (maps)."""
    prefix = f"{shm_dir}/{_PREFIX}"
    used: set[str] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            for line in (pid_dir / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at + len(prefix) - len(_PREFIX) :].split()[0])
            for fd in (pid_dir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix):
                        used.add(target[len(prefix) - len(_PREFIX) :].split()[0])
    return used


def _ours(path: Path) -> bool:
    """A plain file of this user (``lstat``: a symbolic link is never followed)."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
