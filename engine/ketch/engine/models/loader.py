"""Finds a model directory and loads its safetensors weights into ``ModelWeights``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import paddle
from safetensors.paddle import load_file

from ketch.engine.errors import ModelLoadError
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LayerWeights, ModelWeights
from ketch.engine.models.paths import TINY_MODEL_DIR, resolve_model_path

logger = logging.getLogger(__name__)

__all__ = ["TINY_MODEL_DIR", "load_weights", "resolve_model_path"]

_INDEX = "model.safetensors.index.json"


def load_weights(path: Path, config: ModelConfig, dtype: str) -> ModelWeights:
    tensors = _read_tensors(path, dtype)
    loader = _Checked(tensors, config, path)
    c = config
    q, kv, hidden = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.hidden_size,
    )
    inter = c.intermediate_size
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = [
            loader.get(p + f"self_attn.{n}_proj.weight", (m, hidden))
            for n, m in (("q", q), ("k", kv), ("v", kv))
        ]
        qkv_bias = None
        if c.qkv_bias:
            qkv_bias = paddle.concat(
                [
                    loader.get(p + f"self_attn.{n}_proj.bias", (m,))
                    for n, m in (("q", q), ("k", kv), ("v", kv))
                ]
            )
        gate = loader.get(p + "mlp.gate_proj.weight", (inter, hidden))
        up = loader.get(p + "mlp.up_proj.weight", (inter, hidden))
        layers.append(
            LayerWeights(
                input_norm=loader.get(p + "input_layernorm.weight", (hidden,)),
                qkv=paddle.concat(qkv, axis=0).T.contiguous(),
                qkv_bias=qkv_bias,
                o=loader.get(p + "self_attn.o_proj.weight", (hidden, q)).T.contiguous(),
                o_bias=loader.get(p + "self_attn.o_proj.bias", (hidden,)) if c.o_bias else None,
                post_norm=loader.get(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up=paddle.concat([gate, up], axis=0).T.contiguous(),
                gate_up_bias=paddle.concat(
                    [
                        loader.get(p + "mlp.gate_proj.bias", (inter,)),
                        loader.get(p + "mlp.up_proj.bias", (inter,)),
                    ]
                )
                if c.mlp_bias
                else None,
                down=loader.get(p + "mlp.down_proj.weight", (hidden, inter)).T.contiguous(),
                down_bias=loader.get(p + "mlp.down_proj.bias", (hidden,)) if c.mlp_bias else None,
            )
        )
    embed = loader.get("model.embed_tokens.weight", (c.vocab_size, hidden))
    if c.tie_word_embeddings or "lm_head.weight" not in tensors:
        if not c.tie_word_embeddings:
            raise ModelLoadError(f"{path}: lm_head.weight is missing and embeddings are not tied")
        lm_head = embed
    else:
        lm_head = loader.get("lm_head.weight", (c.vocab_size, hidden))
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        norm=loader.get("model.norm.weight", (hidden,)),
        lm_head=lm_head.T.contiguous(),
    )
    loader.warn_unused()
    return weights


class _Checked:
    """Hands out tensors by name, checking they exist and have the configured shape."""

    def __init__(self, tensors: dict[str, paddle.Tensor], config: ModelConfig, path: Path) -> None:
        self.tensors = tensors
        self.path = path
        self.used: set[str] = set()

    def get(self, name: str, shape: tuple[int, ...]) -> paddle.Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: weight {name!r} is missing from the checkpoint")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{self.path}: weight {name!r} has shape {list(tensor.shape)}, but config.json "
                f"implies {list(shape)}"
            )
        self.used.add(name)
        return tensor

    def warn_unused(self) -> None:
        unused = sorted(set(self.tensors) - self.used - {"lm_head.weight"})
        unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            logger.warning(
                "%s: ignoring %d unused weights, e.g. %s", self.path, len(unused), unused[:3]
            )


def _read_tensors(path: Path, dtype: str) -> dict[str, paddle.Tensor]:
    files = _weight_files(path)
    tensors: dict[str, paddle.Tensor] = {}
    target = _paddle_dtype(dtype)
    # safetensors' paddle reader needs the stride kernels that inference turns off.
    previous = paddle.get_flags(["FLAGS_use_stride_kernel"])
    paddle.set_flags({"FLAGS_use_stride_kernel": True})
    try:
        for file in files:
            _read_file(file, target, dtype, tensors)
    finally:
        paddle.set_flags(previous)
    return tensors


def _read_file(
    file: Path, target: paddle.dtype, dtype: str, tensors: dict[str, paddle.Tensor]
) -> None:
    try:
        loaded = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"{file}: cannot read safetensors file: {exc}") from exc
    for name, tensor in loaded.items():
        tensors[name] = tensor if tensor.dtype == target else tensor.astype(dtype)


def _weight_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
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
