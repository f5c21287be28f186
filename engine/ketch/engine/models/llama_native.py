"""The Llama-family decoder on Ketch's own CPU kernels, in dygraph (``--backend native``).

Same inputs and outputs as ``LlamaModel.forward`` (the eager reference). Per layer: the q/k/v
matmul (for Qwen3 then the per-head q/k RMSNorm: a split, two fused norms and a concat), one
fused op for the split and the rotary embedding, the KV write and paged attention in the C++
kernel (within the layer's sliding window, ``ModelConfig.window``), the output projection, one
fused op for the residual add and RMSNorm, the MLP (SwiGLU between two matmuls; for an expert
layer the router, then the routed experts in one fused op on the packed GEMM or a matmul pair
per expert with tokens, ``_experts``, plus ERNIE's shared experts as a dense MLP), and the next
fused add + RMSNorm. Every matmul goes through the ``linear`` it is given: Ketch's packed-weight
GEMM, OpenBLAS's GEMM op or paddle.matmul, whichever ``choose_matmul`` measured faster for that
row count on this machine. A matmul with ``prepare``
(the packed GEMM) gets the weights in its layout once, here, and the model keeps only those.

Why dygraph and not the inference predictor (docs/backend.md): dygraph dispatches an op in a few
microseconds where the predictor takes 40-80 (on the AMD EPYC of docs/backend.md its oneDNN
matmuls reached 36-46 GFLOP/s on one thread against OpenBLAS's 60-80). What stays is per-op
dispatch, so the layer is written to need few ops (about 12, against about 40 for the same
layer in plain paddle ops).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import paddle
from paddle.nn.functional import embedding, swiglu

from ketch.engine.models.attention import LayerCache, SequenceSpan
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LayerWeights, LlamaModel, ModelWeights, weights_nbytes
from ketch.engine.models.moe import MoeWeights, combine, select_experts
from ketch.engine.models.sharding import Shard, whole
from ketch.kernels import fused
from ketch.kernels.collective import Group
from ketch.kernels.dense_graph import Matmul
from ketch.kernels.fused_moe import FusedMoe
from ketch.kernels.linear import choose_matmul, packed_gemm_of, prepared
from ketch.kernels.packed_linear import PackedLinear
from ketch.kernels.paged_attention import PagedAttention, PagedAttentionMetadata

logger = logging.getLogger(__name__)


def measured_matmul(weights: ModelWeights, threads: int) -> tuple[Matmul, str]:
    """The matmul ``choose_matmul`` measures fastest on this model's weight shapes (layer 0's
    projections and the lm_head, where this rank holds one), and its line. A MoE model's
    experts are not measured: unless ``KETCH_MATMUL`` forces a matmul (then nothing is), they
    run in the fused op on the packed GEMM (``packed_gemm_of``), which the op library that the
    native backend needs anyway always provides."""
    first = weights.layers[0]
    shapes = [first.qkv, first.o, first.gate_up, first.down, weights.lm_head]
    return choose_matmul([w for w in shapes if w is not None], threads)


def _fuses_swiglu(linear: Matmul, layer: LayerWeights) -> bool:
    """The packed GEMM computes the MLP's SwiGLU in its epilogue (no bias to add first)."""
    return isinstance(linear, PackedLinear) and layer.gate_up_bias is None


@dataclasses.dataclass(frozen=True)
class Panels:
    """The element types the packed GEMM's panels hold below float32: ``linear`` for the
    layers' projections and experts (float32, bfloat16 or int8), ``head`` for the lm_head
    (float32 or bfloat16: never quantized). None in ``NativeLlamaModel``: float32 weights in
    whatever layout the measured matmul takes."""

    linear: str
    head: str


# LayerWeights' vectors: norms and biases, float32 whatever the weights' dtype (they are added
# to or multiplied with float32 activations; a few kilobytes a layer).
_VECTORS = (
    "input_norm", "post_norm", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm",
    "k_norm", "attn_out_norm", "mlp_out_norm",
)  # fmt: skip


def _float32(t: paddle.Tensor | None) -> paddle.Tensor | None:
    return t if t is None or t.dtype == paddle.float32 else t.astype("float32")


def _prepared_weights(
    weights: ModelWeights,
    linear: Matmul,
    fuse: bool,
    fused_experts: bool,
    panels: Panels | None = None,
) -> ModelWeights:
    """``weights`` with every matmul operand in ``linear``'s layout (the same tensors where it
    has no ``prepare``; ``fuse``: gate/up with the SwiGLU epilogue); with ``fused_experts``, no
    routed experts' lists (the fused op holds its own copy). ``panels``: the packed GEMM's
    element types below float32 (``linear`` is then a ``PackedLinear``); norms, biases and the
    router become float32 and the embedding stays as loaded.

    Below float32 (``panels``) ``weights`` itself is changed, layer by layer, so that each
    layer's loaded matrices are freed as soon as they are packed: loading then peaks near the
    model's size, not twice it. (float32 keeps ``weights`` intact: ``auto`` may still fall back
    to another backend that reads them.)"""

    def pack(w: paddle.Tensor, glu: bool = False, head: bool = False):
        if panels is not None:
            return linear.prepare(w, glu=glu, dtype=panels.head if head else panels.linear)
        return linear.prepare(w, glu=True) if glu else prepared(linear, w)

    def moe(e: MoeWeights) -> MoeWeights:
        router = _float32(e.router)
        if fused_experts:
            return dataclasses.replace(e, router=router, gate_up=[], down=[])
        return dataclasses.replace(
            e,
            router=router,
            gate_up=[pack(w, glu=fuse) for w in e.gate_up],
            down=[pack(w) for w in e.down],
        )

    def layer(lw: LayerWeights) -> LayerWeights:
        forms = {n: pack(getattr(lw, n)) for n in ("qkv", "o")}
        if lw.moe is not None:
            forms["moe"] = moe(lw.moe)
        if lw.gate_up is not None:  # the dense MLP, or ERNIE's shared experts
            forms["gate_up"] = pack(lw.gate_up, glu=fuse)
            forms["down"] = pack(lw.down)
        if panels is not None:
            forms.update({n: _float32(getattr(lw, n)) for n in _VECTORS})
        return dataclasses.replace(lw, **forms)

    if getattr(linear, "prepare", None) is None and not fused_experts:
        return weights
    if panels is None:
        lm_head = None if weights.lm_head is None else pack(weights.lm_head, head=True)
        layers = [layer(lw) for lw in weights.layers]
        return dataclasses.replace(weights, layers=layers, lm_head=lm_head)
    for i, lw in enumerate(weights.layers):
        weights.layers[i] = layer(lw)  # the last reference to lw's matrices goes here
    if weights.lm_head is not None:
        weights.lm_head = pack(weights.lm_head, head=True)
    weights.norm = _float32(weights.norm)
    weights.lm_head_bias = _float32(weights.lm_head_bias)
    return weights


@dataclasses.dataclass(frozen=True)
class KeptRows:
    """The rows the last layer computes past its K/V (the others only feed the KV cache).

    A prompt chunk needs its last layer's K and V for every token, but its attention output,
    MLP and final norm only where logits or hidden states are read: the last prompt token, or
    none for a chunk that does not end the prompt. For a 160-token prompt through 8 layers that
    is 1/8 of the prompt's FLOPs, less the K/V projections."""

    rows: paddle.Tensor  # [R] int64: the kept rows of the step's flat order, ascending
    meta: PagedAttentionMetadata  # each kept row as a one-token query over its own context
    logit_rows: paddle.Tensor  # the forward's logit_rows, as indices into ``rows``
    hidden_rows: paddle.Tensor | None  # likewise for hidden_rows

    @classmethod
    def build(
        cls,
        spans: Sequence[SequenceSpan],
        logit_rows: Sequence[int],
        hidden_rows: Sequence[int] | None,
        block_size: int,
    ) -> KeptRows | None:
        """None when every row of the step is needed (decode-only steps): nothing to save."""
        keep = sorted(set(logit_rows).union(hidden_rows or ()))
        if len(keep) == sum(s.query_len for s in spans):
            return None
        starts = np.asarray([s.start for s in spans], dtype=np.int64)
        rows = np.asarray(keep, dtype=np.int64)
        seq = np.searchsorted(starts, rows, side="right") - 1
        # A kept row at position p (computed + its offset in the chunk) sees tokens 0..p (those
        # of its layer's window); its own K/V and those of the chunk's earlier rows are written
        # before it attends.
        lens = [spans[b].context_len - spans[b].query_len + int(r) - spans[b].start + 1
                for b, r in zip(seq, rows, strict=True)]  # fmt: skip
        meta = PagedAttentionMetadata.build(
            [1] * len(keep), lens, [spans[b].block_ids for b in seq], block_size
        )
        index = {r: i for i, r in enumerate(keep)}

        def remap(wanted: Sequence[int]) -> paddle.Tensor:
            return paddle.to_tensor(np.asarray([index[r] for r in wanted], dtype=np.int64))

        hidden = None if hidden_rows is None else remap(hidden_rows)
        return cls(paddle.to_tensor(rows), meta, remap(logit_rows), hidden)


class NativeLlamaModel:
    """Computes logits for the last token of each sampling request in a flattened batch.

    Tensor parallelism: ``weights`` hold ``shard``'s slices (``ketch.engine.models.sharding``)
    and ``group`` sums the o and down projections' partial outputs across the ranks; a rank
    other than 0 computes no logits (``forward`` returns None)."""

    backend_name = "native"
    supports_mtp = True
    swiglu_mlp = True  # the MLP is SwiGLU (the packed GEMM may compute it in its epilogue)

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        eager: LlamaModel,
        linear: Matmul,
        attention: PagedAttention | None,
        shard: Shard | None = None,
        group: Group | None = None,
        panels: Panels | None = None,
    ) -> None:
        """``panels``: weights below float32 (``linear`` is then the packed GEMM)."""
        if attention is None:
            raise RuntimeError(
                f"the C++ paged-attention kernel cannot run this model (head dim "
                f"{config.head_dim}, kernels {eager.kernels.paged_attention})"
            )
        self.config = config
        self.kernels = eager.kernels
        self._fused_swiglu = self.swiglu_mlp and all(
            _fuses_swiglu(linear, lw) for lw in weights.layers
        )
        # The routed experts run in one fused op on the packed GEMM whenever it is there (the
        # dense matmuls' measured winner or not): per-expert calls cost more than any GEMM saves.
        experts = packed_gemm_of(linear) if config.is_moe else None
        # The fused experts op, or None: one matmul pair per expert through ``linear``.
        self.experts_op = None if experts is None else FusedMoe.for_linear(experts)
        if config.is_moe:
            logger.info("routed experts: %s", self.experts_op or "one matmul pair per expert")
        expert_dtype = None if panels is None else panels.linear
        self._packed_experts = {}
        for i, lw in enumerate(weights.layers):
            if lw.moe is not None and self.experts_op is not None:
                moe = lw.moe
                self._packed_experts[i] = self.experts_op.prepare(
                    moe.gate_up, moe.down, dtype=expert_dtype
                )
                if panels is not None:  # no fallback below float32: the originals can go now
                    moe.gate_up.clear()
                    moe.down.clear()
        fused_experts = self.experts_op is not None
        self.weights = _prepared_weights(weights, linear, self._fused_swiglu, fused_experts, panels)
        self.panels = panels
        self.linear = linear
        self._fused_bias = isinstance(linear, PackedLinear)
        self.attention = attention
        self.eps = float(config.rms_norm_eps)
        self._cos, self._sin = eager._cos, eager._sin
        self.shard = shard or whole(config)
        if self.shard.world > 1 and (group is None or group.world != self.shard.world):
            raise ValueError(f"a shard of {self.shard.world} ranks needs a group of as many")
        self.group = group if self.shard.world > 1 else None

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds, in the layouts it computes from."""
        return weights_nbytes(self.weights) + weights_nbytes(self._packed_experts)

    def metadata(
        self, spans: list[SequenceSpan], block_size: int, num_blocks: int
    ) -> PagedAttentionMetadata:
        return PagedAttentionMetadata.build(
            [s.query_len for s in spans],
            [s.context_len for s in spans],
            [s.block_ids for s in spans],
            block_size,
        )

    def _dense(self, x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None) -> paddle.Tensor:
        if self._fused_bias:
            return self.linear(x, w, b)
        y = self.linear(x, w)
        return y if b is None else y + b

    def _row_parallel(
        self, x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor | None
    ) -> paddle.Tensor:
        """o and down: each rank's partial product, summed over the ranks, then the bias."""
        y = self.linear(x, w)
        if self.group is not None:
            y = self.group.all_reduce(y)
        return y if b is None else y + b

    def _experts(self, i: int, x: paddle.Tensor) -> paddle.Tensor:
        """Layer i's routed experts (``ketch.engine.models.moe``): the router in paddle ops, as
        the eager model routes (``select_experts``: the layer's architecture's router), then
        this rank's experts (``routed_experts``); the ranks' parts summed like the dense down's."""
        routing, indices = select_experts(x, self.weights.layers[i].moe, self.config)
        y = self.routed_experts(i, x, routing, indices)
        return y if self.group is None else self.group.all_reduce(y)

    def routed_experts(
        self, i: int, x: paddle.Tensor, routing: paddle.Tensor, indices: paddle.Tensor
    ) -> paddle.Tensor:
        """Layer i's held experts' sum for a router's choice (routing [T, top_k], indices
        [T, top_k]), whatever router chose: the fused op on the packed GEMM, else one matmul
        pair per expert that has tokens. Both sum each token's experts in ascending order."""
        moe = self.weights.layers[i].moe
        if self.experts_op is not None:
            return self.experts_op(x, routing, indices, self._packed_experts[i], moe.first)

        def mlp(rows: paddle.Tensor, j: int) -> paddle.Tensor:
            up = self.linear(rows, moe.gate_up[j])
            if not self._fused_swiglu:
                up = swiglu(up)
            return self.linear(up, moe.down[j])

        return combine(x, moe, routing, indices, mlp)

    def _mlp(self, x: paddle.Tensor, layer: LayerWeights) -> paddle.Tensor:
        """The dense SwiGLU MLP (column- then row-parallel), summed over the ranks."""
        if self._fused_swiglu:
            up = self.linear(x, layer.gate_up)  # silu(gate) * up, from the GEMM
        else:
            up = swiglu(self._dense(x, layer.gate_up, layer.gate_up_bias))
        return self._row_parallel(up, layer.down, layer.down_bias)

    kept_rows = staticmethod(KeptRows.build)  # what forward's ``kept`` takes

    def _attend(
        self,
        i: int,
        x: paddle.Tensor,
        cos,
        sin,
        cache: LayerCache,
        meta,
        kept: KeptRows | None = None,
    ) -> paddle.Tensor:
        """Layer ``i``: writes every row's K/V; attends for every row, or only the ``kept`` ones,
        within the layer's sliding window."""
        layer = self.weights.layers[i]
        heads, kv_heads, d = self.shard.num_heads, self.shard.num_kv_heads, self.config.head_dim
        qkv = self._dense(x, layer.qkv, layer.qkv_bias)
        if layer.q_norm is not None:
            qkv = self._norm_heads(qkv, layer)
        q, k, v = fused.rope_qkv(qkv, cos, sin, heads, kv_heads)
        self.attention.write_kv(k, v, cache.k_blocks, cache.v_blocks, meta)
        if kept is not None:
            q, meta = paddle.gather(q, kept.rows), kept.meta
        scale, window = self.config.attention_scale, self.config.window(i)
        out = self.attention(q, cache.k_blocks, cache.v_blocks, meta, scale, window)
        return out.reshape([0, heads * d])

    def _norm_heads(self, qkv: paddle.Tensor, layer: LayerWeights) -> paddle.Tensor:
        """Qwen3: each query and key head RMS-normed with its own weights, before the rotation;
        qkv [T, (H + 2 KV) D] in, the same layout out (what ``rope_qkv`` takes)."""
        heads, kv_heads, d = self.shard.num_heads, self.shard.num_kv_heads, self.config.head_dim
        q, k, v = paddle.split(
            qkv.reshape([0, heads + 2 * kv_heads, d]), [heads, kv_heads, kv_heads], axis=1
        )
        q = fused.rms_norm(q, layer.q_norm, self.eps)
        k = fused.rms_norm(k, layer.k_norm, self.eps)
        return paddle.concat([q, k, v], axis=1).reshape([0, (heads + 2 * kv_heads) * d])

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[LayerCache],
        meta: PagedAttentionMetadata,
        logit_rows: paddle.Tensor,
        hidden_rows: paddle.Tensor | None = None,
        kept: KeptRows | None = None,
        inputs_embeds: paddle.Tensor | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor] | None:
        """input_ids, positions: [T]; returns logits [len(logit_rows), vocab] in float32 (None
        on a tensor-parallel rank other than 0); with ``hidden_rows``, (logits, those rows'
        final-normed hidden states), as ``LlamaModel.forward``. With ``kept`` (``kept_rows``
        of the same rows), the last layer computes only those rows past its K/V write; the
        result is the same. ``inputs_embeds`` [T, hidden] float32: the first layer's input in
        place of the tokens' embeddings (the MTP block's projection, ``spec_decode.mtp``)."""
        w = self.weights
        cos = paddle.gather(self._cos, positions)
        sin = paddle.gather(self._sin, positions)
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x = fused.rms_norm(h, w.layers[0].input_norm, self.eps)
        last = len(w.layers) - 1
        for i, (layer, cache) in enumerate(zip(w.layers, kv_caches, strict=True)):
            pruned = kept if i == last else None
            attn = self._attend(i, x, cos, sin, cache, meta, pruned)
            if pruned is not None:
                h = paddle.gather(h, pruned.rows)
                logit_rows, hidden_rows = pruned.logit_rows, pruned.hidden_rows
            h, x = fused.add_rms_norm(
                h, self._row_parallel(attn, layer.o, layer.o_bias), layer.post_norm, self.eps
            )
            if layer.moe is not None:
                mlp = self._experts(i, x)
                if layer.gate_up is not None:  # ERNIE's shared experts, beside the routed
                    mlp = mlp + self._mlp(x, layer)
            else:
                mlp = self._mlp(x, layer)
            if i < last:
                h, x = fused.add_rms_norm(h, mlp, w.layers[i + 1].input_norm, self.eps)
            elif w.lm_head is None:
                return None  # a rank other than 0: no logits
            else:
                h = h + mlp
        return self._head(h, logit_rows, hidden_rows)

    def embed(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        """The tokens' embeddings in float32 (the table stays in the weights' dtype)."""
        return _float32(embedding(input_ids, self.weights.embed))

    def _head(
        self, h: paddle.Tensor, logit_rows: paddle.Tensor, hidden_rows: paddle.Tensor | None
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """The final norm and the logits of ``logit_rows`` of h, as ``forward`` returns them."""
        w = self.weights
        logits = self._logits(fused.rms_norm(paddle.gather(h, logit_rows), w.norm, self.eps))
        if hidden_rows is None:
            return logits
        return logits, fused.rms_norm(paddle.gather(h, hidden_rows), w.norm, self.eps)

    def _logits(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._dense(x, self.weights.lm_head, self.weights.lm_head_bias)
