"""Llama-family decoder (Llama, Mistral-style, Qwen2, Qwen3, Qwen3-MoE, ERNIE 4.5) for inference
on paddle.

Weights are plain tensors, fused where that saves kernel launches: q/k/v in one matmul, gate/up
in one matmul followed by ``swiglu``. Matrices are stored transposed ([in, out]) once at load so
each step's matmuls need no transpose.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle.nn.functional import swiglu

from ketch.engine.models.attention import (
    AttentionMetadata,
    LayerCache,
    SequenceSpan,
    build_metadata,
    paged_attention,
)
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.moe import MoeWeights, eager_moe
from ketch.engine.models.rope import cos_sin_tables
from ketch.kernels import CpuKernels


@dataclass
class LayerWeights:
    input_norm: paddle.Tensor
    qkv: paddle.Tensor  # [hidden, (H + 2 KV) * D]
    qkv_bias: paddle.Tensor | None
    o: paddle.Tensor  # [H * D, hidden]
    o_bias: paddle.Tensor | None
    post_norm: paddle.Tensor
    # [hidden, 2 * intermediate]; in an expert layer None, or ERNIE's shared experts
    gate_up: paddle.Tensor | None
    gate_up_bias: paddle.Tensor | None
    down: paddle.Tensor | None  # [intermediate, hidden]; as gate_up
    down_bias: paddle.Tensor | None
    # Qwen3: RMSNorm weights [head_dim] of every query head and every key head (``qk_norm``)
    q_norm: paddle.Tensor | None = None
    k_norm: paddle.Tensor | None = None
    moe: MoeWeights | None = None  # routed experts (beside ERNIE's shared ones, if any)
    # Gemma 3: the norms of the attention's and the MLP's outputs, before each joins the residual
    # (its post_attention_layernorm and post_feedforward_layernorm; ``post_norm`` then holds its
    # pre_feedforward_layernorm, the MLP's input norm as Llama's post_attention_layernorm is)
    attn_out_norm: paddle.Tensor | None = None
    mlp_out_norm: paddle.Tensor | None = None


@dataclass
class ModelWeights:
    embed: paddle.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: paddle.Tensor
    lm_head: paddle.Tensor | None  # [hidden, vocab]; None on tensor-parallel ranks but 0
    lm_head_bias: paddle.Tensor | None = None  # [vocab] (ERNIE 4.5 MoE with use_bias)


def weights_nbytes(tree: object) -> int:
    """Bytes of every tensor in ``tree``: a tensor, a packed weight (``nbytes``), or a
    dataclass, list, tuple or dict of them (``ModelWeights``, a packed form per matmul)."""
    if tree is None:
        return 0
    if isinstance(tree, paddle.Tensor):
        return int(tree.numel()) * tree.element_size()
    if hasattr(tree, "nbytes"):  # a packed weight or packed experts
        return int(tree.nbytes)
    if dataclasses.is_dataclass(tree):
        return sum(weights_nbytes(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    if isinstance(tree, dict):
        return sum(weights_nbytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(weights_nbytes(v) for v in tree)
    return 0


def _linear(x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None) -> paddle.Tensor:
    y = paddle.matmul(x, w)
    return y if b is None else y + b


class LlamaModel:
    """Computes logits for the last token of each sampling request in a flattened batch.

    ``kernels``: the implementations to run with (default: the fastest this CPU can run)."""

    backend_name = "eager"
    supports_mtp = True

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_len: int,
        kernels: CpuKernels | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.kernels = kernels or CpuKernels.select()
        cos, sin = cos_sin_tables(config.rope, config.head_dim, max_len)
        self._cos = paddle.to_tensor(cos)
        self._sin = paddle.to_tensor(sin)
        self._q_size = config.num_attention_heads * config.head_dim
        self._kv_size = config.num_key_value_heads * config.head_dim

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds."""
        return weights_nbytes(self.weights)

    def kept_rows(self, spans, logit_rows, hidden_rows, block_size: int) -> None:
        """None: this backend's last layer computes every row (``DecoderModel.kept_rows``)."""
        return None

    def metadata(
        self, spans: list[SequenceSpan], block_size: int, num_blocks: int
    ) -> AttentionMetadata:
        """The attention inputs ``forward`` needs for a step of ``spans``."""
        kv = self.config.num_key_value_heads
        group = self.config.num_attention_heads // kv
        windows = self.config.attention_windows
        return build_metadata(spans, block_size, num_blocks, kv, group, windows)

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[LayerCache],
        meta: AttentionMetadata,
        logit_rows: paddle.Tensor,
        hidden_rows: paddle.Tensor | None = None,
        inputs_embeds: paddle.Tensor | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """input_ids, positions: [T]; returns logits [len(logit_rows), vocab] in float32.

        With ``hidden_rows`` (embeddings): (logits, the final-normed hidden states of those
        rows [len(hidden_rows), hidden] in float32), what HF's ``last_hidden_state`` holds.
        ``inputs_embeds`` [T, hidden]: the first layer's input in place of the tokens'
        embeddings (the MTP block's projection, ``spec_decode.mtp``)."""
        c = self.config
        rms_norm = self.kernels.rms_norm
        cos = paddle.gather(self._cos, positions).unsqueeze(1)
        sin = paddle.gather(self._sin, positions).unsqueeze(1)
        h = F.embedding(input_ids, self.weights.embed) if inputs_embeds is None else inputs_embeds
        for i, (layer, cache) in enumerate(zip(self.weights.layers, kv_caches, strict=True)):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            attn = self.attend(i, x, cos, sin, cache, meta)
            h = h + _linear(attn, layer.o, layer.o_bias)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            mlp = None
            if layer.gate_up is not None:  # the dense MLP, or ERNIE's shared experts
                gate_up = _linear(x, layer.gate_up, layer.gate_up_bias)
                mlp = _linear(swiglu(gate_up), layer.down, layer.down_bias)
            if layer.moe is not None:
                routed = eager_moe(x, layer.moe, c)
                mlp = routed if mlp is None else routed + mlp
            h = h + mlp
        return self.head(h, logit_rows, hidden_rows)

    def attend(
        self,
        i: int,
        x: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> paddle.Tensor:
        """Layer ``i``'s attention [T, H * D] before the output projection: q/k/v, the per-head
        q/k norms where it has them, the rotation (cos, sin: [T, 1, D]), the KV write and paged
        attention within the layer's sliding window."""
        c, layer = self.config, self.weights.layers[i]
        qkv = _linear(x, layer.qkv, layer.qkv_bias)
        qk, v = paddle.split(qkv, [self._q_size + self._kv_size, self._kv_size], axis=-1)
        qk = qk.reshape([0, c.num_attention_heads + c.num_key_value_heads, c.head_dim])
        if layer.q_norm is not None:
            qk = qk_norm(qk, c.num_attention_heads, layer, c.rms_norm_eps, self.kernels.rms_norm)
        # Queries and keys rotate together: one set of rotary ops per layer.
        qk = rotate(qk, cos, sin)
        q, k = paddle.split(qk, [c.num_attention_heads, c.num_key_value_heads], axis=1)
        v = v.reshape([0, c.num_key_value_heads, c.head_dim])
        return paged_attention(q, k, v, cache, meta, c.window(i), c.attention_scale)

    def head(
        self, h: paddle.Tensor, logit_rows: paddle.Tensor, hidden_rows: paddle.Tensor | None
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """The final norm and the logits of ``logit_rows`` of h (and ``hidden_rows``' normed
        states), as ``forward`` returns them."""
        c = self.config
        last = self.kernels.rms_norm(
            paddle.gather(h, logit_rows), self.weights.norm, c.rms_norm_eps
        )
        logits = self.logits(last)
        if hidden_rows is None:
            return logits
        hidden = self.kernels.rms_norm(
            paddle.gather(h, hidden_rows), self.weights.norm, c.rms_norm_eps
        )
        return logits, hidden.astype("float32")

    def logits(self, x: paddle.Tensor) -> paddle.Tensor:
        """Final-normed states [R, hidden] -> logits [R, vocab] in float32."""
        w = self.weights
        return _linear(x, w.lm_head, w.lm_head_bias).astype("float32")


def qk_norm(
    qk: paddle.Tensor, heads: int, layer: LayerWeights, eps: float, rms_norm
) -> paddle.Tensor:
    """Qwen3's RMSNorm of each query head (``layer.q_norm``) and key head (``layer.k_norm``),
    before the rotation. qk: [T, heads + kv_heads, D]. ``rms_norm`` normalises the last axis of
    a 2-D tensor (the fused AVX-512 op normalises every axis after the first)."""
    d = qk.shape[-1]
    q, k = paddle.split(qk, [heads, qk.shape[1] - heads], axis=1)
    q = rms_norm(q.reshape([-1, d]), layer.q_norm, eps).reshape(q.shape)
    k = rms_norm(k.reshape([-1, d]), layer.k_norm, eps).reshape(k.shape)
    return paddle.concat([q, k], axis=1)


def rotate(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + paddle.concat([-x2, x1], axis=-1) * sin
