"""The model in a separate worker process (engine-worker queue + shared-memory KV cache)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ketch.engine import LLM, EngineConfig, SamplingParams, rundir
from ketch.engine.llm_engine import LLMEngine
from ketch.engine.worker.remote_runner import WorkerDiedError
from ketch.engine.worker.shm import shm_names

CONFIG = dict(block_size=16, kv_cache_memory="32MiB", max_num_batched_tokens=48, max_num_seqs=4)
PROMPTS = [[5, 6, 7, 8] * k for k in (1, 3, 9, 20)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(engine: LLMEngine) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return done


@pytest.mark.parametrize("backend", ["eager", "predictor", "native"])
def test_remote_worker_matches_in_process_runner(backend: str) -> None:
    """The worker runs every backend over the shared-memory KV cache (one asked for by name is
    not allowed to fall back), token for token as the in-process eager reference."""
    expected = LLM("tiny", backend="eager", **CONFIG).generate(PROMPTS, GREEDY)
    port = free_port()
    engine = LLMEngine(EngineConfig(model="tiny", backend=backend, **CONFIG), worker_port=port)
    try:
        assert all((Path("/dev/shm") / name).exists() for name in shm_names(port))
        done = run(engine)
        assert engine.runner.status[0] == 1.0 and engine.runner.status[1] > 0  # ready, steps
    finally:
        engine.close()
    assert [done[str(i)] for i in range(len(PROMPTS))] == [e.outputs[0].token_ids for e in expected]
    assert not any((Path("/dev/shm") / name).exists() for name in shm_names(port))


def test_dead_worker_is_reported_not_waited_for() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", **CONFIG), worker_port=free_port())
    try:
        os.kill(engine.runner.process.pid, signal.SIGKILL)
        engine.runner.process.join(10)
        with pytest.raises(WorkerDiedError, match="exited"):
            engine.check_health()
        engine.add_request("x", [1, 2, 3], GREEDY)
        with pytest.raises(WorkerDiedError):
            engine.step()
    finally:
        engine.close()


def test_busy_worker_port_is_a_clear_error() -> None:
    """Another live instance with the same --engine-worker-queue-port holds its socket; a dead
    one's leftover file is replaced."""
    port = free_port()
    path = rundir.worker_address(port).removeprefix("ipc://")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)
        sock.listen()
        try:
            with pytest.raises(ValueError, match=r"engine-worker-queue-port .* in use"):
                LLMEngine(EngineConfig(model="tiny", **CONFIG), worker_port=port)
            assert os.path.exists(path)  # not ours: left alone
        finally:
            os.unlink(path)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)  # bound, never listening: what a killed process leaves
    engine = LLMEngine(EngineConfig(model="tiny", **CONFIG), worker_port=port)
    try:
        assert len(run(engine)) == len(PROMPTS)
    finally:
        engine.close()
    assert not os.path.exists(path)


_CLEAN_CLOSE = """
import sys
from ketch.engine import EngineConfig
from ketch.engine.llm_engine import LLMEngine
engine = LLMEngine(EngineConfig(model="tiny", block_size=16, kv_cache_memory="16MiB"),
                   worker_port=int(sys.argv[1]))
engine.close()
"""


def test_a_clean_close_prints_no_resource_tracker_traceback() -> None:
    """The worker attaches to the engine's segments without registering them with the resource
    tracker it shares with the engine; before, its unregister removed the engine's entry and the
    engine's unlink made the tracker print KeyError tracebacks at every shutdown."""
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-c", _CLEAN_CLOSE, str(port)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resource_tracker" not in out.stderr and "KeyError" not in out.stderr, out.stderr
    assert not any((Path("/dev/shm") / name).exists() for name in shm_names(port))


def test_ready_message_weight_bytes_are_read_defensively():
    """A rank's ``ready <bytes>``: the count when it is a plain non-negative integer of sane
    length, else 0 (a worker of another version, or a garbled frame, never breaks start-up)."""
    from ketch.engine.worker.remote_runner import _ready_bytes

    assert _ready_bytes(b"ready 1367119872") == 1367119872
    for junk in (b"ready", b"ready ", b"ready -5", b"ready 1e9", b"ready " + b"9" * 40,
                 b"ready \xff\xfe", b"steady 12", b"", b"ready 12 34"):  # fmt: skip
        assert _ready_bytes(junk) == 0, junk
