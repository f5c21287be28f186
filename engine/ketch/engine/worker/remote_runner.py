"""The engine's handle on its worker processes (``RemoteRunner``): starts one per
tensor-parallel rank (``worker_process.run_worker``), owns the shared-memory segments and the
engine-worker queues, sends each step and reads the sampled tokens back.

The engine encodes each step once and writes the same frame to every rank's queue; only rank 0
answers. Any rank that exits fails the instance: the engine watches them all, and stops the
others. The KV cache and status segments are the engine's: it creates them before the workers
start and unlinks them when it closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import socket as socketlib
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import zmq

from ketch.engine import rundir
from ketch.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ketch.engine.device import parse_device, rank_devices
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.main_guard import check_main_guard
from ketch.engine.worker.messages import decode_result, encode_step
from ketch.engine.worker.runner_config import RunnerConfig
from ketch.engine.worker.shm import (
    ENGINE_HEARTBEAT,
    PID_NAMESPACE,
    STATUS_BYTES,
    STATUS_SLOTS,
    fresh_segment,
    group_segment_name,
    pid_namespace,
    reclaim_stale_segments,
    shm_names,
)
from ketch.engine.worker.worker_process import COLLECTIVE_ENV, POLL_MS, run_worker
from ketch.kernels.collective import ShmGroup, tp_environment

logger = logging.getLogger(__name__)

COLLECTIVES = ("shm", "paddle")


def free_tcp_port() -> int:
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class WorkerDiedError(RuntimeError):
    """The worker process exited; the engine cannot step any more."""


def _ready_bytes(message: bytes) -> int:
    """The weight bytes in a rank's ``ready <bytes>`` (0 if it sent none)."""
    word = message.split(b" ", 1)[1:] if message.startswith(b"ready") else []
    return int(word[0]) if word and word[0].isdigit() and len(word[0]) < 20 else 0


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
        socket.setsockopt(zmq.SNDTIMEO, POLL_MS)
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
        while not socket.poll(POLL_MS):
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
