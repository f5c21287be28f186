"""Gemma 3's decoder (``Gemma3ForCausalLM``, text only) on the eager and native backends.

Where it differs from the Llama layer it reuses (``llama``, ``llama_native``):

- sliding-window (local) and full (global) layers interleave, each kind with its own rotation:
  ``ModelConfig.rope`` for the full layers, ``GemmaConfig.local_rope`` for the sliding ones;
- attention scores are scaled by 1/sqrt(query_pre_attn_scalar) (``ModelConfig.attention_scale``);
- sandwich norms: the attention's and the MLP's outputs are RMS-normed before each joins the
  residual (``attn_out_norm``, ``mlp_out_norm``), besides the input norms of both;
- the MLP is GELU (tanh approximation) gated, ``down(gelu(gate) * up)``; the packed GEMM's SwiGLU
  epilogue does not apply;
- logits are optionally soft-capped, ``cap * tanh(logits / cap)``.

Gemma's RMSNorm, ``x * (1 + w)`` in float32, and its embeddings scaled by sqrt(hidden_size) are
folded into the weights at load (``loader``), so the norms here are Llama's. Tensor parallelism
splits it as Llama (``sharding``): the output norms act on the all-reduced (whole) outputs.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from ketch.engine.models.attention import AttentionMetadata, LayerCache
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LlamaModel, ModelWeights, _linear
from ketch.engine.models.llama_native import KeptRows, NativeLlamaModel, Panels
from ketch.engine.models.rope import cos_sin_tables
from ketch.engine.models.sharding import Shard
from ketch.kernels import CpuKernels, fused
from ketch.kernels.collective import Group
from ketch.kernels.dense_graph import Matmul
from ketch.kernels.paged_attention import PagedAttention, PagedAttentionMetadata

Rotation = tuple[paddle.Tensor, paddle.Tensor]  # cos, sin [T, D] of the step's positions


def gelu_glu(gate_up: paddle.Tensor) -> paddle.Tensor:
    """[T, 2 I] ([gate | up]) -> gelu_tanh(gate) * up [T, I] (transformers' gelu_pytorch_tanh)."""
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return F.gelu(gate, approximate=True) * up


def soft_cap(logits: paddle.Tensor, cap: float | None) -> paddle.Tensor:
    return logits if cap is None else paddle.tanh(logits / cap) * cap


class Gemma3Model(LlamaModel):
    """The eager (reference) Gemma 3 decoder; inputs and outputs as ``LlamaModel.forward``."""

    supports_mtp = False  # no Gemma 3 checkpoint has MTP layers; the layer is Llama's

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_len: int,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__(config, weights, max_len, kernels)
        cos, sin = cos_sin_tables(config.gemma.local_rope, config.head_dim, max_len)
        self._local_cos = paddle.to_tensor(cos)
        self._local_sin = paddle.to_tensor(sin)

    def rotations(self, positions: paddle.Tensor) -> list[Rotation]:
        """Each layer's cos and sin at ``positions``: the local tables in the sliding layers."""
        full = (paddle.gather(self._cos, positions), paddle.gather(self._sin, positions))
        local = (
            paddle.gather(self._local_cos, positions),
            paddle.gather(self._local_sin, positions),
        )
        sliding = set(self.config.gemma.local_layers)
        return [local if i in sliding else full for i in range(self.config.num_hidden_layers)]

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[LayerCache],
        meta: AttentionMetadata,
        logit_rows: paddle.Tensor,
        hidden_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        eps, norm = self.config.rms_norm_eps, self.kernels.rms_norm
        rotations = self.rotations(positions)
        h = F.embedding(input_ids, self.weights.embed)
        for i, (layer, cache) in enumerate(zip(self.weights.layers, kv_caches, strict=True)):
            cos, sin = rotations[i]
            x = norm(h, layer.input_norm, eps)
            attn = self.attend(i, x, cos.unsqueeze(1), sin.unsqueeze(1), cache, meta)
            h = h + norm(_linear(attn, layer.o, layer.o_bias), layer.attn_out_norm, eps)
            x = norm(h, layer.post_norm, eps)
            up = gelu_glu(_linear(x, layer.gate_up, layer.gate_up_bias))
            h = h + norm(_linear(up, layer.down, layer.down_bias), layer.mlp_out_norm, eps)
        return self.head(h, logit_rows, hidden_rows)

    def logits(self, x: paddle.Tensor) -> paddle.Tensor:
        return soft_cap(super().logits(x), self.config.gemma.final_logit_softcapping)


class NativeGemma3Model(NativeLlamaModel):
    """Gemma 3 on Ketch's C++ kernels (``--backend native``, tensor parallelism); inputs and
    outputs as ``NativeLlamaModel.forward``. Per layer it adds to Llama's ops two fused
    RMSNorms (the output norms) and the GELU gate in paddle ops."""

    swiglu_mlp = False
    supports_mtp = False  # as Gemma3Model

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        eager: Gemma3Model,
        linear: Matmul,
        attention: PagedAttention | None,
        shard: Shard | None = None,
        group: Group | None = None,
        panels: Panels | None = None,
    ) -> None:
        super().__init__(config, weights, eager, linear, attention, shard, group, panels)
        self._rotations = eager.rotations  # the eager model's tables, per layer kind

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[LayerCache],
        meta: PagedAttentionMetadata,
        logit_rows: paddle.Tensor,
        hidden_rows: paddle.Tensor | None = None,
        kept: KeptRows | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor] | None:
        w, eps = self.weights, self.eps
        rotations = self._rotations(positions)
        h = self.embed(input_ids)
        x = fused.rms_norm(h, w.layers[0].input_norm, eps)
        last = len(w.layers) - 1
        for i, (layer, cache) in enumerate(zip(w.layers, kv_caches, strict=True)):
            pruned = kept if i == last else None
            attn = self._attend(i, x, *rotations[i], cache, meta, pruned)
            if pruned is not None:
                h = paddle.gather(h, pruned.rows)
                logit_rows, hidden_rows = pruned.logit_rows, pruned.hidden_rows
            attn = self._row_parallel(attn, layer.o, layer.o_bias)
            h, x = fused.add_rms_norm(
                h, fused.rms_norm(attn, layer.attn_out_norm, eps), layer.post_norm, eps
            )
            up = gelu_glu(self._dense(x, layer.gate_up, layer.gate_up_bias))
            mlp = fused.rms_norm(
                self._row_parallel(up, layer.down, layer.down_bias), layer.mlp_out_norm, eps
            )
            if i < last:
                h, x = fused.add_rms_norm(h, mlp, w.layers[i + 1].input_norm, eps)
            elif w.lm_head is None:
                return None  # a rank other than 0: no logits
            else:
                h = h + mlp
        return self._head(h, logit_rows, hidden_rows)

    def _logits(self, x: paddle.Tensor) -> paddle.Tensor:
        return soft_cap(super()._logits(x), self.config.gemma.final_logit_softcapping)
