"""Fused elementwise ops of the native backend's decoder layer (``csrc/fused.cc``) and their
references in plain paddle ops (the specification, from ``dense_graph``).

Each fused op replaces a run of small dygraph ops whose dispatch dominates at serving batch
sizes: RMSNorm (7 ops), residual add + RMSNorm (8), and the q/k/v split with the rotary
embedding (about 13).
"""

from __future__ import annotations

import paddle

from ketch.kernels.dense_graph import _rms_norm, _rotate


def rms_norm_reference(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    return _rms_norm(x, weight, eps)


def add_rms_norm_reference(
    h: paddle.Tensor, delta: paddle.Tensor, weight: paddle.Tensor, eps: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    s = h + delta
    return s, _rms_norm(s, weight, eps)


def rope_qkv_reference(
    qkv: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, heads: int, kv_heads: int
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """qkv [T, (H + 2 KV) D], cos/sin [T, D] -> q [T, H, D], k, v [T, KV, D]; q, k rotated."""
    d = cos.shape[-1]
    qk, v = paddle.split(qkv, [(heads + kv_heads) * d, kv_heads * d], axis=-1)
    qk = _rotate(qk.reshape([0, heads + kv_heads, d]), cos.unsqueeze(1), sin.unsqueeze(1))
    q, k = paddle.split(qk, [heads, kv_heads], axis=1)
    return q, k, v.reshape([0, kv_heads, d])


def _ops():
    from ketch.kernels import cpp_ops

    return cpp_ops.ops()


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    return _ops().ketch_rms_norm(x, weight, float(eps))


def add_rms_norm(
    h: paddle.Tensor, delta: paddle.Tensor, weight: paddle.Tensor, eps: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    s, y = _ops().ketch_add_rms_norm(h, delta, weight, float(eps))
    return s, y


def rope_qkv(
    qkv: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, heads: int, kv_heads: int
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    q, k, v = _ops().ketch_rope_qkv(qkv, cos, sin, int(heads), int(kv_heads))
    return q, k, v
