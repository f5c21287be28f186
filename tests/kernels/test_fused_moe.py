"""The fused routed experts (``ketch_fused_moe``) against the plain-paddle reference
(``fused_moe_reference``: paddle.matmul on the unpacked weights) and, bit for bit, against the
one-matmul-pair-per-expert loop on the same packed GEMM (what the native backend ran before),
for every instruction set this CPU can run plus the portable one.

Cases: top_k 1 to 4; experts no token picked; every token on one expert; one token; hundreds of
tokens; tied routing weights; a rank's share of the experts (first > 0, picks of other ranks'
experts ignored, tokens with none get zeros); hidden and intermediate sizes that fill no panel;
one and two threads. Bad operands are refused with a message naming the problem.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ketch.kernels.cpu_features import AVX2_FMA, AVX512, CpuFeatures
from ketch.kernels.fused_moe import (
    AVX2_OP,
    AVX512_OP,
    FusedMoe,
    fused_moe_reference,
    select_fused_moe,
)
from ketch.kernels.packed_linear import PackedLinear

TOLERANCE = 1e-5
FEATURES = CpuFeatures.detect()
RUNNABLE = ["generic"]
RUNNABLE += ["avx2"] if FEATURES.can_run(AVX2_OP) else []
RUNNABLE += ["avx512"] if FEATURES.can_run(AVX512_OP) else []


def problem(tokens, hidden, inter, total, top_k, seed, *, one_expert=None, tied=False):
    """x, routing, indices (distinct experts per token of ``total``) and every expert's
    unpacked weights, as numpy arrays."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden), np.float32)
    if one_expert is not None:
        indices = np.full((tokens, top_k), one_expert, np.int64)
    else:
        indices = np.stack([rng.choice(total, top_k, replace=False) for _ in range(tokens)])
    routing = rng.random((tokens, top_k), np.float32)
    if tied:
        routing[:] = np.float32(1.0 / top_k)
    gate_up = rng.standard_normal((total, hidden, 2 * inter), np.float32) * 0.3
    down = rng.standard_normal((total, inter, hidden), np.float32) * 0.3
    return x, routing, indices.astype(np.int64), gate_up, down


def loop_on_packed(linear, x, routing, indices, gate_up, down, first):
    """The per-expert loop (ketch.engine.models.moe.combine) with ``linear``'s packed GEMM."""
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


def check(isa, threads, tokens, hidden, inter, total, top_k, first=0, held=None, **kw):
    held = total - first if held is None else held
    x, routing, indices, gate_up, down = problem(
        tokens, hidden, inter, total, top_k, tokens * 7 + hidden + total + top_k, **kw
    )
    x, routing, indices = map(paddle.to_tensor, (x, routing, indices))
    gu = [paddle.to_tensor(w) for w in gate_up[first : first + held]]
    dn = [paddle.to_tensor(w) for w in down[first : first + held]]
    linear = PackedLinear(isa)
    gu_packed = [linear.prepare(w, glu=True) for w in gu]
    dn_packed = [linear.prepare(w) for w in dn]
    moe = FusedMoe(isa, threads)
    out = moe(x, routing, indices, moe.prepare(gu, dn), first)
    assert out.shape == [tokens, hidden] and out.dtype == paddle.float32
    ref = fused_moe_reference(x, routing, indices, gu, dn, first).numpy()
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert float(np.abs(out.numpy() - ref).max()) / scale <= TOLERANCE
    loop = loop_on_packed(linear, x, routing, indices, gu_packed, dn_packed, first).numpy()
    np.testing.assert_array_equal(out.numpy(), loop)
    return out.numpy(), indices.numpy()


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "tokens,hidden,inter,total,top_k",
    [(1, 64, 32, 8, 2), (1, 40, 24, 4, 4), (5, 33, 17, 6, 1), (7, 48, 40, 32, 4),
     (13, 96, 56, 16, 3), (64, 64, 48, 32, 4), (300, 72, 40, 8, 2)],
)  # fmt: skip
def test_matches_the_reference_and_the_loop(isa, threads, tokens, hidden, inter, total, top_k):
    check(isa, threads, tokens, hidden, inter, total, top_k)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_experts_without_tokens_and_all_on_one(isa: str) -> None:
    check(isa, 1, 3, 40, 24, 64, 2)  # at most 6 of 64 experts picked
    check(isa, 2, 50, 40, 24, 8, 1, one_expert=5)  # every token on expert 5 alone
    check(isa, 1, 1, 40, 24, 8, 1, one_expert=0)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_tied_routing_weights(isa: str) -> None:
    check(isa, 2, 20, 48, 32, 8, 4, tied=True)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_ranks_share_of_the_experts(isa: str, threads: int) -> None:
    """Experts [4, 8) of 12 held: picks of the others add nothing; a token with none is 0."""
    out, indices = check(isa, threads, 40, 48, 24, 12, 2, first=4, held=4)
    held = (indices >= 4) & (indices < 8)
    assert held.any() and not held.all()
    assert (out[~held.any(axis=1)] == 0).all()


@pytest.mark.parametrize("isa", RUNNABLE)
def test_no_tokens_and_no_held_experts(isa: str) -> None:
    moe = FusedMoe(isa)
    experts = moe.prepare([paddle.ones([8, 6])], [paddle.ones([3, 8])])
    assert len(experts) == 1 and experts.inter == 3
    empty = moe(paddle.ones([0, 8]), paddle.ones([0, 2]), paddle.zeros([0, 2], "int64"), experts)
    assert empty.shape == [0, 8]
    ones = paddle.ones([2, 8])
    none = moe(ones, paddle.ones([2, 1]), paddle.full([2, 1], 5, "int64"), experts)
    assert (none.numpy() == 0).all()
    with pytest.raises(ValueError, match="gate_up weights"):
        moe.prepare([], [])
    with pytest.raises(ValueError, match="every expert must have"):
        moe.prepare([paddle.ones([8, 6]), paddle.ones([8, 4])], [paddle.ones([3, 8])] * 2)


def test_bad_operands_are_refused() -> None:
    ops = __import__("ketch.kernels.cpp_ops", fromlist=["ops"]).ops()
    experts = FusedMoe("generic").prepare([paddle.ones([8, 6])], [paddle.ones([3, 8])])
    x, r, i = paddle.ones([2, 8]), paddle.ones([2, 2]), paddle.zeros([2, 2], "int64")
    up, down = experts.gate_up, experts.down
    op = ops.ketch_fused_moe
    g = "generic"
    cases = [
        (lambda: op(x, r, i, up, down, 0, 3, "sse9", 1), "unknown isa"),
        (lambda: op(x, r, i, up, down, 0, 3, "avx2", 1), "gate_up must"),
        (lambda: op(x, r, i, up, down, 0, 99, g, 1), "gate_up must"),
        (lambda: op(x, r, i, up, up, 0, 3, g, 1), "down must"),
        (lambda: op(x, r, i, up, down[:0], 0, 3, g, 1), "down must"),
        (lambda: op(x, r, i.astype("int32"), up, down, 0, 3, g, 1), "int64"),
        (lambda: op(x, r[:1], i[:1], up, down, 0, 3, g, 1), "x's T"),
        (lambda: op(x.astype("float64"), r, i, up, down, 0, 3, g, 1), "float32"),
        (lambda: op(paddle.ones([2, 7]), r, i, up, down, 0, 3, g, 1), "hidden"),
        (lambda: op(x, r, i, up, down, -1, 3, g, 1), "first >= 0"),
    ]
    for call, message in cases:
        with pytest.raises(Exception, match=message):
            call()
    with pytest.raises(TypeError, match="packed for avx2"):
        FusedMoe("avx2")(x, r, i, experts)
    with pytest.raises(ValueError, match="unknown isa"):
        FusedMoe("sse9")


def test_selection_follows_the_cpu_features() -> None:
    assert select_fused_moe(CpuFeatures(frozenset(), "test")).isa == "generic"
    assert select_fused_moe(CpuFeatures(AVX2_FMA, "test"), 2) == FusedMoe("avx2", 2)
    assert select_fused_moe(CpuFeatures(AVX512 | AVX2_FMA, "test")).isa == "avx512"
