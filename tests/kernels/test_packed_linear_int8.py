"""The packed GEMM on int8 weight panels (``PackedLinear.prepare(w, dtype="int8")``).

The quantization (``quantize_int8``) against a numpy reference, bit for bit: symmetric per
column, scale = max |column| / 127, q = w / scale rounded to nearest even and clamped to
[-127, 127]; ties, zero columns, the largest floats, subnormal columns, a bfloat16 weight; a NaN
or an infinity is refused with a ValueError. The GEMM's spec is the float32 GEMM of the
dequantized weight (``paddle.matmul(x, dequantize_int8(q, scale))``), each output within 1e-5 of
its sum of |x| |w| (float32-accumulation level), for every instruction set this CPU can run plus
the portable one, one and two threads, 1 to 257 rows, K and N off the panel widths, columns of
very different magnitudes (a scale applied to the wrong column shows), the bias and SwiGLU
epilogues (gate and up columns each with their own scale), and the fused experts (bit for bit
against the per-expert loop on the same int8 panels).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ketch.kernels import cpp_ops
from ketch.kernels.cpu_features import CpuFeatures
from ketch.kernels.fused_moe import FusedMoe, PackedExperts, fused_moe_reference
from ketch.kernels.packed_linear import (
    AVX2_OP,
    AVX512_OP,
    PANEL_WIDTH,
    WEIGHT_DTYPES,
    PackedLinear,
    dequantize_int8,
    quantize_int8,
    round_to_bfloat16,
)

TOLERANCE = 1e-5
FEATURES = CpuFeatures.detect()
RUNNABLE = ["generic"]
RUNNABLE += ["avx2"] if FEATURES.can_run(AVX2_OP) else []
RUNNABLE += ["avx512"] if FEATURES.can_run(AVX512_OP) else []
TINY = np.finfo(np.float32).smallest_subnormal
ROWS = [1, 3, 8, 33, 257]


def reference_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantization in numpy, float32 throughout: np.rint rounds half to even."""
    top = np.abs(w).max(axis=0) if len(w) else np.zeros(w.shape[1], np.float32)
    with np.errstate(all="ignore"):
        scale = np.where(top == 0, np.float32(1), top / np.float32(127)).astype(np.float32)
        scale = np.where(scale == 0, TINY, scale).astype(np.float32)
        over = np.isinf(scale * np.float32(127)) & np.isfinite(scale)
        scale = np.where(over, np.nextafter(scale, np.float32(0)), scale).astype(np.float32)
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def weight(k: int, n: int, seed: int) -> np.ndarray:
    """Standard normal columns times factors from 1e-3 to 1e3: every column its own scale."""
    rng = np.random.default_rng(seed)
    factors = np.float32(10.0) ** rng.uniform(-3, 3, n).astype(np.float32)
    return (rng.standard_normal((k, n), np.float32) * factors).astype(np.float32)


def dequantized(w: np.ndarray) -> paddle.Tensor:
    q, scale = quantize_int8(paddle.to_tensor(w))
    return dequantize_int8(q, scale)


def check_close(out: paddle.Tensor, ref: np.ndarray, bound: np.ndarray) -> None:
    """Each output within TOLERANCE of its ``bound`` (a sum of magnitudes)."""
    o = out.numpy()
    assert o.shape == ref.shape and o.dtype == np.float32
    excess = np.abs(o - ref) - TOLERANCE * bound
    assert (excess <= 1e-30).all(), float(excess.max())


def test_weight_dtypes() -> None:
    assert WEIGHT_DTYPES == ("float32", "bfloat16", "int8")


def test_quantize_matches_the_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    big = np.finfo(np.float32).max
    w = rng.standard_normal((64, 40), np.float32) * np.float32(3)
    w[:, 0] = 0  # a zero column: scale 1, q 0
    # Column 1: max 127, so scale 1 and every tie x.5 is a real one, each way.
    w[:8, 1] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]
    w[8:, 1] = rng.integers(-127, 128, 56)
    w[:, 2] = big * rng.uniform(-1, 1, 64).astype(np.float32)  # the largest floats
    w[0, 2] = -big
    w[:, 3] = rng.integers(-100, 101, 64) * TINY  # subnormals: t / 127 underflows to 0
    w[0, 3] = 100 * TINY
    w[:, 4] = rng.integers(-5000, 5001, 64) * TINY  # subnormal, a subnormal scale
    w[:, 5] = 0
    w[7, 5] = -1e-38  # one value, the rest zeros, negative
    w[:, 6] *= np.float32(1e30)
    q, scale = quantize_int8(paddle.to_tensor(w))
    assert q.dtype == paddle.int8 and scale.dtype == paddle.float32
    assert list(q.shape) == [64, 40] and list(scale.shape) == [40]
    q_ref, scale_ref = reference_quantize(w)
    np.testing.assert_array_equal(scale.numpy().view(np.uint32), scale_ref.view(np.uint32))
    np.testing.assert_array_equal(q.numpy(), q_ref)
    qn, sn = q.numpy(), scale.numpy()
    assert sn[0] == 1 and (qn[:, 0] == 0).all()
    assert sn[1] == 1 and list(qn[:8, 1]) == [127, 0, 2, 2, 0, -2, -2, 126]
    assert np.abs(qn).max() == 127 and qn.min() >= -127  # never -128
    # Each column's largest value maps to +-127 (but the zero columns and the subnormal one).
    assert ((np.abs(qn).max(axis=0) == 127) | (sn == 1) | (sn == TINY)).all()
    assert sn[3] == TINY and (qn[:, 3].astype(np.float32) * TINY == w[:, 3]).all()  # exact
    assert np.isfinite(sn[2] * np.float32(127)) and qn[0, 2] == -127  # scale lowered, not inf
    deq = dequantize_int8(q, scale).numpy()
    assert deq.dtype == np.float32 and np.isfinite(deq).all()
    np.testing.assert_array_equal(deq, qn.astype(np.float32) * sn)


def test_quantize_a_bfloat16_weight_as_its_float32_value() -> None:
    w = weight(50, 30, 1)
    w16 = round_to_bfloat16(paddle.to_tensor(w))
    q16, s16 = quantize_int8(w16)
    q32, s32 = quantize_int8(w16.astype("float32"))
    np.testing.assert_array_equal(q16.numpy(), q32.numpy())
    np.testing.assert_array_equal(s16.numpy(), s32.numpy())
    q_ref, s_ref = reference_quantize(w16.astype("float32").numpy())
    np.testing.assert_array_equal(q16.numpy(), q_ref)
    np.testing.assert_array_equal(s16.numpy(), s_ref)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_infinite_weights_are_refused(bad: float) -> None:
    w = weight(20, 12, 2)
    w[3, 5] = bad
    wt = paddle.to_tensor(w)
    with pytest.raises(ValueError, match=r"NaN or infinite .*1 column\(s\) of 12: 5\)"):
        quantize_int8(wt)
    with pytest.raises(ValueError, match="NaN or infinite"):
        PackedLinear("generic").prepare(wt, dtype="int8")
    with pytest.raises(ValueError, match="NaN or infinite"):
        PackedLinear("generic").prepare(wt, glu=True, dtype="int8")
    with pytest.raises(ValueError, match="NaN or infinite"):
        FusedMoe("generic").prepare([paddle.ones([12, 4])], [wt[2:4]], "int8")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_int8(round_to_bfloat16(wt))  # the bfloat16 NaN / inf as well
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        quantize_int8(paddle.ones([4]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize_int8(paddle.ones([4, 4], "float64"))


@pytest.mark.parametrize("isa", RUNNABLE)
def test_prepare_packs_int8_panels_with_their_scales(isa: str) -> None:
    k, n = 37, 45
    w = weight(k, n, 3)
    kernel = PackedLinear(isa)
    nr = PANEL_WIDTH[isa]
    packed = kernel.prepare(paddle.to_tensor(w), dtype="int8")
    q, scale = quantize_int8(paddle.to_tensor(w))
    assert packed.dtype == "int8" and packed.data.dtype == paddle.int8
    panels = -(-n // nr)
    assert list(packed.data.shape) == [panels, k, nr] and packed.shape == [k, n]
    np.testing.assert_array_equal(packed.scale.numpy(), scale.numpy())
    assert packed.nbytes == panels * k * nr + 4 * n
    # The panels are q's columns, zero-padded past N.
    flat = packed.data.numpy().transpose(1, 0, 2).reshape(k, panels * nr)
    np.testing.assert_array_equal(flat[:, :n], q.numpy())
    assert (flat[:, n:] == 0).all()
    glu = kernel.prepare(paddle.to_tensor(w[:, :44]), glu=True, dtype="int8")
    assert glu.dtype == "int8" and glu.n == 22 and list(glu.scale.shape) == [44]
    assert glu.nbytes == int(glu.data.numel()) + 4 * 44
    # Float panels: no scale, their bytes.
    f32 = kernel.prepare(paddle.to_tensor(w))
    bf16 = kernel.prepare(paddle.to_tensor(w), dtype="bfloat16")
    assert f32.scale is None and bf16.scale is None
    assert f32.nbytes == 4 * panels * k * nr and bf16.nbytes == 2 * panels * k * nr
    # A bfloat16 weight quantizes as its float32 value does.
    w16 = round_to_bfloat16(paddle.to_tensor(w))
    a, b = kernel.prepare(w16, dtype="int8"), kernel.prepare(w16.astype("float32"), dtype="int8")
    np.testing.assert_array_equal(a.data.numpy(), b.data.numpy())
    np.testing.assert_array_equal(a.scale.numpy(), b.scale.numpy())


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k,n", [(1, 9), (67, 45), (300, 131), (130, 17)])
def test_matches_the_gemm_of_the_dequantized_weight(
    isa: str, threads: int, m: int, k: int, n: int
) -> None:
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), np.float32)
    w = weight(k, n, m + k + n)
    b = rng.standard_normal(n, np.float32) * 10
    kernel = PackedLinear(isa, threads)
    packed = kernel.prepare(paddle.to_tensor(w), dtype="int8")
    wd = dequantized(w)
    xt = paddle.to_tensor(x)
    ref = paddle.matmul(xt, wd).numpy()
    bound = np.abs(x) @ np.abs(wd.numpy())
    check_close(kernel(xt, packed), ref, bound)
    with_bias = kernel(xt, packed, paddle.to_tensor(b))
    check_close(with_bias, ref + b, bound + np.abs(b))
    # Not the original weight's GEMM: quantization errors are far above the tolerance.
    assert k < 8 or np.abs(kernel(xt, packed).numpy() - x @ w).max() > 1e3 * TOLERANCE


def silu(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-v) = inf for v far below 0: silu -> -0
        return v / (1.0 + np.exp(-v))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k,inter", [(67, 37), (33, 3), (256, 40)])
def test_glu_epilogue_scales_gate_and_up_apart(
    isa: str, threads: int, m: int, k: int, inter: int
) -> None:
    rng = np.random.default_rng(m + k + inter)
    x = rng.standard_normal((m, k), np.float32)
    w = weight(k, 2 * inter, k * inter) * np.float32(0.05)  # gates over silu's curve
    w[:, inter:] *= np.float32(1000)  # up columns on a scale of their own
    kernel = PackedLinear(isa, threads)
    packed = kernel.prepare(paddle.to_tensor(w), glu=True, dtype="int8")
    wd = dequantized(w)
    h = paddle.matmul(paddle.to_tensor(x), wd).numpy().astype(np.float64)
    gate, up = h[:, :inter], h[:, inter:]
    ref = silu(gate) * up
    # Errors in gate and up of at most TOLERANCE times their magnitude sums, propagated
    # (|silu'| <= 1.1).
    mags = np.abs(x).astype(np.float64) @ np.abs(wd.numpy()).astype(np.float64)
    bound = 1.1 * np.abs(up) * mags[:, :inter] + np.abs(silu(gate)) * mags[:, inter:]
    check_close(kernel(paddle.to_tensor(x), packed), ref.astype(np.float32), bound)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_empty_operands(isa: str) -> None:
    kernel = PackedLinear(isa)
    no_rows = kernel(paddle.zeros([0, 8]), kernel.prepare(paddle.ones([8, 3]), dtype="int8"))
    assert no_rows.shape == [0, 3]
    empty_k = kernel.prepare(paddle.zeros([0, 3]), dtype="int8")
    np.testing.assert_array_equal(empty_k.scale.numpy(), [1, 1, 1])
    out = kernel(paddle.ones([2, 0]), empty_k, paddle.to_tensor([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(out.numpy(), [[1, 2, 3], [1, 2, 3]])
    no_n = kernel.prepare(paddle.zeros([8, 0]), dtype="int8")
    assert kernel(paddle.ones([2, 8]), no_n).shape == [2, 0]


def test_bad_int8_operands_are_refused() -> None:
    ops = cpp_ops.ops()
    packed = PackedLinear("generic").prepare(paddle.ones([8, 3]), dtype="int8")
    x = paddle.ones([2, 8])
    with pytest.raises(Exception, match="packed must be a float32"):
        ops.ketch_packed_linear(x, packed.data, None, 3, "generic", 1, False)  # no scales
    with pytest.raises(Exception, match=r"scale must be \[3\]"):
        ops.ketch_packed_linear_i8(x, packed.data, paddle.ones([4]), None, 3, "generic", 1, False)
    with pytest.raises(Exception, match=r"scale must be \[6\]"):
        ops.ketch_packed_linear_i8(x, packed.data, packed.scale, None, 3, "generic", 1, True)
    with pytest.raises(Exception, match="int8 CPU tensor"):
        f32 = PackedLinear("generic").prepare(paddle.ones([8, 3]))
        ops.ketch_packed_linear_i8(x, f32.data, packed.scale, None, 3, "generic", 1, False)
    with pytest.raises(Exception, match="packed must"):
        ops.ketch_packed_linear_i8(x, packed.data, packed.scale, None, 3, "avx2", 1, False)
    with pytest.raises(Exception, match="int8 CPU tensor"):
        ops.ketch_pack_weight_i8(paddle.ones([8, 4]), "generic", False)
    with pytest.raises(Exception, match="even N"):
        ops.ketch_pack_weight_i8(paddle.ones([8, 5]).astype("int8"), "generic", True)
    with pytest.raises(TypeError, match="packed for avx2"):
        PackedLinear("avx2")(x, packed)


def moe_problem(seed: int, tokens: int, hidden: int, inter: int, total: int, top_k: int):
    rng = np.random.default_rng(seed)
    x = paddle.to_tensor(rng.standard_normal((tokens, hidden), np.float32))
    routing = paddle.to_tensor(rng.random((tokens, top_k), np.float32))
    picks = np.stack([rng.choice(total, top_k, replace=False) for _ in range(tokens)])
    indices = paddle.to_tensor(picks.astype(np.int64))
    gate_up = [paddle.to_tensor(weight(hidden, 2 * inter, seed + e) * 0.05) for e in range(total)]
    down = [paddle.to_tensor(weight(inter, hidden, seed + 99 + e) * 0.05) for e in range(total)]
    return x, routing, indices, gate_up, down


def loop_on_packed(linear, x, routing, indices, gate_up, down, first):
    """The per-expert loop (ketch.engine.models.moe.combine) on ``linear``'s packed weights."""
    out = paddle.zeros_like(x)
    top_k = int(indices.shape[1])
    flat = indices.numpy().reshape(-1)
    weights = routing.reshape([-1, 1])
    for j in range(len(gate_up)):
        picks = np.nonzero(flat == first + j)[0]
        if len(picks):
            tokens = paddle.to_tensor(picks // top_k)
            y = linear(linear(paddle.gather(x, tokens), gate_up[j]), down[j])
            y = y * paddle.gather(weights, paddle.to_tensor(picks))
            out = paddle.index_add(out, tokens, 0, y)
    return out


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "tokens,hidden,inter,total,top_k,first,held",
    [(1, 64, 32, 8, 2, 0, 8), (7, 33, 17, 6, 3, 0, 6), (37, 48, 40, 5, 2, 0, 5),
     (300, 72, 40, 8, 2, 0, 8), (40, 48, 24, 12, 2, 4, 4)],
)  # fmt: skip
def test_fused_experts_on_int8_panels(
    isa: str, threads: int, tokens: int, hidden: int, inter: int, total: int, top_k: int,
    first: int, held: int,
) -> None:  # fmt: skip
    x, routing, indices, gate_up, down = moe_problem(
        tokens + hidden + total, tokens, hidden, inter, total, top_k
    )
    gate_up, down = gate_up[first : first + held], down[first : first + held]
    moe = FusedMoe(isa, threads)
    experts = moe.prepare(gate_up, down, "int8")
    assert experts.dtype == "int8" and len(experts) == held
    assert experts.gate_up.dtype == paddle.int8 and experts.down.dtype == paddle.int8
    assert list(experts.gate_up_scale.shape) == [held, 2 * inter]
    assert list(experts.down_scale.shape) == [held, hidden]
    scales = 4 * held * (2 * inter + hidden)
    assert experts.nbytes == int(experts.gate_up.numel() + experts.down.numel()) + scales
    out = moe(x, routing, indices, experts, first)
    assert out.shape == [tokens, hidden] and out.dtype == paddle.float32
    # Bit for bit the per-expert loop of PackedLinear calls on the same int8 panels.
    linear = PackedLinear(isa)
    gu_packed = [linear.prepare(w, glu=True, dtype="int8") for w in gate_up]
    dn_packed = [linear.prepare(w, dtype="int8") for w in down]
    for j, (g, d) in enumerate(zip(gu_packed, dn_packed, strict=True)):
        np.testing.assert_array_equal(g.data.numpy(), experts.gate_up[j].numpy())
        np.testing.assert_array_equal(g.scale.numpy(), experts.gate_up_scale[j].numpy())
        np.testing.assert_array_equal(d.scale.numpy(), experts.down_scale[j].numpy())
    loop = loop_on_packed(linear, x, routing, indices, gu_packed, dn_packed, first).numpy()
    np.testing.assert_array_equal(out.numpy(), loop)
    # And the plain-paddle reference on the dequantized weights.
    ref = fused_moe_reference(
        x, routing, indices, [dequantized(w.numpy()) for w in gate_up],
        [dequantized(w.numpy()) for w in down], first,
    ).numpy()  # fmt: skip
    assert float(np.abs(out.numpy() - ref).max()) <= TOLERANCE * float(np.abs(ref).max())


def test_fused_experts_refuse_mixed_or_missing_scales() -> None:
    x, routing, indices, gate_up, down = moe_problem(1, 5, 16, 8, 3, 2)
    moe = FusedMoe("generic")
    int8 = moe.prepare(gate_up, down, "int8")
    f32 = moe.prepare(gate_up, down)
    assert f32.dtype == "float32" and f32.gate_up_scale is None
    assert f32.nbytes == 4 * int(f32.gate_up.numel() + f32.down.numel())
    mixed = PackedExperts(int8.gate_up, f32.down, 8, "generic", int8.gate_up_scale, int8.down_scale)
    with pytest.raises(Exception, match="both be int8"):
        moe(x, routing, indices, mixed)
    no_scales = PackedExperts(int8.gate_up, int8.down, 8, "generic")
    with pytest.raises(Exception, match="must be a float32"):
        moe(x, routing, indices, no_scales)
    short = PackedExperts(
        int8.gate_up, int8.down, 8, "generic", int8.gate_up_scale[:, :8], int8.down_scale
    )
    with pytest.raises(Exception, match=r"gate_up_scale must be \[3, 16\]"):
        moe(x, routing, indices, short)
    narrow = PackedExperts(
        int8.gate_up, int8.down, 8, "generic", int8.gate_up_scale, int8.down_scale[:, :4]
    )
    with pytest.raises(Exception, match=r"down_scale must be \[3, 16\]"):
        moe(x, routing, indices, narrow)
