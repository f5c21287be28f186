"""The Llama-family decoder with its dense layers on the paddle inference predictor.

Same inputs and outputs as ``LlamaModel.forward`` (the eager reference); per layer, the
predictor computes everything but attention (and Qwen3's q/k norm, ``_norm_heads``), and
``paged_attention`` (dygraph) writes the new keys/values into the shared KV cache in place and
attends over it: with the C++ paged-attention kernel of ``ketch.kernels`` where the kernels have
one (the KV write too), else with the eager model's dygraph ``paged_attention``. Steps of very
few tokens run in dygraph on the same weights and cache (at 1-3 rows the predictor's matmuls are
slower than dygraph's, docs/backend.md): the programs' own functions called eagerly, around the
C++ kernel, or without it the eager model.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

import paddle

from ketch.engine.models.attention import (
    AttentionMetadata,
    LayerCache,
    SequenceSpan,
    paged_attention,
)
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LayerWeights, LlamaModel, ModelWeights, qk_norm, rotate
from ketch.kernels import CpuKernels, dense_graph
from ketch.kernels.dense_graph import DenseShape, Matmul
from ketch.kernels.paged_attention import PagedAttention, PagedAttentionMetadata
from ketch.kernels.predictor_backend import DensePrograms

logger = logging.getLogger(__name__)


def dense_shape(config: ModelConfig) -> DenseShape:
    return DenseShape(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        eps=float(config.rms_norm_eps),
        qkv_bias=bool(config.qkv_bias),
        o_bias=bool(config.o_bias),
        mlp_bias=bool(config.mlp_bias),
    )


def _present(*tensors: paddle.Tensor | None) -> list[paddle.Tensor]:
    return [t for t in tensors if t is not None]


def _qkv_weights(layer: LayerWeights) -> list[paddle.Tensor]:
    return _present(layer.input_norm, layer.qkv, layer.qkv_bias)


def _finish_weights(layer: LayerWeights) -> list[paddle.Tensor]:
    return _present(
        layer.o,
        layer.o_bias,
        layer.post_norm,
        layer.gate_up,
        layer.gate_up_bias,
        layer.down,
        layer.down_bias,
    )


class PredictorLlamaModel:
    """Computes logits for the last token of each sampling request in a flattened batch.

    ``eager``: the reference model on the same weights; steps of fewer than
    ``eager_below_tokens`` tokens (0: none) run in dygraph (see the module's docstring)."""

    backend_name = "predictor"
    supports_mtp = False
    # Crossover on the 23M Qwen2, 1 thread, both around the C++ attention kernel: the predictor
    # runs at 0.68x dygraph's speed at 2 tokens, 0.97x at 6, 1.02x at 7, 1.27x at 8.
    eager_below_tokens = 7

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        eager: LlamaModel,
        threads: int,
        cache_dir: Path | None = None,
    ) -> None:
        problem = config.backend_problem("predictor")
        if problem is not None:  # routed experts, Gemma 3's layers: not in its programs
            raise ValueError(problem)
        self._setup(config, weights, eager, paddle.matmul)
        self.programs: DensePrograms | None = DensePrograms(dense_shape(config), threads, cache_dir)

    def _setup(
        self, config: ModelConfig, weights: ModelWeights, eager: LlamaModel, matmul: Matmul
    ) -> None:
        self.config = config
        self.eager = eager
        self.kernels: CpuKernels = eager.kernels  # what the eager steps run with
        shape = dense_shape(config)
        self._dygraph = {kind: make(shape, matmul) for kind, make in dense_graph.PROGRAMS.items()}
        self.predictor_steps = 0
        self.attention = _attention_kernel(eager.kernels, config.head_dim)
        self._cos, self._sin = eager._cos, eager._sin
        layers = weights.layers
        self._first = [weights.embed, *_qkv_weights(layers[0])]
        self._middle = [
            _finish_weights(prev) + _qkv_weights(layer)
            for prev, layer in itertools.pairwise(layers)
        ]
        self._last = [*_finish_weights(layers[-1]), weights.norm, weights.lm_head]
        self._identity: paddle.Tensor | None = None  # built for the first embedding step
        self._qk_norm_layers = layers if config.qk_norm else None

    def weight_bytes(self) -> int:
        """Bytes of the weights: the eager model's, which the programs read as they are."""
        return self.eager.weight_bytes()

    def kept_rows(self, spans, logit_rows, hidden_rows, block_size: int) -> None:
        """None: this backend's last layer computes every row (``DecoderModel.kept_rows``)."""
        return None

    def metadata(
        self, spans: list[SequenceSpan], block_size: int, num_blocks: int
    ) -> AttentionMetadata | PagedAttentionMetadata:
        """What ``forward`` needs for a step of ``spans`` (in flat token order): block tables
        for the C++ kernel, or the eager path's gather indices and masks."""
        if self.attention is None:
            return self.eager.metadata(spans, block_size, num_blocks)
        return PagedAttentionMetadata.build(
            [s.query_len for s in spans],
            [s.context_len for s in spans],
            [s.block_ids for s in spans],
            block_size,
        )

    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[LayerCache],
        meta: AttentionMetadata | PagedAttentionMetadata,
        logit_rows: paddle.Tensor,
        hidden_rows: paddle.Tensor | None = None,
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """input_ids, positions: [T]; returns logits [len(logit_rows), vocab] in float32; with
        ``hidden_rows``, (logits, those rows' final-normed hidden states), as the eager model."""
        small = self.programs is None or input_ids.shape[0] < self.eager_below_tokens
        if isinstance(meta, PagedAttentionMetadata):
            attend = self._kernel_attention
        elif small:
            return self.eager.forward(
                input_ids, positions, kv_caches, meta, logit_rows, hidden_rows
            )
        else:
            attend = paged_attention
        run = self._run_dygraph if small else self.programs.run
        self.predictor_steps += not small
        cos = paddle.gather(self._cos, positions)
        sin = paddle.gather(self._sin, positions)
        rotary = (cos, sin) if self._qk_norm_layers is None else self._identity_rotary(cos)
        h, q, k, v = run("first", [input_ids, *rotary, *self._first])
        window = self.config.window
        attn = attend(*self._norm_heads(0, q, k, cos, sin), v, kv_caches[0], meta, window(0))
        for i, (weights, cache) in enumerate(zip(self._middle, kv_caches[1:], strict=True), 1):
            h, q, k, v = run("middle", [h, attn, *rotary, *weights])
            attn = attend(*self._norm_heads(i, q, k, cos, sin), v, cache, meta, window(i))
        logits = run("last", [h, attn, logit_rows, *self._last])[0]
        if hidden_rows is None:
            return logits
        return logits, self._hidden(h, attn, hidden_rows)

    @staticmethod
    def _identity_rotary(cos: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos 1, sin 0: the programs' rotation leaves q and k exactly as projected."""
        return paddle.ones_like(cos), paddle.zeros_like(cos)

    def _norm_heads(
        self, layer: int, q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """q and k as attention takes them. Qwen3 norms each head before the rotation, which the
        exported programs (shaped by ``DenseShape``, which has no q/k norm) cannot do: they run
        with the identity rotation, and the norm and the rotation run here, in dygraph."""
        if self._qk_norm_layers is None:
            return q, k
        heads = q.shape[1]
        qk = qk_norm(
            paddle.concat([q, k], axis=1),
            heads,
            self._qk_norm_layers[layer],
            float(self.config.rms_norm_eps),
            self.kernels.rms_norm,
        )
        qk = rotate(qk, cos.unsqueeze(1), sin.unsqueeze(1))
        q, k = paddle.split(qk, [heads, qk.shape[1] - heads], axis=1)
        return q, k

    def _hidden(self, h: paddle.Tensor, attn: paddle.Tensor, rows: paddle.Tensor) -> paddle.Tensor:
        """The last layer's output at ``rows``, final-normed: the "last" program's own function
        (in dygraph) with an identity matrix for the lm_head, which multiplies exactly."""
        if self._identity is None:
            self._identity = paddle.eye(self.config.hidden_size, dtype="float32")
        return self._run_dygraph("last", [h, attn, rows, *self._last[:-1], self._identity])[0]

    def _run_dygraph(self, kind: str, inputs: list[paddle.Tensor]) -> list[paddle.Tensor]:
        split = 4 if kind == "middle" else 3  # the programs' leading token inputs
        out = self._dygraph[kind](*inputs[:split], inputs[split:])
        return list(out) if isinstance(out, tuple) else [out]

    def _kernel_attention(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        cache: LayerCache,
        meta: PagedAttentionMetadata,
        window: int = 0,
    ) -> paddle.Tensor:
        kernel = self.attention
        kernel.write_kv(k, v, cache.k_blocks, cache.v_blocks, meta)
        scale = self.config.head_dim**-0.5
        out = kernel(q, cache.k_blocks, cache.v_blocks, meta, scale, window)
        return out.reshape([0, self.config.num_attention_heads * self.config.head_dim])


def _attention_kernel(kernels: CpuKernels, head_dim: int) -> PagedAttention | None:
    """The C++ kernel the kernels chose, if it can run this model; None: dygraph attention
    (logged once when the library cannot be built).

    Always on one thread: its OpenMP runtime (libgomp) is not the predictor's, and the two
    pools spin against each other (2 threads on 2 cores, decode b=32: 101 ms with 2 kernel
    threads, 38 ms with 1)."""
    kernel = kernels.paged_attention
    if kernel is None or not kernel.supports(head_dim):
        return None
    from ketch.kernels import cpp_ops

    try:
        cpp_ops.ops()
    except RuntimeError as exc:
        logger.warning("paged attention: dygraph (%s)", exc)
        return None
    return dataclasses.replace(kernel, num_threads=1)
