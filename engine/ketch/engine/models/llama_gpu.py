"""The Llama-family decoder on a GPU (``--device gpu``): WRITTEN BUT NEVER RUN ON A GPU.

No paddle GPU build could be installed where Ketch is built and tested. The model's code is
device-independent paddle ops and has run on the CPU in float32 (with ``varlen_attention``
standing in for the fused attention op), where its logits match the eager reference model's
(tests/engine/test_llama_gpu.py); on a GPU nothing of it has run.

Same inputs and outputs as ``LlamaModel.forward``. Weights are loaded by ``load_weights`` on the
host (in the compute dtype, only this rank's slices) and moved to the rank's GPU; RMSNorm
computes in float32 and casts back (as Hugging Face does for half precision); attention goes
through ``ketch.kernels.gpu_attention``; tensor parallelism is the CPU's (sharding.py): the o and
down projections' partial sums are all-reduced through ``group`` (``PaddleGroup`` over NCCL on a
GPU), and only rank 0 computes logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import paddle
import paddle.nn.functional as F
from paddle.nn.functional import swiglu

from ketch.engine.device import attention_window
from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LayerWeights, ModelWeights, qk_norm, rotate, weights_nbytes
from ketch.engine.models.moe import refuse_moe
from ketch.engine.models.rope import cos_sin_tables
from ketch.engine.models.sharding import Shard, whole
from ketch.kernels.collective import Group
from ketch.kernels.gpu_attention import GpuAttention, GpuAttentionMetadata

logger = logging.getLogger(__name__)

Cache = tuple[paddle.Tensor, paddle.Tensor]


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """RMSNorm in float32, cast back to ``x``'s dtype before the weight (Hugging Face's order)."""
    x32 = x.astype("float32")
    normed = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=-1, keepdim=True) + eps)
    return normed.astype(x.dtype) * weight


def to_device(weights: ModelWeights) -> ModelWeights:
    """Every weight moved to paddle's current GPU (``Tensor.cuda()``), layer by layer, so the
    host copies can go as the loop passes them."""
    if any(layer.moe is not None for layer in weights.layers):
        refuse_moe("a routed-expert (MoE) model", "--device gpu")

    def move(t: paddle.Tensor | None) -> paddle.Tensor | None:
        return None if t is None else t.cuda()

    layers = [
        LayerWeights(**{name: move(getattr(layer, name)) for name in layer.__dataclass_fields__})
        for layer in weights.layers
    ]
    return ModelWeights(
        embed=move(weights.embed),
        layers=layers,
        norm=move(weights.norm),
        lm_head=move(weights.lm_head),
    )


class GpuLlamaModel:
    """Computes logits for the last token of each sampling request in a flattened batch."""

    backend_name = "gpu"
    supports_mtp = False

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_len: int,
        attention: GpuAttention,
        *,
        max_num_batched_tokens: int,
        shard: Shard | None = None,
        group: Group | None = None,
    ) -> None:
        """``weights`` already on the device this model computes on (``to_device``)."""
        problem = config.backend_problem("gpu", gpu=True)  # routed experts, sliding windows
        if problem is not None:
            raise ValueError(problem)
        self.config = config
        self.weights = weights
        self.attention = attention
        self.shard = shard or whole(config)
        if self.shard.world > 1 and (group is None or group.world != self.shard.world):
            raise ValueError(f"a shard of {self.shard.world} ranks needs a group of as many")
        self.group = group if self.shard.world > 1 else None
        dtype = weights.embed.dtype
        cos, sin = cos_sin_tables(config.rope, config.head_dim, max_len)
        self._cos = paddle.to_tensor(cos).astype(dtype)
        self._sin = paddle.to_tensor(sin).astype(dtype)
        self.attention_window = attention_window(max_num_batched_tokens, max_len)
        self.eps = float(config.rms_norm_eps)

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds (in device memory)."""
        return weights_nbytes(self.weights)

    def kept_rows(self, spans, logit_rows, hidden_rows, block_size: int) -> None:
        """None: this backend's last layer computes every row (``DecoderModel.kept_rows``)."""
        return None

    def metadata(
        self, spans: Sequence[SequenceSpan], block_size: int, num_blocks: int
    ) -> GpuAttentionMetadata:
        return self.attention.metadata(
            [s.query_len for s in spans],
            [s.context_len for s in spans],
            [s.block_ids for s in spans],
            block_size,
            self.attention_window,
        )

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[Cache],
        meta: GpuAttentionMetadata,
        logit_rows: paddle.Tensor,
        hidden_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor] | None:
        """input_ids, positions: [T]; returns logits [len(logit_rows), vocab] in float32 (None
        on a tensor-parallel rank other than 0); with ``hidden_rows``, (logits, those rows'
        final-normed hidden states in float32), as ``LlamaModel.forward``."""
        w = self.weights
        cos = paddle.gather(self._cos, positions).unsqueeze(1)
        sin = paddle.gather(self._sin, positions).unsqueeze(1)
        h = F.embedding(input_ids, w.embed)
        for layer, cache in zip(w.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_norm, self.eps)
            h = h + self._row_parallel(self._attend(layer, x, cos, sin, cache, meta), layer, "o")
            x = rms_norm(h, layer.post_norm, self.eps)
            up = swiglu(_linear(x, layer.gate_up, layer.gate_up_bias))
            h = h + self._row_parallel(up, layer, "down")
        if w.lm_head is None:
            return None  # a rank other than 0: no logits
        last = rms_norm(paddle.gather(h, logit_rows), w.norm, self.eps)
        logits = paddle.matmul(last, w.lm_head).astype("float32")
        if hidden_rows is None:
            return logits
        hidden = rms_norm(paddle.gather(h, hidden_rows), w.norm, self.eps)
        return logits, hidden.astype("float32")

    def _attend(self, layer: LayerWeights, x, cos, sin, cache: Cache, meta) -> paddle.Tensor:
        heads, kv, d = self.shard.num_heads, self.shard.num_kv_heads, self.config.head_dim
        qkv = _linear(x, layer.qkv, layer.qkv_bias)
        qk, v = paddle.split(qkv, [(heads + kv) * d, kv * d], axis=-1)
        qk = qk.reshape([0, heads + kv, d])
        if layer.q_norm is not None:
            qk = qk_norm(qk, heads, layer, self.eps, rms_norm)
        qk = rotate(qk, cos, sin)
        q, k = paddle.split(qk, [heads, kv], axis=1)
        return self.attention(q, k, v.reshape([0, kv, d]), cache, meta)

    def _row_parallel(self, x: paddle.Tensor, layer: LayerWeights, name: str) -> paddle.Tensor:
        """o and down: this rank's partial product, summed over the ranks, then the bias."""
        y = paddle.matmul(x, getattr(layer, name))
        if self.group is not None:
            y = self.group.all_reduce(y)
        bias = getattr(layer, f"{name}_bias")
        return y if bias is None else y + bias


def _linear(x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None) -> paddle.Tensor:
    y = paddle.matmul(x, w)
    return y if b is None else y + b
