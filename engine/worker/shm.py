"""Names and lifetime of the worker's shared-memory segments (no paddle here).

The KV cache and the worker's status block are named after the engine-worker queue port, so a
restarted instance, or the server cleaning up after a killed engine, can find them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

logger = logging.getLogger(__name__)


def shm_names(port: int) -> tuple[str, str]:
    return f"ketch-kv-{port}", f"ketch-status-{port}"


def fresh_segment(name: str, size: int) -> SharedMemory:
    """Creates a segment, replacing one left behind by a killed run."""
    remove_segment(name)
    return SharedMemory(name=name, create=True, size=max(size, 1))


def remove_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        stale = SharedMemory(name=name)
        stale.close()
        stale.unlink()


def remove_segments(port: int) -> None:
    """Removes both segments of the instance on ``port`` (idempotent)."""
    for name in shm_names(port):
        remove_segment(name)


SHM_DIR = Path("/dev/shm")
_PREFIX = "ketch-"


def reclaim_stale_segments(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[str]:
    """Removes this user's ``ketch-*`` segments that no live process has open or mapped: what
    a killed instance left behind, on whatever port. Returns the names removed."""
    try:
        candidates = {
            p.name: p for p in shm_dir.glob(f"{_PREFIX}*") if p.stat().st_uid == os.getuid()
        }
    except OSError:  # no /dev/shm (not Linux)
        return []
    if not candidates or not proc.is_dir():
        return []
    stale = set(candidates) - segments_in_use(shm_dir, proc)
    for name in sorted(stale):
        with contextlib.suppress(FileNotFoundError):
            candidates[name].unlink()
    if stale:
        logger.warning(
            "removed %d shared-memory segment(s) that no live process uses: %s",
            len(stale),
            " ".join(sorted(stale)),
        )
    return sorted(stale)


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
