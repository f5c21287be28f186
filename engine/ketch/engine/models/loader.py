"""Finds a model directory and loads its safetensors weights into ``ModelWeights``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
from safetensors import safe_open

from ketch.engine.errors import ModelLoadError
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LayerWeights, ModelWeights
from ketch.engine.models.moe import MoeWeights
from ketch.engine.models.paths import TINY_MODEL_DIR, read_json_object, resolve_model_path
from ketch.engine.models.sharding import Shard, whole

logger = logging.getLogger(__name__)

__all__ = ["TINY_MODEL_DIR", "load_mtp_weights", "load_weights", "resolve_model_path"]

_INDEX = "model.safetensors.index.json"


def load_weights(
    path: Path,
    config: ModelConfig,
    dtype: str,
    shard: Shard | None = None,
    small_dtype: str | None = None,
) -> ModelWeights:
    """The checkpoint's weights, or only ``shard``'s slices of them (tensor parallelism: each
    rank reads its heads' and columns' slices from the files, never the whole matrices).
    ``small_dtype``: the dtype of the norms, biases and MoE routers (default ``dtype``): the CPU
    reads them in float32 whatever its matrices' dtype, so bfloat16 rounds only the matrices."""
    with _Checkpoint(path, dtype) as checkpoint:
        return _load(checkpoint, config, shard or whole(config), small_dtype)


def _load(
    checkpoint: _Checkpoint, config: ModelConfig, shard: Shard, small: str | None = None
) -> ModelWeights:
    loader = _Checked(checkpoint, small)
    c = config
    hidden = c.hidden_size
    layers = [
        _layer(loader, c, f"model.layers.{i}.", shard, i in c.moe_layers)
        for i in range(c.num_hidden_layers)
    ]
    embed = loader.get("model.embed_tokens.weight", (c.vocab_size, hidden))
    lm_head = lm_head_bias = None
    if shard.first:  # the other ranks never compute logits
        if c.tie_word_embeddings or "lm_head.weight" not in checkpoint:
            if not c.tie_word_embeddings:
                raise ModelLoadError(
                    f"{checkpoint.path}: lm_head.weight is missing and embeddings are not tied"
                )
            lm_head = embed
        else:
            lm_head = loader.get("lm_head.weight", (c.vocab_size, hidden))
        lm_head = lm_head.T.contiguous()
        if c.lm_head_bias:
            lm_head_bias = loader.get("lm_head.bias", (c.vocab_size,))
    norm = loader.get("model.norm.weight", (hidden,))
    if c.gemma is not None:
        embed, norm = _gemma_scaled(embed, hidden), _gemma_norm(norm)
    weights = ModelWeights(
        embed=embed, layers=layers, norm=norm, lm_head=lm_head, lm_head_bias=lm_head_bias
    )
    # ERNIE 4.5 MoE's multi-token-prediction layers (``mtp_*``, ``model.mtp_*``): read only
    # for speculative method 'mtp' (``load_mtp_weights``); plain decoding never uses them.
    loader.used.update(n for n in checkpoint.names if _is_mtp(n))
    loader.warn_unused()
    return weights


def _layer(loader: _Checked, c: ModelConfig, p: str, shard: Shard, routed: bool) -> LayerWeights:
    """The decoder layer of prefix ``p`` (``shard``'s slices of it); ``routed``: its MLP is
    the routed experts."""
    d, hidden = c.head_dim, c.hidden_size
    q_rows = _times(shard.heads, d)
    kv_rows = _times(shard.kv_heads, d)
    rows = (
        ("q", c.num_attention_heads * d, q_rows),
        *((n, c.num_key_value_heads * d, kv_rows) for n in ("k", "v")),
    )
    qkv = [loader.get(p + f"self_attn.{n}_proj.weight", (m, hidden), r) for n, m, r in rows]
    qkv_bias = None
    if c.qkv_bias:
        qkv_bias = [loader.get(p + f"self_attn.{n}_proj.bias", (m,), r) for n, m, r in rows]
    if c.rope_interleaved:
        qkv[:2] = [deinterleave(w, d) for w in qkv[:2]]
        if qkv_bias is not None:
            qkv_bias[:2] = [deinterleave(b, d) for b in qkv_bias[:2]]
    moe = _experts(loader, c, p, shard) if routed else None
    o_shape = (hidden, c.num_attention_heads * d)
    return LayerWeights(
        **_norms(loader, c, p),
        qkv=paddle.concat(qkv, axis=0).T.contiguous(),
        qkv_bias=None if qkv_bias is None else paddle.concat(qkv_bias),
        o=loader.get(p + "self_attn.o_proj.weight", o_shape, cols=q_rows).T.contiguous(),
        o_bias=loader.get(p + "self_attn.o_proj.bias", (hidden,)) if c.o_bias else None,
        **_mlp(loader, c, p, shard, moe is not None),
        moe=moe,
    )


def _is_mtp(name: str) -> bool:
    return name.startswith(("mtp_", "model.mtp_"))


@dataclass
class MtpWeights:
    """One multi-token-prediction layer (ERNIE 4.5 MoE's ``mtp_*`` weights, as transformers'
    ``MtpLayer`` reads them): the RMSNorm weights of the token embedding (``enorm``) and of the
    target's hidden state (``hnorm``), the projection of their concatenation (``eh_proj``,
    [2 * hidden, hidden], embedding half first) and the decoder block (``layer``). Its output
    norm is the model's final norm (transformers: ``_keys_shared_with_mtp``)."""

    enorm: paddle.Tensor
    hnorm: paddle.Tensor
    eh_proj: paddle.Tensor
    layer: LayerWeights


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The config the MTP block is built with: one layer, routed experts where transformers'
    ``get_mtp_config`` gives them (``ModelConfig.mtp_moe``)."""
    return dataclasses.replace(
        config,
        num_hidden_layers=1,
        moe_layers=(0,) if config.mtp_moe else (),
        sliding_windows=config.sliding_windows[:1],
    )


def load_mtp_weights(path: Path, config: ModelConfig, dtype: str, small_dtype: str) -> MtpWeights:
    """The checkpoint's first multi-token-prediction layer, whole (speculative method 'mtp'
    runs it on tensor-parallel rank 0 alone). Its names: ``mtp_block.0.*``,
    ``mtp_emb_norm.0.weight``, ``mtp_hidden_norm.0.weight``, ``mtp_linear_proj.0.weight``, with
    or without the ``model.`` prefix (the Hub's checkpoints have it)."""
    if not config.num_mtp_layers:
        raise ModelLoadError(f"{path}: config.json declares no multi-token-prediction layers")
    with _Checkpoint(path, dtype) as checkpoint:
        loader = _Checked(checkpoint, small_dtype)
        prefix = "model." if "model.mtp_linear_proj.0.weight" in checkpoint else ""
        c, hidden = mtp_config(config), config.hidden_size
        layer = _layer(loader, c, f"{prefix}mtp_block.0.", whole(c), c.is_moe)
        vector = (hidden,)
        return MtpWeights(
            enorm=loader.get(f"{prefix}mtp_emb_norm.0.weight", vector, dtype="float32"),
            hnorm=loader.get(f"{prefix}mtp_hidden_norm.0.weight", vector, dtype="float32"),
            eh_proj=loader.get(
                f"{prefix}mtp_linear_proj.0.weight", (hidden, 2 * hidden), dtype="float32"
            ).T.contiguous(),
            layer=layer,
        )


def deinterleave(w: paddle.Tensor, head_dim: int) -> paddle.Tensor:
    """q or k projection rows (weight [heads * D, hidden] or bias [heads * D]) with each head's
    rows reordered: its even rows, then its odd rows.

    ERNIE 4.5 rotates each head's pairs (2i, 2i + 1) by angle ``p * inv_freq[i]`` (GLM style);
    Ketch's kernels rotate (i, i + D/2) (Llama's rotate-half). Row 2i of the checkpoint becomes
    row i and row 2i + 1 becomes row i + D/2, so rotate-half on the reordered q and k moves every
    pair exactly as the interleaved rotation does. q and k are reordered alike, so each q.k (the
    only use of them) is the same sum in another order: the attention is transformers'. v and o
    are untouched; the KV cache holds the reordered keys."""
    heads = w.shape[0] // head_dim
    order = paddle.to_tensor(list(range(0, head_dim, 2)) + list(range(1, head_dim, 2)))
    per_head = w.reshape([heads, head_dim, -1])
    return paddle.gather(per_head, order, axis=1).reshape(w.shape)


def _mlp(
    loader: _Checked, c: ModelConfig, p: str, shard: Shard, routed: bool
) -> dict[str, paddle.Tensor | None]:
    """Layer ``p``'s dense SwiGLU MLP, or in an expert layer ERNIE's shared experts (``None``
    without them), as ``LayerWeights``' gate_up, gate_up_bias, down and down_bias: this
    ``shard``'s intermediate columns of it."""
    if not routed:
        prefix, inter, cols = p + "mlp.", c.intermediate_size, shard.intermediate
    elif c.shared_intermediate_size:
        prefix, inter, cols = p + "mlp.shared_experts.", c.shared_intermediate_size, shard.shared
    else:
        return dict.fromkeys(("gate_up", "gate_up_bias", "down", "down_bias"))
    hidden = c.hidden_size
    gate_up = [
        loader.get(f"{prefix}{n}_proj.weight", (inter, hidden), cols) for n in ("gate", "up")
    ]
    down = loader.get(prefix + "down_proj.weight", (hidden, inter), cols=cols)
    biases = {"gate_up_bias": None, "down_bias": None}
    if c.mlp_bias:
        halves = [loader.get(f"{prefix}{n}_proj.bias", (inter,), cols) for n in ("gate", "up")]
        biases = {
            "gate_up_bias": paddle.concat(halves),
            "down_bias": loader.get(prefix + "down_proj.bias", (hidden,)),
        }
    return {
        "gate_up": paddle.concat(gate_up, axis=0).T.contiguous(),
        "down": down.T.contiguous(),
        **biases,
    }


def _norms(loader: _Checked, c: ModelConfig, p: str) -> dict[str, paddle.Tensor]:
    """Layer ``p``'s RMSNorm weights, by ``LayerWeights``' names."""
    names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
    if c.gemma is not None:
        names = {
            "input_norm": "input_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "post_norm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
    out = {
        field: loader.get(p + f"{name}.weight", (c.hidden_size,)) for field, name in names.items()
    }
    if c.qk_norm:  # per-head-dim weights, the same for every head: replicated on every rank
        for n in ("q", "k"):
            out[f"{n}_norm"] = loader.get(p + f"self_attn.{n}_norm.weight", (c.head_dim,))
    return {k: _gemma_norm(w) for k, w in out.items()} if c.gemma is not None else out


def _gemma_norm(w: paddle.Tensor) -> paddle.Tensor:
    """Gemma's RMSNorm multiplies by ``1 + w`` (in float32): folded here, so every backend's
    RMSNorm computes it as Llama's."""
    return (w.astype("float32") + 1.0).astype(w.dtype)


def _gemma_scaled(embed: paddle.Tensor, hidden: int) -> paddle.Tensor:
    """Gemma scales each embedding by sqrt(hidden_size), rounded to the weights' dtype; folded
    into the table (a tied lm_head keeps the unscaled one)."""
    normalizer = paddle.to_tensor(np.float32(hidden**0.5)).astype(embed.dtype)
    return embed * normalizer


def _experts(loader: _Checked, c: ModelConfig, p: str, shard: Shard) -> MoeWeights:
    """Layer ``p``'s router and ``shard``'s experts, whole. transformers 5's save_pretrained
    writes one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``, as the
    Hub's checkpoints have them); its in-memory layout, stacked ``mlp.experts.gate_up_proj``
    [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], is read too. ERNIE's router and its
    ``e_score_correction_bias`` stay float32 whatever the compute dtype (transformers keeps them
    so: ``_keep_in_fp32_modules_strict``)."""
    hidden, inter, count = c.hidden_size, c.moe_intermediate_size, c.num_experts
    first, end = shard.experts
    router_dtype = "float32" if c.moe_score_bias else loader.small
    router = loader.get(p + "mlp.gate.weight", (count, hidden), dtype=router_dtype)
    router = router.T.contiguous()
    score_bias = _score_bias(loader, p, count) if c.moe_score_bias else None
    # Other ranks' experts are theirs to read, not unused weights.
    loader.used.update(n for n in loader.checkpoint.names if n.startswith(p + "mlp.experts."))
    stacked = p + "mlp.experts.gate_up_proj"
    if stacked in loader.checkpoint:
        gate_ups = loader.get(stacked, (count, 2 * inter, hidden), (first, end))
        downs = loader.get(p + "mlp.experts.down_proj", (count, hidden, inter), (first, end))
        gate_up = [gate_ups[j].T.contiguous() for j in range(end - first)]
        down = [downs[j].T.contiguous() for j in range(end - first)]
        return MoeWeights(router, gate_up, down, first, score_bias)
    gate_up, down = [], []
    for e in range(first, end):
        q = f"{p}mlp.experts.{e}."
        halves = [loader.get(q + f"{n}_proj.weight", (inter, hidden)) for n in ("gate", "up")]
        gate_up.append(paddle.concat(halves, axis=0).T.contiguous())
        down.append(loader.get(q + "down_proj.weight", (hidden, inter)).T.contiguous())
    return MoeWeights(router, gate_up, down, first, score_bias)


def _score_bias(loader: _Checked, p: str, count: int) -> paddle.Tensor:
    """ERNIE's ``e_score_correction_bias`` [1, E] as [E]: where the Hub's checkpoints (and
    save_pretrained) put it, ``mlp.moe_statics.``, or transformers' module path."""
    name = p + "mlp.moe_statics.e_score_correction_bias"
    if name not in loader.checkpoint:
        name = p + "mlp.gate.moe_statics.e_score_correction_bias"
    return loader.get(name, (1, count), dtype="float32").reshape([count])


def _times(span: tuple[int, int], n: int) -> tuple[int, int]:
    return span[0] * n, span[1] * n


class _Checked:
    """Hands out tensors (or row/column slices of them) by name, checking they exist and have
    the configured shape."""

    def __init__(self, checkpoint: _Checkpoint, small: str | None = None) -> None:
        self.checkpoint = checkpoint
        self.small = small  # the dtype of 1-D weights (norms, biases), None: the checkpoint's
        self.used: set[str] = set()

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        dtype: str | None = None,
    ) -> paddle.Tensor:
        """``dtype``: read in it, not in the compute dtype (a 1-D weight: in ``small``)."""
        path = self.checkpoint.path
        if dtype is None and len(shape) == 1:
            dtype = self.small
        if name not in self.checkpoint:
            raise ModelLoadError(f"{path}: weight {name!r} is missing from the checkpoint")
        found = self.checkpoint.shape(name)
        if found != shape:
            raise ModelLoadError(
                f"{path}: weight {name!r} has shape {list(found)}, but config.json implies "
                f"{list(shape)}"
            )
        self.used.add(name)
        return self.checkpoint.read(name, rows, cols, dtype)

    def warn_unused(self) -> None:
        unused = sorted(set(self.checkpoint.names) - self.used - {"lm_head.weight"})
        unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            logger.warning(
                "%s: ignoring %d unused weights, e.g. %s",
                self.checkpoint.path,
                len(unused),
                unused[:3],
            )


class _Checkpoint:
    """The checkpoint's safetensors files, open for reading whole tensors or slices of them
    (converted to the compute dtype after slicing)."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = path
        self.dtype = dtype
        self._target = _paddle_dtype(dtype)
        self._stack = contextlib.ExitStack()
        self._files: dict[str, object] = {}

    def __enter__(self) -> _Checkpoint:
        # safetensors' paddle reader needs the stride kernels that inference turns off.
        previous = paddle.get_flags(["FLAGS_use_stride_kernel"])
        paddle.set_flags({"FLAGS_use_stride_kernel": True})
        self._stack.callback(paddle.set_flags, previous)
        try:
            for file in _weight_files(self.path):
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="paddle"))
                    names = handle.keys()
                except Exception as exc:  # safetensors raises its own error types
                    raise ModelLoadError(f"{file}: cannot read safetensors file: {exc}") from exc
                for name in names:
                    self._files[name] = (file, handle)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    @property
    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        _file, handle = self._files[name]
        return tuple(handle.get_slice(name).get_shape())

    def read(
        self,
        name: str,
        rows: tuple[int, int] | None,
        cols: tuple[int, int] | None,
        dtype: str | None = None,
    ) -> paddle.Tensor:
        file, handle = self._files[name]
        try:
            if rows is None and cols is None:
                tensor = handle.get_tensor(name)
            else:
                part = handle.get_slice(name)
                r = slice(*rows) if rows is not None else slice(None)
                tensor = part[r] if cols is None else part[r, slice(*cols)]
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read weight {name!r}: {exc}") from exc
        tensor = tensor.contiguous()
        target = self._target if dtype is None else _paddle_dtype(dtype)
        if tensor.dtype != target:
            return tensor.astype(dtype or self.dtype)
        # A tensor read as it is stored may view the file's memory map: a weight kept as read
        # (the embedding) would keep the whole file mapped and resident after loading.
        return tensor.clone()


def _weight_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        names = list(weight_map.values()) if isinstance(weight_map, dict) else None
        # Shard names only: never a path out of the checkpoint's directory.
        if names is None or not all(isinstance(n, str) and Path(n).name == n for n in names):
            raise ModelLoadError(
                f"{index} is not a valid safetensors index: weight_map must map tensor names "
                "to shard file names in the checkpoint's directory"
            )
        files = [path / name for name in sorted(set(names))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard(s) {missing} listed in {_INDEX} are missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported; "
            "convert them with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def _paddle_dtype(dtype: str) -> paddle.dtype:
    return {"float32": paddle.float32, "bfloat16": paddle.bfloat16, "float16": paddle.float16}[
        dtype
    ]
