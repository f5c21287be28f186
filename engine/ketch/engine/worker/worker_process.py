"""The worker process: maps the shared KV cache, loads the model and runs the steps the engine
sends (``run_worker``); the engine's side of it is ``remote_runner.RemoteRunner``.

The engine sends each step's changes over the engine-worker queue (a ZMQ PAIR on the Unix
socket ``worker-<engine_worker_queue_port>.sock`` in the private run directory, so no other
user can pose as either side) and gets the sampled tokens back. The KV cache lives in a named
POSIX shared-memory segment (``ketch-kv-<port>``) so the cache-manager sidecar can map the same
blocks; a small shared status block carries the worker's liveness signals (ready flag, step
count, heartbeat). Either side that loses the other exits, so nothing is left orphaned.

Tensor parallelism (``tensor_parallel_size`` N > 1): N worker processes, one per rank, each with
its own queue (``worker-<port>-rank<r>.sock`` for r > 0); every rank runs the same steps in
lockstep through their all-reduces, which meet in the ``ketch-tp-<port>`` segment, and only rank
0 answers. Every rank views its KV heads in the one ``ketch-kv-<port>`` segment.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import zmq

from ketch.engine.core.scheduler_output import ModelRunnerOutput
from ketch.engine.device import parse_device
from ketch.engine.lifecycle import exit_with_parent
from ketch.engine.wire import BadMessages, MessageError
from ketch.engine.worker.messages import decode_step, encode_result
from ketch.engine.worker.model_runner import ModelRunner
from ketch.engine.worker.runner_config import RunnerConfig
from ketch.engine.worker.shm import STATUS_SLOTS, attach_segment, group_segment_name, shm_names
from ketch.kernels.collective import Group, PaddleGroup, ShmGroup

logger = logging.getLogger(__name__)

POLL_MS = 500  # how long either side waits on its queue before checking on the other
COLLECTIVE_ENV = "KETCH_TP_COLLECTIVE"  # shm (default) | paddle


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
    socket.setsockopt(zmq.SNDTIMEO, POLL_MS * 4)  # never block forever on a dead engine
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
        if not socket.poll(POLL_MS):
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
