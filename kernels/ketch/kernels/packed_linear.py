"""The native backend's matmul on weights packed once at load (``csrc/packed_gemm.cc``).

``x @ w`` where ``w`` [K, N] was rearranged by ``PackedLinear.prepare`` into panels of NR
columns ([ceil(N / NR), K, NR], zero-padded): each panel is one contiguous block the micro-kernel
streams once per register tile of rows. A library GEMM does that rearranging on every call; at
serving batch sizes it costs as much as the arithmetic (docs/backend.md has the figures).

The panel width belongs to the instruction set (AVX-512: 32, AVX2 + FMA: 16, generic: 8), so a
weight is packed by the ``PackedLinear`` that will run it, and ``select_packed_linear`` picks the
instruction set from the CPU's features (never assumed). ``linear_reference`` (paddle.matmul on
the unpacked weight) is the spec.

Panels hold float32 or bfloat16 (``prepare(w, dtype="bfloat16")``: half the bytes, which is what
a decode step's few rows are bound by). Every instruction set widens bfloat16 to float32 as it
loads a panel; x, the sums and the epilogues stay float32, so a bfloat16 weight gives the float32
GEMM of the weight rounded to bfloat16 (``round_to_bfloat16``: to nearest, ties to even).

Panels may also hold int8 (``prepare(w, dtype="int8")``: a quarter of the float32 bytes plus one
float32 scale per column; W8A16 in spirit, the activations stay float32). ``quantize_int8`` is
symmetric per output column: scale = max |column| / 127 (1 for a zero column), q = w / scale
rounded to nearest even and clamped to [-127, 127]; a weight holding a NaN or an infinity is
refused. The kernels widen int8 to float32 as they load a panel, accumulate in float32 as for
float32 panels, and multiply each column's sum by its scale in the epilogue (before the bias or
SwiGLU; with glu the gate and up columns keep their own scales): the float32 GEMM of
``dequantize_int8(q, scale)`` up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from ketch.kernels import cpp_ops
from ketch.kernels.cpu_features import CpuFeatures

AVX512_OP = "ketch.kernels.packed_linear.packed_linear_avx512"
AVX2_OP = "ketch.kernels.packed_linear.packed_linear_avx2"
PANEL_WIDTH = {"avx512": 32, "avx2": 16, "generic": 8}
WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
PANEL_DTYPE_NAMES = {paddle.float32: "float32", paddle.bfloat16: "bfloat16", paddle.int8: "int8"}


@dataclass(frozen=True)
class PackedWeight:
    """A [K, N] weight in one instruction set's panel layout. ``glu``: a [gate | up] weight
    packed so that the product comes out as SwiGLU's ``silu(x @ gate) * (x @ up)``, N / 2 wide.
    ``scale``: int8 panels' dequantization scales, float32, one per column of the unpacked
    weight ([N]; [gate | up] with glu), in its column order; None for float32/bfloat16 panels."""

    data: paddle.Tensor  # [ceil(outputs / (NR or NR / 2)), K, NR], float32, bfloat16 or int8
    k: int
    n: int  # output columns
    isa: str
    glu: bool = False
    scale: paddle.Tensor | None = None

    @property
    def dtype(self) -> str:
        """The panels' element type, one of ``WEIGHT_DTYPES``."""
        return PANEL_DTYPE_NAMES[self.data.dtype]

    @property
    def nbytes(self) -> int:
        """The bytes this weight holds: its panels (padding included) and its scales."""
        return tensor_nbytes(self.data) + (0 if self.scale is None else tensor_nbytes(self.scale))

    @property
    def shape(self) -> list[int]:
        """The unpacked weight's shape, [K, N]."""
        return [self.k, 2 * self.n if self.glu else self.n]


@dataclass(frozen=True)
class PackedLinear:
    """``x @ w`` (+ ``bias``) for float32 CPU tensors, ``w`` packed by ``prepare`` (float32 or
    bfloat16 panels)."""

    isa: str
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.isa not in PANEL_WIDTH:
            raise ValueError(f"unknown isa {self.isa!r}; expected one of {sorted(PANEL_WIDTH)}")

    def prepare(
        self, w: paddle.Tensor, glu: bool = False, dtype: str | None = None
    ) -> PackedWeight:
        """``w`` [K, N] in this instruction set's layout (a copy; ``w`` may be dropped);
        ``glu``: ``w`` is [gate | up] and the product is SwiGLU's (see ``swiglu_reference``).
        ``dtype``: the panels' element type (default: ``w``'s, float32 or bfloat16); a float32
        ``w`` packed as bfloat16 is rounded to nearest even; "int8" quantizes ``w`` with
        ``quantize_int8`` (ValueError if it holds a NaN or an infinity)."""
        if len(w.shape) != 2 or (glu and int(w.shape[1]) % 2):
            want = "[K, 2I]" if glu else "[K, N]"
            raise ValueError(f"a weight to pack must be {want}, got {list(w.shape)}")
        packed, scale = pack_weight_scaled(w, self.isa, glu, dtype)
        n = int(w.shape[1]) // 2 if glu else int(w.shape[1])
        return PackedWeight(packed, int(w.shape[0]), n, self.isa, glu, scale)

    def __call__(
        self, x: paddle.Tensor, w: PackedWeight, bias: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        """x [..., K] -> [..., N]."""
        if not isinstance(w, PackedWeight) or w.isa != self.isa:
            raise TypeError(f"expects a weight packed for {self.isa} by PackedLinear.prepare")
        if w.glu and bias is not None:
            raise ValueError("a glu-packed weight takes no bias")
        if w.scale is not None:
            return cpp_ops.ops().ketch_packed_linear_i8(
                x, w.data, w.scale, bias, w.n, self.isa, int(self.num_threads), w.glu
            )
        return cpp_ops.ops().ketch_packed_linear(
            x, w.data, bias, w.n, self.isa, int(self.num_threads), w.glu
        )


def pack_weight_scaled(
    w: paddle.Tensor, isa: str, glu: bool, dtype: str | None
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """The packed panels of ``w`` and, for int8 panels, their scales (see
    ``PackedLinear.prepare``)."""
    own = "bfloat16" if w.dtype == paddle.bfloat16 else "float32"
    dtype = dtype or own
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {dtype!r}; expected one of {WEIGHT_DTYPES}")
    ops = cpp_ops.ops()
    if dtype == "int8":
        q, scale = quantize_int8(w)
        return ops.ketch_pack_weight_i8(q, isa, glu), scale
    if dtype == "bfloat16":
        return ops.ketch_pack_weight_bf16(w, isa, glu), None
    return ops.ketch_pack_weight(w.astype("float32") if own == "bfloat16" else w, isa, glu), None


def pack_weight(w: paddle.Tensor, isa: str, glu: bool, dtype: str | None) -> paddle.Tensor:
    """The packed panels of ``w`` as float32 or bfloat16 (see ``PackedLinear.prepare``); int8
    panels need their scales: ``pack_weight_scaled``."""
    if dtype == "int8":
        raise ValueError("int8 panels come with their scales: use pack_weight_scaled")
    return pack_weight_scaled(w, isa, glu, dtype)[0]


def quantize_int8(w: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``w`` [K, N] (float32 or bfloat16) quantized symmetrically per column: ``(q, scale)``, q
    int8 [K, N] and scale float32 [N], scale = max_k |w[k, n]| / 127 (1 for a zero column; the
    smallest subnormal where that quotient underflows to 0; the next float down where 127 * scale
    would overflow, near the largest float) and q = w / scale rounded to
    nearest, ties to even, clamped to [-127, 127]. ValueError if ``w`` holds a NaN or an
    infinity (no scale would represent it)."""
    if len(w.shape) != 2:
        raise ValueError(f"a weight to quantize must be [K, N], got {list(w.shape)}")
    if w.dtype not in (paddle.float32, paddle.bfloat16):
        raise ValueError(f"a weight to quantize must be float32 or bfloat16, got {w.dtype}")
    q, scale = cpp_ops.ops().ketch_quantize_int8(w)
    # A column with a NaN or an infinity has a non-finite scale; only the [N] scales are checked.
    bad = paddle.logical_not(paddle.isfinite(scale))
    if bool(bad.any()):
        columns = paddle.nonzero(bad).reshape([-1]).numpy()
        shown = ", ".join(str(int(c)) for c in columns[:8]) + (", ..." if len(columns) > 8 else "")
        raise ValueError(
            f"cannot quantize a weight holding NaN or infinite values to int8 "
            f"({len(columns)} column(s) of {int(w.shape[1])}: {shown})"
        )
    return q, scale


def dequantize_int8(q: paddle.Tensor, scale: paddle.Tensor) -> paddle.Tensor:
    """The float32 weight [K, N] that int8 panels of ``q`` with ``scale`` stand for:
    ``q[k, n] * scale[n]`` (the GEMM multiplies x by this, up to float32 rounding)."""
    return q.astype("float32") * scale.astype("float32").reshape([1, -1])


def tensor_nbytes(t: paddle.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return int(t.numel()) * t.element_size()


def round_to_bfloat16(w: paddle.Tensor) -> paddle.Tensor:
    """float32 ``w`` rounded to bfloat16 as the packing rounds it (nearest, ties to even; NaN
    stays NaN), as bfloat16: ``.astype("float32")`` is the weight a bfloat16 GEMM multiplies by."""
    size = int(w.numel())
    row = pack_weight(w.reshape([1, size]), "generic", False, "bfloat16")  # [P, 1, 8]
    return row.reshape([-1])[:size].reshape(w.shape)


def swiglu_reference(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """What a glu-packed ``w`` ([K, 2I] = [gate | up]) computes: ``swiglu(x @ w)``."""
    return paddle.nn.functional.swiglu(paddle.matmul(x, w))


packed_linear_avx512 = PackedLinear("avx512")
packed_linear_avx2 = PackedLinear("avx2")
packed_linear_generic = PackedLinear("generic")


def select_packed_linear(features: CpuFeatures | None = None, num_threads: int = 1) -> PackedLinear:
    """The widest micro-kernel ``features`` (default: this CPU's) allow."""
    features = features or CpuFeatures.detect()
    for isa, op in (("avx512", AVX512_OP), ("avx2", AVX2_OP)):
        if features.can_run(op):
            return PackedLinear(isa, max(1, int(num_threads)))
    return PackedLinear("generic", max(1, int(num_threads)))
