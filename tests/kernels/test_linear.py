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


def test_choose_matmul_takes_the_faster_per_row_count() -> None:
    """The chooser times real calls: a matmul made slow for wide inputs loses only there."""
    import time

    from ketch.kernels.linear import RowDispatch, choose_matmul

    def slow_when_wide(x, w):
        if x.shape[0] >= 16:
            time.sleep(0.002)
        return paddle.matmul(x, w)

    def slow_when_narrow(x, w):
        if x.shape[0] < 16:
            time.sleep(0.002)
        return paddle.matmul(x, w)

    w = paddle.randn([64, 32])
    matmul, line = choose_matmul([w], candidates={"a": slow_when_wide, "b": slow_when_narrow})
    assert isinstance(matmul, RowDispatch), line
    # Each row count goes to the one that does not sleep there.
    assert matmul.pick(1) is slow_when_wide and matmul.pick(8) is slow_when_wide
    assert matmul.pick(32) is slow_when_narrow and matmul.pick(10_000) is slow_when_narrow
    assert "1 rows" in line and "256 rows" in line
    x = paddle.randn([3, 5, 64])  # 15 rows: nearest measured count 8
    assert rel_err(matmul(x, w), linear_reference(x, w)) <= TOLERANCE


def test_choose_matmul_env_override_and_one_winner(monkeypatch: pytest.MonkeyPatch) -> None:
    from ketch.kernels.linear import ENV, Linear, choose_matmul

    w = paddle.randn([16, 8])
    monkeypatch.setenv(ENV, "paddle")
    matmul, line = choose_matmul([w])
    assert matmul is paddle.matmul and ENV in line
    monkeypatch.setenv(ENV, "openblas")
    matmul, _ = choose_matmul([w], num_threads=1)
    assert isinstance(matmul, Linear)
    monkeypatch.setenv(ENV, "fastest-please")
    with pytest.raises(ValueError, match=ENV):
        choose_matmul([w])
    monkeypatch.delenv(ENV)
    matmul, line = choose_matmul([w])  # measured: whichever wins, the answer is the reference's
    x = paddle.randn([300, 16])
    assert rel_err(matmul(x, w), linear_reference(x, w)) <= TOLERANCE and "matmul:" in line


def test_row_dispatch_refuses_bad_tables_and_takes_any_row_count() -> None:
    from ketch.kernels.linear import RowDispatch

    for rows, matmuls in [((), ()), ((8, 1), (paddle.matmul,) * 2), ((1, 8), (paddle.matmul,))]:
        with pytest.raises(ValueError, match="rows must be"):
            RowDispatch(rows, matmuls)
    first, second = (lambda x, w: paddle.matmul(x, w)), (lambda x, w: paddle.matmul(x, w))
    table = RowDispatch((1, 32), (first, second))
    assert table.pick(0) is first and table.pick(5) is first  # edge: sqrt(32) ~ 5.7
    assert table.pick(6) is second and table.pick(2**62) is second
    w = paddle.randn([4, 3])
    assert table(paddle.zeros([0, 4]), w).shape == [0, 3]  # an empty step


def test_big_weights_are_timed_on_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 150k-word lm_head must not cost seconds at start-up: only its first columns are timed."""
    from ketch.kernels import linear

    seen = []

    def record(x, w):
        seen.append(tuple(w.shape))
        return paddle.matmul(x, w)

    monkeypatch.setattr(linear, "_MAX_MEASURED_ELEMENTS", 64 * 100)
    big, small = paddle.randn([64, 5000]), paddle.randn([64, 10])
    linear.choose_matmul([big, small], candidates={"a": record, "b": paddle.matmul}, rows=(2,))
    assert set(seen) == {(64, 100), (64, 10)}


def test_packed_gemm_of_finds_or_makes_the_packed_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a MoE model's fused experts run on: the packed GEMM in the measured matmul, else
    this CPU's (with the winner's threads) unless KETCH_MATMUL forced another matmul."""
    from ketch.kernels.linear import ENV, RowDispatch, packed_gemm_of
    from ketch.kernels.packed_linear import PackedLinear

    packed = PackedLinear("generic", 2)
    assert packed_gemm_of(packed) is packed
    assert packed_gemm_of(RowDispatch((1, 32), (Linear(1), packed))) is packed
    monkeypatch.delenv(ENV, raising=False)
    made = packed_gemm_of(Linear(3))
    assert isinstance(made, PackedLinear) and made.num_threads == 3
    assert isinstance(packed_gemm_of(paddle.matmul), PackedLinear)
    monkeypatch.setenv(ENV, "openblas")
    assert packed_gemm_of(Linear(1)) is None
    assert packed_gemm_of(packed) is packed
