"""The worker process, and the engine's handle on it (``RemoteRunner``).

The engine sends each step's changes over the engine-worker queue (a ZMQ PAIR on the Unix
socket ``worker-<engine_worker_queue_port>.sock`` in the private run directory, so no other
user can pose as either side) and gets the sampled tokens back. The KV cache lives in a named
POSIX shared-memory segment (``ketch-kv-<port>``) so the cache-manager sidecar can map the same
blocks; a small shared status block carries the worker's liveness signals (ready flag, step
count, heartbeat). Either side that loses the other exits, so nothing is left orphaned.

Tensor parallelism (``tensor_parallel_size`` N > 1): N worker processes, one per rank, each with
its own queue (``worker-<port>-rank<r>.sock`` for r > 0). The engine encodes each step once and
writes the same frame to every rank's queue (the ranks then run in lockstep through their
all-reduces, which meet in the ``ketch-tp-<port>`` segment); only rank 0 answers. Every rank
views its KV heads in the one ``ketch-kv-<port>`` segment. Any rank that exits fails the
instance: the engine watches them all, and stops the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket as socketlib
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import zmq

from ketch.engine import rundir
from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ketch.engine.device import parse_device, rank_devices
from ketch.engine.lifecycle import exit_with_parent
from ketch.engine.wire import BadMessages, MessageError
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.main_guard import check_main_guard
from ketch.engine.worker.messages import decode_result, decode_step, encode_result, encode_step
from ketch.engine.worker.model_runner import ModelRunner, RunnerConfig
from ketch.engine.worker.shm import (
    ENGINE_HEARTBEAT,
    PID_NAMESPACE,
    STATUS_BYTES,
    STATUS_SLOTS,
    attach_segment,
    fresh_segment,
    group_segment_name,
    pid_namespace,
    reclaim_stale_segments,
    shm_names,
)
from ketch.kernels.collective import Group, PaddleGroup, ShmGroup, tp_environment

logger = logging.getLogger(__name__)

_POLL_MS = 500
COLLECTIVE_ENV = "KETCH_TP_COLLECTIVE"  # shm (default) | paddle
COLLECTIVES = ("shm", "paddle")


def free_tcp_port() -> int:
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class WorkerDiedError(RuntimeError):
    """The worker process exited; the engine cannot step any more."""


def run_worker(
    config: RunnerConfig,
    port: int,
    parent_pid: int,
    address: str,
    rank: int = 0,
    environment: dict[str, str] | None = None,
) -> None:
    """Worker entry point: map the shared KV cache, load the model, execute steps.

    The engine owns the shared memory and cleans up, so this process may end at any moment:
    SIGTERM (or the engine's death, through ``exit_with_parent``) ends it at once."""
    exit_with_parent(parent_pid)
    os.environ.update(environment or {})
    prefix = f"worker {rank}" if config.tensor_parallel_size > 1 else "worker"
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {prefix}: %(message)s")
    kv_name, status_name = shm_names(port)
    gpu = parse_device(config.device).is_gpu  # a GPU's KV cache is device memory, not /dev/shm
    kv_shm = None if gpu else attach_segment(kv_name)  # the engine's
    status_shm = attach_segment(status_name)
    status = np.ndarray((STATUS_SLOTS,), dtype=np.float64, buffer=status_shm.buf)
    # Replaces paddle's fatal-error report. os._exit: nothing here needs cleaning up, and an
    # interpreter shutdown could wait forever on a reply queued for a dead engine.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    group = _group(config.tensor_parallel_size, rank, port, parent_pid, gpu)
    kv_buffer = None if kv_shm is None else kv_shm.buf
    runner = ModelRunner(config, kv_buffer=kv_buffer, rank=rank, group=group)
    socket = zmq.Context().socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, _POLL_MS * 4)  # never block forever on a dead engine
    socket.connect(address)
    refusals = BadMessages("worker")
    parent = os.getppid()
    answers = rank == 0
    if answers:
        status[0] = 1.0
    socket.send(b"ready %d" % runner.weight_bytes)  # the engine reports the instance's total
    while True:
        if answers:
            status[2] = time.monotonic()
        if not socket.poll(_POLL_MS):
            if os.getppid() != parent:
                os._exit(0)  # the engine is gone
            continue
        output = _execute(runner, socket.recv_multipart(), refusals)
        if answers:
            try:
                socket.send(encode_result(output))
            except zmq.Again:
                os._exit(0)  # the engine stopped listening
            status[1] += 1
            runner.prepare_next_step()  # while the engine schedules the next step
        if os.getppid() != parent:
            os._exit(0)


def _group(world: int, rank: int, port: int, parent_pid: int, gpu: bool = False) -> Group | None:
    """The ranks' collectives: the shared-memory group, or paddle.distributed where
    ``KETCH_TP_COLLECTIVE=paddle`` (gloo on the CPU: 1-3 ms an all-reduce here, against tens of
    microseconds; the reference) or the device is a GPU (NCCL; never run)."""
    if world == 1:
        return None
    if gpu or os.environ.get(COLLECTIVE_ENV) == "paddle":
        return PaddleGroup(on_gpu=gpu)
    segment = attach_segment(group_segment_name(port))
    group = ShmGroup(segment.buf, rank, world, parent_pid=parent_pid)
    group.segment = segment  # closing the mapping under the group's views would crash it
    return group


def _ready_bytes(message: bytes) -> int:
    """The weight bytes in a rank's ``ready <bytes>`` (0 if it sent none)."""
    word = message.split(b" ", 1)[1:] if message.startswith(b"ready") else []
    return int(word[0]) if word and word[0].isdigit() and len(word[0]) < 20 else 0


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
    """The engine's model runner when the model runs in worker processes (one per
    tensor-parallel rank)."""

    def __init__(self, config: RunnerConfig, port: int, start_timeout: float = 600.0) -> None:
        world = config.tensor_parallel_size
        check_main_guard("tensor parallelism" if world > 1 else "this engine")
        if os.environ.get(COLLECTIVE_ENV, "shm") not in COLLECTIVES:
            raise ValueError(
                f"{COLLECTIVE_ENV}={os.environ[COLLECTIVE_ENV]!r}: choose one of "
                f"{', '.join(COLLECTIVES)}"
            )
        self.device = parse_device(config.device)
        if self.device.is_gpu and os.environ.get(COLLECTIVE_ENV) == "shm":
            raise ValueError(f"{COLLECTIVE_ENV}=shm: the shared-memory all-reduce is CPU only")
        if config.num_threads is None:
            # The API server and the engine need a core too: a worker that takes them all
            # stalls in its own thread barriers (measured on 2 cores: 1 thread serves 1.46x
            # the requests/s of 2). Tensor-parallel ranks share what is left.
            cores = len(os.sched_getaffinity(0))
            config = dataclasses.replace(config, num_threads=max(1, (cores - 1) // world))
        mc = config.model_config
        size = KVCache.model_nbytes(mc, config)
        reclaim_stale_segments()
        kv_name, status_name = shm_names(port)
        self._segments: list[SharedMemory] = []
        self._addresses: list[str] = []
        self._sockets: list[zmq.Socket] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        context = zmq.Context.instance()
        try:
            for rank in range(world):
                self._sockets.append(self._bind(context, port, rank))
            status = fresh_segment(status_name, STATUS_BYTES)
            self._segments.append(status)
            if not self.device.is_gpu:  # a GPU's KV cache is device memory
                self._segments.append(fresh_segment(kv_name, size))
            if world > 1 and not self.device.is_gpu:
                self._segments.append(
                    fresh_segment(group_segment_name(port), ShmGroup.nbytes(world))
                )
            self.status = np.ndarray((STATUS_SLOTS,), np.float64, buffer=status.buf)
            self.status[ENGINE_HEARTBEAT] = time.monotonic()
            self.status[PID_NAMESPACE] = pid_namespace()
            self._start(config, port, world)
            self.weight_bytes = 0  # every rank's, as each reports it when ready
            for rank in range(world):
                self.weight_bytes += _ready_bytes(self._receive(start_timeout, "start", rank))
        except BaseException:  # SIGTERM while loading included: leave nothing behind
            self.close()
            raise

    @property
    def process(self) -> multiprocessing.process.BaseProcess:
        """Rank 0's process (the only one without tensor parallelism)."""
        return self.processes[0]

    def _bind(self, context: zmq.Context, port: int, rank: int) -> zmq.Socket:
        socket = context.socket(zmq.PAIR)
        socket.setsockopt(zmq.SNDTIMEO, _POLL_MS)
        socket.setsockopt(zmq.LINGER, 0)
        address = rundir.worker_address(port, rank)
        try:
            rundir.claim(address, f"--engine-worker-queue-port {port}")
            socket.bind(address)
        except (ValueError, zmq.ZMQError) as exc:
            socket.close(linger=0)
            if isinstance(exc, ValueError):
                raise  # not ours: leave it
            rundir.release(address)
            raise ValueError(f"--engine-worker-queue-port {port}: cannot bind: {exc}") from exc
        self._addresses.append(address)
        return socket

    def _start(self, config: RunnerConfig, port: int, world: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        environments: list[dict[str, str]] = [{} for _ in range(world)]
        if world > 1 and (self.device.is_gpu or os.environ.get(COLLECTIVE_ENV) == "paddle"):
            endpoints = [f"127.0.0.1:{free_tcp_port()}" for _ in range(world)]
            gpus = [d.index if d.is_gpu else None for d in rank_devices(self.device, world)]
            environments = [tp_environment(r, endpoints, gpus[r]) for r in range(world)]
        for rank in range(world):
            process = spawn.Process(
                target=run_worker,
                args=(config, port, os.getpid(), self._addresses[rank], rank, environments[rank]),
                name="ketch-worker" if world == 1 else f"ketch-worker-{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        data = encode_step(sched)
        self.check_alive()
        for socket in self._sockets:  # the same bytes to every rank
            while True:
                try:
                    socket.send(data)  # PAIR blocks while no peer is connected: bounded
                    break
                except zmq.Again:
                    self.check_alive()  # a rank that never reads again has exited
        output = decode_result(self._receive(None, what="step"))
        if output.refused is not None:  # nothing was applied: fail what the step named
            logger.error("the worker refused a step: %s", output.refused)
            why = f"the worker refused the step: {output.refused}"
            output.failed = dict.fromkeys(sched.num_scheduled_tokens, why)
        return output

    def check_alive(self) -> None:
        self.status[ENGINE_HEARTBEAT] = time.monotonic()  # shm.reclaim_stale_segments reads it
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerDiedError(f"{self._name(rank)} exited (exit code {process.exitcode})")

    def _name(self, rank: int) -> str:
        if len(self.processes) == 1:
            return "the worker process"
        return f"the worker process of tensor-parallel rank {rank}"

    def _receive(self, timeout: float | None, what: str, rank: int = 0) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        socket = self._sockets[rank]
        while not socket.poll(_POLL_MS):
            self.status[ENGINE_HEARTBEAT] = time.monotonic()
            for r, process in enumerate(self.processes):
                if not process.is_alive():
                    raise WorkerDiedError(
                        f"{self._name(r)} exited (exit code {process.exitcode}) during {what}"
                    )
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"{self._name(rank)} did not {what} within {timeout:.0f} s")
        return socket.recv()

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
        for socket in self._sockets:
            socket.close(linger=0)
        self._sockets = []
        for address in self._addresses:
            rundir.release(address)
        self._addresses = []
        for segment in self._segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
        self._segments = []
