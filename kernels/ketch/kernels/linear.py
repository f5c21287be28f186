"""The native backend's matmul: ``x @ w`` through Ketch's packed-weight GEMM (``packed_linear``),
OpenBLAS (``csrc/gemm.cc``) or paddle's own matmul, whichever measures faster on this machine,
and the reference.

``linear_reference`` (``paddle.matmul``) is the spec. ``Linear`` calls the OpenBLAS op with a
fixed number of threads; ``select_linear()`` returns it where the GEMM library builds and loads,
else None. A matmul may carry ``prepare(w)``: the weight in the layout it computes from (the
packed GEMM's panels), made once at load; the model then keeps only that form.

Which one is faster depends on the CPU, not on its instruction set alone: on a 2-core AMD EPYC
(Zen 3, AVX2) OpenBLAS ran 75-80 GFLOP/s on one thread against 24 for paddle's dygraph matmul;
on a 2-core Intel Xeon with AVX-512 paddle's matmul (MKL) ran 170-190 against OpenBLAS's 80-110;
on a 2-core AMD EPYC with AVX-512 (Zen 4) the packed GEMM ran 90-108 at 4-256 rows against
OpenBLAS's 35-100 (which repacks the weight on every call). So ``choose_matmul`` times them on
the model's own weight shapes at a few row counts when the model is built (tens of milliseconds)
and dispatches each call by its row count to the winner of the nearest measured count.
``KETCH_MATMUL=packed|openblas|paddle`` skips the measurement.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import paddle

from ketch.kernels import cpp_ops

logger = logging.getLogger(__name__)

Matmul = Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]
ENV = "KETCH_MATMUL"
CHOICES = ("auto", "packed", "openblas", "paddle")
# Row counts measured: decode of one sequence, small and large decode batches, a prefill chunk.
MEASURED_ROWS = (1, 8, 32, 256)
# Measurement stops adding rounds once one implementation has spent this long on one row count.
_ROUND_BUDGET_S = 0.05
# Weights above this many elements are timed on their first columns only, so that measuring a
# large model (a 150k-word lm_head) costs milliseconds, not seconds, at start-up.
_MAX_MEASURED_ELEMENTS = 1 << 22
# A matmul with its own weight layout (the packed GEMM) is taken over a faster one at a row count
# where it is at most this much slower: measured differences of a few percent are noise.
PREFER_OWN_LAYOUT = 1.1


def linear_reference(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x [..., K] @ w [K, N] -> [..., N]: the spec."""
    return paddle.matmul(x, w)


@dataclass(frozen=True)
class Linear:
    """``x @ w`` for float32 CPU tensors on ``num_threads`` OpenBLAS threads."""

    num_threads: int = 1

    def __call__(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        return cpp_ops.gemm_ops().ketch_linear(x, w, self.num_threads)


def select_linear(num_threads: int = 1) -> Linear | None:
    """The GEMM kernel if its library can be built and loaded here, else None (logged once)."""
    try:
        cpp_ops.gemm_ops()
    except RuntimeError as exc:
        logger.warning("linear: paddle.matmul (%s)", exc)
        return None
    return Linear(max(1, int(num_threads)))


def prepared(matmul: Matmul, w: paddle.Tensor):
    """``w`` in the layout ``matmul`` computes from (itself for a matmul without ``prepare``)."""
    prepare = getattr(matmul, "prepare", None)
    return w if prepare is None else prepare(w)


@dataclass(frozen=True)
class Forms:
    """One weight in the layouts of a RowDispatch's matmuls (one entry per matmul)."""

    forms: tuple

    @property
    def shape(self) -> list[int]:
        return list(self.forms[0].shape)


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
        return self.matmuls[self._band(rows)]

    def _band(self, rows: int) -> int:
        return bisect.bisect_right(self._edges, rows)

    def prepare(self, w: paddle.Tensor) -> Forms:
        """``w`` in every layout the bands need (each distinct matmul prepares it once)."""
        made: dict[int, object] = {}
        for m in self.matmuls:
            if id(m) not in made:
                made[id(m)] = prepared(m, w)
        return Forms(tuple(made[id(m)] for m in self.matmuls))

    def __call__(self, x: paddle.Tensor, w) -> paddle.Tensor:
        shape = x.shape
        rows = 1
        for d in shape[:-1]:
            rows *= d
        band = self._band(rows)
        return self.matmuls[band](x, w.forms[band] if isinstance(w, Forms) else w)


def packed_gemm_of(matmul: Matmul):
    """The packed GEMM (a ``PackedLinear``) for weights that only it runs: a MoE layer's experts,
    whose fused op is built on its micro-kernels. ``matmul`` itself or the packed member of its
    row dispatch; else, unless ``KETCH_MATMUL`` forced ``matmul``, this CPU's on as many threads;
    None where the op library does not build (the experts then loop over ``matmul``)."""
    from ketch.kernels.packed_linear import PackedLinear

    members = matmul.matmuls if isinstance(matmul, RowDispatch) else (matmul,)
    for m in members:
        if isinstance(m, PackedLinear):
            return m
    if (os.environ.get(ENV, "auto").strip().lower() or "auto") != "auto":
        return None
    return _select_packed(max(getattr(m, "num_threads", 1) for m in members))


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
        for name, select in (("packed", _select_packed), ("openblas", select_linear)):
            if forced not in ("auto", name):
                continue
            kernel = select(num_threads)
            if kernel is not None:
                candidates[name] = kernel
            elif forced == name:
                raise RuntimeError(f"{ENV}={name} but its kernel cannot be built here")
        if forced != "auto":
            return candidates[forced], f"matmul: {forced} ({ENV})"
    names = list(candidates)
    if len(names) == 1:
        return candidates[names[0]], f"matmul: {names[0]} (the only one)"
    weights = [_measured_part(w) for w in weights]
    winners: list[str] = []
    parts = []
    forms = {n: [prepared(candidates[n], w) for w in weights] for n in names}
    for m in rows:
        xs = [paddle.randn([m, int(w.shape[0])], dtype=w.dtype) for w in weights]
        times = {n: _seconds(candidates[n], xs, forms[n]) for n in names}
        best = min(names, key=times.__getitem__)
        # Within the noise, a matmul with its own layout wins: a dispatch mixing layouts keeps
        # each weight twice.
        own = [n for n in names if getattr(candidates[n], "prepare", None) is not None]
        if own and best not in own and times[own[0]] <= PREFER_OWN_LAYOUT * times[best]:
            best = own[0]
        winners.append(best)
        parts.append(
            f"{m} rows " + "/".join(f"{n} {times[n] * 1e3:.2f}" for n in names) + f" ms: {best}"
        )
    line = "matmul: " + "; ".join(parts)
    logger.info("%s", line)
    if len(set(winners)) == 1:
        return candidates[winners[0]], line
    return RowDispatch(tuple(rows), tuple(candidates[n] for n in winners)), line


def _select_packed(num_threads: int):
    """The packed GEMM for this CPU where Ketch's op library builds here, else None (logged)."""
    from ketch.kernels.packed_linear import select_packed_linear

    try:
        cpp_ops.ops()
    except RuntimeError as exc:
        logger.warning("linear: no packed GEMM (%s)", exc)
        return None
    return select_packed_linear(num_threads=num_threads)


def _measured_part(w: paddle.Tensor) -> paddle.Tensor:
    """``w`` itself, or a contiguous copy of its first columns where it is too big to time."""
    k, n = int(w.shape[0]), int(w.shape[1])
    if k * n <= _MAX_MEASURED_ELEMENTS:
        return w
    return w[:, : max(1, _MAX_MEASURED_ELEMENTS // max(k, 1))].contiguous()
