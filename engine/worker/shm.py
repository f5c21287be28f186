"""Names and lifetime of the worker's shared-memory segments (no paddle here).

The KV cache and the worker's status block are named after the engine-worker queue port, so a
restarted instance, or the server cleaning up after a killed engine, can find them.
"""

from __future__ import annotations

import contextlib
from multiprocessing.shared_memory import SharedMemory


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
