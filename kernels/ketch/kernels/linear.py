"""The native backend's matmul: ``x @ w`` through OpenBLAS (``csrc/gemm.cc``) or paddle's own
matmul, whichever measures faster on this machine, and the reference.

``linear_reference`` (``paddle.matmul``) is the spec. ``Linear`` calls the C++ op with a fixed
number of OpenBLAS threads; ``select_linear()`` returns it where the GEMM library builds and
loads, else None (the caller keeps paddle.matmul).

Which one is faster depends on the CPU, not on its instruction set alone: on a 2-core AMD EPYC
(Zen 3, AVX2) OpenBLAS ran 75-80 GFLOP/s on one thread against 24 for paddle's dygraph matmul;
on a 2-core Intel Xeon with AVX-512 paddle's matmul (MKL) ran 170-190 against OpenBLAS's 80-110
(``[32, 512] x [512, 2816]``: 0.54 against 1.07 ms). So ``choose_matmul`` times both on the
model's own weight shapes at a few row counts when the model is built (tens of milliseconds)
and dispatches each call by its row count to the winner of the nearest measured count.
``KETCH_MATMUL=openblas|paddle`` skips the measurement.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import paddle

logger = logging.getLogger(__name__)

Matmul = Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]
ENV = "KETCH_MATMUL"
CHOICES = ("auto", "openblas", "paddle")
# Row counts measured: decode of one sequence, small and large decode batches, a prefill chunk.
MEASURED_ROWS = (1, 8, 32, 256)
# Measurement stops adding rounds once one implementation has spent this long on one row count.
_ROUND_BUDGET_S = 0.05
# Weights above this many elements are timed on their first columns only, so that measuring a
# large model (a 150k-word lm_head) costs milliseconds, not seconds, at start-up.
_MAX_MEASURED_ELEMENTS = 1 << 22


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


@dataclass(frozen=True)
class RowDispatch:
    """Calls ``matmuls[i]`` for inputs whose row count is nearest ``rows[i]`` (log scale)."""

    rows: tuple[int, ...]
    matmuls: tuple[Matmul, ...]

    def __post_init__(self) -> None:
        if (
            not self.rows
            or len(self.rows) != len(self.matmuls)
            or list(self.rows) != sorted(self.rows)
        ):
            raise ValueError("rows must be sorted, non-empty and one per matmul")
        # Band edges: geometric means of neighbouring measured counts.
        edges = tuple((a * b) ** 0.5 for a, b in zip(self.rows, self.rows[1:], strict=False))
        object.__setattr__(self, "_edges", edges)

    def pick(self, rows: int) -> Matmul:
        return self.matmuls[bisect.bisect_right(self._edges, rows)]

    def __call__(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        rows = 1
        for d in shape[:-1]:
            rows *= d
        return self.pick(rows)(x, w)


def _seconds(matmul: Matmul, xs: Sequence[paddle.Tensor], ws: Sequence[paddle.Tensor]) -> float:
    """Best of a few rounds of one call per weight."""
    for x, w in zip(xs, ws, strict=True):
        matmul(x, w)  # warm-up: first-call allocations, library dispatch
    best, spent = float("inf"), 0.0
    for _ in range(5):
        start = time.perf_counter()
        for x, w in zip(xs, ws, strict=True):
            matmul(x, w)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > _ROUND_BUDGET_S:
            break
    return best


def choose_matmul(
    weights: Sequence[paddle.Tensor],
    num_threads: int = 1,
    candidates: dict[str, Matmul] | None = None,
    rows: Sequence[int] = MEASURED_ROWS,
) -> tuple[Matmul, str]:
    """The faster matmul for ``x @ w`` over ``weights`` ([K, N] each), and a line saying what
    was measured (also logged). ``candidates`` defaults to OpenBLAS (where it builds) and
    paddle.matmul."""
    if candidates is None:
        candidates = {"paddle": paddle.matmul}
        forced = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if forced not in CHOICES:
            raise ValueError(f"{ENV}={forced!r}: expected one of {', '.join(CHOICES)}")
        if forced != "paddle":
            blas = select_linear(num_threads)
            if blas is not None:
                candidates["openblas"] = blas
            elif forced == "openblas":
                raise RuntimeError(f"{ENV}=openblas but the GEMM library cannot be built here")
        if forced != "auto":
            return candidates[forced], f"matmul: {forced} ({ENV})"
    names = list(candidates)
    if len(names) == 1:
        return candidates[names[0]], f"matmul: {names[0]} (the only one)"
    weights = [_measured_part(w) for w in weights]
    winners: list[str] = []
    parts = []
    for m in rows:
        xs = [paddle.randn([m, int(w.shape[0])], dtype=w.dtype) for w in weights]
        times = {n: _seconds(candidates[n], xs, weights) for n in names}
        best = min(names, key=times.__getitem__)
        winners.append(best)
        parts.append(
            f"{m} rows " + "/".join(f"{n} {times[n] * 1e3:.2f}" for n in names) + f" ms: {best}"
        )
    line = "matmul: " + "; ".join(parts)
    logger.info("%s", line)
    if len(set(winners)) == 1:
        return candidates[winners[0]], line
    return RowDispatch(tuple(rows), tuple(candidates[n] for n in winners)), line


def _measured_part(w: paddle.Tensor) -> paddle.Tensor:
    """``w`` itself, or a contiguous copy of its first columns where it is too big to time."""
    k, n = int(w.shape[0]), int(w.shape[1])
    if k * n <= _MAX_MEASURED_ELEMENTS:
        return w
    return w[:, : max(1, _MAX_MEASURED_ELEMENTS // max(k, 1))].contiguous()
