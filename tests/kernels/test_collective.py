"""The tensor-parallel collectives (``ketch.kernels.collective``) against their reference: the
sum of every rank's tensor in rank order, computed here from the inputs each rank draws.

Each case runs on real spawned ranks sharing one segment (``tp_harness.run_ranks``), with a
small slot so that tensors larger than it are reduced in chunks."""

from __future__ import annotations

import numpy as np
import pytest
from tp_harness import run_ranks

SLOT = 1 << 12  # 4 KiB a rank: 1024 float32 elements
TIMEOUT_S = 20.0


def inputs(rank: int, shapes: list[tuple[int, ...]], dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    if dtype == "int32":
        return [rng.integers(-(2**20), 2**20, s, dtype=np.int32) for s in shapes]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def reduce_job(group, shapes, dtype):
    import paddle

    return [
        group.all_reduce(paddle.to_tensor(x)).numpy() for x in inputs(group.rank, shapes, dtype)
    ]


def broadcast_job(group, payloads):
    return [group.broadcast_bytes(p if group.rank == 0 else None) for p in payloads]


def mismatch_job(group):
    import paddle

    return group.all_reduce(paddle.ones([3 + group.rank])).numpy()


def absent_job(group):
    import paddle

    if group.rank == 1:
        return "stayed away"
    return group.all_reduce(paddle.ones([4])).numpy()


SHAPES = [(1, 64), (32, 64), (5000,), (0, 64), (3, 7), (1024,), (1025,)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_all_reduce_equals_the_rank_order_sum(world: int, dtype: str) -> None:
    results = run_ranks(reduce_job, world, SLOT, SHAPES, dtype, TIMEOUT_S)
    assert not any(isinstance(r, str) for r in results), results
    drawn = [inputs(r, SHAPES, dtype) for r in range(world)]
    for i, shape in enumerate(SHAPES):
        want = drawn[0][i].copy()
        for r in range(1, world):
            want = want + drawn[r][i]
        for rank in range(world):
            got = results[rank][i]
            assert got.shape == shape and got.dtype == want.dtype
            # the same bits on every rank, equal to the reference (summed in the same order)
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, shape {shape}")


def test_broadcast_bytes_of_every_length() -> None:
    payloads = [b"", b"x", b"abc", b"abcd", bytes(range(256)) * 40, b"\xff" * 9999]
    results = run_ranks(broadcast_job, 2, SLOT, payloads, TIMEOUT_S)
    assert results == [payloads, payloads]


def test_ranks_bringing_different_sizes_fail_on_every_rank() -> None:
    results = run_ranks(mismatch_job, 2, SLOT, TIMEOUT_S)
    for result in results:
        assert isinstance(result, str) and "disagree on the all-reduce" in result, result


def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang() -> None:
    results = run_ranks(absent_job, 2, SLOT, 1.0)
    assert results[1] == "stayed away"
    assert isinstance(results[0], str) and "did not reach the all-reduce" in results[0]


def test_group_arguments_are_checked() -> None:
    from ketch.kernels.collective import ShmGroup

    buffer = memoryview(bytearray(ShmGroup.nbytes(2, SLOT)))
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        ShmGroup(buffer, 2, 2, slot_bytes=SLOT)
    with pytest.raises(ValueError, match="multiple of 8"):
        ShmGroup(buffer, 0, 2, slot_bytes=12)
    with pytest.raises(ValueError, match="the group needs more"):
        ShmGroup(buffer[:-1], 0, 2, slot_bytes=SLOT)
