"""Collectives between the tensor-parallel ranks of one engine: ``all_reduce`` of the row-parallel
matmuls' partial sums, and ``broadcast_bytes`` of rank 0's sampling decisions.

Two implementations of one interface (``Group``):

- ``ShmGroup`` (the CPU default): the ranks are processes on one machine, so they meet in one
  shared-memory segment (``ketch_shm_all_reduce`` in ``csrc/comm.cc``): each rank copies its
  part in, publishes a sequence number, spins (yielding the core) until every rank has, and sums
  the parts in rank order, so every rank holds the same bits. Measured on a 2-core machine: a
  [32, 512] float32 all-reduce in tens of microseconds (benchmarks/bench_tp.py).
- ``PaddleGroup``: ``paddle.distributed`` (gloo on the CPU, NCCL on GPUs), initialised from the
  environment the engine gives each worker. On the CPU its gloo all-reduce took 1-3 ms per call
  here (one per row-parallel matmul: 16 per step for an 8-layer model), so it is the GPU path and
  the reference the shared-memory group is tested against.

The reference for ``all_reduce`` is the sum of the ranks' tensors in rank order (tests compare
both groups to it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # numpy and paddle are imported where they are used: the operator (whose
    import paddle  # image has neither) sizes the segment with ShmGroup.nbytes

CTRL_STRIDE = 16  # int64 slots per rank in the control block (csrc/comm.cc)
DEFAULT_SLOT_BYTES = 4 << 20  # per rank and buffer: larger tensors are reduced in chunks
MAX_BROADCAST_BYTES = (1 << 31) - 4


class Group(Protocol):
    rank: int
    world: int

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor: ...

    def broadcast_bytes(self, payload: bytes | None) -> bytes: ...


class ShmGroup:
    """One rank's handle on the group's shared-memory segment (made by the engine, zeroed,
    ``nbytes(world, slot_bytes)`` long; every rank maps the same one)."""

    def __init__(
        self,
        buffer: memoryview,
        rank: int,
        world: int,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 120.0,
        parent_pid: int = 0,
    ) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a group of {world}")
        if slot_bytes <= 0 or slot_bytes % 8:
            raise ValueError(f"slot_bytes must be a positive multiple of 8, not {slot_bytes}")
        if len(buffer) < self.nbytes(world, slot_bytes):
            raise ValueError(f"the segment holds {len(buffer)} bytes, the group needs more")
        import numpy as np
        import paddle

        from ketch.kernels import cpp_ops

        self._op = cpp_ops.ops().ketch_shm_all_reduce
        self.rank, self.world = rank, world
        ctrl = world * CTRL_STRIDE
        words = 2 * world * slot_bytes // 8
        array = np.ndarray((ctrl + words,), dtype=np.int64, buffer=buffer)
        self._ctrl = paddle.from_dlpack(array[:ctrl])
        self._data = paddle.from_dlpack(array[ctrl:])
        self._attrs = (rank, world, int(timeout_s * 1000), parent_pid)

    @staticmethod
    def nbytes(world: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
        return 8 * world * CTRL_STRIDE + 2 * world * slot_bytes

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._op(x, self._ctrl, self._data, *self._attrs)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        return _broadcast_bytes(self, payload)


class PaddleGroup:
    """``paddle.distributed`` over the ranks the environment names (``PADDLE_TRAINER_ID``,
    ``PADDLE_TRAINERS_NUM``, ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_CURRENT_ENDPOINT``; on a
    GPU also ``FLAGS_selected_gpus`` and ``PADDLE_DISTRI_BACKEND=nccl``: ``tp_environment``).

    ``on_gpu``: the tensors it reduces live on the GPU (NCCL takes no host tensors), so
    ``broadcast_bytes`` copies its words there. The NCCL path has never been run."""

    def __init__(self, on_gpu: bool = False) -> None:
        import paddle
        import paddle.distributed as dist

        dist.init_parallel_env()
        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._words = paddle.to_tensor if on_gpu else None

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        out = x.clone()  # paddle.distributed reduces in place
        self._dist.all_reduce(out)
        return out

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        return _broadcast_bytes(self, payload, self._words)


def _broadcast_bytes(group: Group, payload: bytes | None, words_tensor=None) -> bytes:
    """Rank 0's ``payload`` on every rank (the others pass None): an int32 all-reduce where the
    other ranks bring zeros, which adds exactly. ``words_tensor`` makes the words a tensor
    (default ``paddle.from_dlpack``, no copy)."""
    import numpy as np
    import paddle

    words_tensor = words_tensor or paddle.from_dlpack

    if group.rank == 0:
        if payload is None or len(payload) > MAX_BROADCAST_BYTES:
            raise ValueError("rank 0 broadcasts bytes of at most 2 GiB")
        length = len(payload)
    else:
        length = 0
    n = int(group.all_reduce(paddle.to_tensor([length], dtype=paddle.int32)).numpy()[0])
    words = np.zeros((n + 3) // 4, dtype=np.int32)
    if group.rank == 0:
        words.view(np.uint8)[:n] = np.frombuffer(payload, dtype=np.uint8)
    out = group.all_reduce(words_tensor(words))
    return out.numpy().view(np.uint8)[:n].tobytes()


def tp_environment(rank: int, endpoints: list[str], gpu: int | None = None) -> dict[str, str]:
    """The environment ``PaddleGroup`` initialises from, for rank ``rank`` of ``endpoints``;
    with ``gpu``, NCCL on that GPU (``init_parallel_env`` reads ``FLAGS_selected_gpus`` for the
    rank's device: paddle.distributed.ParallelEnv's documented ``device_id``)."""
    environment = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_DISTRI_BACKEND": os.environ.get("PADDLE_DISTRI_BACKEND", "gloo"),
    }
    if gpu is not None:
        environment.update(PADDLE_DISTRI_BACKEND="nccl", FLAGS_selected_gpus=str(gpu))
    return environment
