"""The packed GEMM on bfloat16 weight panels (``PackedLinear.prepare(w, dtype="bfloat16")``).

The spec: the float32 GEMM of the weight rounded to bfloat16 (float64 numpy on the rounded
weight, error at most 1e-5 of the largest output, float32-accumulation level), for every
instruction set this CPU can run plus the portable one, one and two threads, row counts 1 to
300 around the register tiles, columns that fill no panel, the bias and SwiGLU epilogues, and
the fused experts. The rounding itself is torch's bfloat16 cast, bit for bit, ties included
(a NaN stays a NaN); a weight that is bfloat16 already is packed as it is.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ketch.kernels.cpu_features import CpuFeatures
from ketch.kernels.fused_moe import FusedMoe, fused_moe_reference
from ketch.kernels.packed_linear import (
    AVX2_OP,
    AVX512_OP,
    PANEL_WIDTH,
    PackedLinear,
    round_to_bfloat16,
)

TOLERANCE = 1e-5
FEATURES = CpuFeatures.detect()
RUNNABLE = ["generic"]
RUNNABLE += ["avx2"] if FEATURES.can_run(AVX2_OP) else []
RUNNABLE += ["avx512"] if FEATURES.can_run(AVX512_OP) else []


def rounded(w: np.ndarray) -> np.ndarray:
    """``w`` through the packing's rounding, back as float32."""
    return round_to_bfloat16(paddle.to_tensor(w)).astype("float32").numpy()


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


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def test_rounding_is_torchs_bfloat16_cast() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    # Ties (dropped half exactly 0x8000) with even and odd kept halves, both signs; the largest
    # float (rounds to inf), infinities, NaNs of both signs, zeros, subnormals.
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x7F7FFFFF, 0x7F7F8000,
                     0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000000,
                     0x80000000, 0x00008000, 0x00018000, 0x00000001], np.uint32)  # fmt: skip
    w = np.concatenate([bits, ties]).view(np.float32)
    ours = round_to_bfloat16(paddle.to_tensor(w)).numpy().view(np.uint16)
    theirs = torch.from_numpy(w.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    theirs = theirs.view(np.uint16)
    # NaN stays NaN; its bits are torch's scalar cast's 0x7fc0 (torch's vectorised cast, which
    # this size of tensor takes, makes some NaNs 0xffff instead).
    nan = np.isnan(w)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert (ours[nan] == 0x7FC0).all() and ((theirs[nan] & 0x7F80) == 0x7F80).all()
    # Some ties went each way: the cases are really there.
    assert {int(v) for v in ours[-16:-12]} == {0x3F80, 0x3F82, 0xBF80, 0xBF82}


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 512, 2816), (1, 3, 1), (2, 33, 7), (3, 1408, 512), (5, 17, 1), (6, 1, 9), (7, 64, 65),
     (12, 31, 33), (13, 512, 768), (25, 130, 96), (64, 257, 300), (129, 130, 131),
     (300, 96, 2048)],
)  # fmt: skip
def test_matches_the_gemm_of_the_rounded_weight(isa: str, threads: int, m: int, k: int, n: int):
    x, w, b = operands(m, k, n, m * 1000 + k + n)
    kernel = PackedLinear(isa, threads)
    packed = kernel.prepare(paddle.to_tensor(w), dtype="bfloat16")
    nr = PANEL_WIDTH[isa]
    assert packed.dtype == "bfloat16" and packed.data.dtype == paddle.bfloat16
    assert list(packed.data.shape) == [-(-n // nr), k, nr] and packed.shape == [k, n]
    ref = x.astype(np.float64) @ rounded(w).astype(np.float64)
    assert rel_err(kernel(paddle.to_tensor(x), packed), ref) <= TOLERANCE
    with_bias = kernel(paddle.to_tensor(x), packed, paddle.to_tensor(b))
    assert rel_err(with_bias, ref + b) <= TOLERANCE


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,k,inter", [(1, 512, 1408), (2, 33, 3), (6, 17, 16), (13, 96, 40), (70, 31, 100)]
)
def test_glu_epilogue(isa: str, threads: int, m: int, k: int, inter: int) -> None:
    x, w, _ = operands(m, k, 2 * inter, m + k + inter)
    x = x * 2  # spread the gates over silu's curve
    kernel = PackedLinear(isa, threads)
    packed = kernel.prepare(paddle.to_tensor(w), glu=True, dtype="bfloat16")
    h = x.astype(np.float64) @ rounded(w).astype(np.float64)
    ref = silu(h[:, :inter]) * h[:, inter:]
    assert rel_err(kernel(paddle.to_tensor(x), packed), ref) <= TOLERANCE


@pytest.mark.parametrize("isa", RUNNABLE)
def test_a_bfloat16_weight_packs_as_it_is(isa: str) -> None:
    """A checkpoint's bfloat16 weight: the same panels as its float32 original rounded, and
    packed as float32 on request (widened exactly)."""
    x, w, _ = operands(9, 70, 50, 3)
    kernel = PackedLinear(isa)
    w16 = round_to_bfloat16(paddle.to_tensor(w))
    from_bf16 = kernel.prepare(w16)
    from_f32 = kernel.prepare(paddle.to_tensor(w), dtype="bfloat16")
    assert from_bf16.dtype == "bfloat16"
    np.testing.assert_array_equal(from_bf16.data.numpy(), from_f32.data.numpy())
    widened = kernel.prepare(w16, dtype="float32")
    assert widened.dtype == "float32"
    xt = paddle.to_tensor(x)
    np.testing.assert_array_equal(kernel(xt, widened).numpy(), kernel(xt, from_bf16).numpy())
    glu = kernel.prepare(w16, glu=True)
    np.testing.assert_array_equal(
        glu.data.numpy(),
        kernel.prepare(paddle.to_tensor(w), glu=True, dtype="bfloat16").data.numpy(),
    )
    with pytest.raises(ValueError, match="unknown weight dtype"):
        kernel.prepare(paddle.to_tensor(w), dtype="float16")


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_experts_on_bfloat16_panels(isa: str, threads: int) -> None:
    rng = np.random.default_rng(5)
    tokens, hidden, inter, total, top_k = 37, 48, 40, 5, 2
    x = paddle.to_tensor(rng.standard_normal((tokens, hidden), np.float32))
    routing = paddle.to_tensor(rng.random((tokens, top_k), np.float32))
    picks = np.stack([rng.choice(total, top_k, replace=False) for _ in range(tokens)])
    indices = paddle.to_tensor(picks.astype(np.int64))
    gate_up = [rng.standard_normal((hidden, 2 * inter), np.float32) * 0.3 for _ in range(total)]
    down = [rng.standard_normal((inter, hidden), np.float32) * 0.3 for _ in range(total)]
    moe = FusedMoe(isa, threads)
    experts = moe.prepare(
        [paddle.to_tensor(w) for w in gate_up], [paddle.to_tensor(w) for w in down], "bfloat16"
    )
    assert experts.gate_up.dtype == paddle.bfloat16 and experts.down.dtype == paddle.bfloat16
    out = moe(x, routing, indices, experts)
    gu_ref = [paddle.to_tensor(rounded(w)) for w in gate_up]
    dn_ref = [paddle.to_tensor(rounded(w)) for w in down]
    ref = fused_moe_reference(x, routing, indices, gu_ref, dn_ref)
    assert rel_err(out, ref.numpy()) <= TOLERANCE
    # Both weights of one dtype: a float32 down with bfloat16 gate_up is refused.
    f32 = moe.prepare([paddle.to_tensor(w) for w in gate_up], [paddle.to_tensor(w) for w in down])
    with pytest.raises(Exception, match="both be float32 or both bfloat16"):
        moe(x, routing, indices, type(experts)(experts.gate_up, f32.down, inter, isa))


def test_bad_bfloat16_operands_are_refused() -> None:
    from ketch.kernels import cpp_ops

    ops = cpp_ops.ops()
    with pytest.raises(Exception, match="float32 or bfloat16"):
        ops.ketch_pack_weight_bf16(paddle.ones([8, 4], "float64"), "generic", False)
    with pytest.raises(Exception, match="even N"):
        ops.ketch_pack_weight_bf16(paddle.ones([8, 5]), "generic", True)
    packed = PackedLinear("generic").prepare(paddle.ones([8, 3]), dtype="bfloat16")
    with pytest.raises(Exception, match="packed must"):
        ops.ketch_packed_linear(paddle.ones([2, 8]), packed.data, None, 3, "avx2", 1, False)
