"""The engine on an emulated AVX2-only CPU (AMD EPYC Milan, Zen 3), whatever CPU runs the tests.

qemu's user-mode emulator runs this venv's Python with the CPUID of a Zen 3 and no AVX-512
decoding at all, so an AVX-512 instruction anywhere on the path is an illegal instruction there.
``ketch generate`` must pick the portable kernels from that CPUID and give the native run's text.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

QEMU = shutil.which("qemu-x86_64")
CPU_MODEL = "EPYC-Milan"
KETCH = str(Path(sys.executable).parent / "ketch")
# Under qemu an illegal instruction makes paddle's signal handler spin rather than exit.
EMULATED_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="needs qemu-x86_64 (Debian: qemu-user; .ci/run installs it) on an x86-64 machine",
)


def _emulated(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [QEMU, "-cpu", CPU_MODEL, sys.executable, *args],
            capture_output=True, text=True, timeout=EMULATED_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung on the emulated {CPU_MODEL} (an illegal instruction?): {exc.stderr}")


def test_the_emulated_cpu_has_avx2_and_no_avx512() -> None:
    probe = "from numpy._core._multiarray_umath import __cpu_features__ as f;"
    probe += "print(f['AVX2'], f['FMA3'], f['AVX512F'])"
    out = _emulated("-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


@pytest.mark.parametrize(
    "sampling",
    [[], ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "7"]],
    ids=["greedy", "sampled"],
)
def test_ketch_generate_runs_and_matches_the_native_output(sampling: list[str]) -> None:
    args = ["generate", "--log-level", "INFO", "--max-tokens", "12", *sampling]
    args += ["Alice was beginning to get", "The Mouse"]
    native = subprocess.run([KETCH, *args], capture_output=True, text=True, timeout=120)
    assert native.returncode == 0, native.stderr
    emulated = _emulated(KETCH, *args)
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    assert "rms_norm: portable" in emulated.stderr
    assert emulated.stdout == native.stdout


# Under the emulated Zen 3: the kernel choice, then the chosen (AVX2) and the generic C++ kernels
# against the reference; the library was built natively first, so this only loads it.
_KERNELS_PROBE = """
import numpy as np, paddle
from ketch.kernels import CpuKernels
from ketch.kernels.paged_attention import (
    PagedAttention, PagedAttentionMetadata, paged_attention_reference)
kernel = CpuKernels.select(log=False).paged_attention
rng = np.random.default_rng(0)
k_cache, v_cache = (paddle.to_tensor(rng.standard_normal((2, 9, 16, 64), np.float32))
                    for _ in range(2))
meta = PagedAttentionMetadata.build([1, 20], [40, 20], [[3, 1, 7], [2, 8]], 16)
q = paddle.to_tensor(rng.standard_normal((21, 8, 64), np.float32))
ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.125).numpy()
for isa in (kernel.isa, "generic"):
    out = PagedAttention(isa)(q, k_cache, v_cache, meta, 0.125).numpy()
    print(isa, float(np.abs(out - ref).max() / np.abs(ref).max()) <= 1e-5)
import ctypes, scipy_openblas32
from ketch.kernels.linear import Linear
blas = ctypes.CDLL(scipy_openblas32.get_lib_dir() + "/lib" + scipy_openblas32.get_library() + ".so")
blas.scipy_openblas_get_corename.restype = ctypes.c_char_p
for m in (1, 37):
    x = paddle.to_tensor(rng.standard_normal((m, 300), np.float32))
    w = paddle.to_tensor(rng.standard_normal((300, 130), np.float32))
    ref = paddle.matmul(x, w).numpy()
    out = Linear(1)(x, w).numpy()
    print("linear", float(np.abs(out - ref).max() / np.abs(ref).max()) <= 1e-5)
from ketch.kernels.packed_linear import PackedLinear, select_packed_linear
packed = select_packed_linear()
print(packed.isa)
for kernel in (packed, PackedLinear("generic")):
    x = paddle.to_tensor(rng.standard_normal((9, 300), np.float32))
    w = paddle.to_tensor(rng.standard_normal((300, 130), np.float32))
    out = kernel(x, kernel.prepare(w)).numpy()
    ref = paddle.matmul(x, w).numpy()
    print("packed", float(np.abs(out - ref).max() / np.abs(ref).max()) <= 1e-5)
print(blas.scipy_openblas_get_corename().decode().lower())
"""


def test_cpp_kernels_run_without_avx512() -> None:
    from ketch.kernels import cpp_ops

    cpp_ops.ops()  # build (or load) natively: compiling under the emulator would take minutes
    cpp_ops.gemm_ops()
    out = _emulated("-c", _KERNELS_PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    *checks, core = out.stdout.split()
    assert checks == [
        "avx2", "True", "generic", "True", "linear", "True", "linear", "True",
        "avx2", "packed", "True", "packed", "True",
    ]  # fmt: skip
    # OpenBLAS picked its kernels from the emulated CPUID: an AVX2 core, not an AVX-512 one.
    assert core not in ("skylakex", "cooperlake", "sapphirerapids"), core


# The bfloat16 panels of the packed GEMM under the emulated Zen 3 (no AVX512-BF16, no AVX-512):
# the chosen (AVX2) and generic kernels widen them and match the float GEMM of the rounded weight.
_BF16_PROBE = """
import numpy as np, paddle
from ketch.kernels.packed_linear import PackedLinear, round_to_bfloat16, select_packed_linear
rng = np.random.default_rng(0)
x = rng.standard_normal((7, 300), np.float32)
w = paddle.to_tensor(rng.standard_normal((300, 130), np.float32))
ref = x.astype(np.float64) @ round_to_bfloat16(w).astype("float32").numpy().astype(np.float64)
for kernel in (select_packed_linear(), PackedLinear("generic")):
    out = kernel(paddle.to_tensor(x), kernel.prepare(w, dtype="bfloat16")).numpy()
    print(kernel.isa, float(np.abs(out - ref).max() / np.abs(ref).max()) <= 1e-5)
"""


def test_bf16_packed_gemm_runs_without_avx512() -> None:
    from ketch.kernels import cpp_ops

    cpp_ops.ops()  # build natively first
    out = _emulated("-c", _BF16_PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["avx2", "True", "generic", "True"]


# The int8 panels under the emulated Zen 3: the chosen (AVX2: vpmovsxbd + vcvtdq2ps) and generic
# kernels, plain, with bias and with SwiGLU, and the fused experts, against the float GEMM of the
# dequantized weight.
_INT8_PROBE = """
import numpy as np, paddle
from ketch.kernels.fused_moe import FusedMoe, fused_moe_reference
from ketch.kernels.packed_linear import (
    PackedLinear, dequantize_int8, quantize_int8, select_packed_linear, swiglu_reference)
rng = np.random.default_rng(0)
x = paddle.to_tensor(rng.standard_normal((7, 300), np.float32))
w = rng.standard_normal((300, 130)) * rng.uniform(0.01, 10, 130)  # a scale per column
w = paddle.to_tensor(w.astype(np.float32))
b = paddle.to_tensor(rng.standard_normal(130, np.float32))
wd = dequantize_int8(*quantize_int8(w))
def close(out, ref):
    return float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
for kernel in (select_packed_linear(), PackedLinear("generic")):
    packed = kernel.prepare(w, dtype="int8")
    glu = kernel.prepare(w, glu=True, dtype="int8")
    print(kernel.isa, close(kernel(x, packed, b), paddle.matmul(x, wd) + b),
          close(kernel(x, glu), swiglu_reference(x, wd)))
    moe = FusedMoe.for_linear(kernel)
    gate_up = [paddle.to_tensor(rng.standard_normal((300, 80), np.float32)) for _ in range(3)]
    down = [paddle.to_tensor(rng.standard_normal((40, 300), np.float32)) for _ in range(3)]
    routing = paddle.to_tensor(rng.random((7, 2), np.float32))
    indices = paddle.to_tensor(np.stack([rng.choice(3, 2, replace=False) for _ in range(7)]))
    out = moe(x, routing, indices, moe.prepare(gate_up, down, "int8"))
    ref = fused_moe_reference(x, routing, indices, [dequantize_int8(*quantize_int8(v))
                              for v in gate_up], [dequantize_int8(*quantize_int8(v)) for v in down])
    print("moe", close(out, ref))
"""


def test_int8_packed_gemm_runs_without_avx512() -> None:
    from ketch.kernels import cpp_ops

    cpp_ops.ops()  # build natively first
    out = _emulated("-c", _INT8_PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "avx2", "True", "True", "moe", "True", "generic", "True", "True", "moe", "True",
    ]  # fmt: skip


# The bfloat16 KV cache under the emulated Zen 3: the write's rounding (bits as numpy rounds
# them) and the chosen (AVX2) and generic attention kernels widening the cache's rows, against
# the reference on the cache widened to float32, with and without a sliding window.
_KV_BF16_PROBE = """
import numpy as np, paddle
from ketch.kernels import CpuKernels
from ketch.engine.worker.kv_cache import KVCache
from ketch.kernels.paged_attention import (
    PagedAttention, PagedAttentionMetadata, paged_attention_reference)
kernel = CpuKernels.select(log=False).paged_attention
rng = np.random.default_rng(0)
cache = KVCache(1, 9, 16, 2, 64, dtype="bfloat16")
layer = cache.layers[0]
meta = PagedAttentionMetadata.build([1, 20], [40, 20], [[3, 1, 7], [2, 8]], 16)
k, v = (rng.standard_normal((21, 2, 64)).astype(np.float32) for _ in range(2))
kernel.write_kv(paddle.to_tensor(k), paddle.to_tensor(v), layer.k_blocks, layer.v_blocks, meta)
bits = k.view(np.uint32).astype(np.uint64)
rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
slot = meta.slot_mapping.numpy()[5]
print("write", bool(np.array_equal(cache.array[0, 0, :, slot // 16, slot % 16], rne[5])))
q = paddle.to_tensor(rng.standard_normal((21, 8, 64), np.float32))
wide = [paddle.to_tensor((cache.array[0, i].astype(np.uint32) << 16).view(np.float32))
        for i in range(2)]
for window in (0, 7):
    ref = paged_attention_reference(q, *wide, meta, 0.125, window).numpy()
    for isa in (kernel.isa, "generic"):
        out = PagedAttention(isa)(q, layer.k_blocks, layer.v_blocks, meta, 0.125, window).numpy()
        print(isa, float(np.abs(out - ref).max() / np.abs(ref).max()) <= 1e-5)
"""


def test_bf16_kv_cache_kernels_run_without_avx512() -> None:
    from ketch.kernels import cpp_ops

    cpp_ops.ops()  # build natively first
    out = _emulated("-c", _KV_BF16_PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "write", "True", "avx2", "True", "generic", "True", "avx2", "True", "generic", "True",
    ]  # fmt: skip
