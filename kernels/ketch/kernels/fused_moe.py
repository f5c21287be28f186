"""A MoE block's routed experts in one op (``csrc/fused_moe.cc``), on the packed GEMM's weights.

Given the router's choice (routing weights and expert indices, [T, top_k] each, computed
elsewhere) and a rank's held experts packed by ``FusedMoe.prepare`` (each in the packed GEMM's
layout, gate_up with SwiGLU in the epilogue, stacked), ``FusedMoe`` returns each token's sum
over its picked held experts of routing weight times the expert's SwiGLU MLP, experts
ascending, in one call: the tokens
grouped by expert (a counting sort), each expert's two GEMMs on its rows with the dense linear's
micro-kernels, and the weighted sum. It replaces one Python-level matmul pair per expert with
tokens (``ketch.engine.models.moe.combine``), whose per-expert dispatch dominates at decode.

Its results equal that loop's bit for bit when the loop runs the same ``PackedLinear``; the
plain-paddle ``fused_moe_reference`` (``paddle.matmul`` on the unpacked weights) is the spec.
The instruction set is chosen once from the CPU's features (``select_fused_moe``, as
``select_packed_linear``; the native backend takes its packed GEMM's). The experts' panels are
float32, bfloat16 or int8 (``prepare(..., dtype="int8")``: each expert's two weights quantized
per column on their own, ``quantize_int8``; the op ``ketch_fused_moe_i8`` takes the scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import paddle

from ketch.kernels import cpp_ops
from ketch.kernels.cpu_features import CpuFeatures
from ketch.kernels.packed_linear import (
    PANEL_DTYPE_NAMES,
    PANEL_WIDTH,
    PackedLinear,
    pack_weight_scaled,
    tensor_nbytes,
)

AVX512_OP = "ketch.kernels.fused_moe.fused_moe_avx512"
AVX2_OP = "ketch.kernels.fused_moe.fused_moe_avx2"


@dataclass(frozen=True)
class PackedExperts:
    """A layer's held experts in one instruction set's packed layout, stacked (what
    ``FusedMoe`` runs; one tensor each, since every tensor handed to an op costs its dispatch)."""

    gate_up: paddle.Tensor  # [E, ceil(I / (NR / 2)), hidden, NR]: [gate | up] packed with glu
    down: paddle.Tensor  # [E, ceil(hidden / NR), I, NR]; both float32, bfloat16 or int8
    inter: int  # I, each expert's intermediate size
    isa: str
    # int8 panels only: each expert's per-column scales (``quantize_int8``), float32.
    gate_up_scale: paddle.Tensor | None = None  # [E, 2I], gate columns then up columns
    down_scale: paddle.Tensor | None = None  # [E, hidden]

    def __len__(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def dtype(self) -> str:
        """The panels' element type, one of ``packed_linear.WEIGHT_DTYPES``."""
        return PANEL_DTYPE_NAMES[self.gate_up.dtype]

    @property
    def nbytes(self) -> int:
        """The bytes these experts hold: panels (padding included) and scales."""
        held = (self.gate_up, self.down, self.gate_up_scale, self.down_scale)
        return sum(tensor_nbytes(t) for t in held if t is not None)


@dataclass(frozen=True)
class FusedMoe:
    """The routed experts of one layer (or one rank's share) for float32 CPU tensors."""

    isa: str
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.isa not in PANEL_WIDTH:
            raise ValueError(f"unknown isa {self.isa!r}; expected one of {sorted(PANEL_WIDTH)}")

    def prepare(
        self,
        gate_up: Sequence[paddle.Tensor],
        down: Sequence[paddle.Tensor],
        dtype: str | None = None,
    ) -> PackedExperts:
        """Expert j's gate_up[j] [hidden, 2I] ([gate | up]) and down[j] [I, hidden], packed and
        stacked (a copy; the inputs may be dropped); ``dtype``: the panels' element type, as
        ``PackedLinear.prepare`` takes it (default: the first weight's); "int8" quantizes each
        weight on its own (``quantize_int8``: per expert, per column)."""
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate_up weights and {len(down)} down weights")
        hidden, inter = int(gate_up[0].shape[0]), int(gate_up[0].shape[1]) // 2
        for g, d in zip(gate_up, down, strict=True):
            if list(g.shape) != [hidden, 2 * inter] or list(d.shape) != [inter, hidden]:
                raise ValueError(
                    f"every expert must have gate_up [{hidden}, {2 * inter}] and down "
                    f"[{inter}, {hidden}], got {list(g.shape)} and {list(d.shape)}"
                )
        dtype = dtype or ("bfloat16" if gate_up[0].dtype == paddle.bfloat16 else "float32")
        up = [pack_weight_scaled(w, self.isa, True, dtype) for w in gate_up]
        dn = [pack_weight_scaled(w, self.isa, False, dtype) for w in down]
        up_scale = dn_scale = None
        if dtype == "int8":
            up_scale = paddle.stack([scale for _, scale in up])
            dn_scale = paddle.stack([scale for _, scale in dn])
        return PackedExperts(
            paddle.stack([panels for panels, _ in up]),
            paddle.stack([panels for panels, _ in dn]),
            inter,
            self.isa,
            up_scale,
            dn_scale,
        )

    def __call__(
        self,
        x: paddle.Tensor,
        routing: paddle.Tensor,
        indices: paddle.Tensor,
        experts: PackedExperts,
        first: int = 0,
    ) -> paddle.Tensor:
        """x [T, hidden], routing [T, top_k] (x's dtype), indices [T, top_k] (global expert
        ids); ``experts``: experts ``first``, ``first + 1``, ... Returns [T, hidden]."""
        if experts.isa != self.isa:
            raise TypeError(f"expects experts packed for {self.isa} by FusedMoe.prepare")
        if indices.dtype != paddle.int64:
            indices = indices.astype("int64")
        if experts.gate_up_scale is not None:
            return cpp_ops.ops().ketch_fused_moe_i8(
                x, routing, indices, experts.gate_up, experts.down, experts.gate_up_scale,
                experts.down_scale, int(first), experts.inter, self.isa, int(self.num_threads),
            )  # fmt: skip
        return cpp_ops.ops().ketch_fused_moe(
            x, routing, indices, experts.gate_up, experts.down, int(first), experts.inter,
            self.isa, int(self.num_threads),
        )  # fmt: skip

    @classmethod
    def for_linear(cls, linear: PackedLinear) -> FusedMoe:
        """The experts op for ``linear``'s instruction set, on as many threads."""
        return cls(linear.isa, linear.num_threads)


def fused_moe_reference(
    x: paddle.Tensor,
    routing: paddle.Tensor,
    indices: paddle.Tensor,
    gate_up: Sequence[paddle.Tensor],
    down: Sequence[paddle.Tensor],
    first: int = 0,
) -> paddle.Tensor:
    """What ``FusedMoe`` computes, on the unpacked weights ([hidden, 2I] = [gate | up], and
    [I, hidden]) in plain paddle: for each held expert in ascending order, the rows of the
    tokens that picked it through SwiGLU, scaled by their routing weights and added."""
    out = paddle.zeros_like(x)
    flat_routing = routing.reshape([-1, 1])
    top_k = int(indices.shape[1])
    flat = indices.reshape([-1]).numpy()
    for j, (wg, wd) in enumerate(zip(gate_up, down, strict=True)):
        picks = (flat == first + j).nonzero()[0]
        if not len(picks):
            continue
        tokens = paddle.to_tensor(picks // top_k)
        y = paddle.matmul(
            paddle.nn.functional.swiglu(paddle.matmul(paddle.gather(x, tokens), wg)), wd
        )
        out = paddle.index_add(
            out, tokens, 0, y * paddle.gather(flat_routing, paddle.to_tensor(picks))
        )
    return out


fused_moe_avx512 = FusedMoe("avx512")
fused_moe_avx2 = FusedMoe("avx2")
fused_moe_generic = FusedMoe("generic")


def select_fused_moe(features: CpuFeatures | None = None, num_threads: int = 1) -> FusedMoe:
    """The widest micro-kernels ``features`` (default: this CPU's) allow, as
    ``select_packed_linear`` picks them (weights must be packed for the same isa)."""
    features = features or CpuFeatures.detect()
    for isa, op in (("avx512", AVX512_OP), ("avx2", AVX2_OP)):
        if features.can_run(op):
            return FusedMoe(isa, max(1, int(num_threads)))
    return FusedMoe("generic", max(1, int(num_threads)))
