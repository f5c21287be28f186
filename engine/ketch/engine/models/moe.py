"""Routed experts (the sparse MLP blocks of Qwen3-MoE and ERNIE 4.5 MoE) in paddle ops, for the
eager and native backends.

Two routers, each transformers' step for step. ``route`` is ``Qwen3MoeTopKRouter``: router
logits in the hidden dtype, softmax in float32, ``topk`` of the probabilities (paddle's CPU
``topk`` orders exact ties as torch's does: the tests check it on tied routers), renormalised over
the top-k when ``norm_topk_prob``, then cast back to the logits' dtype. ``route_with_bias`` is
``Ernie4_5_MoeTopKRouter``: everything in float32 (the router weight and its
``e_score_correction_bias`` are kept in float32 at load, as transformers keeps them), the top-k
chosen on the probabilities plus the bias, the weights gathered from the un-biased probabilities
and divided by their sum (clamped to at least ``moe_norm_min``). ERNIE's shared experts are a
dense MLP the callers add beside the routed output (``LayerWeights.gate_up``/``down`` of an
expert layer), not part of this module. The experts run as
``Qwen3MoeExperts``' eager loop does: the tokens routed to each expert gathered, that expert's
SwiGLU on them, each output scaled by its routing weight and added into the result, experts in
ascending order (so each token's sum has transformers' order).

Tensor parallelism splits the experts: a rank holds ``num_experts / world`` of them whole
(``Shard.experts``) and the router entire, computes the contributions of its own experts only,
and the ranks' partial results are summed by the caller (like the dense MLP's row-parallel
output). ``combine`` is one matmul pair per expert that has tokens (the eager reference, and the
native backend without the packed GEMM); the native backend otherwise runs the same sum in one
fused op (``ketch.kernels.fused_moe``). Routing and the experts stay two steps: both routers
feed the same experts code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.nn.functional import swiglu

from ketch.engine.models.config import ModelConfig, moe_refusal


@dataclass
class MoeWeights:
    """One layer's routed experts, or a rank's share of them."""

    router: paddle.Tensor  # [hidden, num_experts], every expert's (replicated)
    gate_up: list  # per held expert: [hidden, 2 * moe_intermediate] ([gate | up]), or its form
    down: list  # per held expert: [moe_intermediate, hidden], or its form
    first: int  # the global index of gate_up[0]: this rank holds [first, first + len(gate_up))
    # ERNIE 4.5: e_score_correction_bias [num_experts], float32, added to the probabilities
    # only to choose the top-k (``route_with_bias``); None for Qwen3-MoE's router
    score_bias: paddle.Tensor | None = None


def route(
    x: paddle.Tensor, router: paddle.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(routing weights [T, top_k] in x's dtype, expert indices [T, top_k] int64), as
    ``Qwen3MoeTopKRouter.forward`` computes them."""
    logits = paddle.matmul(x, router)
    wide = logits.dtype == paddle.float32  # no casts to make (each is an op call at decode)
    probs = F.softmax(logits if wide else logits.astype("float32"), axis=-1)
    top, indices = paddle.topk(probs, top_k, axis=-1)
    if norm_topk_prob:
        top = top / top.sum(axis=-1, keepdim=True)
    return (top if wide else top.astype(logits.dtype)), indices


def route_with_bias(
    x: paddle.Tensor, router: paddle.Tensor, score_bias: paddle.Tensor, top_k: int, norm_min: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(routing weights [T, top_k] in x's dtype, expert indices [T, top_k] int64), as
    ``Ernie4_5_MoeTopKRouter.forward`` computes them; ``router`` [hidden, E] and ``score_bias``
    [E] are float32."""
    wide = x.dtype == paddle.float32  # no casts to make (each is an op call at decode)
    probs = F.softmax(paddle.matmul(x if wide else x.astype("float32"), router), axis=-1)
    _, indices = paddle.topk(probs + score_bias, top_k, axis=-1)
    top = paddle.take_along_axis(probs, indices, axis=-1)
    top = top / paddle.clip(top.sum(axis=-1, keepdim=True), min=norm_min)
    return (top if wide else top.astype(x.dtype)), indices


def select_experts(
    x: paddle.Tensor, weights: MoeWeights, config: ModelConfig
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The layer's routing weights and expert indices, by its architecture's router."""
    top_k = config.num_experts_per_tok
    if weights.score_bias is not None:
        return route_with_bias(x, weights.router, weights.score_bias, top_k, config.moe_norm_min)
    return route(x, weights.router, top_k, config.norm_topk_prob)


ExpertMlp = Callable[[paddle.Tensor, int], paddle.Tensor]  # (rows, held expert j) -> rows out


def combine(
    x: paddle.Tensor,
    weights: MoeWeights,
    routing: paddle.Tensor,
    indices: paddle.Tensor,
    mlp: ExpertMlp,
) -> paddle.Tensor:
    """Sum over the held experts of routing weight times the expert's MLP, for each token of x
    [T, hidden] (zero where a token picked none of them)."""
    out = paddle.zeros_like(x)
    chosen = indices.numpy().reshape(-1)  # [T * top_k], token-major
    order = np.argsort(chosen, kind="stable")
    counts = np.bincount(chosen, minlength=weights.first + len(weights.gate_up))
    starts = np.concatenate([[0], np.cumsum(counts)])
    top_k = int(indices.shape[1])
    flat = routing.reshape([-1, 1])
    for j in range(len(weights.gate_up)):
        e = weights.first + j
        picks = order[starts[e] : starts[e + 1]]
        if not len(picks):
            continue
        tokens = paddle.to_tensor(picks // top_k)
        y = mlp(paddle.gather(x, tokens), j) * paddle.gather(flat, paddle.to_tensor(picks))
        out = paddle.index_add(out, tokens, 0, y.astype(out.dtype))
    return out


def eager_moe(x: paddle.Tensor, weights: MoeWeights, config: ModelConfig) -> paddle.Tensor:
    """The routed experts in plain paddle ops (``LlamaModel``, the reference)."""
    routing, indices = select_experts(x, weights, config)

    def mlp(rows: paddle.Tensor, j: int) -> paddle.Tensor:
        return paddle.matmul(swiglu(paddle.matmul(rows, weights.gate_up[j])), weights.down[j])

    return combine(x, weights, routing, indices, mlp)


def refuse_moe(architecture: str, where: str) -> None:
    """Raises ``ValueError``: a MoE model asked to run where there are no routed experts;
    ``where`` names it as the user chose it (``--backend predictor``, ``--device gpu``)."""
    raise ValueError(moe_refusal(architecture, where))
