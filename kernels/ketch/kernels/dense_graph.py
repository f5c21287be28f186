"""The dense part of a Llama-family decoder as three static-graph programs.

A step's layers are cut at attention: the *first* program embeds the tokens and projects layer
0's queries/keys/values; a *middle* program finishes layer ``l - 1`` (output projection, MLP)
and projects layer ``l``'s q/k/v; the *last* one finishes the last layer and computes logits.
Attention over the paged KV cache runs between them, outside the graph, so the programs see no
block tables, masks or cache. Weights are program inputs, not parameters: one middle program
serves every layer, an export depends only on the model's shapes (never on a checkpoint's
values), and the predictor reads the loaded weights in place instead of holding a second copy.

Every token dimension is ``None`` (``reshape([0, ...])``), so batch and chunk sizes never
retrace. Each function is the reference for itself: called eagerly it is plain dygraph paddle.
The programs take the matmul they use (``paddle.matmul`` by default, what is exported); the
native backend calls them eagerly with Ketch's GEMM kernel instead (``ketch.kernels.linear``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import paddle
from paddle.nn.functional import embedding, swiglu
from paddle.static import InputSpec


@dataclass(frozen=True)
class DenseShape:
    """Everything that shapes the programs; an export is valid for any checkpoint with it."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    # The portable formula in Hugging Face's order (the fused kernel is AVX-512 only). A sum,
    # not a mean: paddle 3.3.1's oneDNN mean kernel prints a debug line to stdout.
    variance = paddle.sum(x * x, axis=-1, keepdim=True) * (1.0 / x.shape[-1])
    return x * paddle.rsqrt(variance + eps) * weight


def _rotate(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[:, :, :half], x[:, :, half:]
    return x * cos + paddle.concat([-x2, x1], axis=-1) * sin


Matmul = Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]


class _Weights:
    """Reads a program's weight inputs in the order ``weight_specs`` lists them, and applies the
    program's matmul to them."""

    def __init__(self, tensors: list[paddle.Tensor], matmul: Matmul = paddle.matmul) -> None:
        self._tensors = list(tensors)
        self.matmul = matmul

    def take(self, present: bool = True) -> paddle.Tensor | None:
        return self._tensors.pop(0) if present else None

    def linear(self, x: paddle.Tensor, bias: bool) -> paddle.Tensor:
        """x @ (the next weight) [+ the next one, the bias, when ``bias``]."""
        y = self.matmul(x, self.take())
        return y if not bias else y + self.take()


def _project_qkv(
    s: DenseShape, h: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, w: _Weights
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    x = _rms_norm(h, w.take(), s.eps)
    qkv = w.linear(x, s.qkv_bias)
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qk, v = paddle.split(qkv, [q_size + kv_size, kv_size], axis=-1)
    # Queries and keys rotate together: one set of rotary ops per layer.
    qk = _rotate(
        qk.reshape([0, s.heads + s.kv_heads, s.head_dim]), cos.unsqueeze(1), sin.unsqueeze(1)
    )
    q, k = paddle.split(qk, [s.heads, s.kv_heads], axis=1)
    return q, k, v.reshape([0, s.kv_heads, s.head_dim])


def _finish_layer(
    s: DenseShape, h: paddle.Tensor, attn: paddle.Tensor, w: _Weights
) -> paddle.Tensor:
    h = h + w.linear(attn, s.o_bias)
    x = _rms_norm(h, w.take(), s.eps)
    gate_up = w.linear(x, s.mlp_bias)
    return h + w.linear(swiglu(gate_up), s.mlp_bias)


def first_program(
    s: DenseShape, matmul: Matmul = paddle.matmul
) -> Callable[..., tuple[paddle.Tensor, ...]]:
    """(input_ids [T], cos [T, D], sin [T, D], embed, input_norm, qkv[, qkv_bias])
    -> (h [T, hidden], q [T, H, D], k [T, KV, D], v [T, KV, D])."""

    def first(input_ids, cos, sin, weights):
        w = _Weights(weights, matmul)
        h = embedding(input_ids, w.take())
        return (h, *_project_qkv(s, h, cos, sin, w))

    return first


def middle_program(
    s: DenseShape, matmul: Matmul = paddle.matmul
) -> Callable[..., tuple[paddle.Tensor, ...]]:
    """(h, attn [T, H * D], cos, sin, <finish weights of layer l-1>, <q/k/v weights of layer l>)
    -> (h, q, k, v) of layer l."""

    def middle(h, attn, cos, sin, weights):
        w = _Weights(weights, matmul)
        h = _finish_layer(s, h, attn, w)
        return (h, *_project_qkv(s, h, cos, sin, w))

    return middle


def last_program(s: DenseShape, matmul: Matmul = paddle.matmul) -> Callable[..., paddle.Tensor]:
    """(h, attn, logit_rows [R], <finish weights of the last layer>, norm, lm_head)
    -> logits [R, vocab]."""

    def last(h, attn, logit_rows, weights):
        w = _Weights(weights, matmul)
        h = _finish_layer(s, h, attn, w)
        x = _rms_norm(paddle.gather(h, logit_rows), w.take(), s.eps)
        return w.linear(x, False)

    return last


def _f32(shape: list[int | None], name: str) -> InputSpec:
    return InputSpec(shape, "float32", name)


def _qkv_specs(s: DenseShape, prefix: str) -> list[InputSpec]:
    out = (s.heads + 2 * s.kv_heads) * s.head_dim
    specs = [_f32([s.hidden], prefix + "input_norm"), _f32([s.hidden, out], prefix + "qkv")]
    return specs + ([_f32([out], prefix + "qkv_bias")] if s.qkv_bias else [])


def _finish_specs(s: DenseShape, prefix: str) -> list[InputSpec]:
    hidden, inter = s.hidden, s.intermediate
    specs = [_f32([s.heads * s.head_dim, hidden], prefix + "o")]
    specs += [_f32([hidden], prefix + "o_bias")] if s.o_bias else []
    specs += [_f32([hidden], prefix + "post_norm"), _f32([hidden, 2 * inter], prefix + "gate_up")]
    specs += [_f32([2 * inter], prefix + "gate_up_bias")] if s.mlp_bias else []
    specs += [_f32([inter, hidden], prefix + "down")]
    return specs + ([_f32([hidden], prefix + "down_bias")] if s.mlp_bias else [])


def input_specs(s: DenseShape, kind: str) -> list[InputSpec]:
    """The inputs of program ``kind`` ('first', 'middle' or 'last'), token dims dynamic."""
    tokens = [_f32([None, s.hidden], "h"), _f32([None, s.heads * s.head_dim], "attn")]
    rope = [_f32([None, s.head_dim], "cos"), _f32([None, s.head_dim], "sin")]
    if kind == "first":
        ids = InputSpec([None], "int64", "input_ids")
        return [ids, *rope, [_f32([s.vocab, s.hidden], "embed"), *_qkv_specs(s, "")]]
    if kind == "middle":
        return [*tokens, *rope, [*_finish_specs(s, "prev_"), *_qkv_specs(s, "")]]
    rows = InputSpec([None], "int64", "logit_rows")
    lm = [_f32([s.hidden], "norm"), _f32([s.hidden, s.vocab], "lm_head")]
    return [*tokens, rows, [*_finish_specs(s, "prev_"), *lm]]


PROGRAMS = {"first": first_program, "middle": middle_program, "last": last_program}
