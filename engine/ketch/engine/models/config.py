"""The facts of a Hugging Face checkpoint that the engine needs, read from ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ketch.engine.errors import ModelLoadError

# architecture name -> family. Both are Llama-style decoders; Qwen2 adds q/k/v biases.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(
                f"{path} has no config.json; is it a Hugging Face model directory?"
            )
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
        generation = path / "generation_config.json"
        gen = json.loads(generation.read_text()) if generation.is_file() else {}
        return cls.from_dict(raw, gen, source=str(config_file))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config"
    ) -> ModelConfig:
        architecture = _architecture(raw, source)
        _check_honourable(raw, source)
        heads = _int(raw, "num_attention_heads", source)
        hidden = _int(raw, "hidden_size", source)
        head_dim = raw.get("head_dim") or hidden // heads
        family = SUPPORTED_ARCHITECTURES[architecture]
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        config = cls(
            architecture=architecture,
            vocab_size=_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size", source),
            num_hidden_layers=_int(raw, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=family == "llama" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be even for rotary embeddings")


def _architecture(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    found = ", ".join(architectures) or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {found}; Ketch supports {supported}")


def _int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _check_honourable(raw: dict[str, Any], source: str) -> None:
    """Rejects settings that would make the engine silently compute something else."""
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{source}: hidden_act={act!r} is not supported (only silu)")
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        raise ModelLoadError(f"{source}: sliding-window attention is not supported yet")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ModelLoadError(f"{source}: only full-attention layers are supported ({layer_types})")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ModelLoadError(f"{source}: pretraining_tp > 1 is not supported")


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes "rope_parameters" (with rope_theta inside); 4.x wrote "rope_theta"
    # and an optional "rope_scaling" with "type" or "rope_type".
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {list(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = float(params.get("factor", 1.0))
    if factor <= 0:
        raise ModelLoadError(f"{source}: rope scaling factor must be positive, got {factor}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
