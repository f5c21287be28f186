"""Container processes: start one through ``launch.py``, signal it, reap it, run commands in it.

A container is the process ``launch.py`` execs into; its pid is the container's (containerID
``ketch://<pid>``), its session and process group are its own, and it has its own mount
namespace. Stopping a container signals the whole group; once its main process has exited,
every process still in its mount namespace is killed too (the closest thing to a pid namespace
going away: a real runtime kills the container's whole cgroup). Each started container's pid
and start time are recorded in ``<container dir>/pid``, so an agent that was killed can stop,
on its next start, what it left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAUNCHER = str(Path(__file__).with_name("launch.py"))
START_TIMEOUT_S = 60

_live_ns: set[int] = set()  # mount namespaces of running containers (never swept)
_live_lock = threading.Lock()


class StartError(Exception):
    """The container process could not be started (runc's StartError, exit code 128)."""


def start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/<pid>/stat), None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def kill_namespace(inode: int, kind: str = "mnt") -> int:
    """SIGKILLs every process in the namespace ``inode`` (unless a live container's); returns
    how many there were."""
    with _live_lock:
        if inode in _live_ns or inode == _ns_inode(os.getpid(), kind):  # never the host's
            return 0
    killed = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _ns_inode(int(entry), kind) == inode:
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
    return killed


def _launch(spec: dict[str, Any], stdout: Any, stderr: Any) -> subprocess.Popen:
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", LAUNCHER], stdin=subprocess.PIPE, stdout=stdout,
            stderr=stderr, pass_fds=(write_end,), close_fds=True,
        )  # fmt: skip
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    os.close(write_end)
    try:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({**spec, "errfd": write_end}).encode())
        proc.stdin.close()
        proc.stdin = None  # communicate() must not flush it
        chunks = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            ready, _, _ = select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise StartError("the container process did not start in time")
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    except BaseException:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        raise
    finally:
        os.close(read_end)
    if chunks:
        proc.wait()
        raise StartError(b"".join(chunks).decode(errors="replace"))
    return proc


@dataclass
class Process:
    """A running (or exited) container process."""

    popen: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.time)
    mnt_ns: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(cls, spec: dict[str, Any], log_path: Path, pid_file: Path) -> Process:
        """Starts the container of ``spec`` (see launch.py); StartError if it could not."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            try:
                popen = _launch(spec, log, subprocess.STDOUT)
            except StartError as exc:
                log.write(f"[node agent] cannot start the container: {exc}\n".encode())
                raise
        proc = cls(popen, log_path, mnt_ns=_ns_inode(popen.pid, "mnt"))
        if proc.mnt_ns is not None:
            with _live_lock:
                _live_ns.add(proc.mnt_ns)
        with contextlib.suppress(OSError):
            pid_file.write_text(f"{popen.pid} {start_time(popen.pid)}\n")
        return proc

    def poll(self) -> int | None:
        """The exit code once it exited (128 + signal number if killed by a signal)."""
        code = self.popen.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def signal(self, sig: int) -> None:
        """Signals the container's process group (its main process, if the group is gone)."""
        if self.popen.returncode is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, sig)
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.kill(self.pid, sig)
        except PermissionError:
            pass

    def signal_main(self, sig: int) -> None:
        """Signals the main process only (a runtime's stop signal goes to the container's pid 1)."""
        if self.popen.returncode is None:
            with contextlib.suppress(OSError):
                self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        return self.poll()

    def cleanup(self) -> None:
        """After the main process exited: kills what is left of the container."""
        self.signal(signal.SIGKILL)
        if self.mnt_ns is not None:
            with _live_lock:
                _live_ns.discard(self.mnt_ns)
            kill_namespace(self.mnt_ns)


def exec_in(
    proc: Process, argv: list[str], base: dict[str, Any], timeout: float
) -> tuple[int | None, str]:
    """Runs ``argv`` in the container's namespaces as its user (``base`` has env, cwd, uid,
    gid, groups). Returns (exit code, output); exit code None if it timed out (then killed)."""
    spec = {**base, "join": proc.pid, "argv": argv, "mounts": []}
    try:
        popen = _launch(spec, subprocess.PIPE, subprocess.STDOUT)
    except StartError as exc:
        return 126, str(exc)
    try:
        out, _ = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.communicate()
        return None, f"command timed out after {timeout:g}s"
    code = popen.returncode
    return (128 - code if code < 0 else code), out.decode(errors="replace")[-10240:]


def kill_recorded(root: Path) -> int:
    """Kills the process groups recorded in ``<root>/<pod>/<container>/pid`` files that still
    run (a killed agent's containers); returns how many."""
    killed = 0
    for pid_file in root.glob("*/*/pid"):
        with contextlib.suppress(OSError, ValueError):
            pid_text, started = pid_file.read_text().split()
            pid = int(pid_text)
            if start_time(pid) == started:
                inode = _ns_inode(pid, "mnt")
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                if inode is not None:
                    kill_namespace(inode)
                killed += 1
    return killed
