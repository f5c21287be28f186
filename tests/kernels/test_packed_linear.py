"""The packed-weight GEMM (``ketch_pack_weight`` + ``ketch_packed_linear``) against its
reference, paddle.matmul on the unpacked weight, for every instruction set this CPU can run.

Shapes straddle the kernel's own boundaries: one row, row counts around the register tiles
(4, 6, 12) and the row blocks, columns that fill no panel or leave one partly empty, K = 1,
empty inputs; 2-D and 3-D inputs, non-contiguous operands, a fused bias, one and two threads;
float32, error at most 1e-5 of the largest output value. Bad operands are refused with a message
naming the problem, and the process goes on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from ketch.kernels.cpu_features import CpuFeatures
from ketch.kernels.linear import Forms, RowDispatch, choose_matmul, linear_reference
from ketch.kernels.packed_linear import (
    AVX2_OP,
    AVX512_OP,
    PANEL_WIDTH,
    PackedLinear,
    PackedWeight,
    select_packed_linear,
    swiglu_reference,
)

TOLERANCE = 1e-5
FEATURES = CpuFeatures.detect()
RUNNABLE = ["generic"]
RUNNABLE += ["avx2"] if FEATURES.can_run(AVX2_OP) else []
RUNNABLE += ["avx512"] if FEATURES.can_run(AVX512_OP) else []


def rel_err(out: paddle.Tensor, ref: np.ndarray) -> float:
    o = out.numpy()
    assert o.shape == ref.shape and o.dtype == np.float32
    return float(np.abs(o - ref).max()) / max(float(np.abs(ref).max()), 1e-30)


def operands(m: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    b = rng.standard_normal(n, np.float32)
    return x, w, b


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 512, 2816), (2, 33, 7), (3, 1408, 512), (4, 64, 64), (5, 17, 1), (6, 1, 9),
     (8, 40, 48), (12, 31, 33), (13, 512, 768), (25, 130, 96), (64, 512, 768),
     (129, 130, 131), (300, 96, 2048), (700, 64, 40)],
)  # fmt: skip
def test_matches_the_reference(isa: str, threads: int, m: int, k: int, n: int) -> None:
    x, w, b = operands(m, k, n, m * 1000 + k + n)
    kernel = PackedLinear(isa, threads)
    packed = kernel.prepare(paddle.to_tensor(w))
    nr = PANEL_WIDTH[isa]
    assert list(packed.data.shape) == [-(-n // nr), k, nr] and packed.shape == [k, n]
    ref = linear_reference(paddle.to_tensor(x), paddle.to_tensor(w)).numpy()
    assert rel_err(kernel(paddle.to_tensor(x), packed), ref) <= TOLERANCE
    with_bias = kernel(paddle.to_tensor(x), packed, paddle.to_tensor(b))
    assert rel_err(with_bias, ref + b) <= TOLERANCE


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,k,inter",
    [(1, 512, 1408), (2, 33, 3), (5, 64, 8), (6, 17, 16), (12, 40, 17), (13, 96, 40),
     (32, 512, 1408), (70, 31, 100), (300, 64, 2)],
)  # fmt: skip
def test_glu_matches_swiglu_of_the_product(isa: str, threads: int, m: int, k: int, inter: int):
    """[gate | up] packed with glu: silu(x @ gate) * (x @ up), SwiGLU fused in the epilogue."""
    x, w, _ = operands(m, k, 2 * inter, m + k + inter)
    x, w = paddle.to_tensor(x * 2), paddle.to_tensor(w)  # spread gates over silu's curve
    kernel = PackedLinear(isa, threads)
    packed = kernel.prepare(w, glu=True)
    assert packed.n == inter and packed.shape == [k, 2 * inter]
    out = kernel(x, packed)
    assert out.shape == [m, inter]
    assert rel_err(out, swiglu_reference(x, w).numpy()) <= TOLERANCE
    with pytest.raises(ValueError, match="no bias"):
        kernel(x, packed, paddle.ones([inter]))


@pytest.mark.parametrize("isa", RUNNABLE)
def test_batched_input_views_and_empty(isa: str) -> None:
    kernel = PackedLinear(isa)
    rng = np.random.default_rng(1)
    x = paddle.to_tensor(rng.standard_normal((3, 5, 40), np.float32))
    w = paddle.to_tensor(rng.standard_normal((40, 24), np.float32))
    out = kernel(x, kernel.prepare(w))
    assert out.shape == [3, 5, 24]
    assert rel_err(out, linear_reference(x, w).numpy()) <= TOLERANCE
    # Non-contiguous operands: a transposed weight to pack, a strided slice of the input.
    wt = paddle.to_tensor(rng.standard_normal((24, 40), np.float32)).transpose([1, 0])
    xs = paddle.to_tensor(rng.standard_normal((10, 40), np.float32))[::2]
    assert rel_err(kernel(xs, kernel.prepare(wt)), linear_reference(xs, wt).numpy()) <= TOLERANCE
    assert kernel(paddle.zeros([0, 8]), kernel.prepare(paddle.ones([8, 3]))).shape == [0, 3]
    out = kernel(paddle.ones([2, 0]), kernel.prepare(paddle.zeros([0, 3])), paddle.ones([3]))
    assert out.shape == [2, 3] and (out.numpy() == 1).all()  # K = 0: the bias alone
    assert kernel(paddle.ones([2, 8]), kernel.prepare(paddle.zeros([8, 0]))).shape == [2, 0]


def test_bad_operands_are_refused() -> None:
    ops = __import__("ketch.kernels.cpp_ops", fromlist=["ops"]).ops()
    kernel = PackedLinear("generic")
    packed = kernel.prepare(paddle.ones([8, 3]))
    glu = kernel.prepare(paddle.ones([8, 4]), glu=True)
    ones = paddle.ones([2, 8])
    linear = ops.ketch_packed_linear
    cases = [
        (lambda: kernel(paddle.ones([2, 7]), packed), "last dimension"),
        (lambda: kernel(ones.astype("float64"), packed), "float32"),
        (lambda: kernel(ones, packed, paddle.ones([4])), "bias must be"),
        (lambda: linear(ones, packed.data, None, 9, "generic", 1, False), "panels"),
        (lambda: linear(ones, packed.data, None, 2**31 - 1, "generic", 1, False), "n ="),
        (lambda: linear(ones, packed.data, None, 3, "avx2", 1, False), "packed must"),
        (lambda: linear(ones, packed.data, None, 3, "sse9", 1, False), "unknown isa"),
        (lambda: ops.ketch_pack_weight(paddle.ones([8]), "generic", False), r"\[K, N\]"),
        (lambda: ops.ketch_pack_weight(paddle.ones([8, 5]), "generic", True), "even N"),
        (lambda: linear(ones, glu.data, paddle.ones([2]), 2, "generic", 1, True), "no bias"),
    ]
    for call, message in cases:
        with pytest.raises(Exception, match=message):
            call()
    with pytest.raises(TypeError, match="packed for avx2"):
        PackedLinear("avx2")(ones, packed)  # a generic layout handed to the AVX2 kernel
    with pytest.raises(ValueError, match="unknown isa"):
        PackedLinear("neon")
    assert float(kernel(ones, packed).sum()) == 48.0  # the process and the kernel go on


def test_select_follows_the_cpu_features() -> None:
    def features(*flags: str) -> CpuFeatures:
        return CpuFeatures(frozenset(flags), "test")

    avx512 = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
    assert select_packed_linear(features(*avx512), 3) == PackedLinear("avx512", 3)
    assert select_packed_linear(features("avx", "avx2", "fma")).isa == "avx2"
    assert select_packed_linear(features("avx", "avx2")).isa == "generic"  # no FMA
    assert select_packed_linear(features()).isa == "generic"


def test_row_dispatch_keeps_each_band_its_layout() -> None:
    """A dispatch over the packed GEMM and paddle.matmul prepares each weight once per distinct
    matmul and hands each band its own form."""
    packed = PackedLinear("generic")
    calls = []

    def plain(x, w):
        calls.append(type(w).__name__)
        return paddle.matmul(x, w)

    dispatch = RowDispatch((1, 8, 64), (packed, packed, plain))
    x, w, _ = operands(70, 16, 20, 3)
    forms = dispatch.prepare(paddle.to_tensor(w))
    assert isinstance(forms, Forms) and forms.forms[0] is forms.forms[1]
    assert isinstance(forms.forms[0], PackedWeight) and forms.shape == [16, 20]
    ref = x @ w
    for m in (1, 5, 70):
        out = dispatch(paddle.to_tensor(x[:m]), forms)
        assert rel_err(out, ref[:m]) <= TOLERANCE
    assert calls == ["Tensor"]  # only the 70-row call went to the plain matmul


def test_choose_matmul_measures_the_packed_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    w = paddle.randn([64, 96])
    monkeypatch.setenv("KETCH_MATMUL", "packed")
    matmul, line = choose_matmul([w], num_threads=2)
    assert isinstance(matmul, PackedLinear) and matmul.num_threads == 2 and "KETCH_MATMUL" in line
    monkeypatch.setenv("KETCH_MATMUL", "auto")
    matmul, line = choose_matmul([w], rows=(1, 16))
    assert "packed" in line, line  # measured against the others
    x = paddle.randn([16, 64])
    form = getattr(matmul, "prepare", lambda w: w)(w)
    assert rel_err(matmul(x, form), linear_reference(x, w).numpy()) <= TOLERANCE


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a read-only bind mount needs root and unshare",
)
def test_prebuilt_kernels_load_from_a_read_only_directory(tmp_path: Path) -> None:
    """An image's prebuilt kernels sit on a read-only filesystem; paddle's loader writes a Python
    wrapper beside the library, so Ketch must load them without writing there."""
    from ketch.kernels import cpp_ops

    cpp_ops.ops(), cpp_ops.gemm_ops()
    prebuilt = tmp_path / "extensions"
    shutil.copytree(cpp_ops.build_dir(), prebuilt, ignore=shutil.ignore_patterns("*.py", "*.lock"))
    probe = (
        "import os, pathlib, sys\n"
        "from ketch.kernels import cpp_ops\n"
        "root = pathlib.Path(os.environ['KETCH_EXTENSION_DIR'])\n"
        "assert not os.access(root, os.W_OK), 'the mount is writable'\n"
        "print(cpp_ops.ops().ketch_paged_attention.__name__, cpp_ops.gemm_ops().__name__)\n"
    )
    script = (
        f"mount --bind {prebuilt} {prebuilt} && mount -o remount,bind,ro {prebuilt} && "
        f'exec {sys.executable} -c "$PROBE"'
    )
    env = {**os.environ, cpp_ops.ENV_DIR: str(prebuilt), "PROBE": probe}
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ketch_paged_attention" in result.stdout
    assert sorted(p.name for p in prebuilt.rglob("*.py")) == []
