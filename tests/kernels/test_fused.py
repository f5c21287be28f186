"""The fused RMSNorm, residual add + RMSNorm and rotary/q-k-v split ops against their plain-paddle
references, on shapes around their edges (one row, odd widths, 3-D inputs, strided views, GQA
head counts), float32, error at most 1e-5 of the largest value; bad operands are refused with a
message and the process goes on."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ketch.kernels import fused

TOLERANCE = 1e-5


def close(a: paddle.Tensor, b: paddle.Tensor) -> None:
    x, y = a.numpy(), b.numpy()
    assert x.shape == y.shape
    if x.size == 0:
        return
    assert np.abs(x - y).max() <= TOLERANCE * max(np.abs(y).max(), 1e-30)


def rand(rng, *shape: int) -> paddle.Tensor:
    return paddle.to_tensor(rng.standard_normal(shape, np.float32))


def ones(*shape: int, dtype: str = "float32") -> paddle.Tensor:
    return paddle.ones(list(shape), dtype)


@pytest.mark.parametrize("shape", [(1, 8), (7, 96), (3, 5, 33), (64, 512), (0, 16)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norms_match_the_references(shape: tuple[int, ...], eps: float) -> None:
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x, delta, w = rand(rng, *shape), rand(rng, *shape), rand(rng, shape[-1])
    close(fused.rms_norm(x, w, eps), fused.rms_norm_reference(x, w, eps))
    s, y = fused.add_rms_norm(x, delta, w, eps)
    s_ref, y_ref = fused.add_rms_norm_reference(x, delta, w, eps)
    close(s, s_ref)
    close(y, y_ref)


def test_rms_norm_of_a_strided_view() -> None:
    rng = np.random.default_rng(3)
    x, w = rand(rng, 10, 40)[::3], rand(rng, 40)
    close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim",
    [(1, 1, 1, 2), (5, 4, 2, 16), (9, 8, 2, 64), (3, 12, 12, 32), (17, 16, 1, 128), (0, 2, 1, 8)],
)
def test_rope_qkv_matches_the_reference(tokens, heads, kv_heads, head_dim) -> None:
    rng = np.random.default_rng(tokens + heads * 7 + head_dim)
    qkv = rand(rng, tokens, (heads + 2 * kv_heads) * head_dim)
    cos, sin = rand(rng, tokens, head_dim), rand(rng, tokens, head_dim)
    got = fused.rope_qkv(qkv, cos, sin, heads, kv_heads)
    want = fused.rope_qkv_reference(qkv, cos, sin, heads, kv_heads)
    for a, b in zip(got, want, strict=True):
        close(a, b)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: fused.rms_norm(ones(2, 8), ones(7), 1e-6), "weight"),
        (lambda: fused.rms_norm(ones(2, 8, dtype="float64"), ones(8), 1e-6), "float32"),
        (lambda: fused.add_rms_norm(ones(2, 8), ones(3, 8), ones(8), 1e-6), "shape"),
        (lambda: fused.rope_qkv(ones(2, 40), ones(2, 8), ones(2, 8), 2, 1), "width"),
        (lambda: fused.rope_qkv(ones(2, 28), ones(2, 7), ones(2, 7), 2, 1), "even"),
        (lambda: fused.rope_qkv(ones(2, 32), ones(3, 8), ones(3, 8), 2, 1), "cos"),
        (lambda: fused.rope_qkv(ones(2, 32), ones(2, 8), ones(2, 8), 0, 1), "positive"),
    ],
)
def test_bad_operands_are_refused(call, message: str) -> None:
    with pytest.raises(Exception, match=message):
        call()
    out = fused.rms_norm(paddle.ones([2, 8]), paddle.ones([8]), 0.0)
    assert float(out.sum()) == 16.0
