"""Issue 13, finding 10: no local process of another user can reach an instance's internal
channels (API server <-> engine, engine <-> worker, engine <-> cache manager).

They are Unix sockets in a 0700 run directory (``ketch.engine.rundir``), and nothing but the
instance's public ports listens on TCP."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import httpx
import pytest
from cm_harness import CacheManagerProcess
from serve_harness import Server, wait_for

from ketch.engine import rundir

NOBODY = 65534


def listening_tcp_ports(pids: list[int]) -> set[int]:
    """TCP ports in LISTEN state whose socket one of ``pids`` holds."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def connect_as(uid: int, path: str) -> int:
    """Tries to connect to the Unix socket ``path`` from a child running as ``uid``; returns the
    errno it got (0 when the connection was made)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, try, report
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(path)
        except OSError as exc:
            code = exc.errno or 255
        os.write(write, code.to_bytes(2, "little"))
        os._exit(0)
    os.close(write)
    try:
        return int.from_bytes(os.read(read, 2), "little")
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.fixture(scope="module")
def instance():
    cm = CacheManagerProcess().wait_ready()
    server = Server("--cache-queue-port", str(cm.queue_port))
    try:
        server.wait_ready()
        wait_for(
            lambda: (
                httpx.get(f"{server.url}/ready", timeout=2).json()["cache_manager"] == "attached"
            ),
            60,
            "the cache manager to attach",
        )
        yield server, cm
    finally:
        server.stop()
        cm.stop()


def test_internal_channels_are_not_tcp_ports(instance) -> None:
    server, cm = instance
    pids = [server.proc.pid, *server.descendants()]
    assert len(pids) >= 3  # API server, engine, worker
    assert listening_tcp_ports(pids) == {server.port}
    assert listening_tcp_ports([cm.proc.pid]) == {cm.kv_port, cm.http_port}
    sockets = sorted(p.name for p in rundir.run_dir().glob("*.sock"))
    for name in (
        f"api-{server.port}-requests.sock",
        f"api-{server.port}-outputs.sock",
        f"worker-{server.worker_port}.sock",
        f"cache-{cm.queue_port}.sock",
    ):
        assert name in sockets
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a probe as another user")
def test_another_user_cannot_connect(instance) -> None:
    server, cm = instance
    directory = rundir.run_dir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in (f"worker-{server.worker_port}.sock", f"cache-{cm.queue_port}.sock"):
        path = str(directory / name)
        assert connect_as(os.getuid(), path) == 0  # the owner can (the probe works)
        assert connect_as(NOBODY, path) == 13  # EACCES: the directory stops everyone else


def test_unsafe_run_directories_are_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(rundir.ENV, str(tmp_path / "run"))
    made = rundir.run_dir()
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)
    with pytest.raises(rundir.RunDirError, match="mode 755"):
        rundir.run_dir()
    made.chmod(0o700)
    if os.getuid() == 0:
        os.chown(made, NOBODY, NOBODY)
        with pytest.raises(rundir.RunDirError, match=f"belongs to uid {NOBODY}"):
            rundir.run_dir()
    (tmp_path / "link").symlink_to(made)
    monkeypatch.setenv(rundir.ENV, str(tmp_path / "link"))
    with pytest.raises(rundir.RunDirError, match="symlink"):
        rundir.run_dir()
    monkeypatch.setenv(rundir.ENV, str(tmp_path / ("x" * 120)))
    with pytest.raises(rundir.RunDirError, match="longer than 107 bytes"):
        rundir.worker_address(8002)


def test_claim_replaces_leftovers_and_refuses_live_sockets(tmp_path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as leftover:
        leftover.bind(str(path))  # bound, not listening: a killed process's file
    rundir.claim(f"ipc://{path}", "--x")
    assert not path.exists()
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(ValueError, match="--x is in use by another running instance"):
            rundir.claim(f"ipc://{path}", "--x")
    rundir.release(f"ipc://{path}")
    assert not path.exists()
