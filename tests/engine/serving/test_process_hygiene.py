"""No ``ketch serve`` process tree outlives whatever killed it, and no shared memory either.

Each test kills something the way a machine or a person would (SIGKILL of the test process,
SIGTERM or SIGKILL of a whole process group, SIGKILL of the server alone) and then requires,
within the issue's 10 s, that no process of that tree is left and that its ``/dev/shm``
segments are gone (or, after a SIGKILL of everything, reclaimed by the next instance to start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import httpx
import pytest
from serve_harness import Server, running_server

from ketch.engine.lifecycle import ENV_WATCH_PID, process_start_time, watch_supervisor
from ketch.engine.worker.shm import reclaim_stale_segments, segments_in_use, shm_names
from procs import ketch_segments, processes_with_env, wait_for

GONE_WITHIN_S = 10.0
HERE = Path(__file__).parent


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a server started with ``new_session``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def _segments(worker_port: int) -> set[str]:
    return set(shm_names(worker_port)) & ketch_segments()


def _wait_gone(what: str, alive) -> None:
    wait_for(lambda: not alive(), GONE_WITHIN_S, what, interval=0.1)


def test_sigkill_of_the_test_process_leaves_no_server_and_no_segment(tmp_path: Path) -> None:
    marker = tmp_path / "inner.json"
    env = {**os.environ, "KETCH_HYGIENE_MARKER": str(marker)}
    env.pop(ENV_WATCH_PID)  # the inner pytest's conftest sets its own
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(HERE / "killed_mid_request.py")],
        cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: marker.is_file() and marker.stat().st_size, 180, "the inner test")
        info = json.loads(marker.read_text())
        assert _segments(info["worker_port"]), "the server's KV segments should exist by now"
        started = processes_with_env(ENV_WATCH_PID, str(info["pid"]))
        assert len(started) >= 3, started  # ketch serve, its engine and its worker at least
    finally:
        inner.kill()
        inner.wait(10)
    _wait_gone("the server tree", lambda: processes_with_env(ENV_WATCH_PID, str(info["pid"])))
    _wait_gone("the KV segments", lambda: _segments(info["worker_port"]))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_signal_to_the_process_group_leaves_no_process(sig: int) -> None:
    server = Server(new_session=True)
    try:
        server.wait_ready()
        assert len(_session(server.proc.pid)) >= 3
        os.killpg(server.proc.pid, sig)
        _wait_gone("the process group", lambda: _session(server.proc.pid))
        if sig == signal.SIGTERM:  # a clean stop removes its shared memory itself
            assert server.proc.wait(1) == 0, server.log()
            _wait_gone("the KV segments", lambda: _segments(server.worker_port))
            return
        # SIGKILL of everything: nothing could clean up, so the next instance to start, on
        # other ports, reclaims the segments no live process uses.
        assert _segments(server.worker_port)
        with running_server():
            assert not _segments(server.worker_port)
    finally:
        server.stop()


@pytest.mark.parametrize("victim", ["server", "engine"])
def test_sigkill_of_one_process_takes_its_children_and_segments(victim: str) -> None:
    server = Server(new_session=True)
    try:
        server.wait_ready()
        pid = server.proc.pid if victim == "server" else server.engine_pid()
        os.kill(pid, signal.SIGKILL)
        _wait_gone("the process group", lambda: _session(server.proc.pid))
        _wait_gone("the KV segments", lambda: _segments(server.worker_port))
    finally:
        server.stop()


def _orphan_segment(name: str) -> None:
    """A segment nobody holds, as a SIGKILLed instance leaves it."""
    shm = SharedMemory(name=name, create=True, size=4096)
    resource_tracker.unregister(shm._name, "shared_memory")
    shm.close()


def test_reclaim_removes_only_segments_no_live_process_holds() -> None:
    held = SharedMemory(name=f"ketch-kv-test-held-{os.getpid()}", create=True, size=4096)
    orphan = f"ketch-kv-test-orphan-{os.getpid()}"
    _orphan_segment(orphan)
    try:
        assert held.name in segments_in_use()
        assert orphan not in segments_in_use()
        removed = reclaim_stale_segments()
        assert orphan in removed
        assert held.name not in removed
        assert held.name in ketch_segments()
        assert orphan not in ketch_segments()
    finally:
        held.close()
        held.unlink()
        Path("/dev/shm", orphan).unlink(missing_ok=True)


def test_reclaim_keeps_a_segment_another_process_maps() -> None:
    name = f"ketch-kv-test-mapped-{os.getpid()}"
    _orphan_segment(name)
    mapper = subprocess.Popen(
        [sys.executable, "-c",
         "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0);"
         " f.close(); print('mapped', flush=True); time.sleep(60)", f"/dev/shm/{name}"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert mapper.stdout.readline().strip() == "mapped"
        assert name not in reclaim_stale_segments()  # only mapped, no file descriptor open
        mapper.kill()
        mapper.wait(10)
        assert name in reclaim_stale_segments()
    finally:
        mapper.kill()
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_watch_supervisor_rejects_bad_values_and_ignores_itself() -> None:
    for bad in ("abc", "-3", "0", "1.5"):
        with pytest.raises(ValueError, match="not a process id"):
            watch_supervisor({ENV_WATCH_PID: bad})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ValueError, match="no such process"):
        watch_supervisor({ENV_WATCH_PID: str(dead.pid)})
    assert watch_supervisor({ENV_WATCH_PID: str(os.getpid())}) is None
    assert watch_supervisor({}) is None
    assert process_start_time(os.getpid()) is not None
    assert process_start_time(dead.pid) is None


def test_a_command_stops_when_the_watched_process_goes() -> None:
    """A ``ketch router`` whose supervisor dies exits by itself (SIGTERM path: exit 0)."""
    from procs import free_ports

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (port,) = free_ports(1)
    env = {**os.environ, ENV_WATCH_PID: str(sleeper.pid)}
    router = subprocess.Popen(
        [str(Path(sys.executable).parent / "ketch"), "router", "--host", "127.0.0.1",
         "--port", str(port), "--mixed", "127.0.0.1:1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: _answers(port) or router.poll() is not None, 60, "the router")
        assert router.poll() is None, router.stdout.read()
        sleeper.kill()
        sleeper.wait()
        assert router.wait(GONE_WITHIN_S) == 0
        assert "is gone: stopping" in router.stdout.read()
    finally:
        router.kill()
        sleeper.kill()


def _answers(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


def test_reclaim_keeps_a_pair_whose_engine_still_beats() -> None:
    """An owner made in another PID namespace sharing /dev/shm (whose processes this one
    cannot see) keeps its segments as long as its engine's heartbeat is fresh."""
    import time

    import numpy as np

    from ketch.engine.worker.shm import (
        ENGINE_HEARTBEAT,
        PID_NAMESPACE,
        STALE_AFTER_S,
        STATUS_SLOTS,
        pid_namespace,
    )

    port = f"{os.getpid()}0"
    kv, status = f"ketch-kv-{port}", f"ketch-status-{port}"
    _orphan_segment(kv)
    _orphan_segment(status)

    def write_status(heartbeat: float) -> None:  # written, not mapped: nobody holds it
        slots = np.zeros(STATUS_SLOTS, dtype=np.float64)
        slots[PID_NAMESPACE] = pid_namespace() + 1  # made in a namespace that is not ours
        slots[ENGINE_HEARTBEAT] = heartbeat
        Path("/dev/shm", status).write_bytes(slots.tobytes())

    try:
        write_status(time.monotonic())
        assert not {kv, status} & set(reclaim_stale_segments())
        write_status(time.monotonic() - STALE_AFTER_S - 1)
        assert {kv, status} <= set(reclaim_stale_segments())
    finally:
        for name in (kv, status):
            Path("/dev/shm", name).unlink(missing_ok=True)
