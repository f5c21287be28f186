"""The native backend's GEMM (``ketch_linear``, OpenBLAS) against its reference, paddle.matmul.

Random shapes around the kernel's own boundaries (the GEMV path below 4 rows, one row, empty
inputs, sizes that are no multiple of any SIMD width), 2-D and 3-D inputs, non-contiguous
operands, one and two threads; float32, error at most 1e-5 of the largest output value. Bad
operands are refused with a message naming the problem, and the process goes on.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ketch.kernels.linear import Linear, linear_reference, select_linear

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def linear() -> Linear:
    kernel = select_linear(1)
    assert kernel is not None, "the GEMM library must build where the test extra is installed"
    return kernel


def rel_err(out: paddle.Tensor, ref: paddle.Tensor) -> float:
    o, r = out.numpy(), ref.numpy()
    assert o.shape == r.shape and o.dtype == np.float32
    scale = max(float(np.abs(r).max()), 1e-30)
    return float(np.abs(o - r).max()) / scale


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 512, 2816), (2, 33, 7), (3, 1408, 512), (4, 64, 64), (5, 17, 1), (7, 1, 9),
     (64, 512, 768), (129, 130, 131), (300, 96, 2048)],
)  # fmt: skip
def test_matches_the_reference(linear: Linear, m: int, k: int, n: int, threads: int) -> None:
    rng = np.random.default_rng(m * 1000 + k + n)
    x = paddle.to_tensor(rng.standard_normal((m, k), np.float32))
    w = paddle.to_tensor(rng.standard_normal((k, n), np.float32))
    kernel = Linear(threads)
    assert rel_err(kernel(x, w), linear_reference(x, w)) <= TOLERANCE


def test_batched_input_and_views(linear: Linear) -> None:
    rng = np.random.default_rng(1)
    x = paddle.to_tensor(rng.standard_normal((3, 5, 40), np.float32))
    w = paddle.to_tensor(rng.standard_normal((40, 24), np.float32))
    out = linear(x, w)
    assert out.shape == [3, 5, 24]
    assert rel_err(out, linear_reference(x, w)) <= TOLERANCE
    # Non-contiguous operands (a transposed weight, a strided slice of the input).
    wt = paddle.to_tensor(rng.standard_normal((24, 40), np.float32)).transpose([1, 0])
    xs = paddle.to_tensor(rng.standard_normal((10, 40), np.float32))[::2]
    assert rel_err(linear(xs, wt), linear_reference(xs, wt)) <= TOLERANCE


def test_empty_operands(linear: Linear) -> None:
    x = paddle.zeros([0, 8], "float32")
    w = paddle.ones([8, 3], "float32")
    assert linear(x, w).shape == [0, 3]
    x = paddle.ones([2, 0], "float32")
    out = linear(x, paddle.zeros([0, 3], "float32"))
    assert out.shape == [2, 3] and not out.numpy().any()


@pytest.mark.parametrize(
    "x,w,message",
    [
        (paddle.ones([2, 8], "float32"), paddle.ones([7, 3], "float32"), "last dimension"),
        (paddle.ones([2, 8], "float64"), paddle.ones([8, 3], "float64"), "float32"),
        (paddle.ones([2, 8], "float32"), paddle.ones([8], "float32"), r"\[K, N\]"),
    ],
)
def test_bad_operands_are_refused(linear: Linear, x, w, message: str) -> None:
    with pytest.raises(Exception, match=message):
        linear(x, w)
    ok = linear(paddle.ones([2, 8], "float32"), paddle.ones([8, 3], "float32"))
    assert float(ok.sum()) == 48.0  # the process and the kernel go on
