"""The worker process, and the engine's handle on it (``RemoteRunner``).

The engine sends each step's changes over the engine-worker queue (a ZMQ PAIR on the Unix
socket ``worker-<engine_worker_queue_port>.sock`` in the private run directory, so no other
user can pose as either side) and gets the sampled tokens back. The KV cache lives in a named
POSIX shared-memory segment (``ketch-kv-<port>``) so the cache-manager sidecar can map the same
blocks; a small shared status block carries the worker's liveness signals (ready flag, step
count, heartbeat). Either side that loses the other exits, so nothing is left orphaned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import zmq

from ketch.engine import rundir
from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ketch.engine.lifecycle import exit_with_parent
from ketch.engine.wire import BadMessages, MessageError
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.messages import decode_result, decode_step, encode_result, encode_step
from ketch.engine.worker.model_runner import ModelRunner, RunnerConfig
from ketch.engine.worker.shm import (
    ENGINE_HEARTBEAT,
    PID_NAMESPACE,
    STATUS_BYTES,
    STATUS_SLOTS,
    attach_segment,
    fresh_segment,
    pid_namespace,
    reclaim_stale_segments,
    shm_names,
)

logger = logging.getLogger(__name__)

_POLL_MS = 500


class WorkerDiedError(RuntimeError):
    """The worker process exited; the engine cannot step any more."""


def run_worker(config: RunnerConfig, port: int, parent_pid: int, address: str) -> None:
    """Worker entry point: map the shared KV cache, load the model, execute steps.

    The engine owns the shared memory and cleans up, so this process may end at any moment:
    SIGTERM (or the engine's death, through ``exit_with_parent``) ends it at once."""
    exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s worker: %(message)s")
    kv_name, status_name = shm_names(port)
    kv_shm, status_shm = attach_segment(kv_name), attach_segment(status_name)  # the engine's
    status = np.ndarray((STATUS_SLOTS,), dtype=np.float64, buffer=status_shm.buf)
    # Replaces paddle's fatal-error report. os._exit: nothing here needs cleaning up, and an
    # interpreter shutdown could wait forever on a reply queued for a dead engine.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    runner = ModelRunner(config, kv_buffer=kv_shm.buf)
    socket = zmq.Context().socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, _POLL_MS * 4)  # never block forever on a dead engine
    socket.connect(address)
    refusals = BadMessages("worker")
    parent = os.getppid()
    status[0] = 1.0
    socket.send(b"ready")
    while True:
        status[2] = time.monotonic()
        if not socket.poll(_POLL_MS):
            if os.getppid() != parent:
                os._exit(0)  # the engine is gone
            continue
        output = _execute(runner, socket.recv_multipart(), refusals)
        try:
            socket.send(encode_result(output))
        except zmq.Again:
            os._exit(0)  # the engine stopped listening
        status[1] += 1
        if os.getppid() != parent:
            os._exit(0)


def _execute(runner: ModelRunner, frames: list[bytes], refusals: BadMessages) -> ModelRunnerOutput:
    """Runs one step; a step that cannot be decoded is answered with ``refused``, never raised
    (the engine is the only peer the run directory lets in, but a bug there must not kill us)."""
    try:
        if len(frames) != 1:
            raise MessageError(f"engine-worker step: {len(frames)} frames, expected 1")
        sched = decode_step(frames[0])
    except MessageError as exc:
        refusals.note("engine", exc)
        return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], refused=str(exc))
    return runner.execute(sched)


class RemoteRunner:
    """The engine's model runner when the model runs in a separate worker process."""

    def __init__(self, config: RunnerConfig, port: int, start_timeout: float = 600.0) -> None:
        if config.num_threads is None:
            # The API server and the engine need a core too: a worker that takes them all
            # stalls in its own thread barriers (measured on 2 cores: 1 thread serves 1.46x
            # the requests/s of 2).
            cores = len(os.sched_getaffinity(0))
            config = dataclasses.replace(config, num_threads=max(1, cores - 1))
        mc = config.model_config
        size = KVCache.nbytes(
            mc.num_hidden_layers,
            config.num_blocks,
            config.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
        )
        reclaim_stale_segments()
        kv_name, status_name = shm_names(port)
        self._segments: list[SharedMemory] = []
        self._socket = zmq.Context().socket(zmq.PAIR)
        self._socket.setsockopt(zmq.SNDTIMEO, _POLL_MS)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._address = rundir.worker_address(port)
        try:
            rundir.claim(self._address, f"--engine-worker-queue-port {port}")
            self._socket.bind(self._address)
        except (ValueError, zmq.ZMQError) as exc:
            self._address = None  # not ours: leave it
            self.close()
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"--engine-worker-queue-port {port}: cannot bind: {exc}") from exc
        try:
            self._segments += [
                fresh_segment(kv_name, size),
                fresh_segment(status_name, STATUS_BYTES),
            ]
            self.status = np.ndarray((STATUS_SLOTS,), np.float64, buffer=self._segments[1].buf)
            self.status[ENGINE_HEARTBEAT] = time.monotonic()
            self.status[PID_NAMESPACE] = pid_namespace()
            spawn = multiprocessing.get_context("spawn")
            self.process = spawn.Process(
                target=run_worker,
                args=(config, port, os.getpid(), self._address),
                name="ketch-worker",
                daemon=True,
            )
            self.process.start()
            self._receive(start_timeout, what="start")
        except BaseException:  # SIGTERM while loading included: leave nothing behind
            self.close()
            raise

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        data = encode_step(sched)
        while True:
            self.check_alive()
            try:
                self._socket.send(data)  # PAIR blocks while no peer is connected: bounded
                break
            except zmq.Again:
                continue
        output = decode_result(self._receive(None, what="step"))
        if output.refused is not None:  # nothing was applied: fail what the step named
            logger.error("the worker refused a step: %s", output.refused)
            why = f"the worker refused the step: {output.refused}"
            output.failed = dict.fromkeys(sched.num_scheduled_tokens, why)
        return output

    def check_alive(self) -> None:
        self.status[ENGINE_HEARTBEAT] = time.monotonic()  # shm.reclaim_stale_segments reads it
        if not self.process.is_alive():
            raise WorkerDiedError(f"the worker process exited (exit code {self.process.exitcode})")

    def _receive(self, timeout: float | None, what: str) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._socket.poll(_POLL_MS):
            self.status[ENGINE_HEARTBEAT] = time.monotonic()
            if not self.process.is_alive():
                raise WorkerDiedError(
                    f"the worker process exited (exit code {self.process.exitcode}) during {what}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"the worker did not {what} within {timeout:.0f} s")
        return self._socket.recv()

    def close(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.is_alive():
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
        self._socket.close(linger=0)
        if getattr(self, "_address", None):
            rundir.release(self._address)
        for segment in self._segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
        self._segments = []
