"""RMSNorm implementations against the reference (the portable formula, Hugging Face's order)."""

from __future__ import annotations

import numpy as np
import pytest

from ketch.kernels.cpu_features import CpuFeatures
from ketch.kernels.rms_norm import FUSED_OP, rms_norm_fused, rms_norm_portable

SHAPES = [(1, 8), (3, 64), (17, 96), (64, 512), (5, 1000)]


def _numpy_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
def test_portable_matches_the_formula_in_float64(shape: tuple[int, int]) -> None:
    import paddle

    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = rms_norm_portable(paddle.to_tensor(x), paddle.to_tensor(w), 1e-6).numpy()
    want = _numpy_reference(x, w, 1e-6)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-6


@pytest.mark.skipif(
    not CpuFeatures.detect().can_run(FUSED_OP), reason="the fused kernel needs AVX-512"
)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_matches_portable_where_it_can_run(shape: tuple[int, int]) -> None:
    import paddle

    rng = np.random.default_rng(len(shape) + shape[0])
    x = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal(shape[-1]).astype(np.float32))
    want = rms_norm_portable(x, w, 1e-5).numpy()
    got = rms_norm_fused(x, w, 1e-5).numpy()
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
