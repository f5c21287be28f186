"""What every test harness that starts processes needs: free ports, stopping a process, and
polling until something is true."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_ports(count: int) -> list[int]:
    """Distinct free ports, never the same twice in one test process, and below the kernel's
    ephemeral range: a port handed to one server is not handed to another (two pods of one
    local cluster once got the same port from successive bind(0) calls), nor taken meanwhile
    by some connection's source port or another bind(0)."""
    low, high = _PORT_RANGE
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for attempt in itertools.count():
            if len(ports) == count:
                break
            if attempt > 50 * count + 1000:
                raise RuntimeError(f"no {count} free ports in {low}-{high}")
            port = _RANDOM.randrange(low, high)
            if port in _HANDED_OUT or port in ports or not _claim(port):
                continue
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("0.0.0.0", port))  # free on every address, TIME_WAIT included
            except OSError:
                continue
            ports.append(port)
        _HANDED_OUT.update(ports)
        return ports


def _port_range() -> tuple[int, int]:
    """Ports 20000 up to the start of the ephemeral range (Linux: 32768)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return (20000, ephemeral_low) if ephemeral_low > 21000 else (10000, 20000)


def _claim(port: int) -> bool:
    """Claims ``port`` for this process among every test process on the machine (a lock file
    naming the owner; a dead owner's claim is taken over), so two test runs at once do not
    start servers on the same port between choosing it and binding it."""
    _CLAIMS.mkdir(mode=0o777, exist_ok=True)
    path = _CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or 0)
            except (OSError, ValueError):
                return False
            if owner == os.getpid() or _alive(owner):
                return False
            path.unlink(missing_ok=True)  # its owner is gone: take it over
            continue
        with os.fdopen(fd, "w") as out:
            out.write(str(os.getpid()))
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _release_claims() -> None:
    for port in _HANDED_OUT:
        with contextlib.suppress(OSError):
            if (_CLAIMS / str(port)).read_text() == str(os.getpid()):
                (_CLAIMS / str(port)).unlink()


_CLAIMS = Path(tempfile.gettempdir()) / "ketch-test-ports"
_PORT_RANGE = _port_range()
_HANDED_OUT: set[int] = set()  # this test process's; ports are plenty (about 12k)
_RANDOM = random.Random()
atexit.register(_release_claims)


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Polls ``predicate`` until it returns something truthy; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids (not this one) whose environment has ``name=value``: with ``KETCH_WATCH_PID`` set
    by a test run, every process it started and everything they started."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] not in ("Z", "X"):  # exited, not yet reaped
                    found.append(int(entry.name))
    return found


def ketch_segments() -> set[str]:
    """Names of the ``/dev/shm/ketch-*`` shared-memory segments that exist now."""
    return {p.name for p in Path("/dev/shm").glob("ketch-*")}


def own_segments() -> set[str]:
    """The ``ketch-*`` segments named after a port this test process handed out (an instance's
    segments carry its worker port): those of another test run on the machine are not ours."""
    return {s for s in ketch_segments() if s.rsplit("-", 1)[-1] in {str(p) for p in _HANDED_OUT}}


def describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            lines.append(f"  {pid}: {cmd[:160]}")
    return "\n".join(lines)
