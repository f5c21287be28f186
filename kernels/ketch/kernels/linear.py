"""The native backend's matmul: ``x @ w`` through OpenBLAS (``csrc/gemm.cc``), and its reference.

``linear_reference`` (``paddle.matmul``) is the spec. ``Linear`` calls the C++ op with a fixed
number of OpenBLAS threads; ``select_linear()`` returns it where the GEMM library builds and
loads, else None (the caller keeps paddle.matmul).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import paddle

logger = logging.getLogger(__name__)


def linear_reference(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x [..., K] @ w [K, N] -> [..., N]: the spec."""
    return paddle.matmul(x, w)


@dataclass(frozen=True)
class Linear:
    """``x @ w`` for float32 CPU tensors on ``num_threads`` OpenBLAS threads."""

    num_threads: int = 1

    def __call__(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        from ketch.kernels import cpp_ops

        return cpp_ops.gemm_ops().ketch_linear(x, w, self.num_threads)


def select_linear(num_threads: int = 1) -> Linear | None:
    """The GEMM kernel if its library can be built and loaded here, else None (logged once)."""
    from ketch.kernels import cpp_ops

    try:
        cpp_ops.gemm_ops()
    except RuntimeError as exc:
        logger.warning("linear: paddle.matmul (%s)", exc)
        return None
    return Linear(max(1, int(num_threads)))
