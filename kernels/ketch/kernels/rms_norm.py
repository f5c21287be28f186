"""RMSNorm: the portable formula (the reference) and paddle's fused CPU kernel where it can run."""

from __future__ import annotations

import paddle

FUSED_OP = "paddle.incubate.nn.functional.fused_rms_norm"


def rms_norm_portable(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last axis, in Hugging Face's order."""
    variance = paddle.mean(x * x, axis=-1, keepdim=True)
    return x * paddle.rsqrt(variance + eps) * weight


def rms_norm_fused(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """One kernel instead of five ops; AVX-512 only on the CPU (see cpu_features)."""
    from paddle.incubate.nn.functional import fused_rms_norm

    return fused_rms_norm(x, weight, None, eps, 1)[0]
