"""Process lifetime: no Ketch process outlives what started it.

Two mechanisms, one per kind of parent:

- a child Ketch starts itself (the engine under ``ketch serve``, a worker under the engine)
  calls ``exit_with_parent`` first thing: the kernel signals it when its parent dies
  (``PR_SET_PDEATHSIG`` on Linux), and a parent that died before that call is caught by
  comparing ``getppid()`` with the pid the parent passed down;
- a top-level command (``ketch serve``, ``ketch cache-manager``, ``ketch router``,
  ``ketch-operator run``) started by a supervisor that is not its container runtime — a test
  run, a harness, a script — watches the pid in ``KETCH_WATCH_PID`` when it is set, and stops
  as on SIGTERM when that process is gone (then exits hard if stopping takes too long). Children
  inherit the variable, which also lets a test run find every process it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_WATCH_PID = "KETCH_WATCH_PID"

_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 0.25
# After asking itself to stop, a process whose supervisor is gone gets this long to clean up.
_STOP_GRACE_S = 6.0


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies; exit now if the
    parent (``parent_pid``, passed down by it) is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        logger.warning("parent process %d is already gone; exiting", parent_pid)
        os._exit(0)


def watch_supervisor(environ: Mapping[str, str] | None = None) -> threading.Thread | None:
    """Starts a daemon thread that stops this process when the pid in ``KETCH_WATCH_PID`` dies:
    SIGTERM to itself (the command's own clean stop), then ``os._exit(1)`` after a grace period.
    Returns the thread, or None when the variable is unset. Raises ValueError if it is not a pid.
    """
    value = (os.environ if environ is None else environ).get(ENV_WATCH_PID)
    if value is None or value == "":
        return None
    try:
        pid = int(value)
    except ValueError:
        raise ValueError(f"{ENV_WATCH_PID}={value!r} is not a process id") from None
    if pid <= 0:
        raise ValueError(f"{ENV_WATCH_PID}={value!r} is not a process id")
    if pid == os.getpid():  # a command run in-process by the watched program itself
        return None
    started = process_start_time(pid)
    if started is None:
        raise ValueError(f"{ENV_WATCH_PID}={pid}: no such process")
    thread = threading.Thread(
        target=_watch, args=(pid, started), name="ketch-supervisor-watch", daemon=True
    )
    thread.start()
    return thread


def _watch(pid: int, started: str) -> None:
    while process_start_time(pid) == started:
        time.sleep(_WATCH_INTERVAL_S)
    logger.warning("process %d (%s) is gone: stopping", pid, ENV_WATCH_PID)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_STOP_GRACE_S)
    logger.error("still running %.0f s after %d went away: exiting now", _STOP_GRACE_S, pid)
    os._exit(1)


def process_start_time(pid: int) -> str | None:
    """The start time of a live process (a zombie counts as gone), or None. Comparing it tells
    a process from a later one that reuses its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return _exists(pid)
    return None if fields[0] in ("Z", "X") else fields[19]


def _exists(pid: int) -> str | None:
    """Without /proc (not Linux): whether the pid exists at all."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "?"
